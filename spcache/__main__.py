"""``python -m spcache``: the ``spcache`` command line."""

import sys

from spcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
