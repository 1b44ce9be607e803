"""Top-1 accuracy of ``gpuwarden explain`` on the held-back split, printed, not asserted.

tests/explain_heldout/ holds real logs from public issue threads (``<name>.log``,
with ``<name>.toml``: ``expected`` code, ``source`` URL, the failing ``rank`` when
the log names one). They were collected before the v2 signatures were written and
are not used to tune them: this script is how the knowledge base is measured on
failures it was not fitted to. The tuning corpus (tests/explain_corpus/) is
asserted by tests; this split is only reported, separately for the 18 original
codes, the codes added in v2, and unrelated failures (which must get NONE).

    python benchmarks/explain_heldout.py [--verbose]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.explain import NONE_CODE, explain_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

HELDOUT = Path(__file__).resolve().parent.parent / "tests" / "explain_heldout"
# The codes of the first knowledge base; every other code was added in v2.
ORIGINAL_CODES = frozenset({
    "CUDA_FORK_REINIT", "MAIN_GUARD_MISSING", "CUDA_DEVICES_BUSY", "CUDA_OOM", "CUDA_NO_DEVICE",
    "CUDA_DRIVER_TOO_OLD", "CUDA_INVALID_ORDINAL", "NCCL_DUPLICATE_GPU", "NCCL_SHM",
    "NCCL_NO_INTERFACE", "NCCL_WATCHDOG_TIMEOUT", "DATALOADER_SHM", "DATALOADER_WORKER_KILLED",
    "RDZV_PORT_IN_USE", "RDZV_DNS", "RDZV_CONNECT_TIMEOUT", "RDZV_CONN_REFUSED",
    "RDZV_WORKERS_MISSING",
})


@dataclass(frozen=True)
class Case:
    name: str
    expected: str
    got: str
    rank_expected: int | None
    rank_got: int | None
    source: str

    @property
    def group(self) -> str:
        if self.expected == NONE_CODE:
            return "unrelated (must be NONE)"
        return "original 18 codes" if self.expected in ORIGINAL_CODES else "v2 codes"


def run() -> list[Case]:
    cases = []
    for meta_path in sorted(HELDOUT.glob("*.toml")):
        meta = tomllib.loads(meta_path.read_text(encoding="utf-8"))
        primary = explain_file(meta_path.with_suffix(".log")).primary
        cases.append(Case(meta_path.stem, meta["expected"], primary.code, meta.get("rank"),
                          primary.first_rank, meta["source"]))
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verbose", action="store_true", help="list every case, not only misses")
    args = ap.parse_args()
    cases = run()
    print(f"held-back split: {len(cases)} real logs from public threads, not tuned on")
    print(f"  {'group':<26} {'right':>5} {'cases':>5} {'top-1':>7}")
    for group in ("original 18 codes", "v2 codes", "unrelated (must be NONE)"):
        members = [c for c in cases if c.group == group]
        right = sum(c.got == c.expected for c in members)
        share = f"{right / len(members):.1%}" if members else "-"
        print(f"  {group:<26} {right:>5} {len(members):>5} {share:>7}")
    false_positives = [c for c in cases if c.expected == NONE_CODE and c.got != NONE_CODE]
    print(f"  false positives: {len(false_positives)}")
    ranked = [c for c in cases if c.rank_expected is not None and c.got == c.expected]
    rank_right = sum(c.rank_got == c.rank_expected for c in ranked)
    print(f"  first failing rank named: {rank_right}/{len(ranked)} "
          "(right-code cases whose log names the rank)")
    for c in cases:
        wrong_rank = c.rank_expected is not None and c.rank_got != c.rank_expected
        miss = c.got != c.expected or wrong_rank
        if miss or args.verbose:
            mark = "MISS" if miss else "ok  "
            rank = ("" if c.rank_expected is None
                    else f", rank {c.rank_got} (want {c.rank_expected})")
            print(f"  {mark} {c.name}: expected {c.expected}, got {c.got}{rank}  {c.source}")


if __name__ == "__main__":
    main()
