"""A log line as its program printed it: what terminals, log collectors and forums add, removed.

Real logs rarely reach ``gpuwarden explain`` as the program wrote them. A line may carry
ANSI colours (or what is left of them once the escape byte is gone: ``[31m``), the borders
of rich's or loguru's boxes (or their mojibake once UTF-8 went through a cp437 or cp1252
console: ``Γöé``, ``â”‚``, ``���``), markdown emphasis from an issue thread, and a stack of
prefixes: dmesg's ``[ 1843.30]``, journald's ``Jun 02 13:13:04 host kernel:``, a timestamp,
a log viewer's line number, pdsh's ``host:``, Ray's ``(Actor pid=1, ip=...)``, docker
compose's ``svc  |``, and the rank: torch's ``[rank3]:``, torchrun --tee's ``[default3]:``,
torchx's ``trainer/0 [3]:``, Lightning's ``[rank: 3]``, Horovod's ``[3]<stderr>:``,
mpirun's ``[1,3]<stdout>:``, srun -l's ``3:``; a comment's ``#`` or a quote opening a pasted
line. One physical line may also hold several
logical ones (an elastic error record in JSON with ``\\n`` escapes, ranks writing into the
same line).

:func:`normalize` turns such a line into its logical lines, each as ``prefix + body``: the
noise is gone, a torch-style rank prefix is written as ``[rankN]: `` (mpirun's and srun's are
kept as they are: a number and a colon means a rank only in a log that shows a
multi-process launch), and the rank read from the prefix comes with it. The engine runs it
on the few lines the keyword prefilter selects, never on every line of a log, so it may
afford regular expressions; it returns the input unchanged (one cheap scan) when there is
nothing to remove.
"""

from __future__ import annotations

import re

# -- characters and marks --------------------------------------------------------------
# ANSI escapes with their escape byte (ESC, or how `cat -v` and some viewers show it), and the
# colour codes left once the escape byte was lost in a copy ("[31mRuntimeError[0m").
_ANSI = re.compile(r"(?:\x1b|\u241b|\^\[)(?:\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])")
_ANSI_RESIDUE = re.compile(r"\[(?:\d{1,3};)*\d{1,3}[mK]")
# Box drawing (rich tracebacks and log handlers, loguru), and the same bytes read in another
# code page: cp437 (Windows consoles) "Γöé", cp1252/latin-1 "â”‚", cp850 "Ôöé", GBK "鈹", or
# replaced by U+FFFD.
_BOX_CHARS = "│┃║╎╏┆┇┊┋─━═╭╮╰╯┌┐└┘├┤┬┴┼╔╗╚╝╟╢❱"
_BOX_TOKEN = (rf"(?:[{_BOX_CHARS}]|Γ[öò¥].|â[”•\x94\x95\x9d].|Ô[öòØ].|[鈹鈺鉂]\ufffd?|\ufffd+)")
_BOX_LEAD = re.compile(rf"^[ \t]*(?:{_BOX_TOKEN}[ \t]*)+")
_BOX_TAIL = re.compile(rf"(?:[ \t]*{_BOX_TOKEN})+[ \t]*$")
_BOX_RUN = re.compile(rf"{_BOX_TOKEN}{{3,}}")
_MAYBE_BOX = re.compile(rf"[{_BOX_CHARS}\ufffdΓâÔ鈹鈺鉂]")
# Markdown around a pasted log: a quote mark, emphasis, a line in backticks, escapes.
_MD_QUOTE = re.compile(r"^(?:[ \t]*>)+[ \t]?")
_MD_ESCAPE = re.compile(r"\\([_*\[\]`#<>|])")
# **strong**, not "*** SIGABRT received at time=... ***" (abseil's failure handler)
_MD_STRONG = re.compile(r"(?<!\*)\*\*(?![\s*])(.+?)(?<![\s*])\*\*(?!\*)")
_TYPOGRAPHY = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                             "\u00a0": " ", "\u2007": " ", "\u202f": " ", "\u200b": None,
                             "\ufeff": None})


# -- prefixes ----------------------------------------------------------------------------
_LEVEL = r"(?:TRACE|DEBUG|INFO|NOTICE|WARN|WARNING|ERROR|ERR|CRITICAL|FATAL)"
_NOISE = re.compile("|".join((
    # dmesg: "[ 1843.308145] ", dmesg -H's "[  +0.000003] ", dmesg -T's "[Mon Jun  2 13:13:04 2025] "
    r"\[\s*\+?\d+\.\d+\]\s",
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}\]\s",
    # an ISO date and time, bracketed or not (python logging, CI runners, container runtimes:
    # "2024-05-01T12:34:56.123456789Z stderr F "), then maybe a level and a logger name
    r"\[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d+)?(?:Z|[+-]\d\d:?\d\d| ?UTC)?\]?"
    r"(?: (?:stdout|stderr) [FP])?(?:[ \t]*(?:[-|:][ \t]*)?(?:\[?" + _LEVEL + r"\]?)(?=[\s:|-]))?"
    r"(?:[ \t]*[-|:])?[ \t]+",
    # syslog and journald: "Jun 02 13:13:04 host kernel: ", "Mar  3 11:22:33 host python[12]: ",
    # and the same time without host ("Oct 16 02:07:00 ")
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?"
    r"(?: [\w.-]+ [\w./@-]+?(?:\[\d+\])?:)?[ \t]+",
    # a time of day: rich's log handler "[20:42:05] WARNING  ", "12:01:02 | INFO | "
    r"\[\d\d:\d\d:\d\d(?:[.,]\d+)?\][ \t]+(?:" + _LEVEL + r"[ \t]+)?",
    r"\d\d:\d\d:\d\d(?:[.,]\d+)?[ \t]+(?:\|[ \t]*)?(?:" + _LEVEL + r"[ \t]*\|?[ \t]+)?",
    # rich's log handler continues under the time column: "           ERROR    failed ..."
    _LEVEL + r"[ \t]{2,}",
    # python logging: "ERROR:torch.distributed.elastic.multiprocessing.api:" (basicConfig),
    # "trainer - ERROR - " (after the time)
    _LEVEL + r":[\w.]*:[ \t]*",
    r"(?:[\w.]+ - )?" + _LEVEL + r" - ",
    # a log viewer's line number "[1830] "
    r"\[\d{1,7}\][ \t]+",
    # Ray: "(RayTrainWorker pid=1234, ip=10.0.0.1) ", "(pid=1234) "
    r"\((?:[\w.:-]+ )?pid=\d+(?:, ip=[\d.]+)?\)[ \t]+",
    # Metaflow "[flow/run/step/task (pid 123)] " and its "[uuid] "
    r"\[[^\]\s]*(?: \(pid \d+\))\][ \t]+(?:\[[0-9a-f-]{8,}\][ \t]+)?",
    # determined's "<container id> || "
    r"[0-9a-f]{8,} \|\|[ \t]+",
    # docker compose "trainer-1  | " (the name padded to the column)
    r"[A-Za-z][\w.-]*[ \t]+\|[ \t]+",
    # pdsh and DeepSpeed's multi-node launcher: "gpu-node-3: ", "worker-1: ", "10.0.0.2: "
    # (a host name with a digit; "srun: error:" and "RuntimeError:" are no host)
    r"(?:[a-z][a-z0-9-]*\d[a-z0-9-]*(?:\.[a-z0-9-]+)*|\d{1,3}(?:\.\d{1,3}){3}):[ \t]+",
    # a terminal's ^C
    r"\^C",
    # a pasted line commented out ("# exitcode  : -9 (pid: 1234)" in a script or config) or
    # opened by a quote or a stray backtick ('"Process Process-4:', '`11T03:16:37Z level=')
    r"#+[ \t]+",
    r"[\"'`]+(?=[^\s\"'`])",
)))
# Torch-style rank prefixes, written "[rankN]: " after normalizing.
_RANK_TORCH = "|".join((
    r"\[(?:rank|default|trainer)\d+\]:",                          # torch, torchrun --tee
    r"\[[A-Za-z]\w*?\d*\|\d+\]:",                                 # "[trainer85612|12]:"
    r"[\w-]+/\d+ \[\d+\]:",                                        # torchx "trainer/0 [3]:"
    r"\[rank(?::[ \t]?|=)\d+\](?:[ \t]?:)?",                       # Lightning "[rank: 3]", "[rank=3]"
    r"\[\d+\]<std(?:out|err)>:",                                   # horovodrun "[3]<stderr>:"
))
# Launcher prefixes kept as they are (what they mean depends on the whole log).
_RANK_KEPT = (r"\[\d+,(?P<k1>\d+)\]<std(?:out|err)>:[ \t]?"       # mpirun --tag-output
              r"|(?P<k2>\d{1,5}):[ \t]")                           # srun -l
_LAST_NUMBER = re.compile(r"(\d+)\D*$")  # the rank is the last number of its prefix
# One match per prefix: which of the three kinds it is, and the rank it names.
_PREFIX = re.compile(rf"[ \t]*(?:(?P<noise>{_NOISE.pattern})|(?P<torch>{_RANK_TORCH})"
                     rf"|(?P<kept>{_RANK_KEPT}))")
_MAX_PREFIXES = 6
# A rank prefix inside a line: output of two ranks run together.
_RANK_INSIDE = re.compile(r"(?<=\S)[ \t]*(?=\[(?:rank|default)\d+\]:)")
# An elastic error record, a JSON log: several logical lines in one, "\n"-escaped.
_ESCAPED_NL = re.compile(r"\\n(?=[ \t\\]|[A-Z\[]|$)")
# rich's log handler writes the source file at the right edge: "    api.py:698"
_RICH_SOURCE = re.compile(r"[ \t]{2,}[\w.-]+\.py:\d+[ \t]*$")


def clean(text: str) -> str:
    """``text`` without colours, box borders (also mangled), markdown and typographic quotes."""
    if not text.isascii():
        if "\u241b" in text:
            text = _ANSI.sub("", text)
        if _MAYBE_BOX.search(text):
            text = _BOX_TAIL.sub("", _BOX_LEAD.sub("", text))
            text = _BOX_RUN.sub(" ", text).strip()
        text = text.translate(_TYPOGRAPHY)
    if "\x1b" in text or "^[" in text:
        text = _ANSI.sub("", text)
    if "[" in text and _ANSI_RESIDUE.search(text):
        text = _ANSI_RESIDUE.sub("", text)
    if ">" in text:
        text = _MD_QUOTE.sub("", text)
    if "**" in text:
        text = _MD_STRONG.sub(r"\1", text)
    if "`" in text:
        stripped = text.strip()
        if stripped.startswith("```"):
            text = stripped.strip("`")
        elif stripped.startswith("`") and stripped.endswith("`") and stripped.count("`") == 2:
            text = stripped[1:-1]
    if "\\" in text:
        text = _MD_ESCAPE.sub(r"\1", text).replace("\\'", "'")
    return text


def peel(text: str) -> tuple[str, str, int | None]:
    """Split ``text`` into (rank prefix, body, rank): noise prefixes dropped, the rank read.

    The rank prefix is ``"[rankN]: "`` for a torch-style prefix, mpirun's or srun's as
    written, or ``""``. A torch-style rank wins over srun's task number before it
    ("0: [rank8]: ..." is rank 8).
    """
    prefix, rank = "", None
    pos = 0
    for _ in range(_MAX_PREFIXES):
        m = _PREFIX.match(text, pos)
        if m is None or m.end() == pos:
            break
        torch = m.group("torch")
        if torch is not None:
            value = _LAST_NUMBER.search(torch).group(1)  # type: ignore[union-attr]
            prefix, rank = f"[rank{value}]: ", int(value)
        elif m.group("kept") is not None:
            if rank is not None:  # "[rank8]: 3: ..." is rank 8's text
                break
            prefix, rank = m.group("kept").rstrip() + " ", int(m.group("k1") or m.group("k2"))
        pos = m.end()
    return prefix, text[pos:].lstrip(" \t"), rank


def normalize(text: str) -> list[tuple[str, int | None]]:
    """The logical lines of one physical log line, each ``(prefix + body, rank or None)``."""
    text = clean(text)
    pieces = [text]
    if "\\n" in text and _ESCAPED_NL.search(text):
        pieces = [p.replace('\\"', '"').replace("\\t", "\t")
                  for p in _ESCAPED_NL.split(text) if p.strip()]
    out: list[tuple[str, int | None]] = []
    for piece in pieces:
        prefix, body, rank = peel(piece)
        while "]:" in body:  # another rank's output run into this line
            m = _RANK_INSIDE.search(body)
            if m is None:
                break
            out.append((prefix + body[:m.start()], rank))
            prefix, body, rank = peel(body[m.end():])
        if ".py:" in body[-48:]:
            body = _RICH_SOURCE.sub("", body)
        out.append((prefix + body, rank))
    return out
