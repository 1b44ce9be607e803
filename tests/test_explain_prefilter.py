"""The prefilter's choice of anchors: every keyword covered by an anchor it contains, at the
least cost the greedy choice finds (whole keywords, no anchor another one makes redundant)."""

from __future__ import annotations

import random

from gpuwarden.explain import load_knowledge
from gpuwarden.explain.prefilter import pass_cost, plan_anchors

SAMPLE = (b"[2026-01-01 10:00:01] info trainer: step=1802 loss=0.4121 lr=3.0e-04\n"
          b"[rank3]: epoch 3:  41%|########  | 4100/10000 [12:01<40:00,  9.87it/s]\n") * 200


def covered_once(keywords: list[bytes], plan: list[tuple[bytes, tuple[int, ...]]]) -> None:
    homes = [k for _, members in plan for k in members]
    assert sorted(homes) == list(range(len(keywords)))  # each keyword checked by one anchor
    for anchor, members in plan:
        assert members and all(anchor in keywords[k] for k in members), anchor


def test_the_knowledge_bases_keywords_are_all_covered_on_any_sample() -> None:
    kb = load_knowledge()
    keywords = sorted({k.encode() for e in kb.entries for k in e.keywords})
    rng = random.Random(40)
    for sample in (SAMPLE, b"", bytes(rng.randrange(32, 127) for _ in range(30000)),
                   b"\n".join(keywords) * 20):  # a log full of the keywords themselves
        covered_once(keywords, plan_anchors(keywords, sample))


def test_a_keyword_sharing_nothing_cheap_is_its_own_anchor() -> None:
    # A pass for the whole 21 bytes costs a third of one for a four-byte piece of it.
    keywords = [b"flight recorder dumps", b"out of memory", b"out of shared memory"]
    plan = plan_anchors(keywords, SAMPLE)
    covered_once(keywords, plan)
    assert (b"flight recorder dumps", (0,)) in plan
    assert pass_cost(21) < 0.5 * pass_cost(4) and pass_cost(4) == 1.0
    assert pass_cost(2) > pass_cost(3) > pass_cost(4) > pass_cost(8) > pass_cost(30)


def test_a_whole_keyword_covers_the_keywords_it_is_part_of() -> None:
    keywords = [b"connection reset by peer", b"reset by peer"]
    plan = plan_anchors(keywords, SAMPLE)
    assert plan == [(b"reset by peer", (0, 1))]


def test_an_anchor_another_one_makes_redundant_is_dropped() -> None:
    # Greedy first takes the cheap long anchor for the path, then "gloo" for the bare
    # word; "gloo" covers the path too, so the path's own pass is dropped.
    keywords = [b"gloo/transport/tcp/pair.cc", b"gloo"]
    plan = plan_anchors(keywords, SAMPLE)
    assert plan == [(b"gloo", (0, 1))]


def test_an_anchor_frequent_in_the_log_is_avoided() -> None:
    # "step" would send every line of this log to the slow path; "step=-1" does not.
    keywords = [b"step=-1", b"loss=nan"]
    plan = plan_anchors(keywords, SAMPLE)
    covered_once(keywords, plan)
    assert not any(SAMPLE.count(anchor) for anchor, _ in plan)
