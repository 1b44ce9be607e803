"""torch's error file: what a rank recorded with torch's own error handler, read for the report.

A script decorated with torch's ``@record`` (``torch.distributed.elastic.multiprocessing.errors``)
or calling ``get_error_handler().record_exception(e)`` writes its exception to the file named by
``TORCHELASTIC_ERROR_FILE`` (gpuwarden sets it, in torchrun's layout); torchrun's
``ChildFailedError`` then shows that exception, its traceback and its time for the failed rank.
gpuwarden reads the same file (bounded: the rank wrote it, and with ``--log-dir`` it may lie in a
directory others can write) and the report shows it the same way, also when the rank then left
with ``sys.exit(7)`` and no traceback of its own.

The two layouts torch writes (``ErrorHandler.record_exception`` and ``dump_error_file``)::

    {"message": {"message": "KeyError: 'lr'", "errorCode": 7,
                 "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1700000000"}}}
    {"message": "a message", "timestamp": 1700000000}
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from gpuwarden.boundedio import InputRefused, read_regular

MAX_ERROR_FILE_BYTES = 1 << 20  # a traceback, not an archive


@dataclass(frozen=True)
class TorchError:
    """One rank's torch error file, as torchrun's ``ProcessFailure`` reads it."""

    path: str
    message: str  # "KeyError: 'lr'"
    traceback: str | None  # py_callstack: the traceback torch formatted when it recorded
    timestamp: int | None  # seconds since the epoch, as torch wrote it

    @property
    def exception_type(self) -> str | None:
        """'KeyError' from "KeyError: 'lr'", when the message has that shape."""
        head, sep, _ = self.message.partition(":")
        return head if sep and head.isidentifier() else None

    @property
    def time_text(self) -> str | None:
        """torchrun's ``timestamp_isoformat``: local time, ``YYYY-MM-DD_HH:MM:SS``."""
        if self.timestamp is None:
            return None
        try:
            return time.strftime("%Y-%m-%d_%H:%M:%S", time.localtime(self.timestamp))
        except (OverflowError, OSError, ValueError):
            return None


def read_torch_error(path: str) -> TorchError | None:
    """The error file at ``path`` (TORCHELASTIC_ERROR_FILE), None when there is none or it does
    not have one of torch's layouts."""
    if not path:
        return None
    try:
        data = json.loads(read_regular(path, max_bytes=MAX_ERROR_FILE_BYTES, nofollow=True))
    except (OSError, InputRefused, ValueError, RecursionError):
        return None
    return parse_torch_error(path, data)


def parse_torch_error(path: str, data: object) -> TorchError | None:
    if not isinstance(data, dict) or "message" not in data:
        return None
    message = data["message"]
    if isinstance(message, str):
        return TorchError(path, message, None, _int(data.get("timestamp")))
    if not isinstance(message, dict):
        return None
    extra = message.get("extraInfo")
    extra = extra if isinstance(extra, dict) else {}
    callstack = extra.get("py_callstack")
    return TorchError(path, str(message.get("message", "")),
                      callstack if isinstance(callstack, str) and callstack.strip() else None,
                      _int(extra.get("timestamp")))


def _int(value: object) -> int | None:
    try:
        return int(value)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return None
