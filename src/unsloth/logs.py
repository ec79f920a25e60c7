"""Where unsloth's log lines go: plain messages on the current standard error.

The commands install `log_handler()`. A notebook or a script sets up no logging, and then drops the
INFO lines the loader says once (which parts of the model run fast, vLLM missing for fast_inference,
options ignored): importing the notebook facade calls `show_by_default()`, which gives the "unsloth"
logger a fallback handler, unless logging is set up already (a handler on the root logger or on
"unsloth", or a level chosen for "unsloth"). The fallback stays quiet from the moment anything else
would print: logging configured later (`logging.basicConfig`), or a command's own handler.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "unsloth"


class _CurrentStderr(logging.StreamHandler):
    """A handler that writes to whatever sys.stderr is when a record comes, not the stream of the moment
    it was made: a handler must not outlive a replaced stream (a closed capture, a notebook's cell)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def log_handler() -> logging.Handler:
    """Log lines as plain messages on the current standard error (the commands' one log format)."""
    return _CurrentStderr()


class _Fallback(_CurrentStderr):
    """unsloth's records, while no other handler would print them."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers or any(h is not self for h in logging.getLogger(LOGGER).handlers):
            return
        super().emit(record)


def show_by_default() -> None:
    """Give the "unsloth" logger the fallback handler, at INFO, unless logging is set up (idempotent)."""
    log = logging.getLogger(LOGGER)
    if log.handlers or logging.getLogger().handlers or log.level != logging.NOTSET:
        return
    log.setLevel(logging.INFO)
    log.addHandler(_Fallback())


def own_handlers(log: logging.Logger) -> list[logging.Handler]:
    """`log`'s handlers other than the fallback: what someone set up."""
    return [h for h in log.handlers if not isinstance(h, _Fallback)]
