"""What a rank leaves behind when it ends, read for the report: torch's error file and
faulthandler's dump of a fatal signal. (The bootstrap's own error record is a JSON object,
read with :func:`gpuwarden.boundedio.read_json_object`.)

torch's error file: a script decorated with torch's ``@record``
(``torch.distributed.elastic.multiprocessing.errors``) or calling
``get_error_handler().record_exception(e)`` writes its exception to the file named by
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

from gpuwarden.boundedio import read_json_object
from gpuwarden.launch.outcome import TorchError

MAX_ERROR_FILE_BYTES = 1 << 20  # a traceback, not an archive


def read_torch_error(path: str) -> TorchError | None:
    """The error file at ``path`` (TORCHELASTIC_ERROR_FILE), None when there is none or it does
    not have one of torch's layouts."""
    if not path:
        return None
    data = read_json_object(path, max_bytes=MAX_ERROR_FILE_BYTES, nofollow=True)
    return None if data is None else parse_torch_error(path, data)


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


def read_fatal_dump(path: str) -> str:
    """faulthandler's dump of a fatal signal (SIGSEGV, SIGABRT, ...), which the bootstrap
    points at ``path``; empty when the rank wrote none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def fatal_dump_in(lines: list[str]) -> str:
    """The faulthandler dump a crashed rank printed on stderr ('Fatal Python error: ...'), if any
    (torch's ``@record`` re-enables faulthandler on stderr, replacing the bootstrap's file)."""
    for i, line in enumerate(lines):
        if line.startswith("Fatal Python error"):
            return "\n".join(lines[i:])
    return ""
