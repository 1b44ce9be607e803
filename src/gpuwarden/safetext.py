"""One escaping function for every string that came from another user or another process.

On a shared host, lease records, labels, process command lines (NVML's and /proc's), hostnames
from the network and log lines from ranks are written by someone else. Printed raw, a string can
move the cursor, recolour or clear the terminal, set its title, forge a line of gpuwarden's own
output (an embedded newline), reorder text with bidirectional controls, or crash the printer
(a lone surrogate, which ``str.encode("utf-8")`` refuses). Every such string passes through
:func:`escape_untrusted` before any output, plain or rich, text or JSON-free display.

What is kept: printable text of any script. What is escaped, visibly and reversibly enough to
read (``\\x1b``, ``\\n``, ``\\u202e``, ``\\udcff``): C0 and C1 control characters and DEL,
lone surrogates, and the Unicode format characters that reorder or hide text (bidi overrides
and isolates, zero-width characters, the BOM). Rich markup is a separate layer: text given to
rich as markup must also go through ``rich.markup.escape`` (or be passed as ``rich.text.Text``).
"""

from __future__ import annotations

import re

# C0 controls, DEL and C1 controls; lone surrogates (U+D800..U+DFFF: a str holding one cannot
# be encoded as UTF-8, so printing it raises); format characters that reorder or hide text:
# the bidi embeddings/overrides (U+202A..E), isolates (U+2066..9), marks (U+200E/F, U+061C),
# zero-width space/joiners (U+200B..D), word joiner & invisible operators (U+2060..4), BOM.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\ud800-\udfff\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2064"
    "\u2066-\u2069\ufeff]"
)

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_one(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def escape_untrusted(text: str, max_chars: int | None = None) -> str:
    """``text`` made safe to print on a terminal: controls and hiding characters escaped.

    ``max_chars`` (optional) bounds the result, counted after escaping, with a trailing ``…``
    when cut; a label or command line that another user padded to megabytes then costs a
    bounded amount to print.
    """
    if max_chars is not None and len(text) > 4 * max_chars + 16:
        # Escaping grows a character to at most 6; cut first so a huge input costs little.
        text = text[: 4 * max_chars + 16]
    escaped = _UNSAFE.sub(_escape_one, text)
    if max_chars is not None and len(escaped) > max_chars:
        return escaped[: max(0, max_chars - 1)] + "…"
    return escaped
