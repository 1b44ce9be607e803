"""The trust model of docs/leases.md, proved against a second unix user.

The test creates a user (useradd) and runs each attack of issue 14 as that user, in a
forked child that drops to the user's uid and gid: delete or replace a held lock file,
create the directory first, delete it mid-run, point it at a missing path with a link,
hold the directory mutex, plant FIFOs, write hostile records (deeply nested, forged,
escape sequences), stop a waiter at the head of the line, link loops, a read-only file
system. Each test asserts that no GPU is granted twice, that nothing is created or
written outside the lease directory, that `gpuwarden run --wait 3s` answers within 5 s,
and that no traceback is printed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.errors import LeaseDirError, LeaseUnavailableError
from gpuwarden.lease import acquire, lease, list_leases
from gpuwarden.lease._fs import prepare_dir
from tests._lease_util import fork_child, wait_all

pytestmark = [
    pytest.mark.usefixtures("no_leftover_processes"),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: the test creates a second unix "
                       "user (useradd) and acts as it"),
]

GPU0 = "GPU-00000000-0000-0000-0000-00000000aa00"
GPU1 = "GPU-00000000-0000-0000-0000-00000000aa01"
SCENARIO = Path(__file__).parent / "scenarios" / "two_idle.json"
# `run --wait 3s` must have answered by then, whatever the directory holds: the 3 s wait, plus
# a fresh interpreter's start and a few bounded attempts, which a 2-core machine loaded by
# other test suites stretched past 5 s (5.5 s measured). A hang never answers.
ANSWER_S = 15.0


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@pytest.fixture(scope="module")
def mallory() -> Iterator[User]:
    """A second unix user, created for these tests and deleted after them."""
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs useradd and userdel to create a second user")
    name = f"gwtest{os.getpid() % 1000000}"
    made = subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell",
                           "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd cannot create a user here: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared(scenario: Callable[[Path], Path], monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A root-owned 0755 directory with a scenario every user can read and ``tmp``, a sticky
    1777 directory like /tmp where every user may create names."""
    root = Path(tempfile.mkdtemp(prefix="gpuwarden-multiuser-"))
    root.chmod(0o755)
    (root / "scenario.json").write_text(SCENARIO.read_text())
    (root / "scenario.json").chmod(0o644)
    (root / "tmp").mkdir()
    (root / "tmp").chmod(0o1777)
    scenario(root / "scenario.json")
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(root / "tmp" / "leases"))
    _warm_up(root)
    yield root
    with contextlib.suppress(OSError):
        subprocess.run(["umount", "-l", str(root / "ro")], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


def _warm_up(root: Path) -> None:
    """Import everything a lease and the CLI use, before a child drops to the other user
    (who cannot read the interpreter's files under /root)."""
    import gpuwarden.lease.admin  # noqa: F401 (for `leases init` as the other user)
    from gpuwarden.cli import build_parser

    build_parser()
    with lease(1, lease_dir=root / "warm"):
        list_leases(root / "warm")
    shutil.rmtree(root / "warm")


def _become(user: User) -> None:
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)


def as_user(user: User, body: Callable[[], Any]) -> int:
    """Run ``body`` as ``user`` in a forked child: 0 when it returned, 1 when it raised
    (its traceback on stderr), or the code it passed to os._exit."""
    def run() -> None:
        _become(user)
        body()

    pid = fork_child(run)
    return wait_all([pid], timeout_s=30)[pid]


@contextlib.contextmanager
def holding(user: User, setup: Callable[[], Any]) -> Iterator[int]:
    """Run ``setup`` as ``user`` in a child that keeps what it opened (locks, a lease) until
    the block ends; yields the child's pid."""
    ready_r, ready_w = os.pipe()
    stop_r, stop_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(ready_r)
            os.close(stop_w)
            _become(user)
            kept = setup()  # noqa: F841 (kept alive: its descriptors hold the locks)
            os.write(ready_w, b"1")
            os.read(stop_r, 1)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(stop_r)
    try:
        assert os.read(ready_r, 1) == b"1", "the other user's set-up failed (see stderr)"
        yield pid
    finally:
        os.close(stop_w)
        os.close(ready_r)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        wait_all([pid], timeout_s=10)


def _lock_file(path: Path, *, create: bytes | None = None) -> int:
    """Open ``path`` (writing ``create`` first when given) and hold an exclusive flock."""
    if create is not None:
        path.write_bytes(create)
        path.chmod(0o644)
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def gpuwarden(*args: str, timeout_s: float = 30) -> tuple[int, str, float]:
    """``gpuwarden ARGS`` as root in a fresh process: exit code, stdout+stderr, seconds."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "gpuwarden", *args], capture_output=True,
                          text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - start


def run_wait_3s(*extra: str) -> tuple[int, str]:
    code, out, took = gpuwarden("run", "--wait", "3s", *extra, "--", "true")
    assert took < ANSWER_S, f"`run --wait 3s` took {took:.1f}s: {out}"
    assert "Traceback" not in out, out
    return code, out


def files_outside(root: Path, lease_dir: Path) -> dict[str, float]:
    """Every name under ``root`` but inside ``lease_dir``, with its modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            if path == lease_dir or lease_dir in path.parents:
                continue
            with contextlib.suppress(OSError):
                out[str(path)] = os.lstat(path).st_mtime
    return out


@contextlib.contextmanager
def nothing_written_outside(root: Path, lease_dir: Path) -> Iterator[None]:
    before = files_outside(root, lease_dir)
    yield
    assert files_outside(root, lease_dir) == before


def refusal(ask: Callable[[], Any]) -> str:
    """The rendered LeaseUnavailableError ``ask`` raises (what, why, fix, evidence)."""
    with pytest.raises(LeaseUnavailableError) as info:
        ask()
    return info.value.render()


def _slot(directory: Path, uuid: str = GPU0, k: int = 1, s: int = 0) -> Path:
    return directory / f"slot.{uuid}.k{k}.s{s}.lock"


def _init(directory: Path) -> None:
    code, out, _took = gpuwarden("leases", "init", "--dir", str(directory))
    assert code == 0, out


# -- 1. delete or replace a lock file another user holds ------------------------------------------

def test_a_replaced_lock_file_in_an_unprepared_dir_grants_nothing_twice(shared, mallory):
    leases = shared / "tmp" / "leases"
    prepare_dir(leases)  # root makes it (1777, sticky) but uses it only after her
    # Mallory uses the directory first: the mutex and GPU 0's slot file are hers.
    assert as_user(mallory, lambda: acquire(1).release()) == 0
    assert _slot(leases).stat().st_uid == mallory.uid
    with nothing_written_outside(shared, leases), lease(1) as held:  # root holds GPU 0
        assert held.visible_devices == "0"

        def replace_and_hold() -> int:
            os.unlink(_slot(leases))  # her file, in a sticky directory: allowed
            return _lock_file(_slot(leases), create=b"")

        with holding(mallory, replace_and_hold):
            # The slot lock of the new file is hers, the old inode is root's; the live holder
            # record still names GPU 0, so an honest request gets GPU 1 and then nothing.
            with lease(1) as second:
                assert second.visible_devices == "1"
                with pytest.raises(LeaseUnavailableError):
                    acquire(1)

            def mallory_asks() -> None:
                assert "GPU0 leased by pid" in refusal(lambda: acquire(2))

            assert as_user(mallory, mallory_asks) == 0
            assert any("lock file" in p and "replaced" in p for p in held.verify())


def test_gpuwarden_run_says_when_its_lock_file_is_replaced(shared, mallory):
    leases = shared / "tmp" / "leases"
    prepare_dir(leases)
    assert as_user(mallory, lambda: acquire(1).release()) == 0  # GPU 0's slot file is hers
    proc = subprocess.Popen([sys.executable, "-m", "gpuwarden", "run", "--gpus", "1", "--",
                             "sleep", "6"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not list_leases().holders:
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)

        def replace() -> None:
            os.unlink(_slot(leases))
            _slot(leases).write_bytes(b"")

        assert as_user(mallory, replace) == 0
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"warning: the lock file {_slot(leases).name} was deleted or replaced" in out, out


def test_a_prepared_dir_lets_no_user_delete_or_replace_a_lock_file(shared, mallory):
    leases = shared / "tmp" / "leases"
    # Planted before init: init replaces it with root's (nobody held it).
    leases.mkdir()
    leases.chmod(0o1777)
    assert as_user(mallory, lambda: _slot(leases).write_bytes(b"")) == 0
    _init(leases)
    assert _slot(leases).stat().st_uid == 0
    assert (leases / "mutex.lock").stat().st_uid == 0
    with nothing_written_outside(shared, leases), lease(1) as held:
        def attack() -> None:
            for act in (lambda: os.unlink(_slot(leases)),
                        lambda: os.rename(_slot(leases), leases / "x"),
                        lambda: os.unlink(leases / "mutex.lock"),
                        lambda: os.open(_slot(leases), os.O_WRONLY | os.O_TRUNC)):
                with pytest.raises(PermissionError):
                    act()
            with lease(1) as g:  # she may still lease what is free, with root's files
                assert g.visible_devices == "1"
            assert not list((leases).glob(".*.tmp"))

        assert as_user(mallory, attack) == 0
        assert held.verify() == []


def test_a_prepared_dir_refuses_more_slots_than_it_has_lock_files(shared, mallory):
    leases = shared / "tmp" / "leases"
    leases.mkdir(mode=0o700)
    code, out, _took = gpuwarden("leases", "init", "--dir", str(leases), "--slots-per-gpu", "2")
    assert code == 0, out

    def ask() -> None:
        assert "--slots-per-gpu 4" in refusal(lambda: acquire(1, slots_per_gpu=4))
        assert not list(leases.glob("slot.*.k4.*"))  # she created no lock file

    assert as_user(mallory, ask) == 0


def test_init_with_a_group_admits_only_it_and_needs_root(shared, mallory):
    from gpuwarden.cli import main

    leases = shared / "tmp" / "leases"
    leases.mkdir(mode=0o700)
    code, out, _took = gpuwarden("leases", "init", "--dir", str(leases), "--group", mallory.name)
    assert code == 0, out
    st = leases.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, mallory.gid, 0o1770)
    slot = _slot(leases).stat()
    assert (slot.st_uid, slot.st_gid, slot.st_mode & 0o777) == (0, mallory.gid, 0o640)

    def member() -> None:
        with lease(2) as g:  # her group may enter, lock and write records
            assert g.visible_devices == "0,1"
        os._exit(10 + main(["leases", "init", "--dir", str(shared / "tmp" / "mine")]))

    assert as_user(mallory, member) == 12  # init as a user: a usage error, nothing made
    assert not (shared / "tmp" / "mine").exists()


def test_the_default_directory_is_the_prepared_shared_one_else_per_user(shared, mallory,
                                                                        monkeypatch):
    from gpuwarden.lease import _fs

    monkeypatch.delenv("GPUWARDEN_LEASE_DIR")
    run = shared / "run-gpuwarden"
    monkeypatch.setattr(_fs, "SHARED_LEASE_DIR", str(run))

    def choice() -> None:
        path, warning = _fs.lease_dir_choice()
        assert path == Path(f"/tmp/gpuwarden-leases-{mallory.uid}")
        assert warning and "not other users'" in warning and "leases init" in warning

    assert as_user(mallory, choice) == 0  # not prepared: her own, with a warning
    run.mkdir(mode=0o700)
    _init(run)
    assert as_user(mallory, lambda: _expect(_fs.lease_dir_choice(), (run, None))) == 0


def _expect(got: object, wanted: object) -> None:
    assert got == wanted, got


# -- 2. the directory created first by the other user ---------------------------------------------

def test_a_lease_dir_another_user_created_first_is_refused(shared, mallory):
    leases = shared / "tmp" / "leases"

    def squat() -> None:
        leases.mkdir()
        leases.chmod(0o1777)
        _slot(leases).write_bytes(b"")

    assert as_user(mallory, squat) == 0
    with nothing_written_outside(shared, leases):
        with pytest.raises(LeaseDirError, match=f"owned by user {mallory.name}") as info:
            acquire(1)
        assert "could delete or replace any lock file" in info.value.render()
        code, out = run_wait_3s()
        assert code == 2 and "error[LEASE_DIR]" in out
    assert sorted(p.name for p in leases.iterdir()) == [_slot(leases).name]  # root made nothing


# -- 3. the directory deleted mid-run ------------------------------------------------------------

def test_the_lease_dir_cannot_be_deleted_by_another_user_and_a_holder_locks_it(shared, mallory):
    leases = shared / "tmp" / "leases"
    with lease(2) as held:
        def delete() -> None:
            with pytest.raises(PermissionError):
                shutil.rmtree(leases)
            with pytest.raises(PermissionError):
                os.rename(leases, shared / "tmp" / "moved")

        with nothing_written_outside(shared, leases):
            assert as_user(mallory, delete) == 0
        assert {_slot(leases, GPU0).name, _slot(leases, GPU1).name} <= set(os.listdir(leases))
        with pytest.raises(LeaseUnavailableError):
            acquire(1)
        # systemd-tmpfiles skips a directory someone holds a flock on: a holder holds one.
        fd = os.open(leases, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
        assert held.verify() == []
        # A cleaner that ignores locks (root) deletes it anyway: the holder notices.
        shutil.rmtree(leases)
        assert any("lease directory" in p and "deleted" in p for p in held.verify())


# -- 4. a link to a path that does not exist ----------------------------------------------------

def test_a_link_to_a_missing_path_creates_nothing_anywhere(shared, mallory, monkeypatch):
    target = shared / "etc-like" / "gpuwarden"
    link = shared / "tmp" / "leases"
    (shared / "etc-like").mkdir(mode=0o755)
    assert as_user(mallory, lambda: os.symlink(target, link)) == 0
    with nothing_written_outside(shared, link):
        with pytest.raises(LeaseDirError, match=f"symbolic link owned by {mallory.name}"):
            acquire(1)
        code, out = run_wait_3s()
        assert code == 2 and "error[LEASE_DIR]" in out
    # Root's own dangling link: still never created through.
    mine = shared / "tmp" / "mine"
    os.symlink(target, mine)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(mine))
    with pytest.raises(LeaseDirError, match="which does not exist"):
        acquire(1)
    assert not target.exists()


# -- 5. the mutex held by another user ------------------------------------------------------------

@pytest.mark.parametrize("prepared", [False, True], ids=["unprepared", "prepared"])
def test_a_held_mutex_bounds_every_wait_and_names_its_holder(shared, mallory, prepared):
    leases = shared / "tmp" / "leases"
    if prepared:
        leases.mkdir(mode=0o700)
        _init(leases)
    else:
        with lease(1):
            pass  # root makes the directory and its mutex
    with holding(mallory, lambda: _lock_file(leases / "mutex.lock")) as pid:
        code, out = run_wait_3s()
        assert code == 4 and "error[LEASE_TIMEOUT]" in out, out
        assert f"pid {pid} ({mallory.name}" in out and "mutex" in out
        code, out, took = gpuwarden("run", "--", "true")  # no --wait: bounded too
        assert code == 4 and took < ANSWER_S and "Traceback" not in out, out
        code, out, took = gpuwarden("leases")
        assert code == 0 and took < ANSWER_S, out
        assert f"mutex is held by pid {pid} ({mallory.name}" in out


# -- 6. FIFOs where a mutex, slot or record file is expected ----------------------------------------

def test_a_fifo_as_the_mutex_is_a_clear_error_not_a_hang(shared, mallory):
    leases = shared / "tmp" / "leases"
    leases.mkdir()
    leases.chmod(0o1777)
    assert as_user(mallory, lambda: os.mkfifo(leases / "mutex.lock")) == 0
    with nothing_written_outside(shared, leases):
        code, out = run_wait_3s()
        assert code == 2 and "mutex.lock is a FIFO (named pipe) owned by " + mallory.name in out, out
        code, out, took = gpuwarden("leases")
        assert code == 0 and took < ANSWER_S and "Traceback" not in out, out


def test_fifos_as_slot_or_record_files_block_nothing_else(shared, mallory):
    leases = shared / "tmp" / "leases"
    with lease(1):
        pass  # root's mutex and GPU 0 slot

    def plant() -> None:
        os.mkfifo(_slot(leases, GPU1))
        os.mkfifo(leases / "holder.fifo.json")
        os.mkfifo(leases / "ticket.fifo.json")

    assert as_user(mallory, plant) == 0
    with nothing_written_outside(shared, leases):
        with lease(1) as g:
            assert g.visible_devices == "0"
        assert "is a FIFO (named pipe) owned by " + mallory.name in refusal(lambda: acquire(2))
        code, out = run_wait_3s("--gpus", "1")
        assert code == 0, out
        bad = {c.path.name for c in list_leases().corrupt}
        assert bad == {"holder.fifo.json", "ticket.fifo.json"}


# -- 7. a deeply nested record --------------------------------------------------------------------

def test_a_deeply_nested_record_is_listed_not_a_traceback(shared, mallory):
    leases = shared / "tmp" / "leases"
    with lease(1):
        pass
    deep = leases / "holder.deep.json"
    with holding(mallory, lambda: _lock_file(deep, create=b"[" * 60000)), \
            nothing_written_outside(shared, leases):
        code, out = run_wait_3s("--gpus", "2")
        assert code == 0, out
        code, out, _took = gpuwarden("leases")
        assert code == 0 and "Traceback" not in out, out
        assert "holder.deep.json" in out and "nested deeper" in out


# -- 8. a forged, locked ticket under a fake identity ---------------------------------------------

def test_a_forged_ticket_under_a_fake_identity_holds_nothing_back(shared, mallory):
    leases = shared / "tmp" / "leases"
    with lease(1):
        pass
    forged = {"schema": 1, "kind": "ticket", "id": "forged", "pid": 1, "user": "root",
              "host": "x", "command": "init", "label": "", "started_at": 0, "claims": [],
              "arrival_ns": 1, "gpus_wanted": 2, "slots_per_gpu": 1, "slots_each": 1,
              "eligible": [GPU0, GPU1], "unknown_field": {"ignored": True}}
    ticket = leases / "ticket.forged.json"
    with holding(mallory, lambda: _lock_file(ticket, create=json.dumps(forged).encode())) as pid:
        with lease(2) as g:
            assert g.visible_devices == "0,1"
        [bad] = list_leases().corrupt
        assert "forged: claims pid 1" in bad.problem and f"pid {pid}" in bad.problem
        assert f"owner {mallory.name}" in bad.problem
        code, out, _took = gpuwarden("leases", "--json")
        assert code == 0 and json.loads(out)["waiting"] == []


# -- 9. a stopped waiter at the head of the line --------------------------------------------------

def test_a_stopped_waiter_holds_no_gpu_back_and_is_shown_stopped(shared, mallory):
    with lease(1) as held:  # root holds GPU 0
        assert held.visible_devices == "0"

        def wait_for_two() -> Any:
            import threading

            threading.Thread(target=lambda: acquire(2, wait=60, label="needs two"),
                             daemon=True).start()
            deadline = time.monotonic() + 20
            while not list_leases().tickets:
                assert time.monotonic() < deadline
                time.sleep(0.02)

        with holding(mallory, wait_for_two) as pid:
            # Running, it holds GPU 1 back for itself (arrival order).
            assert "held back for an earlier request" in refusal(lambda: acquire(1))
            os.kill(pid, signal.SIGSTOP)
            try:
                _wait_stopped(pid)
                with lease(1) as g:
                    assert g.visible_devices == "1"
                [ticket] = list_leases().tickets
                assert ticket.stopped and ticket.user == mallory.name
                code, out, _took = gpuwarden("leases")
                assert f"{pid} (stopped)" in out, out
            finally:
                os.kill(pid, signal.SIGCONT)


def test_a_stopped_holder_is_shown_stopped(shared, mallory):
    prepare_dir(shared / "tmp" / "leases")
    with holding(mallory, lambda: acquire(1, label="train.py")) as pid:
        os.kill(pid, signal.SIGSTOP)
        _wait_stopped(pid)
        why = refusal(lambda: acquire(2))
        assert f"GPU0 leased by pid {pid} ({mallory.name}, train.py, stopped)" in why, why
        code, out, _took = gpuwarden("leases")
        assert f"{pid} (stopped)" in out, out


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 5
    while not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].startswith(" T"):
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)


# -- 10. escape sequences in labels -----------------------------------------------------------------

def test_escape_sequences_in_another_users_label_are_printed_escaped(shared, mallory):
    label = "\x1b]0;owned\x07\x1b[2J\x1b[31mevil\r\x9b1m\u202eabc"
    prepare_dir(shared / "tmp" / "leases")  # root's, shared
    with holding(mallory, lambda: acquire(2, label=label)):
        for args in (("leases",), ("run", "--gpus", "1", "--", "true")):
            code, out, _took = gpuwarden(*args)
            assert code in (0, 4), out
            assert "\x1b" not in out and "\x9b" not in out and "\r" not in out
            assert "\u202e" not in out and "\x07" not in out
            assert "\\x1b[31mevil" in out, out
        code, out, _took = gpuwarden("leases", "--json")
        [holder] = json.loads(out)["holders"]
        assert "\x1b" not in holder["label"] and holder["user"] == mallory.name


# -- 11. symbolic link loops ------------------------------------------------------------------------

def test_a_link_loop_is_a_clear_error(shared, mallory, monkeypatch):
    loop = shared / "tmp" / "loop"
    os.symlink(loop, loop)
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(loop / "leases"))
    with nothing_written_outside(shared, shared / "none"):
        with pytest.raises(LeaseDirError, match="symbolic link loop"):
            acquire(1)
        code, out = run_wait_3s()
        assert code == 2 and "symbolic link loop" in out, out
        code, out, _took = gpuwarden("leases")
        assert code == 2 and "symbolic link loop" in out and "Traceback" not in out, out
    # Another user's loop in a sticky directory: refused for being theirs, before any loop.
    theirs = shared / "tmp" / "theirs"
    assert as_user(mallory, lambda: os.symlink(theirs, theirs)) == 0
    monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(theirs))
    with pytest.raises(LeaseDirError, match=f"symbolic link owned by {mallory.name}"):
        acquire(1)


# -- 12. a read-only file system ---------------------------------------------------------------------

def test_a_read_only_file_system_is_named(shared, mallory, monkeypatch):
    ro = shared / "ro"
    ro.mkdir(mode=0o755)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(ro)],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        (ro / "leases").mkdir()
        (ro / "leases").chmod(0o1777)
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        for path in (ro / "leases", ro / "missing"):
            monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(path))
            with pytest.raises(LeaseDirError, match="read-only file system"):
                acquire(1)
            code, out = run_wait_3s()
            assert code == 2 and "is on a read-only file system" in out, out
            assert "chmod" not in out  # not the "not writable" advice

        def as_other() -> None:
            with pytest.raises(LeaseDirError, match="read-only file system"):
                acquire(1)

        monkeypatch.setenv("GPUWARDEN_LEASE_DIR", str(ro / "leases"))
        assert as_user(mallory, as_other) == 0
    finally:
        subprocess.run(["umount", str(ro)], capture_output=True)
