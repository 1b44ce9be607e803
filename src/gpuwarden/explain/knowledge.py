"""The failure knowledge base: data, read from ``knowledge.toml``, validated once.

Everything ``gpuwarden explain`` knows about a failure lives in the TOML file: the
signatures that identify it, its cause and fix in failure-codes.md's words, the
codes it is usually an echo of, and the lines worth naming in the answer. Adding a
code is an edit of that file (docs/explain.md describes the format); this module
only parses it into compiled, immutable objects and refuses a malformed file with
the entry and field at fault.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from gpuwarden.boundedio import InputRefused, decode_utf8, read_regular
from gpuwarden.errors import KnowledgeBaseError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 reads TOML with the tomli backport
    import tomli as tomllib

KB_SCHEMA_VERSION = 1
ANY_CODE = "*"  # in echo_of: "an echo of any code that is not itself an echo of anything"


@dataclass(frozen=True)
class Signature:
    """One regex that identifies a code on a single log line."""

    pattern: re.Pattern[str]
    confidence: float
    # Only counts when the whole log also shows this context (e.g. torch.distributed),
    # for texts that other programs print too ("Connection refused" from pip).
    requires: str | None
    # Evidence only: adds its line to a code already identified by another signature
    # (NCCL's bare "unhandled system error" says nothing by itself).
    supporting: bool
    # ("a", "b"): the line only counts when the number captured as group a is larger
    # than group b ("worker_count=8" against "world_size=4").
    greater: tuple[str, str] | None = None
    # A group name: the signature only counts once that group took two different
    # values over the log (two ranks printing different "NCCL version" lines).
    distinct: str | None = None
    # Codes this line is an echo of, besides the code's own ``echo_of``: they apply when
    # every identifying line of the code was found by signatures naming them (an abort
    # is an echo of the error it aborted on; a segmentation fault is not).
    echo_of: frozenset[str] = frozenset()
    # A weak trace (a retry warning, an abort): a code seen only by weak signatures is the
    # root cause only when nothing else, not even a rank's bare exception, was found.
    weak: bool = False
    # This signature's own cause and fix, when the text names a special case of the code
    # (the CPU-only torch build among the builds without kernels for the GPU).
    why: str | None = None
    fix: str | None = None
    # Counts only when its last matching line ends the log: what a log shows of a hang is
    # healthy lines, then nothing (a line the paste cut short after it is still the end).
    at_end: bool = False


@dataclass(frozen=True)
class Detail:
    """A regex with named groups and a sentence that names what it captured."""

    pattern: re.Pattern[str]
    say: str
    # Its named groups also become fields of the finding (see FIELD_KINDS); with
    # ``collect`` they are appended as one record to the list field of that name
    # (each process an OOM message names), else the first value of a field stays,
    # or the last one with ``last`` (torchrun prints the root cause after the others).
    collect: str | None = None
    last: bool = False


@dataclass(frozen=True)
class CodeEntry:
    code: str
    title: str
    why: str
    fix: str
    next: str
    keywords: tuple[str, ...]
    signatures: tuple[Signature, ...]
    details: tuple[Detail, ...]
    echo_of: frozenset[str]
    # A catch-all (a rank's own exception): it only counts on lines no other code
    # explains, and it is the root cause only when no specific code was found.
    generic: bool = False


@dataclass(frozen=True)
class KnowledgeBase:
    entries: tuple[CodeEntry, ...]
    contexts: Mapping[str, tuple[str, ...]]
    source: str

    def entry(self, code: str) -> CodeEntry:
        for e in self.entries:
            if e.code == code:
                return e
        raise KeyError(code)

    @property
    def codes(self) -> tuple[str, ...]:
        return tuple(e.code for e in self.entries)


_CODE_KEYS = {"code", "title", "why", "fix", "next", "keywords", "signatures", "details", "echo_of",
              "generic"}
_SIG_KEYS = {"pattern", "confidence", "requires", "supporting", "greater", "distinct", "echo_of",
             "weak", "why", "fix", "at_end"}
_DETAIL_KEYS = {"pattern", "say", "collect", "last"}


def _fail(where: str, problem: str) -> KnowledgeBaseError:
    return KnowledgeBaseError(f"knowledge base: {where}: {problem}",
                              fix="correct the entry; docs/explain.md describes the format")


def _str(d: Mapping[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = d.get(key, "" if not required else None)
    if not isinstance(value, str) or (required and not value.strip()):
        raise _fail(where, f"'{key}' must be a non-empty string")
    return value.strip()


def _compile(pattern: Any, where: str) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise _fail(where, "'pattern' must be a non-empty string")
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise _fail(where, f"pattern {pattern!r} does not compile: {exc}") from exc


def _parse_entry(raw: Any, index: int, contexts: Mapping[str, tuple[str, ...]]) -> CodeEntry:
    where = f"codes[{index}]"
    if not isinstance(raw, dict):
        raise _fail(where, "each [[codes]] entry must be a table")
    code = _str(raw, "code", where)
    where = f"code {code}"
    unknown = set(raw) - _CODE_KEYS
    if unknown:
        raise _fail(where, f"unknown field(s) {sorted(unknown)}")
    keywords = raw.get("keywords")
    if (not isinstance(keywords, list) or not keywords
            or not all(isinstance(k, str) and k and k == k.lower() for k in keywords)):
        raise _fail(where, "'keywords' must be a non-empty list of lower-case strings")
    sigs: list[Signature] = []
    for j, s in enumerate(raw.get("signatures") or []):
        sw = f"{where} signatures[{j}]"
        if not isinstance(s, dict) or set(s) - _SIG_KEYS:
            raise _fail(sw, f"a signature is a table with fields {sorted(_SIG_KEYS)}")
        confidence = s.get("confidence", 0.9)
        if not isinstance(confidence, (int, float)) or not 0 < confidence <= 1:
            raise _fail(sw, "'confidence' must be a number in (0, 1]")
        requires = s.get("requires")
        if requires is not None and requires not in contexts:
            raise _fail(sw, f"'requires' names context {requires!r}, which [contexts] lacks")
        pattern = _compile(s.get("pattern"), sw)
        greater = s.get("greater")
        if greater is not None and (not isinstance(greater, list) or len(greater) != 2
                                    or not all(g in pattern.groupindex for g in greater)):
            raise _fail(sw, "'greater' must name two groups of the pattern")
        distinct = s.get("distinct")
        if distinct is not None and distinct not in pattern.groupindex:
            raise _fail(sw, "'distinct' must name a group of the pattern")
        sig_echo = s.get("echo_of", [])
        if not isinstance(sig_echo, list) or not all(isinstance(c, str) for c in sig_echo):
            raise _fail(sw, "'echo_of' must be a list of codes")
        texts: dict[str, str] = {}
        for key in ("why", "fix"):
            if key in s:
                texts[key] = _str(s, key, sw)
        supporting = bool(s.get("supporting", False))
        weak = bool(s.get("weak", False))
        at_end = s.get("at_end", False)
        if not isinstance(at_end, bool):
            raise _fail(sw, "'at_end' must be true or false")
        if supporting and (weak or sig_echo or texts or at_end):
            raise _fail(sw, "a 'supporting' signature identifies nothing: 'weak', 'echo_of', "
                            "'why', 'fix' and 'at_end' apply to identifying signatures only")
        sigs.append(Signature(pattern, float(confidence), requires, supporting,
                              tuple(greater) if greater else None, distinct,
                              frozenset(sig_echo), weak, texts.get("why"), texts.get("fix"),
                              at_end))
    if not any(not s.supporting for s in sigs):
        raise _fail(where, "needs at least one signature that is not 'supporting'")
    details: list[Detail] = []
    for j, d in enumerate(raw.get("details") or []):
        dw = f"{where} details[{j}]"
        if not isinstance(d, dict) or set(d) - _DETAIL_KEYS:
            raise _fail(dw, f"a detail is a table with fields {sorted(_DETAIL_KEYS)}")
        pattern = _compile(d.get("pattern"), dw)
        say = _str(d, "say", dw)
        try:
            say.format(**{name: "x" for name in pattern.groupindex})
        except (KeyError, IndexError, ValueError) as exc:
            raise _fail(dw, f"'say' uses a name the pattern does not capture: {exc}") from exc
        collect = d.get("collect")
        if collect is not None and (not isinstance(collect, str) or not collect):
            raise _fail(dw, "'collect' must be a field name")
        details.append(Detail(pattern, say, collect, bool(d.get("last", False))))
    echo_of = raw.get("echo_of", [])
    if not isinstance(echo_of, list) or not all(isinstance(c, str) for c in echo_of):
        raise _fail(where, "'echo_of' must be a list of codes")
    return CodeEntry(
        code=code, title=_str(raw, "title", where), why=_str(raw, "why", where),
        fix=_str(raw, "fix", where), next=_str(raw, "next", where, required=False),
        keywords=tuple(keywords), signatures=tuple(sigs), details=tuple(details),
        echo_of=frozenset(echo_of), generic=bool(raw.get("generic", False)),
    )


def parse_knowledge(data: Mapping[str, Any], source: str = "<memory>") -> KnowledgeBase:
    """Validate a parsed TOML document into a :class:`KnowledgeBase`.

    Raises :class:`KnowledgeBaseError` naming the entry and field at fault.
    """
    if data.get("schema_version") != KB_SCHEMA_VERSION:
        raise _fail(source, f"schema_version must be {KB_SCHEMA_VERSION}")
    raw_contexts = data.get("contexts", {})
    if not isinstance(raw_contexts, dict):
        raise _fail(source, "[contexts] must be a table of keyword lists")
    contexts: dict[str, tuple[str, ...]] = {}
    for name, words in raw_contexts.items():
        if (not isinstance(words, list) or not words
                or not all(isinstance(w, str) and w and w == w.lower() for w in words)):
            raise _fail(f"contexts.{name}", "must be a non-empty list of lower-case strings")
        contexts[name] = tuple(words)
    raw_codes = data.get("codes")
    if not isinstance(raw_codes, list) or not raw_codes:
        raise _fail(source, "no [[codes]] entries")
    entries = tuple(_parse_entry(raw, i, contexts) for i, raw in enumerate(raw_codes))
    seen: set[str] = set()
    for e in entries:
        if e.code in seen:
            raise _fail(f"code {e.code}", "defined twice")
        seen.add(e.code)
    for e in entries:
        named = e.echo_of.union(*(s.echo_of for s in e.signatures))
        for other in sorted(named - {ANY_CODE}):
            if other not in seen:
                raise _fail(f"code {e.code}", f"echo_of names unknown code {other!r}")
    return KnowledgeBase(entries, contexts, source)


def load_knowledge(path: str | Path | None = None) -> KnowledgeBase:
    """Read a knowledge base: ``path``, or the one shipped inside the package."""
    if path is None:
        return _default_knowledge()
    p = Path(path)
    try:
        text = decode_utf8(read_regular(p))  # bounded: a FIFO or /dev/zero is refused at once
    except OSError as exc:
        raise _fail(str(p), f"cannot read it ({exc.strerror or exc})") from exc
    except InputRefused as exc:
        raise _fail(str(p), f"it {exc.problem}") from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise _fail(str(p), f"not valid TOML: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # an integer past int()'s digit limit, deep nesting
        raise _fail(str(p), f"not a knowledge base ({type(exc).__name__})") from exc
    return parse_knowledge(data, str(p))


@functools.lru_cache(maxsize=1)
def _default_knowledge() -> KnowledgeBase:
    text = resources.files("gpuwarden.explain").joinpath("knowledge.toml").read_text("utf-8")
    return parse_knowledge(tomllib.loads(text), "gpuwarden/explain/knowledge.toml")
