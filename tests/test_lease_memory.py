"""Memory leases: one accounting with slots and whole GPUs, best fit, the line's bound, and the
guard (issue 41). Real processes, real lock files; the simulated host of tests/scenarios."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from gpuwarden.errors import LeaseUnavailableError, UsageError
from gpuwarden.lease import _locks, acquire, list_leases
from gpuwarden.lease.memory import DEFAULT_RESERVE_BYTES, gpu_budget, overuses
from gpuwarden.lease.records import Record, SlotClaim, parse_record_bytes
from tests._lease_util import kept_in_child, wait_all
from tests.conftest import until

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

PY = sys.executable
GIB = 1024**3
MIB = 1024**2
GPU0 = "GPU-00000000-0000-0000-0000-0000000080a0"
GPU1 = "GPU-00000000-0000-0000-0000-0000000080a1"
# A child that runs until its stop file appears (a job that ends when the test says so).
WAIT_FOR_FILE = "import os, sys, time\nwhile not os.path.exists(sys.argv[1]): time.sleep(0.02)"


def _holder(label: str) -> Record | None:
    return next((h for h in list_leases().holders if h.label == label), None)


def _ticket(label: str) -> Record | None:
    return next((t for t in list_leases().tickets if t.label == label), None)


def _gpuwarden(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([PY, "-m", "gpuwarden", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


# -- the accounting, pure ---------------------------------------------------------------------

def _record(pid: int, *claims: SlotClaim, label: str = "") -> Record:
    return Record("holder", f"id{pid}", pid, "alice", "box", "cmd", label, 0, claims=claims)


def test_one_budget_counts_whole_gpus_slots_memory_and_what_outside_processes_use() -> None:
    from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot

    gpu = GPUSnapshot(0, GPU0, "H100", "", 80 * GIB, 30 * GIB, 0, ComputeMode.DEFAULT, False,
                      processes=(GPUProcess(11, "alice", "eval", 25 * GIB),  # its lease: 20
                                 GPUProcess(12, "bob", "notebook", 4 * GIB)))  # no lease
    memory = _record(10, SlotClaim(GPU0, 0, 1, (), memory_bytes=20 * GIB), label="eval")
    slots = _record(20, SlotClaim(GPU0, 0, 4, (2,)))
    budget = gpu_budget(gpu, [memory, slots], {11: 10}, DEFAULT_RESERVE_BYTES)
    capacity = 80 * GIB - DEFAULT_RESERVE_BYTES
    assert budget.capacity_bytes == capacity
    # The driver's own 1 GiB and bob's 4 GiB are outside every lease.
    assert budget.outside_bytes == 30 * GIB - 25 * GIB
    by_kind = {s.kind: s for s in budget.shares}
    assert by_kind["memory"].counted_bytes == 25 * GIB  # what it uses, past what it booked
    assert by_kind["slots"].booked_bytes == capacity // 4
    assert budget.room_bytes == capacity - 5 * GIB - 25 * GIB - capacity // 4
    [over] = overuses(budget)
    assert (over.holder.pid, over.used_bytes, over.leased_bytes, over.pids) == \
        (10, 25 * GIB, 20 * GIB, ((11, 25 * GIB),))
    assert "uses 25.0 GiB of GPU 0: 5.0 GiB more than the 20.0 GiB" in over.describe()
    whole = _record(30, SlotClaim(GPU0, 0, 1, (0,)))
    assert gpu_budget(gpu, [whole], {}).room_bytes == 0


def test_a_byte_far_out_in_a_lock_file_is_named_at_once() -> None:
    for k in (1, 2, 3, 8, 1024, 65535):
        for s in (0, k - 1):
            assert _locks.slot_of_offset(_locks.slot_offset(k, s)) == (k, s)
    # O(1), in this thread's CPU time (microseconds; a scan up to 2**62 would take hours): a
    # wall-clock bound of milliseconds is missed whenever a loaded machine preempts the test.
    start = time.thread_time()
    k, _slot = _locks.slot_of_offset(2**62)
    assert time.thread_time() - start < 0.5 and _locks.slot_offset(k, 0) <= 2**62


def test_a_memory_claim_reads_to_an_older_gpuwarden_as_a_lease_of_the_whole_gpu() -> None:
    claim = SlotClaim(GPU0, 0, 1, (), memory_bytes=20 * GIB)
    assert claim.to_dict() == {"uuid": GPU0, "index": 0, "slots_per_gpu": 1, "slots": [],
                               "memory_bytes": 20 * GIB}
    raw = json.dumps({"kind": "holder", "claims": [claim.to_dict()]}).encode()
    assert parse_record_bytes(raw, "holder." + "a" * 32 + ".json").claims == (claim,)


def test_memory_and_slots_are_asked_for_apart() -> None:
    with pytest.raises(UsageError, match="memory or slots"):
        acquire(1, mem="6GiB", slots_per_gpu=2)
    with pytest.raises(UsageError, match="more than 0 bytes"):
        acquire(1, mem=0)


# -- packing, in real processes -----------------------------------------------------------------

def test_best_fit_packs_gpu0_and_keeps_gpu1_whole(scenario, lease_dir) -> None:
    scenario("two_80")
    grants = [acquire(mem="20GiB", label=f"run {i}") for i in range(3)]
    assert [g.visible_devices for g in grants] == ["0", "0", "0"]
    # Every GPU's verdict in bytes: taken as the tightest fit, the other kept whole.
    assert grants[1].states[0].line().startswith(
        "GPU 0: taken: 20.0 GiB of 58.6 GiB left (79.6 GiB - 1.0 GiB reserve - 20.0 GiB leased")
    assert "kept whole" in grants[1].states[1].line()
    big = acquire(mem="70GiB", label="big")
    assert big.visible_devices == "1"
    with pytest.raises(LeaseUnavailableError) as info:
        acquire(mem="30GiB")
    assert "30.0 GiB does not fit: 18.6 GiB left" in info.value.render()
    # Three grants of this one process share one POSIX read lock on GPU 0's byte 0: it goes
    # with the last of them, never with the first.
    gpu0 = lease_dir / f"gpu.{GPU0}.lock"
    grants[0].release()
    grants[1].release()
    assert _read_lock_seen_by_another_process(gpu0)
    grants[2].release()
    assert not _read_lock_seen_by_another_process(gpu0)
    assert acquire(mem="30GiB").visible_devices == "0"
    big.release()


def _read_lock_seen_by_another_process(path: Path) -> bool:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        fd = os.open(path, os.O_RDWR)
        owner = _locks.test_lock(fd, 0, 1)
        os.write(w, b"1" if owner is not None and not owner.write else b"0")
        os._exit(0)
    os.close(w)
    seen = os.read(r, 1) == b"1"
    os.close(r)
    os.waitpid(pid, 0)
    return seen


def test_a_whole_gpu_and_memory_leases_keep_each_other_off(scenario, lease_dir) -> None:
    scenario("two_80")
    with kept_in_child(lambda: acquire(mem="10GiB", constraints=_only(GPU0), label="small")):
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(1, constraints=_only(GPU0))
        assert "shared by 1 memory lease(s) (10.0 GiB: pid" in info.value.render()
        with acquire(1) as whole:  # GPU 1: nobody shares it
            assert whole.visible_devices == "1"
            with pytest.raises(LeaseUnavailableError) as info:
                acquire(mem="10GiB", constraints=_only(GPU1))
            assert "leased whole by pid" in info.value.render()


def test_slots_count_in_memory_beside_memory_leases(scenario, lease_dir) -> None:
    scenario("two_80")
    capacity = 81559 * MIB - DEFAULT_RESERVE_BYTES
    with kept_in_child(lambda: acquire(1, slots_per_gpu=2, constraints=_only(GPU0))):
        # One of two slots is half the GPU's capacity: a memory lease gets the other half.
        with pytest.raises(LeaseUnavailableError):
            acquire(mem=capacity // 2 + MIB, constraints=_only(GPU0))
        with acquire(mem=capacity // 2 - MIB, constraints=_only(GPU0)):
            with pytest.raises(LeaseUnavailableError) as info:
                acquire(1, slots_per_gpu=2, constraints=_only(GPU0))  # the second slot
            assert "1 of 2 slots are 39.3 GiB of its memory" in info.value.render()


def _only(uuid: str) -> Any:
    from gpuwarden.select import Constraints

    return Constraints(include=(uuid,))


@pytest.mark.slow
def test_a_large_request_is_overtaken_for_a_bounded_time_only(scenario, lease_dir, monkeypatch,
                                                              tmp_path) -> None:
    from gpuwarden.lease import line

    scenario("two_80")
    bound = 4.0
    monkeypatch.setattr(line, "OVERTAKE_BOUND_S", bound)
    stop = tmp_path / "stop"
    holder = os.fork()
    if holder == 0:
        code = 1
        try:
            with acquire(mem="50GiB", constraints=_only(GPU0), label="fifty"):
                while not stop.exists():
                    time.sleep(0.02)
            code = 0
        finally:
            os._exit(code)
    waiter = os.fork()
    if waiter == 0:
        code = 1
        try:
            until("the 50 GiB lease", lambda: _holder("fifty"))
            with acquire(mem="40GiB", constraints=_only(GPU0), wait=60, label="forty"):
                code = 0
        finally:
            os._exit(code)
    try:
        ticket = until("the 40 GiB request in line", lambda: _ticket("forty"))
        # Young in line: a small request that fits where the large one does not passes it.
        if time.time() - ticket.started_at < bound - 1.0:
            acquire(mem="6GiB", constraints=_only(GPU0), label="early").release()
        until("the bound", lambda: time.time() - ticket.started_at > bound + 0.2)
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(mem="6GiB", constraints=_only(GPU0))
        assert "held back for an earlier request" in info.value.render()
        assert "waiting for 40.0 GiB on 1 GPU" in info.value.render()
    finally:
        stop.touch()  # the 50 GiB lease ends: the 40 GiB request starts, ahead of the others
        codes = wait_all([holder, waiter], 60)
    assert codes == {holder: 0, waiter: 0}


# -- the host: runs through the command line ---------------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_three_20gib_runs_share_gpu0_a_70gib_run_gets_gpu1_a_30gib_run_waits_its_turn(
        scenario, lease_dir, tmp_path) -> None:
    scenario("two_80")
    runs: dict[str, subprocess.Popen[str]] = {}
    try:
        for label, mem in (("a", "20GiB"), ("b", "20GiB"), ("c", "20GiB"), ("big", "70GiB")):
            runs[label] = _gpuwarden("run", "--mem", mem, "--label", label, "--", PY, "-c",
                                     WAIT_FOR_FILE, str(tmp_path / f"{label}.stop"))
            until(f"run {label} leased", lambda label=label: _holder(label))
        placed = {h.label: [c.index for c in h.claims] for h in list_leases().holders}
        assert placed == {"a": [0], "b": [0], "c": [0], "big": [1]}
        runs["d"] = _gpuwarden("run", "--mem", "30GiB", "--wait", "2m", "--label", "d", "--",
                               PY, "-c", WAIT_FOR_FILE, str(tmp_path / "d.stop"))
        until("run d in line", lambda: _ticket("d"))
        assert _holder("d") is None
        (tmp_path / "b.stop").touch()
        holder = until("run d leased once b ended", lambda: _holder("d"))
        assert [c.index for c in holder.claims] == [0]
        for label in runs:
            (tmp_path / f"{label}.stop").touch()
        results = {label: p.communicate(timeout=60) for label, p in runs.items()}
        assert {label: p.returncode for label, p in runs.items()} == dict.fromkeys(runs, 0)
        err_a, err_d = results["a"][1], results["d"][1]
        assert "gpuwarden: leased 20.0 GiB of GPU 0: CUDA_VISIBLE_DEVICES=0" in err_a
        assert "GPU 1: not taken: 78.6 GiB left, as tight a fit as the GPU(s) taken, which " \
            "come first, kept whole" in err_a
        assert "waiting for 30.0 GiB on 1 GPU" in err_d and "after" in err_d
    finally:
        for label, p in runs.items():
            (tmp_path / f"{label}.stop").touch()
            if p.poll() is None:
                p.communicate(timeout=60)


def _growing_host(tmp_path: Path, *, cross_at_s: float) -> Path:
    """Two 80 GB GPUs; the process whose pid is in grow.pid uses 1000 MiB, then 25 GiB from
    ``cross_at_s`` after it started."""
    data = json.loads((Path(__file__).parent / "scenarios" / "two_80.json").read_text())
    data["gpus"][0]["processes"] = [{
        "pid_file": "grow.pid", "used_memory_mib": 1000,
        "timeline": [{"at_s": cross_at_s, "used_memory_mib": 25 * 1024}]}]
    path = tmp_path / "grow.json"
    path.write_text(json.dumps(data))
    return path


GROW = ("import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n"
        "while not os.path.exists(sys.argv[2]): time.sleep(0.02)")


class _Lines:
    """A stream's lines, each with the moment it was read."""

    def __init__(self, stream: Any) -> None:
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: Any) -> None:
        for line in stream:
            self.lines.append((time.time(), line))

    def first(self, text: str) -> float | None:
        return next((t for t, line in self.lines if text in line), None)

    @property
    def text(self) -> str:
        return "".join(line for _t, line in self.lines)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_run_past_its_lease_is_named_within_2s_on_its_stderr_and_by_leases_ls_status(
        scenario, lease_dir, tmp_path) -> None:
    cross_at_s = 1.5
    scenario(_growing_host(tmp_path, cross_at_s=cross_at_s))
    stop = tmp_path / "stop"
    run = _gpuwarden("run", "--mem", "20GiB", "--label", "grow", "--", PY, "-c", GROW,
                     str(tmp_path / "grow.pid"), str(stop))
    err = _Lines(run.stderr)
    try:
        pid = int(until("the child's pid", lambda: (tmp_path / "grow.pid").exists()
                         and (tmp_path / "grow.pid").read_text()))
        crossed_at = psutil.Process(pid).create_time() + cross_at_s
        named_at = until("the finding on the run's stderr",
                          lambda: err.first("warning[LEASE_MEMORY_EXCEEDED]"))
        # Measured from the moment the simulated timeline crosses the lease, not from the
        # start: the 2 s are the guard's, whatever the box's load did before.
        assert named_at - crossed_at <= 2.0, (named_at - crossed_at, err.text)
        assert f"pid {pid} (" in err.text and "uses 25.0 GiB of GPU 0: 5.0 GiB more than the " \
            "20.0 GiB of its memory lease" in err.text
        env = dict(os.environ)
        leases = json.loads(subprocess.run([PY, "-m", "gpuwarden", "leases", "--json"], env=env,
                                           capture_output=True, text=True, check=True).stdout)
        [finding] = leases["memory_findings"]
        assert finding["code"] == "LEASE_MEMORY_EXCEEDED"
        assert finding["fields"]["used_bytes"] == 25 * GIB
        assert finding["fields"]["processes"] == [{"pid": pid, "used_bytes": 25 * GIB}]
        ls = json.loads(subprocess.run([PY, "-m", "gpuwarden", "ls", "--json"], env=env,
                                       capture_output=True, text=True, check=True).stdout)
        assert any(p.startswith(f"LEASE_MEMORY_EXCEEDED: pid {pid} uses 25.0 GiB, leased "
                                "20.0 GiB") for p in ls["gpus"][0]["problems"])
        assert ls["gpus"][0]["memory_leases"]["leased_bytes"] == 25 * GIB
        status = json.loads(subprocess.run([PY, "-m", "gpuwarden", "status", "--json"],
                                           env=env, capture_output=True, text=True,
                                           check=True).stdout)
        [job] = [j for j in status["jobs"] if j["pid"] == run.pid]
        assert [f["code"] for f in job["findings"]] == ["LEASE_MEMORY_EXCEEDED"]
        assert job["gpus"][0]["memory_bytes"] == 20 * GIB
        assert job["gpus"][0]["used_bytes"] == 25 * GIB
    finally:
        stop.touch()
        run.wait(timeout=60)
    assert run.returncode == 0  # named, not stopped: --mem-enforce warn is the default


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_mem_enforce_stop_ends_the_run_that_grows_past_its_lease(scenario, lease_dir,
                                                                 tmp_path) -> None:
    cross_at_s = 1.0
    scenario(_growing_host(tmp_path, cross_at_s=cross_at_s))
    stop = tmp_path / "stop"
    run = _gpuwarden("run", "--mem", "20GiB", "--mem-enforce", "stop", "--", PY, "-c", GROW,
                     str(tmp_path / "grow.pid"), str(stop))
    try:
        _out, err = run.communicate(timeout=90)
    finally:
        stop.touch()
    pid = int((tmp_path / "grow.pid").read_text())
    assert run.returncode == 128 + signal.SIGTERM, err
    assert "error[LEASE_MEMORY_EXCEEDED]" in err
    assert f"stopped: the command's process group {pid}: SIGTERM, SIGKILL 5 s later" in err
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_mem_enforce_stop_kills_what_ignores_sigterm_after_the_grace(scenario, lease_dir,
                                                                    tmp_path, monkeypatch,
                                                                    capsys) -> None:
    from gpuwarden.cli import main
    from gpuwarden.cli import run as run_cli

    monkeypatch.setattr(run_cli, "MEM_STOP_GRACE_S", 0.5)
    scenario(_growing_host(tmp_path, cross_at_s=0.5))
    stubborn = "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n" + GROW
    code = main(["run", "--mem", "20GiB", "--mem-enforce", "stop", "--", PY, "-c", stubborn,
                 str(tmp_path / "grow.pid"), str(tmp_path / "never")])
    assert code == 128 + signal.SIGKILL
    assert "SIGKILL 0.5 s later" in capsys.readouterr().err


# -- many processes, every kind of lease, some dying --------------------------------------------

KINDS: list[dict[str, Any]] = [
    {"n": 1}, {"slots_per_gpu": 2}, {"slots_per_gpu": 2, "slots_each": 2},
    {"slots_per_gpu": 4}, {"mem": 4 * GIB}, {"mem": 8 * GIB}, {"mem": 12 * GIB},
]


def _mixed(out: Path, kind: dict[str, Any], seed: int) -> Callable[[], None]:
    """A child body: two leases of ``kind``, each held a random moment; with some luck it
    SIGKILLs itself at a random moment (waiting in line, or holding a lease). Each interval
    it held is recorded, its end before the release (or the death): recorded intervals lie
    inside the real ones, so an overlap found is a real one."""

    def body() -> None:
        import random

        rng = random.Random(seed)
        lock = threading.Lock()
        holding: dict[str, Any] = {}

        def record(entry: dict[str, Any]) -> None:
            with open(out, "a") as f:
                f.write(json.dumps(entry) + "\n")

        def die() -> None:
            with lock:
                if holding:
                    record({**holding, "end": time.monotonic(), "died": True})
                os.kill(os.getpid(), signal.SIGKILL)

        if rng.random() < 0.3:
            threading.Timer(rng.uniform(0.0, 1.5), die).start()
        for _ in range(2):
            grant = acquire(1 if "n" in kind else None, wait=120, label=f"mixed {seed}",
                            **{k: v for k, v in kind.items() if k != "n"})
            with lock:
                holding.update(pid=os.getpid(), start=time.monotonic(), claims=[
                    [c.uuid, c.slots_per_gpu, list(c.slots), c.memory_bytes]
                    for c in grant.claims])
            time.sleep(rng.uniform(0.02, 0.2))
            with lock:
                record({**holding, "end": time.monotonic()})
                holding.clear()
                grant.release()

    return body


def _violations(records: list[dict[str, Any]], capacity: int) -> list[str]:
    per_gpu: dict[str, list[tuple[float, float, int, set[int], int, int]]] = {}
    for r in records:
        for uuid, k, slots, mem in r["claims"]:
            per_gpu.setdefault(uuid, []).append((r["start"], r["end"], k, set(slots), mem,
                                                 r["pid"]))
    bad = []

    def share(k: int, slots: set[int], mem: int) -> int:
        return mem if mem else capacity if k == 1 or len(slots) == k else len(slots) * capacity // k

    for uuid, items in per_gpu.items():
        for s1, _e1, k1, sl1, m1, p1 in items:
            active = [(k, sl, m, p) for s, e, k, sl, m, p in items if s <= s1 < e]
            used = sum(share(k, sl, m) for k, sl, m, _p in active)
            if used > capacity:
                bad.append(f"{uuid} at {s1:.4f}: {used} bytes booked of {capacity}: {active}")
            for k2, sl2, m2, p2 in active:
                if p2 == p1 and (k2, sl2, m2) == (k1, sl1, m1):
                    continue
                slot_leases = not m1 and not m2
                if slot_leases and (k1 != k2 or sl1 & sl2):
                    bad.append(f"{uuid}: pid {p1} k={k1} {sorted(sl1)} beside pid {p2} k={k2} "
                               f"{sorted(sl2)}")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_mixed_whole_slot_and_memory_leases_with_deaths_are_never_double_booked(
        scenario, lease_dir, tmp_path, monkeypatch) -> None:
    import random

    from gpuwarden.lease import line
    from tests._lease_util import fork_child

    scenario("two_idle")  # 2 x 24 GiB: every kind competes for the same memory
    monkeypatch.setattr(line, "OVERTAKE_BOUND_S", 2.0)  # inherited by the forked children
    out = tmp_path / "holds.jsonl"
    rng = random.Random(41)
    kinds = [rng.choice(KINDS) for _ in range(32)]
    gate_r, gate_w = os.pipe()
    pids = [fork_child(_mixed(out, kind, seed), gate=(gate_r, gate_w))
            for seed, kind in enumerate(kinds)]
    os.close(gate_r)
    os.close(gate_w)
    codes = wait_all(pids, timeout_s=240)
    assert set(codes.values()) <= {0, -signal.SIGKILL}, codes
    assert -signal.SIGKILL in codes.values() and 0 in codes.values()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    done = {r["pid"] for r in records if not r.get("died")}
    assert {p for p, c in codes.items() if c == 0} <= done
    assert {tuple(sorted(k)) for k in kinds if "mem" in k} and \
        any(c[3] for r in records for c in r["claims"]), "no memory lease was ever granted"
    capacity = 24576 * MIB - DEFAULT_RESERVE_BYTES
    assert _violations(records, capacity) == []
    # Memory leases did share a GPU with each other or with slot leases at some moment.
    shared = [(a, b) for a in records for b in records if a["pid"] != b["pid"]
              for ca in a["claims"] for cb in b["claims"] if ca[0] == cb[0] and (ca[3] or cb[3])
              and a["start"] < b["end"] and b["start"] < a["end"]]
    assert shared, "memory leases never shared a GPU: they acted as whole-GPU leases"
    assert list_leases().holders == () and list_leases().tickets == ()


# -- MPS ------------------------------------------------------------------------------------------

def test_where_mps_runs_a_memory_lease_pins_the_child_to_its_memory(scenario, lease_dir,
                                                                     tmp_path, monkeypatch):
    from gpuwarden.mps import mps_state

    scenario("two_80")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not mps_state().running
    with acquire(mem="20GiB") as grant:
        assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in grant.env
    # A process the kernel names nvidia-cuda-mps-control, whose pid is in the daemon's file.
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_bytes(Path("/bin/sleep").read_bytes())
    fake.chmod(0o755)
    daemon = subprocess.Popen([str(fake), "60"])
    try:
        (tmp_path / "nvidia-cuda-mps-control.pid").write_text(f"{daemon.pid}\n")
        until("the daemon's exec", lambda: Path(f"/proc/{daemon.pid}/comm").read_text()
               .startswith("nvidia-cuda-mps"))
        state = mps_state()
        assert state.running and state.pid == daemon.pid
        with acquire(2, mem="20GiB") as grant:
            assert grant.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M,1=20480M"
        with acquire(1) as whole:  # a whole GPU is the process's own: no limit
            assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in whole.env
    finally:
        daemon.kill()
        daemon.wait()
    assert not mps_state().running  # a pid file left by a dead daemon: not up
