"""Real second and third unix users for the tests of what other users can do.

``made_user`` creates a user with ``useradd`` under a per-run unique name and deletes it after;
``as_user`` and ``holding`` run code as that user in a forked child (the test process itself
stays root). A forked child keeps the interpreter and the modules the test process loaded: the
other user could not read them under /root.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests._lease_util import fork_child, kept_in_child, wait_all


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@contextlib.contextmanager
def made_user(tag: str) -> Iterator[User]:
    """A unix user created for these tests (skips when this host cannot make one)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the test creates unix users (useradd) and acts as them")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs useradd and userdel to create a second user")
    name = f"gw{tag}{os.getpid() % 100000}{secrets.token_hex(2)}"
    made = subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell",
                           "/usr/sbin/nologin", name], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"useradd cannot create a user here: {made.stderr.strip()}")
    try:
        entry = pwd.getpwnam(name)
        yield User(name, entry.pw_uid, entry.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def become(user: User) -> None:
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)


def as_user(user: User, body: Callable[[], Any]) -> int:
    """Run ``body`` as ``user`` in a forked child: 0 when it returned, 1 when it raised
    (its traceback on stderr), or the code it passed to os._exit."""
    def run() -> None:
        become(user)
        body()

    pid = fork_child(run)
    return wait_all([pid], timeout_s=60)[pid]


def holding(user: User, setup: Callable[[], Any]) -> contextlib.AbstractContextManager[int]:
    """Run ``setup`` as ``user`` in a child that keeps what it opened (locks, a lease) until
    the block ends; yields the child's pid."""
    def as_them() -> Any:
        become(user)
        return setup()

    return kept_in_child(as_them)
