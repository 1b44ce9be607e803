"""Slurm's compressed host lists: ``node[01-03,07],gpu5`` → node01 node02 node03 node07 gpu5.

The rules Slurm's own ``scontrol show hostnames`` follows: commas inside brackets do not split
hosts; a bracket holds numbers and ranges (``1,3,5-7``); a range keeps the zero padding of its
bounds (``01-10`` → 01 … 10); several bracket groups in one name multiply
(``r[1-2]n[1-2]`` → r1n1 r1n2 r2n1 r2n2).
"""

from __future__ import annotations

import re

from gpuwarden.errors import UsageError

_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_nodelist(text: str) -> list[str]:
    """Every host of a Slurm node list, in order. Raises UsageError for a malformed list."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        if item:
            hosts.extend(_expand_item(item, text))
    return hosts


def first_host(text: str) -> str:
    """The first host of a node list (the usual MASTER_ADDR of a Slurm job)."""
    hosts = expand_nodelist(text)
    if not hosts:
        raise UsageError(f"node list {text!r} names no host", fix="check SLURM_JOB_NODELIST")
    return hosts[0]


def _split_top(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise _bad(text, "brackets inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise _bad(text, "a ']' without its '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise _bad(text, "a '[' without its ']'")
    items.append(text[start:])
    return [i.strip() for i in items]


def _expand_item(item: str, whole: str) -> list[str]:
    match = _GROUP.search(item)
    if match is None:
        if "[" in item or "]" in item:
            raise _bad(whole, f"nested brackets in {item!r}")
        return [item]
    head, tail = item[: match.start()], item[match.end():]
    out = []
    for number in _numbers(match.group(1), whole):
        out.extend(_expand_item(head + number + tail, whole))
    return out


def _numbers(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if m is None:
            raise _bad(whole, f"{part!r} is not a number or a range")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise _bad(whole, f"range {part!r} runs backwards")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _bad(text: str, why: str) -> UsageError:
    return UsageError(f"node list {text!r} is malformed", why=why,
                      fix="write it as Slurm does, e.g. node[01-03,07],gpu5")
