"""escape_untrusted: what another user writes cannot drive the terminal or crash the printer."""

from __future__ import annotations

import io

import pytest

from gpuwarden.safetext import escape_untrusted


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        ("python train.py --lr 0.1", "python train.py --lr 0.1"),
        ("日本語のジョブ ünïcødé", "日本語のジョブ ünïcødé"),
        ("\x1b]0;pwned\x07title", "\\x1b]0;pwned\\x07title"),
        ("\x1b[2J\x1b[Hclear", "\\x1b[2J\\x1b[Hclear"),
        ("line\nerror[FAKE]: forged", "line\\nerror[FAKE]: forged"),
        ("cr\rover", "cr\\rover"),
        ("\x9b31mC1 CSI", "\\x9b31mC1 CSI"),
        ("del\x7f", "del\\x7f"),
        ("bad\udcffsurrogate", "bad\\udcffsurrogate"),
        ("evil\u202etxt.exe", "evil\\u202etxt.exe"),
        ("zero\u200bwidth", "zero\\u200bwidth"),
    ],
)
def test_controls_and_hiding_characters_are_escaped(raw: str, shown: str) -> None:
    assert escape_untrusted(raw) == shown


def test_escaped_text_prints_on_a_strict_utf8_stream() -> None:
    # A lone surrogate crashed `gpuwarden leases` for every user before (issue 25).
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    with pytest.raises(UnicodeEncodeError):
        print("label \udc80", file=stream)
        stream.flush()
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    print(escape_untrusted("label \udc80"), file=stream)
    stream.flush()


def test_max_chars_bounds_the_result_and_the_work() -> None:
    padded = "[" * 10_000_000
    shown = escape_untrusted(padded, max_chars=80)
    assert len(shown) == 80 and shown.endswith("…")
    assert escape_untrusted("short", max_chars=80) == "short"
    assert len(escape_untrusted("\x1b" * 1000, max_chars=20)) == 20


def test_no_escape_survives_in_the_output() -> None:
    every_char = "".join(chr(c) for c in range(0, 0xE000))
    shown = escape_untrusted(every_char)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in shown)
    shown.encode("utf-8")  # no lone surrogate left
