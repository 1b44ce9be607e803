"""Dask's log lines about a lost connection, one line each instead of a traceback.

When the scheduler goes away, every worker's heartbeat and every open comm fails, and Dask logs
each failure at ERROR with the whole chain of tracebacks (``ConnectionRefusedError`` ->
``CommClosedError`` -> ``CancelledError`` -> ``TimeoutError`` ...): about ninety lines before
``gpuwarden worker`` can say in one line what happened. A filter on the handlers of the
``distributed`` logger keeps each such record but drops its traceback, naming the exception in
the line instead. Records of any other exception keep their traceback: those are bugs to read.
"""

from __future__ import annotations

import logging

_CONNECTION_ERRORS = (OSError, TimeoutError)  # CommClosedError is an OSError


class ShortConnectionErrors(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and _is_connection_error(exc):
            record.msg = f"{record.getMessage()} ({type(exc).__name__}: {exc})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def _is_connection_error(exc: BaseException) -> bool:
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 10:
        if isinstance(cur, _CONNECTION_ERRORS):
            return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False


def shorten_connection_errors(logger_name: str = "distributed") -> None:
    """Install the filter on the handlers of ``logger_name`` (once each)."""
    for handler in logging.getLogger(logger_name).handlers:
        if not any(isinstance(f, ShortConnectionErrors) for f in handler.filters):
            handler.addFilter(ShortConnectionErrors())
