"""scikit-learn's own tests with joblib's backend set to "gpuwarden" vs "loky", side by side.

Every test runs inside ``joblib.parallel_config(backend=B)`` (a pytest plugin this script
writes next to a pool trace; scikit-learn's own ``Parallel`` calls inherit it), on the
simulated 2-GPU host, in a fresh pytest process per run; the backends alternate, ROUNDS
times, so both see the same load. Printed: each run's wall time, the median per backend and
their ratio, the tests that passed under each (they must be the same), and the tests whose
median time differs most. With --trace (last round), the processes either backend started in
each test, and what the gpuwarden warm pool did in it (new
pools, resizes, idle releases), for finding out why one is slow.

scikit-learn is not a dependency of gpuwarden: the ``bench`` extra installs it into the
environment (``pip install -e ".[bench]"``; ``scripts/setup`` does not). The default
selection is the modules of issue 39 that finish in about a minute each on a quiet 2-core box;
``--full`` adds ensemble/test_forest and model_selection/test_search (the issue's ~840 tests,
several minutes a run); ``--modules`` names others.

Usage: python benchmarks/bench_sklearn.py [--rounds 5] [--full | --modules PATH...] [--trace]
       [-k EXPR]
       [--before SRC]   (a third arm: gpuwarden from another source tree, e.g. main's)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from _procs import as_installed

ROOT = Path(__file__).resolve().parents[1]
MODULES = ["tests/test_multioutput.py", "inspection/tests/test_permutation_importance.py",
           "utils/tests/test_parallel.py", "model_selection/tests/test_validation.py"]
FULL = [*MODULES, "ensemble/tests/test_forest.py", "model_selection/tests/test_search.py"]

PLUGIN = '''\
"""Every test inside joblib.parallel_config(backend=$BENCH_SKLEARN_BACKEND); with
$BENCH_SKLEARN_TRACE, one JSON line per test: what the gpuwarden warm pool did in it."""
import json, os, time
import pytest
import gpuwarden  # noqa: F401 - registers the backend
import joblib

_events = []
if os.environ.get("BENCH_SKLEARN_TRACE"):
    from gpuwarden.pool import joblib_backend as _jb
    from gpuwarden.pool.executor import GPUPool as _P
    _init, _resize, _park = _P.__init__, _P.resize, getattr(_P, "_park", None)

    def _new(self, *a, **k):
        _init(self, *a, **k)
        _events.append(("new pool", k.get("max_workers")))

    def _resized(self, n):
        _events.append(("resize", self.n_workers, n))
        _resize(self, n)

    _P.__init__, _P.resize = _new, _resized
    if _park is not None:
        def _parked(self):
            done = _park(self)
            _events.append(("parked" if done else "not parked",))
            return done
        _P._park = _parked
    _shutdown = _P.shutdown

    def _down(self, *a, **k):
        if not self._shutdown:
            _events.append(("shutdown", self.n_workers))
        _shutdown(self, *a, **k)

    _P.shutdown = _down


def _processes():
    import psutil
    return {p.pid for p in psutil.Process().children(recursive=True)}


@pytest.fixture(autouse=True)
def _bench_backend(request):
    _events.clear()
    before = _processes() if os.environ.get("BENCH_SKLEARN_TRACE") else set()
    with joblib.parallel_config(backend=os.environ["BENCH_SKLEARN_BACKEND"]):
        yield
    if os.environ.get("BENCH_SKLEARN_TRACE"):
        started = len(_processes() - before)  # either backend's new workers (and helpers)
        if started:
            _events.append(("processes started", started))
    if os.environ.get("BENCH_SKLEARN_TRACE"):
        with open(os.environ["BENCH_SKLEARN_TRACE"], "a") as f:
            f.write(json.dumps({"test": request.node.nodeid, "events": _events}) + "\\n")
'''

DURATION = re.compile(r"\s*([\d.]+)s (call|setup|teardown)\s+(\S+)")
SUMMARY = re.compile(r"(\d+) passed")


def run(arm: str, modules: list[str], keyword: str | None, plugin_dir: Path,
        trace: Path | None, before: str | None = None) -> dict[str, object]:
    """One pytest run of ``modules`` with the arm's backend ("before": gpuwarden imported
    from the ``before`` source tree)."""
    import sklearn

    env = dict(os.environ)
    path = [str(plugin_dir), *([before] if arm == "before" and before else []),
            env.get("PYTHONPATH", "")]
    env.update(BENCH_SKLEARN_BACKEND="loky" if arm == "loky" else "gpuwarden",
               GPUWARDEN_SIMULATE=str(ROOT / "tests/scenarios/two_gpu.json"),
               GPUWARDEN_LEASE_DIR=tempfile.mkdtemp(prefix="leases-", dir=plugin_dir),
               PYTHONPATH=os.pathsep.join(path))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if trace is not None:
        env["BENCH_SKLEARN_TRACE"] = str(trace)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
           "bench_sklearn_plugin", "--durations=0", "--durations-min=0", "-W", "ignore",
           "-o", "addopts=", *(["-k", keyword] if keyword else []), *modules]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=Path(sklearn.__file__).parent, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    durations: dict[str, float] = defaultdict(float)
    for line in proc.stdout.splitlines():
        m = DURATION.match(line)
        if m:
            durations[m.group(3)] += float(m.group(1))
    passed = SUMMARY.search(proc.stdout.splitlines()[-1] if proc.stdout else "")
    return {"wall": wall, "durations": durations, "passed": int(passed.group(1)) if passed else 0,
            "tail": proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr[-500:],
            "failed": sorted(re.findall(r"^FAILED (\S+)", proc.stdout, re.M))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--full", action="store_true", help="the issue's whole selection")
    parser.add_argument("--modules", nargs="+", metavar="PATH",
                        help="these test modules (paths inside sklearn/) instead")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--trace", action="store_true",
                        help="what the gpuwarden warm pool did in each test (last round)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--before", metavar="SRC",
                        help="also run gpuwarden from this source tree (e.g. the src/ of "
                        "`git archive main src`): a third arm, 'before'")
    args = parser.parse_args()
    try:
        import sklearn  # noqa: F401 - present, or the benchmark cannot run
    except ImportError:
        print("bench_sklearn: scikit-learn is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
        return 77
    as_installed(ROOT / "src" / "gpuwarden", *([Path(args.before)] if args.before else []))
    modules = args.modules or (FULL if args.full else MODULES)
    plugin_dir = Path(tempfile.mkdtemp(prefix="bench-sklearn-"))
    try:
        return compare(args, modules, plugin_dir)
    finally:
        shutil.rmtree(plugin_dir, ignore_errors=True)  # the plugin, traces, lease folders


def compare(args: argparse.Namespace, modules: list[str], plugin_dir: Path) -> int:
    import sklearn

    (plugin_dir / "bench_sklearn_plugin.py").write_text(PLUGIN)
    traces = {arm: plugin_dir / f"trace-{arm}.jsonl" for arm in ("loky", "gpuwarden")}
    print(f"scikit-learn {sklearn.__version__}, {os.cpu_count()} CPUs, load average "
          f"{os.getloadavg()[0]:.1f}; {len(modules)} modules"
          f"{', -k ' + args.keyword if args.keyword else ''}; {args.rounds} rounds, "
          "backends alternating, each run a fresh pytest process")
    arms = ["loky", "gpuwarden", *(["before"] if args.before else [])]
    runs: dict[str, list[dict[str, object]]] = {arm: [] for arm in arms}
    for i in range(args.rounds):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:  # who goes first rotates
            last = i == args.rounds - 1 and args.trace
            result = run(arm, modules, args.keyword, plugin_dir,
                         traces.get(arm) if last else None, args.before)
            runs[arm].append(result)
            print(f"  round {i + 1} {arm:9} {result['wall']:7.1f} s  {result['tail']}",
                  flush=True)
    med = {b: statistics.median(float(r["wall"]) for r in rs) for b, rs in runs.items()}  # type: ignore[arg-type]
    print("\nmedian wall time: " + ", ".join(f"{arm} {med[arm]:.1f} s" for arm in arms)
          + f": gpuwarden / loky {med['gpuwarden'] / med['loky']:.2f}x"
          + (f", before / loky {med['before'] / med['loky']:.2f}x" if args.before else "")
          + f" (load average {os.getloadavg()[0]:.1f} at the end)")
    passed = {b: sorted({int(r["passed"]) for r in rs}) for b, rs in runs.items()}  # type: ignore[call-overload]
    failed = {b: sorted({f for r in rs for f in r["failed"]}) for b, rs in runs.items()}  # type: ignore[attr-defined]
    print("passed: " + ", ".join(f"{arm} {passed[arm]}" for arm in arms) + "; failed: "
          + ", ".join(f"{arm} {failed[arm] or 'none'}" for arm in arms))
    per_test = {b: defaultdict(list) for b in runs}
    for b, rs in runs.items():
        for r in rs:
            for test, took in r["durations"].items():  # type: ignore[attr-defined]
                per_test[b][test].append(took)
    common = set(per_test["loky"]) & set(per_test["gpuwarden"])
    medians = {t: (statistics.median(per_test["loky"][t]), statistics.median(per_test["gpuwarden"][t]))
               for t in common}
    # Tests that ask for loky (or multiprocessing) by name run it in both arms: in loky's its
    # executor is warm from every test before, in gpuwarden's it starts cold there.
    pinned = {t for t in common if re.search(r"loky|multiprocessing", t.split("::")[-1])}
    total = [sum(medians[t][i] for t in common) for i in (0, 1)]
    rest = [sum(medians[t][i] for t in common - pinned) for i in (0, 1)]
    print(f"\nthe tests' own time (sum of per-test medians): loky {total[0]:.1f} s, gpuwarden "
          f"{total[1]:.1f} s ({total[1] / total[0]:.2f}x); without the {len(pinned)} tests "
          f"that ask for loky or multiprocessing by name (cold in gpuwarden's arm, warm in "
          f"loky's): {rest[0]:.1f} s, {rest[1]:.1f} s ({rest[1] / rest[0]:.2f}x)")
    worst = sorted(common, key=lambda t: medians[t][1] - medians[t][0], reverse=True)
    print(f"\nthe {args.top} tests gpuwarden lost most time in (median s: loky, gpuwarden):")
    for t in worst[:args.top]:
        lo, gw = medians[t]
        print(f"  {lo:6.2f} {gw:6.2f}  {t.split('sklearn/')[-1]}")
    if args.trace:
        events = {arm: {row["test"]: row["events"] for row in map(json.loads, path.read_text().splitlines())}
                  for arm, path in traces.items() if path.exists()}
        for arm, rows in events.items():
            counts: dict[str, int] = defaultdict(int)
            for row_events in rows.values():
                for event in row_events:
                    counts[event[0]] += 1
            print(f"\n{arm} in the last round: {dict(counts)}")
        print("the tests in which either started processes or the warm pool changed:")
        for test in sorted({t for rows in events.values() for t, e in rows.items()
                            if any(ev[0] != "resize" for ev in e)}):
            said = "; ".join(f"{arm} {events[arm].get(test, [])}" for arm in events)
            print(f"  {test.split('sklearn/')[-1][:90]}: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
