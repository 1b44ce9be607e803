"""The stories of examples/stories, run as a user runs them: the naive script fails with the
documented failure code (read by `gpuwarden explain` from its output), the fixed one works.

Every CPU part runs once, all in parallel (each is a subprocess that mostly waits on a socket,
a timeout or torch's import), in one module fixture; the tests then read their outcome. The
naive/fixed pairs that need a GPU are `gpu`-marked and run where NVML shows one.
"""

from __future__ import annotations

import re
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "stories"))
import catalog  # noqa: E402

# The first test to ask for the module's runs waits for all of them (a hung one is cut at its
# timeout_s, up to 180 s): the whole module's bound, not a test's.
pytestmark = [pytest.mark.usefixtures("no_leftover_processes"), pytest.mark.timeout(600),
              pytest.mark.slow, pytest.mark.xdist_group("stories")]

DOCTOR4 = {case: catalog.StoryRun(catalog.STORY4, "fixed.py", (case, "--no-launch"), timeout_s=30)
           for case in ("wrong-addr", "port-in-use")}
# Parts whose point needs a GPU: without one they must say so and exit 77.
SKIPPING = catalog.NAIVE_GPU_ONLY


def run_all(runs: list[catalog.StoryRun]) -> dict[str, catalog.Outcome]:
    with ThreadPoolExecutor(max_workers=min(8, len(runs))) as pool:
        return {o.run.name: o for o in pool.map(catalog.run, runs)}


def show(outcome: catalog.Outcome) -> str:
    return f"{outcome.run.name}: exit {outcome.exit_code} after {outcome.seconds:.1f} s\n{outcome.output}"


@pytest.fixture(scope="module")
def cpu() -> dict[str, catalog.Outcome]:
    # the slowest first, so that they overlap the most
    runs = [*catalog.NAIVE4.values(), *catalog.FIXED4.values(), *DOCTOR4.values(),
            catalog.FIXED3_SIMULATED]
    if not catalog.has_gpu():
        # With a GPU, fixed stories 1, 2 and 5 take their GPU path: test_gpu_fixed_story_works_on_the_gpu.
        runs += [catalog.FIXED1, catalog.FIXED2, catalog.FIXED5, *SKIPPING]
    return run_all(runs)


@pytest.mark.parametrize("case, raw_text", [
    ("wrong-addr", "The client socket has timed out after 3000ms while trying to connect to "
                   "(node-0.cluster.invalid"),
    ("port-in-use", "EADDRINUSE"),
    ("missing-rank", "1/2 clients joined"),
])
def test_story4_naive_fails_without_naming_the_cause(cpu: dict[str, catalog.Outcome],
                                                     case: str, raw_text: str) -> None:
    outcome = cpu[catalog.NAIVE4[case].name]
    assert outcome.exit_code == 1 and not outcome.timed_out, show(outcome)
    assert raw_text in outcome.output, show(outcome)
    if case == "port-in-use":
        # rank 0 fails at once, rank 1 waits past its own 3 s timeout until it is killed
        assert "rank 1: still waiting 30 s after init_process_group began (its timeout was 3 s), killed" in outcome.output
    if case == "missing-rank":
        # PyTorch counts the ranks that arrived; nothing in its output says which one is missing
        assert "rank 1" not in outcome.output.split("---")[0].replace("[rank0]", "")


@pytest.mark.parametrize("case", list(catalog.NAIVE4))
def test_story4_naive_output_is_explained(cpu: dict[str, catalog.Outcome], case: str) -> None:
    outcome = cpu[catalog.NAIVE4[case].name]
    assert catalog.explain_code(outcome.output) == catalog.NAIVE4[case].expect_code, show(outcome)


def test_story4_doctor_names_dns_and_port_before_anything_starts(cpu: dict[str, catalog.Outcome]) -> None:
    dns, port = (cpu[r.name] for r in DOCTOR4.values())
    for outcome, code in ((dns, "RDZV_DNS"), (port, "RDZV_PORT_IN_USE")):
        assert outcome.exit_code == 0, show(outcome)
        took = re.search(rf"-> exit 1 after ([\d.]+) s, named [A-Z_, ]*{code}", outcome.output)
        assert took and float(took.group(1)) < 5.0, show(outcome)  # the resolver bound is 3 s
    assert "does not resolve  (RDZV_DNS)" in dns.output
    assert "is already in use on this host  (RDZV_PORT_IN_USE)" in port.output


def test_story4_fixed_names_each_cause_in_seconds_then_runs(cpu: dict[str, catalog.Outcome]) -> None:
    for case, story_run in catalog.FIXED4.items():
        outcome = cpu[story_run.name]
        assert outcome.exit_code == 0, show(outcome)
        assert outcome.output.count("all_reduce sum = 3") == 2, show(outcome)
        if case == "port-in-use":
            assert "error[RDZV_PORT_IN_USE]: MASTER_PORT" in outcome.output
            holder_pid = re.search(r"\(pid (\d+), a process left over", outcome.output)
            assert holder_pid and f"evidence: pid {holder_pid.group(1)} (" in outcome.output
        if case == "missing-rank":
            assert "rank(s) 1 of 2 did not get there" in outcome.output, show(outcome)
            assert "stack of rank 1" in outcome.output and "train.py" in outcome.output


def test_story3_fixed_on_the_simulated_busy_host(cpu: dict[str, catalog.Outcome]) -> None:
    outcome = cpu[catalog.FIXED3_SIMULATED.name]
    assert outcome.exit_code == 0, show(outcome)
    out = outcome.output
    # every GPU refused with its reason, then the shared one accepted
    assert "GPU 1: refused: exclusive_process mode, held by pid 5151 (carol" in out, show(outcome)
    assert "error[SELECT_UNSATISFIED]: 1 GPU(s) requested, 0 of 4 usable" in out
    assert "GPU 2: ok: 61.2 GiB free, 31% utilization, shared with 1 process(es)" in out
    # the OOM's pids (explain's typed fields, not its rendered text) joined with the
    # inventory: users and commands by name
    assert "explain: CUDA_OOM" in out
    assert "pid 4242 holds 70.0 GiB on GPU 0: user bob, python train_llm.py" in out
    assert "pid 6161 holds 7.5 GiB on GPU 0: user dave" in out
    # the second job waits in line for the shared GPU the first one leased
    assert "leased GPU 2 after" in out and "waited in line" in out


def test_gpu_only_naive_stories_say_so_and_skip_without_a_gpu(cpu: dict[str, catalog.Outcome]) -> None:
    if catalog.has_gpu():
        pytest.skip("a GPU is present: the naive failures run for real (the gpu tests)")
    for story_run in SKIPPING:
        outcome = cpu[story_run.name]
        assert outcome.exit_code == catalog.SKIP_EXIT, show(outcome)
        assert "skipped" in outcome.output and "GPU" in outcome.output, show(outcome)


def test_stories_1_2_5_fixed_run_on_cpu(cpu: dict[str, catalog.Outcome]) -> None:
    if catalog.has_gpu():
        pytest.skip("a GPU is present: the fixed stories run their GPU path (the gpu tests)")
    story2 = cpu[catalog.FIXED2.name]
    assert story2.exit_code == 0 and "checksums match" in story2.output, show(story2)
    story5 = cpu[catalog.FIXED5.name]
    assert story5.exit_code == 0 and "ok: 4 trials ran" in story5.output, show(story5)
    story1 = cpu[catalog.FIXED1.name]
    assert story1.exit_code == 0, show(story1)
    assert story1.output.count("backend gloo: all_reduce = 3") == 2, show(story1)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("story_run", catalog.NAIVE_GPU_ONLY, ids=lambda r: r.name)
def test_gpu_naive_story_fails_with_its_code(story_run: catalog.StoryRun) -> None:
    outcome = catalog.run(story_run)
    assert outcome.exit_code == story_run.expect_exit, show(outcome)
    assert catalog.explain_code(outcome.output) == story_run.expect_code, show(outcome)


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("story_run", [catalog.FIXED1, catalog.FIXED2, catalog.FIXED3_REAL,
                                       catalog.FIXED5], ids=lambda r: r.name)
def test_gpu_fixed_story_works_on_the_gpu(story_run: catalog.StoryRun) -> None:
    outcome = catalog.run(story_run)
    assert outcome.exit_code == 0, show(outcome)
