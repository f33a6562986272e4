"""``python -m workers``: kept as an alias of ``python -m spcache``."""

import sys

from spcache.cli import main

if __name__ == "__main__":
    sys.exit(main())
