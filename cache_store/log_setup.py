"""The one logging set-up of an spcache process, and its one line format.

Library code only logs (``logging.getLogger(__name__)``); handlers are set up here, by
the two kinds of process that own one: a command (``spcache COMMAND``, in
:mod:`spcache.cli`, before the command runs) and a Ray actor (which no command starts).
"""

from __future__ import annotations

import logging
import sys

__all__ = ["LOG_FORMAT", "configure_logging"]

#: every spcache log line: time, level, logger, message
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: int) -> None:
    """Root logging to stderr at ``level`` (clamped to DEBUG..CRITICAL). Where the root
    logger already has handlers (an embedding program, pytest) nothing changes but the
    chatty HTTP libraries' level."""
    level = max(logging.DEBUG, min(logging.CRITICAL, level))
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    # httpx/httpcore log every request at INFO: a polling client (the demo, HTTPStore)
    # would print a line per poll; they speak only at DEBUG, when asked for everything.
    for chatty in ("httpx", "httpcore"):
        logging.getLogger(chatty).setLevel(
            max(level, logging.WARNING) if level > logging.DEBUG else level
        )
