"""The streaming matcher: bytes in, a :class:`Diagnosis` out, in bounded memory.

How a log is read, and why it is fast:

1. The input arrives in blocks of whole lines (a few MiB at most). A block is
   lower-cased once and every knowledge-base *keyword* is looked for with
   ``bytes.find``, which runs in C over the whole block; a line is only looked at
   when it holds a keyword. Running each signature regex on every line of a
   200 MB log would take minutes; this prefilter makes the cost that of a few
   ``memchr``-like passes.
2. Only the lines a keyword points at are decoded, stripped of ANSI colours, and
   tried against the signature and detail regexes of the codes that keyword
   belongs to.
3. Per code, only the first few matching lines of each signature are kept (the
   evidence window), plus a bounded set of details and ranks: memory does not
   grow with the size of the log.

Root cause over echoes: every code found has a first line (and the rank that
printed it). A code listed in the ``echo_of`` of another code found in the
same log is an echo (the other ranks' watchdog timeouts, "worker exited
unexpectedly" after a worker's own error); the primary code is the earliest
code that is not an echo. A *generic* code (a rank's own exception, RANK_FAILED)
only counts on lines no other code explains and is the root cause only when no
specific code was found.

Evidence as fields: the named groups of signatures and details become the
finding's ``fields`` (pid, rank, gpu, host, port, bytes, the failing exception
and its frame...), typed (numbers, bytes as integers), so callers need not parse
the rendered text.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.errors import UsageError
from gpuwarden.explain.diagnosis import Diagnosis, Finding, rank_findings
from gpuwarden.explain.knowledge import CodeEntry, KnowledgeBase
from gpuwarden.explain.normalize import normalize
from gpuwarden.explain.prefilter import BLOCK_BYTES, PLAN_MIN_BYTES, SAMPLE_BYTES, plan_anchors
from gpuwarden.findings import EvidenceLine
from gpuwarden.units import parse_size

# BLOCK_BYTES (from prefilter, whose anchor cost model is tuned to it): the read size;
# a block is cut back to its last newline.
MAX_LINE_BYTES = 1 << 20         # a "line" longer than this is scanned in pieces
EVIDENCE_PER_SIGNATURE = 3       # matching lines kept per signature
EVIDENCE_SHOWN = 6               # lines reported per code
DETAILS_KEPT = 8
RANKS_KEPT = 64
EVIDENCE_CHARS = 400             # an evidence line is cut around its match beyond this
FIELD_RECORDS_KEPT = 16          # records per list field (the processes of an OOM message)
VALUES_KEPT = 8                  # values remembered per `distinct` signature
FRAMES_KEPT = 256                # ranks whose last traceback frame is remembered
REPLAN_BLOCKS = 16               # re-choose the prefilter's anchors this often (logs change)
JOIN_LINES = 2                   # a wrapped message is looked for over this many more lines
WRAP_SEARCH_BYTES = 256 << 10    # blocks this small are also searched across line breaks
TAIL_BYTES = 8 << 10             # the end of the input kept for signatures that must end it
FRAGMENT_CHARS = 40              # a last line this short, without spaces, was cut by a paste

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# colours in a lower-cased block, with or without their escape byte (a pasted log lost it)
_ANSI_BYTES = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\[(?:\d{1,3};)*\d{1,3}[mk]")
# Rank prefixes, tried in order on the start of a line (after ANSI colours are gone):
# torch's own "[rank1]:" and gpuwarden launch's "[rank1]: ", torchrun --tee's
# "[default0]:" (role + local rank), mpirun --tag-output's "[1,3]<stdout>:", and
# srun -l's "3: ".
_RANK_PREFIXES = (
    re.compile(r"\[(?:rank|default|trainer)(\d+)\]:"),
    re.compile(r"^\s*\[\d+,(\d+)\]<std(?:out|err)>:"),
    re.compile(r"^\s*(\d{1,5}): "),
)
# In the message itself, NCCL/c10d say "[Rank 3]" or "[PG 1 Rank 3]".
_RANK_IN_MESSAGE = re.compile(r"\[(?:PG [^\]]*?)?Rank (\d+)\]")
# A Python traceback frame; the last one a rank printed before its exception is
# where it failed. Lines are found by this keyword (lower-cased, as the prefilter sees them).
_FRAME_KEYWORD = b'file "'
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')

# Field names whose values are numbers; names ending in "bytes" hold sizes ("2.00 GiB"),
# stored as integers; any other field is text.
_INT_FIELDS = frozenset({"pid", "rank", "other_rank", "local_rank", "gpu", "port", "exitcode",
                         "xid", "seq", "world_size", "worker_count", "worker"})


def field_value(name: str, raw: str) -> Any:
    """A captured group as a field value: an int for numeric names and sizes, else text."""
    raw = raw.strip()
    try:
        if name in _INT_FIELDS:
            return int(raw)
        if name == "bytes" or name.endswith("_bytes"):
            return parse_size(raw, what=name)
    except (ValueError, UsageError):
        pass
    return raw


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def rank_of(line: str) -> int | None:
    """The rank a log line comes from, read from its prefix or its message."""
    head = line[:80]
    for pattern in _RANK_PREFIXES:
        m = pattern.search(head)
        if m:
            return int(m.group(1))
    m = _RANK_IN_MESSAGE.search(line)
    return int(m.group(1)) if m else None


@dataclass
class _Hit:
    line: int
    text: str
    rank: int | None


@dataclass
class _CodeState:
    """What is kept about one code while the log streams by (bounded)."""

    hits: list[list[_Hit]]          # per signature: first EVIDENCE_PER_SIGNATURE lines
    counts: list[int]               # per signature: how many lines matched
    details: dict[str, None] = field(default_factory=dict)   # ordered set
    ranks: dict[int, None] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    values: dict[int, set[str]] = field(default_factory=dict)  # per `distinct` signature
    last: dict[int, _Hit] = field(default_factory=dict)   # per `at_end` signature: its last line


def _cut(text: str, start: int) -> str:
    if len(text) <= EVIDENCE_CHARS:
        return text
    lo = max(0, start - 80)
    piece = text[lo:lo + EVIDENCE_CHARS]
    return ("…" if lo else "") + piece + "…"


class Explainer:
    """Feed a log in pieces (:meth:`feed_bytes`, :meth:`feed_lines`), then :meth:`result`.

    :func:`explain_file` feeds it file blocks, :func:`explain_text` one piece (the
    launcher calls that once on a failed rank's output, after the fact). Memory
    stays bounded whatever the log size.
    """

    def __init__(self, kb: KnowledgeBase, source: str = "<text>", *,
                 normalize_lines: bool = True) -> None:
        self._kb = kb
        self._source = source
        # normalize_lines=False matches the lines as they are (ANSI colours removed only):
        # benchmarks/explain_throughput.py measures what the normalizer costs with it
        self._normalize = normalize_lines
        self._states = [_CodeState([[] for _ in e.signatures], [0] * len(e.signatures))
                        for e in kb.entries]
        # keyword -> the codes it belongs to and the contexts it proves
        table: dict[bytes, tuple[set[int], set[str]]] = {}
        for i, e in enumerate(kb.entries):
            for kw in e.keywords:
                table.setdefault(kw.encode(), (set(), set()))[0].add(i)
        for name, words in kb.contexts.items():
            for kw in words:
                table.setdefault(kw.encode(), (set(), set()))[1].add(name)
        self._needles = [(kw, tuple(sorted(codes)), frozenset(ctx))
                         for kw, (codes, ctx) in table.items()]
        # traceback frames are looked for only where a code can name the failing frame
        self._frame_needle = len(self._needles)
        self._needles.append((_FRAME_KEYWORD, (), frozenset()))
        self._last_frame: dict[int | None, str] = {}
        self._contexts_seen: set[str] = set()
        self._plan: list[tuple[bytes, tuple[int, ...]]] | None = None
        self._blocks_since_plan = 0
        self._lines = 0          # newlines seen so far
        self._bytes = 0
        self._partial = False    # the input so far ends inside a line
        self._carry = b""
        self._tail = b""         # the last TAIL_BYTES scanned (signatures that end the log)

    # -- input -------------------------------------------------------------------
    def feed_bytes(self, data: bytes) -> None:
        """Feed the next piece of the log; pieces need not end at a newline."""
        if not data:
            return
        buf = self._carry + data if self._carry else data
        cut = buf.rfind(b"\n")
        if cut < 0:
            if len(buf) >= MAX_LINE_BYTES:  # one enormous line: scan it in pieces
                self._scan(buf)
                self._carry = b""
            else:
                self._carry = buf
            return
        head, self._carry = buf[:cut + 1], buf[cut + 1:]
        # the joined copy goes before the scan lower-cases the head: one 4 MiB buffer less at
        # the peak (the caller still holds `data`)
        del buf
        self._scan(head)

    def feed_lines(self, lines: Iterable[str]) -> None:
        """Feed text lines (with or without their trailing newline)."""
        batch: list[str] = []
        size = 0
        for line in lines:
            batch.append(line if line.endswith("\n") else line + "\n")
            size += len(line)
            if size >= BLOCK_BYTES:
                self.feed_bytes("".join(batch).encode("utf-8", "replace"))
                batch, size = [], 0
        if batch:
            self.feed_bytes("".join(batch).encode("utf-8", "replace"))

    # -- scanning ----------------------------------------------------------------
    def _needed(self, k: int) -> bool:
        _, code_ids, ctx = self._needles[k]
        return bool(code_ids) or k == self._frame_needle or not ctx <= self._contexts_seen

    def _scan(self, block: bytes) -> None:
        self._bytes += len(block)
        low = block.lower()
        needed = [k for k in range(len(self._needles)) if self._needed(k)]
        if len(block) < PLAN_MIN_BYTES:
            # a small piece (a short log, a live feed in pieces): choosing anchors
            # would cost more than looking for each keyword
            plan: list[tuple[bytes, tuple[int, ...]]] = [(self._needles[k][0], (k,)) for k in needed]
        else:
            if self._plan is None or self._blocks_since_plan >= REPLAN_BLOCKS:
                anchors = plan_anchors([self._needles[k][0] for k in needed], low[:SAMPLE_BYTES])
                self._plan = [(anchor, tuple(needed[m] for m in members))
                              for anchor, members in anchors]
                self._blocks_since_plan = 0
            self._blocks_since_plan += 1
            plan = self._plan
        wanted: dict[int, set[int]] = {}   # line start offset -> code indices
        frames: set[int] = set()           # line start offsets of traceback frames
        contexts_before = len(self._contexts_seen)
        for anchor, members in plan:
            i = low.find(anchor)
            while i >= 0:
                start = low.rfind(b"\n", 0, i) + 1
                end = low.find(b"\n", i)
                line = low[start:] if end < 0 else low[start:end]
                for k in members:
                    needle, code_ids, ctx = self._needles[k]
                    if needle in line:
                        if code_ids:
                            wanted.setdefault(start, set()).update(code_ids)
                        elif k == self._frame_needle:
                            frames.add(start)
                        self._contexts_seen |= ctx
                if end < 0:
                    break
                i = low.find(anchor, end)
        if len(self._contexts_seen) != contexts_before:
            self._plan = None  # a context is proven: its keywords need no more looking for
        wrapped: dict[int, dict[str, set[int]]] = {}
        # (a piece of one line, as a live feed gives them, has no line break to look across:
        # only colour codes inside a keyword are looked for in it)
        if self._normalize and len(block) <= WRAP_SEARCH_BYTES and (
                block.count(b"\n", 0, -1) or _ANSI_BYTES.search(low) is not None):
            inside, wrapped = self._wrapped_hits(low)
            for start, codes in inside.items():
                wanted.setdefault(start, set()).update(codes)
        line_no = self._lines + 1
        pos = 0
        for start in sorted(wanted.keys() | frames | wrapped.keys()):
            line_no += block.count(b"\n", pos, start)
            pos = start
            end = block.find(b"\n", start)
            raw = block[start:] if end < 0 else block[start:end]
            if start in frames:
                self._note_frame(raw)
            missed: set[int] = set()
            if start in wanted:
                missed = self._match_line(raw, line_no, wanted[start])
            if missed and self._normalize and end >= 0:
                # a message wrapped onto the next lines (a terminal's width, dmesg, a forum)
                self._match_joined(raw, block, end, line_no, missed)
            for joiner, codes in wrapped.get(start, {}).items():
                self._match_joined(raw, block, end, line_no, codes, joiners=(joiner,),
                                   continuation_only=False)
        newlines = block.count(b"\n")
        self._lines += newlines
        self._partial = not block.endswith(b"\n")
        self._tail = (block[-TAIL_BYTES:] if len(block) >= TAIL_BYTES
                      else (self._tail + block)[-TAIL_BYTES:])

    def _note_frame(self, raw: bytes) -> None:
        text = strip_ansi(raw.decode("utf-8", "replace"))
        m = _FRAME.search(text)
        if not m:
            return
        rank = rank_of(text)
        if rank not in self._last_frame and len(self._last_frame) >= FRAMES_KEPT:
            self._last_frame.clear()
        self._last_frame[rank] = f"{m.group('file')}:{m.group('line')} in {m.group('func')}"

    def _pieces(self, raw: bytes, *, plain: bool = False) -> list[tuple[str, int | None]]:
        """The logical lines of a raw line, normalized, each with the rank of its prefix
        (``plain``: as it is, colours removed)."""
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if plain or not self._normalize:
            # tqdm redraws with \r: keep the line readable as one piece of evidence
            return [(strip_ansi(text).replace("\r", " ⏎ "), None)]
        out: list[tuple[str, int | None]] = []
        for segment in text.split("\r") if "\r" in text else (text,):
            if segment.strip():
                out += normalize(segment)  # what a terminal shows of a \r-redrawn line
        return out

    def _match_line(self, raw: bytes, line_no: int, code_ids: set[int]) -> set[int]:
        """Match a hit line; return the specific codes its keywords named but nothing matched."""
        missed = {ci for ci in code_ids if not self._kb.entries[ci].generic}
        # a line only a catch-all's keyword led here ("error" in a warning) needs normalizing
        # only when it could hold an exception: most such lines of a long log do not
        plain = self._normalize and not missed and _GENERIC_HINT.search(raw) is None
        for text, rank in self._pieces(raw, plain=plain):
            missed -= self._match_text(text, rank, line_no, code_ids)
        return missed

    def _match_joined(self, raw: bytes, block: bytes, end: int, line_no: int,
                      code_ids: set[int], *, joiners: tuple[str, ...] = (" ", ""),
                      continuation_only: bool = True) -> None:
        """Match the codes ``code_ids`` on this line joined with the next (up to JOIN_LINES)."""
        pieces = self._pieces(raw)
        if not pieces or end < 0:
            return
        text, rank = pieces[-1]
        following: list[str] = []
        pos = end + 1
        for _ in range(JOIN_LINES):
            if pos >= len(block):
                break
            nxt_end = block.find(b"\n", pos)
            nxt = block[pos:] if nxt_end < 0 else block[pos:nxt_end]
            nxt_text = nxt.decode("utf-8", "replace").rstrip("\r")
            if continuation_only and not _continues(text if not following else following[-1],
                                                    nxt_text):
                break
            nxt_pieces = normalize(nxt_text)
            if not nxt_pieces:
                break
            body, nxt_rank = nxt_pieces[0]
            if nxt_rank is not None:
                if nxt_rank != rank:
                    break  # another rank's line, not a continuation
                body = body.split("]: ", 1)[-1] if body.startswith("[rank") else body
            following.append(body.strip())
            for joiner in joiners:
                joined = text.rstrip() + joiner + joiner.join(following)
                code_ids = code_ids - self._match_text(joined, rank, line_no, code_ids)
                if not code_ids:
                    return
            if nxt_end < 0:
                break
            pos = nxt_end + 1

    def _wrapped_hits(self, low: bytes) -> tuple[dict[int, set[int]],
                                                 dict[int, dict[str, set[int]]]]:
        """Keywords the plain search cannot see in a small block: cut by colour codes inside a
        line ("out of\\x1b[0m memory"), or by a line break (a terminal wrapped the message
        mid-word or between words). Returns the lines holding such a keyword whole, by their
        start offset, with its codes; and the lines one begins on, with the joiner and codes."""
        inside: dict[int, set[int]] = {}
        spanning: dict[int, dict[str, set[int]]] = {}
        lines = low.split(b"\n")
        if len(lines) < 2 and b"[" not in low:
            return inside, spanning
        starts: list[int] = []
        offset = 0
        for line in lines:
            starts.append(offset)
            offset += len(line) + 1
        parts = [(_ANSI_BYTES.sub(b"", line) if b"[" in line else line).strip() for line in lines]
        coloured = {k for k, line in enumerate(lines) if b"[" in line and len(parts[k]) < len(
            line.strip())}
        for joiner in (b" ", b""):
            glued = joiner.join(parts)
            where: list[int] = []  # where each line's text begins in `glued`
            at = 0
            for part in parts:
                where.append(at)
                at += len(part) + len(joiner)
            for needle, code_ids, _ in self._needles:
                if not code_ids:
                    continue
                i = glued.find(needle)
                while i >= 0:
                    k = bisect.bisect_right(where, i) - 1
                    if i + len(needle) > where[k] + len(parts[k]):  # it runs past its line
                        spanning.setdefault(starts[k], {}).setdefault(
                            joiner.decode(), set()).update(code_ids)
                    elif k in coloured and joiner:
                        inside.setdefault(starts[k], set()).update(code_ids)
                    i = glued.find(needle, i + 1)
        return inside, spanning

    def _match_text(self, text: str, prefix_rank: int | None, line_no: int,
                    code_ids: set[int]) -> set[int]:
        """Try the codes ``code_ids`` on one logical line; return the codes that matched."""
        matched: set[int] = set()
        rank: int | None = prefix_rank
        rank_known = prefix_rank is not None
        explained = False  # a specific code identified this line: generic codes skip it
        entries = self._kb.entries
        for ci in sorted(code_ids, key=lambda c: (entries[c].generic, c)):
            entry = entries[ci]
            if entry.generic and explained:
                continue
            state = self._states[ci]
            for si, sig in enumerate(entry.signatures):
                m = sig.pattern.search(text)
                if not m or (sig.greater and not _greater(m, *sig.greater)):
                    continue
                if not rank_known:
                    rank, rank_known = rank_of(text), True
                if not sig.supporting:
                    explained = True
                matched.add(ci)
                state.counts[si] += 1
                if sig.at_end:  # only its last line can end the log
                    state.last[si] = _Hit(line_no, _cut(text, m.start()), rank)
                elif len(state.hits[si]) < EVIDENCE_PER_SIGNATURE:
                    state.hits[si].append(_Hit(line_no, _cut(text, m.start()), rank))
                if rank is not None and len(state.ranks) < RANKS_KEPT:
                    state.ranks[rank] = None
                if sig.distinct is not None:
                    seen = state.values.setdefault(si, set())
                    if len(seen) < VALUES_KEPT:
                        seen.add(m.group(sig.distinct))
                self._take_fields(state, m, rank, last=False)
            for detail in entry.details:
                if len(state.details) >= DETAILS_KEPT:
                    break
                for dm in detail.pattern.finditer(text):
                    said = detail.say.format(**{k: (v or "").strip()
                                                for k, v in dm.groupdict().items()})
                    if not rank_known:
                        rank, rank_known = rank_of(text), True
                    if rank is not None:  # several ranks say different things: name them
                        said = f"rank {rank}: {said}"
                    state.details[said] = None
                    if detail.collect is not None:
                        records = state.fields.setdefault(detail.collect, [])
                        if len(records) < FIELD_RECORDS_KEPT:
                            records.append({k: field_value(k, v)
                                            for k, v in dm.groupdict().items() if v is not None})
                    else:
                        self._take_fields(state, dm, rank, last=detail.last)
        return matched

    def _take_fields(self, state: _CodeState, m: re.Match[str], rank: int | None,
                     *, last: bool) -> None:
        for name, value in m.groupdict().items():
            if value is None or (name in state.fields and not last):
                continue
            state.fields[name] = field_value(name, value)
            if name == "exception" and "frame" not in state.fields:
                frame = self._last_frame.get(rank)
                if frame is not None:
                    state.fields["frame"] = frame

    # -- result ------------------------------------------------------------------
    def result(self) -> Diagnosis:
        """The diagnosis of everything fed so far (the input may continue after)."""
        if self._carry:
            carry, self._carry = self._carry, b""
            self._scan(carry)
        end_lines = self._end_lines()
        findings = [f for f in (self._finding(e, s, end_lines)
                                for e, s in zip(self._kb.entries, self._states, strict=True)) if f]
        lines = self._lines + (1 if self._partial else 0)
        return rank_findings(findings, lines_read=lines, bytes_read=self._bytes,
                             source=self._source, kb=self._kb)

    def _end_lines(self) -> frozenset[int]:
        """The numbers of the lines that end the input: its last line with text, and the one
        before it when that last one is a fragment a paste cut short ("gcn6:2250476:225047").
        Blank lines and markdown fences after them do not count."""
        pieces = self._tail.split(b"\n")
        if not self._partial:
            pieces.pop()  # what follows the final newline
        number = self._lines + (1 if self._partial else 0)
        ends: list[int] = []
        for piece in reversed(pieces):
            text = piece.decode("utf-8", "replace").strip().strip("`").strip()
            if text:
                ends.append(number)
                if len(ends) == 2 or len(text) > FRAGMENT_CHARS or " " in text:
                    break
            number -= 1
        return frozenset(ends)

    def _finding(self, entry: CodeEntry, state: _CodeState,
                 end_lines: frozenset[int] = frozenset()) -> Finding | None:
        valid: list[int] = []
        for si, sig in enumerate(entry.signatures):
            if not state.counts[si]:
                continue
            if sig.at_end:
                last = state.last.get(si)
                if last is None or last.line not in end_lines:
                    continue
                state.hits[si] = [last]
            if sig.requires is not None and sig.requires not in self._contexts_seen:
                continue
            if sig.distinct is not None and len(state.values.get(si, ())) < 2:
                continue
            valid.append(si)
        identifying = [si for si in valid if not entry.signatures[si].supporting]
        if not identifying:
            return None
        # the lines that identify the code first, then those that only support it
        supporting = [si for si in valid if entry.signatures[si].supporting]
        hits = (sorted((h for si in identifying for h in state.hits[si]), key=lambda h: h.line)
                + sorted((h for si in supporting for h in state.hits[si]), key=lambda h: h.line))
        evidence: list[EvidenceLine] = []
        seen_lines: set[int] = set()
        for h in hits:
            if h.line not in seen_lines and len(evidence) < EVIDENCE_SHOWN:
                evidence.append(EvidenceLine(h.line, h.text))
                seen_lines.add(h.line)
        first = min((h for si in identifying for h in state.hits[si]), key=lambda h: h.line)
        sigs = [entry.signatures[si] for si in identifying]
        strong = [s for s in sigs if not s.weak]
        best = max(s.confidence for s in (strong or sigs))
        # a signature naming a special case of the code says its own cause and fix: the one
        # that matched first
        earliest = {si: min(h.line for h in state.hits[si]) for si in identifying}
        special = min((si for si in identifying if entry.signatures[si].why
                       or entry.signatures[si].fix), key=earliest.__getitem__, default=None)
        why, fix = entry.why, entry.fix
        if special is not None:
            why = entry.signatures[special].why or why
            fix = entry.signatures[special].fix or fix
        # Several independent signatures agreeing make the call firmer, never certain.
        confidence = round(min(0.99, best + 0.02 * (len(strong or sigs) - 1)), 2)
        fields = dict(state.fields)
        first_rank = first.rank
        if first_rank is None:  # "rank : 3 (local_rank: 3)", "local_rank: 3 (pid: ...)"
            named = fields.get("rank", fields.get("local_rank"))
            first_rank = named if isinstance(named, int) else None
        if first_rank is not None:
            fields.setdefault("rank", first_rank)
        return Finding(
            code=entry.code, what=entry.title, confidence=confidence, why=why,
            fix=fix, next=entry.next, evidence=evidence, details=list(state.details),
            first_line=first.line, first_rank=first_rank, ranks=sorted(state.ranks),
            matches=sum(state.counts[si] for si in valid), fields=fields,
            weak=not strong, echo_of=frozenset.intersection(*(s.echo_of for s in sigs)),
        )


# What every signature of the catch-all codes (RANK_FAILED) needs on its line.
_GENERIC_HINT = re.compile(rb"(?:Error|Exception)(?::|\s*$)|exitcode|following error")
_NEW_RECORD = re.compile(r"\s*(?:Traceback \(|File \"|During handling|The above exception"
                         r"|\[?\d{4}-\d\d-\d\d|[A-Z]\d{4} \d\d:|\[[A-Z][ \d])")


def _continues(text: str, nxt: str) -> bool:
    """Whether ``nxt`` looks like the rest of ``text`` wrapped onto another line: it is
    indented, or ``text`` filled a terminal's width, and ``nxt`` starts no new record."""
    if not nxt.strip() or _NEW_RECORD.match(nxt):
        return False
    return nxt[:1] in " \t" or len(text) >= 64 or nxt[:1].islower()


def _greater(m: re.Match[str], a: str, b: str) -> bool:
    try:
        return int(m.group(a)) > int(m.group(b))
    except (TypeError, ValueError):
        return False
