"""service: the FastAPI app that serves cached records. CPU only, never touches CUDA."""

__all__: list[str] = []
