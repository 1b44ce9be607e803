"""Choose the few substrings ("anchors") that the prefilter looks for in each block.

Looking for every knowledge-base keyword costs one pass over the block per keyword
(``bytes.find`` runs in C at a few GB/s, but 80 keywords make 80 passes). Most
keywords share short substrings, so a handful of anchors covers them all: a block
is searched once per anchor, and only the lines an anchor hits are checked for the
keywords behind it. An anchor that is frequent in this very log ("cuda" in a log of
CUDA paths) would send every line to the slow path, so anchors are chosen on a
sample of the log itself: a greedy weighted set cover that prefers substrings
rare in the sample and shared by many keywords. The choice affects speed only:
every keyword is always covered by some anchor it contains.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

ANCHOR_LENGTHS = (3, 4)        # substrings of keywords considered as anchors
SAMPLE_BYTES = 32 << 10        # how much of a block the choice is made on
PLAN_MIN_BYTES = 1 << 20       # smaller blocks are searched for every keyword directly
# Cost model, in units of "one pass of bytes.find over a block": a line an anchor hits
# costs a few microseconds of Python (cut the line, check its keywords), about a
# thousandth of a pass over a 4 MiB block.
HIT_COST = 1e-3
BLOCK_BYTES = 4 << 20         # the engine's read size (engine.BLOCK_BYTES is this one)
BLOCK_OVER_SAMPLE = BLOCK_BYTES / SAMPLE_BYTES


@functools.lru_cache(maxsize=8)
def _candidates(keywords: tuple[bytes, ...]) -> dict[bytes, frozenset[int]]:
    """Every substring of ANCHOR_LENGTHS of the keywords, with the keywords containing it."""
    grams: set[bytes] = set()
    for kw in keywords:
        if len(kw) <= min(ANCHOR_LENGTHS):
            grams.add(kw)
        for n in ANCHOR_LENGTHS:
            grams.update(kw[i:i + n] for i in range(len(kw) - n + 1))
    return {g: frozenset(k for k, kw in enumerate(keywords) if g in kw) for g in grams}


def plan_anchors(keywords: Sequence[bytes], sample: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
    """Anchors covering ``keywords`` (lower-case bytes), each with the keyword indices it checks.

    Every keyword contains its anchor, so a line holding the keyword holds the anchor.
    """
    covers = _candidates(tuple(keywords))
    cost = {gram: 1.0 + sample.count(gram) * BLOCK_OVER_SAMPLE * HIT_COST for gram in covers}
    uncovered = set(range(len(keywords)))
    plan: list[tuple[bytes, tuple[int, ...]]] = []
    while uncovered:
        gram = max(covers, key=lambda g: (len(covers[g] & uncovered) / cost[g], len(g), g))
        members = covers[gram] & uncovered
        plan.append((gram, tuple(sorted(members))))
        uncovered -= members
    return plan
