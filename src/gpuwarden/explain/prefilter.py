"""Choose the few substrings ("anchors") that the prefilter looks for in each block.

Looking for every knowledge-base keyword costs one pass over the block per keyword
(``bytes.find`` runs in C at a few GB/s, but 80 keywords make 80 passes). Most
keywords share short substrings, so a handful of anchors covers them all: a block
is searched once per anchor, and only the lines an anchor hits are checked for the
keywords behind it. An anchor that is frequent in this very log ("cuda" in a log of
CUDA paths) would send every line to the slow path, so anchors are chosen on a
sample of the log itself: a greedy weighted set cover that prefers substrings
rare in the sample and shared by many keywords. A keyword that shares nothing
cheap with the others is its own best anchor: ``bytes.find`` skips ahead by the
needle's length, so a pass looking for all of "flight recorder dumps" costs a
third of one for a four-byte piece of it. The choice affects speed only: every
keyword is always covered by some anchor it contains.
"""

from __future__ import annotations

import functools
import heapq
from collections import Counter
from collections.abc import Sequence

ANCHOR_LENGTHS = (2, 3, 4)     # substrings of keywords considered as anchors
SAMPLE_BYTES = 32 << 10        # how much of a block the choice is made on
PLAN_MIN_BYTES = 1 << 20       # smaller blocks are searched for every keyword directly
# Cost model, in units of "one pass of bytes.find over a block": a line an anchor hits
# costs a few microseconds of Python (cut the line, check its keywords), about a
# thousandth of a pass over a 4 MiB block.
HIT_COST = 1e-3
# A pass looking for a short substring costs more than one for a long one (bytes.find
# skips ahead by the needle's length): measured per 4 MiB block relative to 4 bytes.
# Longer needles follow 0.2 + 4 / (length + 1), which fits these and measured 8, 11 and
# 21 bytes (0.71, 0.60, 0.38) within 0.1.
PASS_COST = {1: 1.6, 2: 1.5, 3: 1.2, 4: 1.0, 5: 0.86, 6: 0.8}


def pass_cost(length: int) -> float:
    """The cost of one pass looking for a needle of ``length`` bytes (4 bytes: 1.0)."""
    return PASS_COST.get(length, 0.2 + 4 / (length + 1))
BLOCK_BYTES = 4 << 20         # the engine's read size (engine.BLOCK_BYTES is this one)
BLOCK_OVER_SAMPLE = BLOCK_BYTES / SAMPLE_BYTES


@functools.lru_cache(maxsize=4)
def _candidates(keywords: tuple[bytes, ...]) -> dict[bytes, int]:
    """Every substring of ANCHOR_LENGTHS of the keywords, and every whole keyword, with the
    keywords containing it.

    The keywords a gram covers are a bit set (bit k: keyword k): a few thousand grams
    stay a few hundred KiB.
    """
    covers: dict[bytes, int] = {}
    for k, kw in enumerate(keywords):
        grams = {kw}
        for n in ANCHOR_LENGTHS:
            grams.update(kw[i:i + n] for i in range(len(kw) - n + 1))
        for gram in grams:
            covers[gram] = covers.get(gram, 0) | (1 << k)
    # a whole keyword covers every keyword it is part of ("reset by peer" the connection's)
    longest = max(ANCHOR_LENGTHS)
    for gram in [g for g in covers if len(g) > longest]:
        for k, kw in enumerate(keywords):
            if len(kw) > len(gram) and gram in kw:
                covers[gram] |= 1 << k
    # A two-byte gram is only worth a pass when it stands for several keywords (it is
    # common in text); keeping the lone ones would only slow the choice down.
    shortest = min(ANCHOR_LENGTHS)
    return {g: ks for g, ks in covers.items()
            if len(g) > shortest or ks & (ks - 1) or g in keywords}


def plan_anchors(keywords: Sequence[bytes], sample: bytes) -> list[tuple[bytes, tuple[int, ...]]]:
    """Anchors covering ``keywords`` (lower-case bytes), each with the keyword indices it checks.

    Every keyword contains its anchor, so a line holding the keyword holds the anchor.
    The greedy choice is evaluated lazily (a gram's worth only falls as keywords get
    covered), so choosing costs little more than counting the grams in the sample.
    """
    covers = _candidates(tuple(keywords))
    uncovered = (1 << len(keywords)) - 1

    # how often each gram occurs in the sample, counted in one pass per gram length
    # (only candidates are kept: every gram of the sample would cost megabytes); a longer
    # one (a whole keyword) by its own count
    seen: Counter[bytes] = Counter()
    longest = max(ANCHOR_LENGTHS)
    for n in {len(g) for g in covers if len(g) <= longest}:
        seen.update(g for g in (sample[i:i + n] for i in range(len(sample) - n + 1))
                    if g in covers)
    for gram in covers:
        if len(gram) > longest:
            seen[gram] = sample.count(gram)
    cost = {gram: pass_cost(len(gram)) + seen[gram] * BLOCK_OVER_SAMPLE * HIT_COST
            for gram in covers}

    def key(gram: bytes) -> tuple[float, int, tuple[int, ...]]:
        """Heap order like ``max``: most keywords per cost, then longer, then larger bytes."""
        worth = bin(covers[gram] & uncovered).count("1") / cost[gram]
        return (-worth, -len(gram), tuple(-b for b in gram))

    heap = [(key(g), g) for g in covers]  # a popped key may be stale: worth only falls
    heapq.heapify(heap)
    plan: list[tuple[bytes, int]] = []  # anchor, the keyword bits it checks
    while uncovered and heap:
        _, gram = heapq.heappop(heap)
        fresh = key(gram)
        if heap and fresh > heap[0][0]:  # worth less now than the next: look again later
            heapq.heappush(heap, (fresh, gram))
            continue
        members = covers[gram] & uncovered
        if members:
            plan.append((gram, members))
            uncovered &= ~members
    return [(gram, tuple(k for k in range(len(keywords)) if members >> k & 1))
            for gram, members in _without_redundant(plan, covers, cost)]


def _without_redundant(plan: list[tuple[bytes, int]], covers: dict[bytes, int],
                       cost: dict[bytes, float]) -> list[tuple[bytes, int]]:
    """The greedy plan less the anchors whose keywords all hold another anchor of it.

    Greedy takes a cheap long anchor for one keyword ("gloo/transport/tcp/pair.cc") before
    the short one that later covers it anyway ("gloo"); dropping it, costliest first, saves
    its pass and covers the same keywords.
    """
    homes = dict(plan)
    for gram in sorted(homes, key=lambda g: -cost[g]):
        others = [g for g in homes if g != gram]
        moved: dict[bytes, int] = {}
        members = homes[gram]
        while members:
            k = members & -members  # the lowest keyword bit
            home = next((g for g in others if covers[g] & k), None)
            if home is None:
                break
            moved[home] = moved.get(home, 0) | k
            members &= ~k
        else:
            del homes[gram]
            for home, ks in moved.items():
                homes[home] |= ks
    return [(gram, homes[gram]) for gram, _ in plan if gram in homes]
