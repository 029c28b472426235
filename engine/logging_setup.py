"""pagedserve's log output: INFO and above from the `pagedserve` loggers go to stderr, as
vLLM does, unless the application has configured logging itself (root or these loggers have handlers). Set PAGEDSERVE_LOG_LEVEL to
change the level (e.g. WARNING to silence start-up messages)."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(levelname)s %(asctime)s [%(name)s] %(message)s"


def configure_logging(names: tuple[str, ...] = ("pagedserve",)) -> None:
    level = os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()
    if logging.getLogger().handlers:  # the application (or pytest) routes records itself
        return
    for name in names:
        logger = logging.getLogger(name)
        if logger.handlers:  # already configured
            continue
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(level)
