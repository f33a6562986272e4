"""Imported first by the loader pool's forkserver: it ignores Ctrl-C from then on.

A terminal's Ctrl-C reaches every process of the group. The forkserver is still
importing torch and trimesh in the first seconds of a run; without this it would die
there with a KeyboardInterrupt traceback printed over the run's own "stopping" line.
The loaders it forks inherit the setting (they ignore Ctrl-C anyway: the engine stops
them). Its only effect is on the process that imports it, which is the forkserver alone.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_IGN)
