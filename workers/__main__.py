"""``python -m workers``: the ``spcache`` command line."""

import sys

from workers.cli import main

if __name__ == "__main__":
    sys.exit(main())
