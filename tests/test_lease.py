"""Leases: grants, crash safety, arrival order, NVML state, bad lease directories."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwarden.errors import (
    ConstraintError,
    LeaseDirError,
    LeaseTimeoutError,
    LeaseUnavailableError,
    UsageError,
)
from gpuwarden.lease import acquire, lease, list_leases
from tests._lease_util import (
    fork_child,
    hold_and_record,
    hold_record_lock,
    read_records,
    wait_all,
)

pytestmark = pytest.mark.usefixtures("no_leftover_processes")

GPU0 = "GPU-00000000-0000-0000-0000-00000000aa00"
GPU1 = "GPU-00000000-0000-0000-0000-00000000aa01"


def _wait_for(cond, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _holders() -> int:
    return len(list_leases().holders)


def _tickets() -> int:
    return len(list_leases().tickets)


def test_grant_names_gpus_for_the_child_and_release_is_idempotent(scenario, lease_dir):
    scenario("two_idle")
    with lease(2, label="train.py") as grant:
        assert grant.visible_devices == "0,1"
        assert grant.env == {"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert [g.uuid for g in grant.gpus] == [GPU0, GPU1]
        table = list_leases()
        assert [h.label for h in table.holders] == ["train.py"]
        assert table.holders[0].pid == os.getpid()
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(1)
        assert info.value.exit_code == 4
        assert "leased by pid" in info.value.render() and "train.py" in info.value.render()
    grant.release()  # second release: nothing happens
    assert list_leases().holders == ()
    with lease(2):
        pass


def test_a_callers_fresh_snapshot_serves_the_first_attempt(scenario, lease_dir, monkeypatch):
    from gpuwarden.inventory import read_visible

    scenario("two_gpu")
    _host, visible = read_visible()
    # Were the GPUs read again, this scenario path would fail the request.
    monkeypatch.setenv("GPUWARDEN_SIMULATE", "/nonexistent/scenario.json")
    with acquire(2, visible=visible) as grant:
        assert grant.visible_devices == "0,1"


def test_same_process_cannot_be_granted_its_own_slot_twice(scenario, lease_dir):
    scenario("two_idle")
    a = acquire(1)
    b = acquire(1)
    assert {a.visible_devices, b.visible_devices} == {"0", "1"}
    with pytest.raises(LeaseUnavailableError):
        acquire(1)
    a.release()
    b.release()


def test_a_forked_child_cannot_release_or_keep_the_parents_grant(scenario, lease_dir):
    scenario("two_idle")
    with lease(2) as grant:
        pid = fork_child(grant.release)  # a child that "releases" and exits
        assert wait_all([pid], timeout_s=10)[pid] == 0
        assert grant.held
        with pytest.raises(LeaseUnavailableError):
            acquire(1)  # still ours


def test_bad_arguments_are_usage_errors(scenario, lease_dir):
    scenario("two_idle")
    for kwargs in ({"n": 0}, {"slots_per_gpu": 0}, {"slots_per_gpu": 2, "slots_each": 3},
                   {"min_free": "lots"}, {"wait": "soon"}):
        with pytest.raises(UsageError):
            acquire(**kwargs)
    with pytest.raises(LeaseUnavailableError, match="only 2 GPU"):
        acquire(3, wait="10m")  # can never be met: fails at once instead of waiting


def test_min_free_is_judged_by_nvml_state(scenario, lease_dir, tmp_path):
    data = json.loads((Path(__file__).parent / "scenarios" / "two_idle.json").read_text())
    data["gpus"][0]["memory_used_mib"] = 20000  # 4 GiB free
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    scenario(path)
    with lease(1, min_free="10GiB") as grant:
        assert grant.visible_devices == "1"
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(1, min_free="10GiB")
    assert "GPU 0: refused: 4.5 GiB free, 10.0 GiB required" in info.value.evidence


@pytest.mark.timeout(30)
def test_sigkilled_holder_frees_its_gpu_for_the_next_waiter(scenario, lease_dir, tmp_path):
    scenario("two_idle")
    holder = fork_child(hold_and_record(tmp_path / "h.jsonl", n=2, hold_s=60))
    _wait_for(lambda: _holders() == 1)
    out = tmp_path / "w.jsonl"
    waiter = fork_child(hold_and_record(out, n=2, hold_s=0.0, wait=20))
    _wait_for(lambda: _tickets() == 1)
    time.sleep(0.3)  # the waiter is now in its poll loop
    killed_at = time.monotonic()
    os.kill(holder, signal.SIGKILL)
    assert wait_all([waiter], timeout_s=15)[waiter] == 0
    wait_all([holder], timeout_s=5)
    [record] = read_records(out)
    # Served because the kernel dropped the dead holder's lock, not after a timeout (the waiter
    # would have waited its 20 s). How fast the next waiter hears of it is a benchmark's
    # question (bench_lease.py); 5 s leaves a loaded machine its scheduling delays.
    assert record["start"] - killed_at < 5.0, f"served {record['start'] - killed_at:.3f}s after"


@pytest.mark.timeout(30)
def test_children_of_a_holder_do_not_keep_its_lease(scenario, lease_dir):
    """Exec'd children (O_CLOEXEC) and bare forks (closed at fork) never hold the claim."""
    scenario("two_idle")
    r, w = os.pipe()

    def body() -> None:
        grant = acquire(2)
        exec_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                      close_fds=False)
        fork_pid = os.fork()
        if fork_pid == 0:
            time.sleep(60)
            os._exit(0)
        os.write(w, f"{exec_child.pid} {fork_pid}\n".encode())
        time.sleep(60)
        grant.release()

    holder = fork_child(body)
    kids = [int(x) for x in os.read(r, 100).split()]
    os.close(r)
    os.close(w)
    os.kill(holder, signal.SIGKILL)
    wait_all([holder], timeout_s=5)
    try:
        with lease(2, wait=5) as grant:  # the children still run, the GPUs are free
            assert grant.visible_devices == "0,1"
            for pid in kids:
                os.kill(pid, 0)
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_requests_are_served_in_arrival_order(scenario, lease_dir, tmp_path):
    """A 2-GPU request that arrives first is not starved by 1-GPU requests after it."""
    scenario("two_idle")
    out = tmp_path / "order.jsonl"
    first = acquire(1)  # GPU 0 busy: the 2-GPU request must wait
    big = fork_child(hold_and_record(out, n=2, hold_s=0.05, tag="big"))
    _wait_for(lambda: _tickets() == 1)
    small = []
    for i in range(4):  # GPU 1 is free, but held back for the earlier 2-GPU request
        small.append(fork_child(hold_and_record(out, n=1, hold_s=0.05, tag=f"small{i}")))
        _wait_for(lambda i=i: _tickets() == i + 2)
    time.sleep(0.3)
    assert read_records(out) == [], "a later 1-GPU request took the GPU the 2-GPU one waits for"
    table = list_leases()
    assert [t.gpus_wanted for t in table.tickets] == [2, 1, 1, 1, 1]
    first.release()
    codes = wait_all([big, *small], timeout_s=30)
    assert all(c == 0 for c in codes.values()), codes
    records = sorted(read_records(out), key=lambda r: r["start"])
    assert records[0]["tag"] == "big"
    assert all(r["start"] >= records[0]["end"] for r in records[1:])


def test_waiting_reports_what_blocks_it_and_times_out_with_exit_4(scenario, lease_dir):
    scenario("two_idle")
    seen = []
    with lease(2, label="train.py"):
        started = time.monotonic()
        with pytest.raises(LeaseTimeoutError) as info:
            acquire(1, wait=0.5, on_wait=seen.append)
        assert 0.5 <= time.monotonic() - started < 10  # gave up after its wait, not never
    err = info.value
    assert isinstance(err, ConstraintError) and err.exit_code == 4
    assert "GPU0 leased by pid" in err.why and "train.py" in err.why
    assert seen and seen[0].headline().startswith(
        "waiting for 1 GPU (0 of 2 free now): GPU0 leased by pid")
    assert _tickets() == 0  # a request that gave up leaves no ticket behind


def test_processes_of_lease_holders_are_not_foreign(scenario, lease_dir, tmp_path):
    """A GPU shared in slots is judged by its leases: the holder's own processes
    (and their descendants) on it do not make it 'in use'."""
    r, w = os.pipe()

    def body() -> None:
        from gpuwarden.select import Constraints

        grant = acquire(1, slots_per_gpu=2, constraints=Constraints(include=("0",)))
        kid = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        os.write(w, f"{kid.pid}\n".encode())
        try:
            time.sleep(60)
        finally:
            kid.kill()
            grant.release()

    data = json.loads((Path(__file__).parent / "scenarios" / "two_idle.json").read_text())
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    scenario(path)
    holder = fork_child(body)
    kid = None
    try:
        kid = int(os.read(r, 100))
        data["gpus"][0]["processes"] = [{"pid": kid, "user": "alice", "command": "python x.py",
                                         "used_memory_mib": 1000}]
        data["gpus"][1]["processes"] = [{"pid": 999999, "user": "bob", "command": "python y.py",
                                         "used_memory_mib": 1000}]
        path.write_text(json.dumps(data))
        with lease(1, slots_per_gpu=2) as grant:
            assert grant.visible_devices == "0"  # the holder's child is not foreign
            assert grant.claims[0].slots == (1,)
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(1, slots_per_gpu=2, slots_each=2)
        text = "\n".join(info.value.evidence)
        assert "GPU 1: refused: in use by 1 other process(es): pid 999999 (bob" in text
    finally:
        os.close(r)
        os.close(w)
        os.kill(holder, signal.SIGTERM)
        wait_all([holder], timeout_s=5)
        if kid is not None:
            # SIGTERM ends the holder at once (no finally runs there): its child is ours to end,
            # or it outlives the suite as an orphan sleeping out its minute
            with contextlib.suppress(ProcessLookupError):
                os.kill(kid, signal.SIGKILL)


# -- corrupt, stale and forged records ------------------------------------------------------

def test_stale_and_corrupt_records_never_block_or_crash(scenario, lease_dir):
    scenario("two_idle")
    stale = {"schema": 2, "kind": "holder", "host": "x", "command": "train.py", "label": "",
             "claims": [{"uuid": GPU0, "index": 0, "slots_per_gpu": 1, "slots": [0]}]}
    (lease_dir / "holder.ghost.json").write_text(json.dumps(stale))  # nobody holds its lock
    (lease_dir / "holder.garbage.json").write_bytes(b"\x00{not json")
    (lease_dir / "ticket.trunc.json").write_text('{"kind": "ticket", "arrival_ns": 1, "elig')
    (lease_dir / "gpu.bogus.lock").write_text("")
    (lease_dir / "notes.txt").write_text("hello")
    # A corrupt record whose owner is alive (it holds the lock) is shown, and ignored.
    live_corrupt = lease_dir / "ticket.alive.json"
    with hold_record_lock(live_corrupt, content=b'{"kind": "ticket", "uuids": ["' +
                          GPU0.encode() + b'"'):
        with lease(2) as grant:
            assert grant.visible_devices == "0,1"
        assert not (lease_dir / "holder.ghost.json").exists()  # our own stale record: removed
        table = list_leases()
        assert [c.path.name for c in table.corrupt] == ["ticket.alive.json"]


def test_a_records_pid_and_user_are_the_kernels_never_what_it_says(scenario, lease_dir):
    """A live record claiming to be pid 1 of user alice is the process that holds its lock, of
    the user who owns the file: it holds GPUs under that name, the only one it can have."""
    scenario("two_idle")
    forged = {"schema": 2, "kind": "holder", "pid": 1, "user": "alice", "host": "x",
              "command": "x", "label": "", "started_at": 0,
              "claims": [{"uuid": GPU0, "index": 0, "slots_per_gpu": 1, "slots": [0]}]}
    path = lease_dir / "holder.forged.json"
    with hold_record_lock(path, content=json.dumps(forged).encode()) as pid:
        [holder] = list_leases().holders
        assert (holder.pid, holder.user) == (pid, pwd.getpwuid(os.geteuid()).pw_name)
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(2)
        assert f"GPU0 leased by pid {pid} (" in info.value.render()
        assert "alice" not in info.value.render() and "pid 1 " not in info.value.render()


def test_an_older_gpuwardens_live_lease_is_kept_off_and_ours_is_visible_to_it(scenario,
                                                                             lease_dir):
    """During an upgrade both versions share a directory: a lease of the version before this
    one (a flock on its record, one lock file per slot) keeps this one off its GPU; a record
    of this one carries a flock and the fields the older version reads, so it keeps off ours."""
    scenario("two_idle")
    path = lease_dir / "holder.host-old.json"

    def older_holder() -> None:  # as that version: its own pid in the record, and a flock
        old = {"schema": 1, "kind": "holder", "id": "old", "pid": os.getpid(),
               "user": "alice", "host": "x", "command": "python train.py", "label": "old job",
               "started_at": 0,
               "claims": [{"uuid": GPU0, "index": 0, "slots_per_gpu": 1, "slots": [0]}]}
        path.write_text(json.dumps(old))
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        time.sleep(30)

    pid = fork_child(older_holder)
    try:
        _wait_for(lambda: path.exists() and not _flock_free(path))
        with lease(1) as grant:
            assert grant.visible_devices == "1"
            why = refusal_of(lambda: acquire(1))
            assert f"GPU0 leased by pid {pid} (" in why and "an older gpuwarden's lease" in why
            [mine] = [p for p in lease_dir.glob("holder.*.json") if p != path]
            assert not _flock_free(mine)  # the older version sees it live
            data = json.loads(mine.read_text())
            assert data["pid"] == os.getpid() and data["id"] and data["claims"][0]["uuid"] == GPU1
        assert path.exists()  # never deleted as stale: its owner lives
    finally:
        os.kill(pid, signal.SIGKILL)
        wait_all([pid], timeout_s=10)


def test_an_older_records_pid_is_believed_only_as_its_writers() -> None:
    """A record in the older format names its pid itself: believed only for a live process of
    the record file's owner that started before the file was born (the multi-user attack is
    in test_lease_multiuser.py)."""
    import psutil

    from gpuwarden.lease import _proc
    from gpuwarden.lease.scan import older_record_problem

    me, uid = os.getpid(), os.getuid()
    now = time.time_ns()
    assert older_record_problem(me, uid, now) == ""
    started = _proc.process_start_ns(me)
    assert started is not None and abs(started / 1e9 - psutil.Process(me).create_time()) < 1
    assert "started after the record was written" in older_record_problem(
        me, uid, started - 5_000_000_000)
    other = uid + 1 if uid != 0 else 65534
    assert "not of the record's owner" in older_record_problem(me, other, now)
    dead = fork_child(lambda: None)
    wait_all([dead], timeout_s=10)
    assert "not running" in older_record_problem(dead, uid, now)
    assert "names no pid" in older_record_problem(-1, uid, now)


def test_the_older_record_format_is_honoured_by_0_1_only() -> None:
    """docs/leases.md, "Upgrading": records of the format before issue 25 are honoured by
    0.1.x only. When the version reaches 0.2, this fails until that format's branch goes
    (scan.older_record_problem and Record.legacy, the flock and the older fields written
    beside each record, admin._is_locked's flock) with this test."""
    import gpuwarden
    from gpuwarden.lease import scan

    version = tuple(int(x) for x in gpuwarden.__version__.split(".")[:2])
    assert version < scan.OLDER_FORMAT_DROPPED_IN, (
        f"gpuwarden {gpuwarden.__version__} still honours the older lease record format")


def _flock_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def refusal_of(ask) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(LeaseUnavailableError) as info:
        ask()
    return info.value.render()


@pytest.mark.parametrize("ofd", [False, True], ids=["posix", "ofd"])
def test_a_claim_without_a_record_still_blocks_and_is_listed(scenario, lease_dir, ofd):
    scenario("two_idle")
    with lease(2):
        pass  # creates the lock files
    with hold_record_lock(lease_dir / f"gpu.{GPU0}.lock", start=0, length=1, ofd=ofd) as pid:
        with lease(1) as grant:
            assert grant.visible_devices == "1"
        [held] = list_leases().unrecorded
        assert (held.uuid, held.slots_per_gpu, held.slot) == (GPU0, 1, 0)
        with pytest.raises(LeaseUnavailableError) as info:
            acquire(2)
        why = info.value.render()
        if ofd:  # the kernel names no process for an open-file-description lock
            assert "GPU0 leased by an open file description lock" in why, why
        else:
            assert f"GPU0 leased by pid {pid} (" in why and "without a lease record" in why, why


# -- the lease directory ------------------------------------------------------------------------

def test_a_missing_lease_dir_is_created_private_root_included(scenario, tmp_path, monkeypatch):
    """A directory gpuwarden makes is its user's own (0700), root's too: a shared one is made by
    `leases init`, which knows it makes one (a world-writable directory root made on the side
    was one anyone could plant names in)."""
    scenario("two_idle")
    path = tmp_path / "new-leases"
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(path))
    old = os.umask(0o077)
    try:
        with lease(1):
            pass
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o7777 == 0o700
    for f in path.iterdir():
        assert f.stat().st_mode & 0o044 == 0o044, f"{f.name} is not readable by other users"


def test_lease_dir_under_a_missing_parent_is_a_clear_error(scenario, tmp_path, monkeypatch):
    scenario("two_idle")
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(LeaseDirError, match="parent .* does not exist") as info:
        acquire(1)
    assert info.value.exit_code == 2


def test_lease_dir_that_is_a_file_or_unsafe_is_refused(scenario, tmp_path, monkeypatch):
    scenario("two_idle")
    afile = tmp_path / "file"
    afile.write_text("")
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(afile))
    with pytest.raises(LeaseDirError, match="not a directory"):
        acquire(1)
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o777)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(loose))
    with pytest.raises(LeaseDirError, match="without the sticky bit"):
        acquire(1)


NOBODY = 65534


@pytest.fixture
def shared_tmp():  # type: ignore[no-untyped-def]
    """A directory another user can reach (pytest's own tmp dirs are 0700)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gpuwarden-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _as_other_user(body) -> int:  # type: ignore[no-untyped-def]
    """Exit code of ``body`` run in a child as user 'nobody' (tests run as root here)."""

    def run() -> None:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        body()

    pid = fork_child(run)
    return wait_all([pid], timeout_s=20)[pid]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_another_user_shares_the_lease_dir_and_its_locks(scenario, shared_tmp, monkeypatch):
    path = shared_tmp / "s.json"
    path.write_text((Path(__file__).parent / "scenarios" / "two_idle.json").read_text())
    path.chmod(0o644)
    scenario(path)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(shared_tmp / "leases"))
    (shared_tmp / "leases").mkdir()
    (shared_tmp / "leases").chmod(0o1777)  # shared by hand, like /tmp (not prepared)
    old = os.umask(0o077)  # our files must still be lockable by the other user
    try:
        with lease(1):
            pass
        with lease(1) as grant:  # root holds GPU 0 (the preferred one)
            def other() -> None:
                try:
                    other_grant = acquire(2)
                except LeaseUnavailableError as exc:
                    assert "leased by pid" in exc.render()
                else:
                    raise AssertionError(f"granted {other_grant} while root holds a GPU")
                with lease(1) as g:
                    assert g.visible_devices == "1" and g.gpus[0].uuid != grant.gpus[0].uuid

            assert _as_other_user(other) == 0
    finally:
        os.umask(old)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_unwritable_lease_dir_is_a_clear_error(scenario, shared_tmp, monkeypatch):
    scenario("two_idle")
    locked = shared_tmp / "locked"
    locked.mkdir(mode=0o755)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(locked))

    def other() -> None:
        try:
            acquire(1)
        except LeaseDirError as exc:
            assert "not writable by user nobody" in exc.render()
            assert "chmod 1777" in exc.render()
            os._exit(7)

    assert _as_other_user(other) == 7


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user")
def test_leases_reads_a_directory_this_user_cannot_write(scenario, shared_tmp, monkeypatch):
    """`gpuwarden leases` is read-only: another user's 0755 directory is listed, not refused."""
    from gpuwarden.cli import build_parser, main

    build_parser()  # imports every subcommand now: user nobody cannot read root's interpreter
    scenario("two_idle")
    locked = shared_tmp / "locked"
    locked.mkdir(mode=0o755)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(locked))
    out = shared_tmp / "out.json"
    out.write_text("")
    out.chmod(0o666)
    with lease(1, label="train.py"):
        def other() -> None:
            import contextlib

            with open(out, "w") as f, contextlib.redirect_stdout(f):
                code = main(["leases", "--json"])
            os._exit(10 + code)

        assert _as_other_user(other) == 10
        [holder] = json.loads(out.read_text())["holders"]
        assert holder["label"] == "train.py"


def test_listing_leases_deletes_no_record(scenario, lease_dir):
    from gpuwarden.cli import main

    scenario("two_idle")
    stale = {"schema": 1, "kind": "holder", "id": "ghost", "pid": 1, "user": "alice",
             "host": "x", "command": "train.py", "label": "", "started_at": 0, "claims": []}
    ghost = lease_dir / "holder.ghost.json"
    ghost.write_text(json.dumps(stale))  # ours, and nobody holds its lock: stale
    assert main(["leases", "--json"]) == 0
    assert ghost.exists()
    assert list_leases().holders == ()


def test_a_scan_by_another_thread_while_a_record_is_made_leaves_its_lock_held(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A POSIX lock belongs to the process: a scan that opened and closed a record another
    thread of the same process was just making would drop that record's lock, and every other
    process would take the live request for a dead one (seen as a waiter skipped in line, about
    1 run in 20 on a loaded box). The scan here runs at the worst moment: locked, not yet known."""
    from gpuwarden.lease import _locks, records, scan

    directory = tmp_path / "leases"
    directory.mkdir()
    real_set_lock = _locks._set_lock
    seen: list[scan.ScanResult] = []

    def lock_then_scan(fd: int, kind: int, start: int, length: int) -> bool:
        held = real_set_lock(fd, kind, start, length)
        seen.append(scan.scan(directory))  # what another thread's scan does just then
        return held

    monkeypatch.setattr(_locks, "_set_lock", lock_then_scan)
    ticket = records.OwnedRecord(directory, records.this_process("ticket", "t", gpus_wanted=1))
    monkeypatch.undo()
    try:
        assert len(seen) == 1 and not seen[0].records  # not listed before it is whole
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # another process asks the kernel who holds the record
            try:
                fd = os.open(ticket.path, os.O_RDONLY)
                owner = _locks.test_lock(fd, 0, 0)
                os.write(write, str(owner.pid if owner else 0).encode())
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 32) == str(os.getpid()).encode()
        os.close(read)
        os.waitpid(pid, 0)
        assert [r.record_id for r in scan.scan(directory).records] == [ticket.record.record_id]
    finally:
        ticket.remove()


def test_a_scan_out_of_time_has_seen_every_users_earliest_request(tmp_path: Path) -> None:
    """Users are taken in turn: when the time budget ends a scan (after its first 64 records), a
    user whose uid sorts late is not left out behind another user's pile of records. And a
    scan that starts already out of time still looks at its first 64 new names."""
    from gpuwarden.lease import records, scan
    from tests._lease_util import kept_in_child

    directory = tmp_path / "leases"
    directory.mkdir()
    dead = records.this_process("holder", "gone")
    for _ in range(100):  # root's: the records of processes that have ended (no lock held)
        (directory / records.record_name("holder", records.new_token())).write_text(
            json.dumps(dead.content()))

    def waiting() -> object:
        return records.OwnedRecord(directory, records.this_process("ticket", "late",
                                                                   gpus_wanted=1))

    with kept_in_child(waiting):
        [ticket] = [p for p in directory.iterdir() if p.name.startswith(records.TICKET_PREFIX)]
        os.chown(ticket, 54321, 54321)  # another user's request (root may give it away)
        scanner = scan.Scanner(directory)
        scanner.scan()  # the names are known now (lstat once per name): the next scan opens
        result = scanner.scan(budget_s=0.0)
        assert not result.complete, (result.corrupt, result.left_out)
        assert [r.uid for r in result.records] == [54321], (result.corrupt, result.left_out)
    ticket_only = tmp_path / "fresh"
    ticket_only.mkdir()
    with kept_in_child(lambda: records.OwnedRecord(ticket_only, records.this_process(
            "ticket", "new", gpus_wanted=1))):
        assert len(scan.Scanner(ticket_only).scan(budget_s=0.0).records) == 1
