"""GPU leases: atomic, crash-safe sharing of a host's GPUs between independent jobs.

::

    from gpuwarden.lease import lease

    with lease(2, min_free="20GiB", wait="10m", label="train.py") as grant:
        subprocess.run(cmd, env={**os.environ, **grant.env})   # CUDA_VISIBLE_DEVICES="1,3"

A claim is a kernel record lock (fcntl) on a byte of a GPU's file in the lease directory
(``GPUWARDEN_LEASE_DIR``; else ``/run/gpuwarden`` when ``gpuwarden leases init`` prepared
it; else ``/tmp/gpuwarden-leases-<uid>``), held by the process that called
:func:`acquire`; it ends when that process releases it or dies, however it dies.
Requests that must wait are served in arrival order. Other users of the host are
assumed hostile: see docs/leases.md, "Trust model".
"""

from __future__ import annotations

from gpuwarden.lease._fs import (
    DEFAULT_LEASE_DIR,
    LEASE_DIR_ENV,
    SHARED_LEASE_DIR,
    lease_dir_choice,
    lease_dir_path,
)
from gpuwarden.lease.grant import Grant, LeaseRequest, make_request
from gpuwarden.lease.listing import LeaseTable, list_leases
from gpuwarden.lease.manager import acquire, lease
from gpuwarden.lease.records import Record, SlotClaim
from gpuwarden.lease.status import GpuState, StatusPrinter, WaitStatus

__all__ = [
    "DEFAULT_LEASE_DIR",
    "LEASE_DIR_ENV",
    "SHARED_LEASE_DIR",
    "GpuState",
    "Grant",
    "LeaseRequest",
    "LeaseTable",
    "Record",
    "SlotClaim",
    "StatusPrinter",
    "WaitStatus",
    "acquire",
    "lease",
    "lease_dir_choice",
    "lease_dir_path",
    "list_leases",
    "make_request",
]
