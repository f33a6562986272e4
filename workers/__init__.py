"""workers: the only package that may touch a GPU.

SPC ops (Kaolin-backed and pure PyTorch), sources, recipes, the engine, the worker loop
and the ``spcache`` command line.
"""

__all__: list[str] = []
