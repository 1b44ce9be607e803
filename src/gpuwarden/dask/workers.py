"""One host's GPU workers for a Dask scheduler: lease, plan, start nannies, stop, release.

Data flows as everywhere in gpuwarden: options (validated once) -> lease (gpuwarden.lease, the
same leases as ``gpuwarden run``, launch and the pool) -> plan (pure, ``plan.py``) -> Dask's own
nannies and workers -> a report of how it ended. The leases are held by the process that
calls :func:`lease_for_workers` and live as long as the workers: they are released when the
workers are stopped (SIGTERM/SIGINT, :meth:`GPUWorkers.close`) or when the scheduler goes away
(Dask closes its workers then, and :func:`serve` returns).

Environment of each worker: ``Nanny(env=...)`` applies it in the worker process before the
``Worker`` object exists, before preloads, plugins and any task. Only distributed's own import
precedes it (which initializes no CUDA). Dask's other route, ``pre-spawn-environ``, sets the
variables in the *nanny's* ``os.environ`` just before each spawn, from an event loop that starts
several nannies at once: two workers could swap their GPUs. So the supervisor's own
``CUDA_VISIBLE_DEVICES`` is emptied (:func:`hide_gpus_from_children`): anything that touched
CUDA before ``env`` applies would see no GPU rather than someone else's.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from gpuwarden.errors import GpuwardenError, NoGPUError, SchedulerUnreachableError, UsageError
from gpuwarden.inventory.snapshot import GPUSnapshot

log = logging.getLogger("gpuwarden.dask")

CONNECT_TIMEOUT_S = 30.0  # as `dask worker --death-timeout`
CLOSE_TIMEOUT_S = 10.0
# The scheduler is gone: nothing to hand over, so a worker gets this long to close, then its
# process is killed. With the loss seen within ~1.5 s (scheduler_link.watch_scheduler), the
# GPUs are released within ~4 s of the scheduler's end.
GONE_CLOSE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class WorkerOptions:
    """What ``gpuwarden worker`` and :func:`start_workers` take, validated by :meth:`check`."""

    scheduler_address: str
    gpus: int | Literal["all"] = "all"
    workers_per_gpu: int = 1
    min_free: str | int | None = None
    memory_fraction: float | None = None
    # A memory lease of workers_per_gpu times this on each GPU, shared with other leases,
    # instead of the whole GPU (None: whole GPUs).
    mem_per_worker: str | int | None = None
    wait: str | float | None = None
    cpu: bool = False
    nthreads: int = 1
    listen_host: str | None = None
    allow_shared: bool = False
    label: str | None = None
    name: str | None = None  # the workers' name prefix (default: this host's name)
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    dask_log_level: int = logging.WARNING

    def check(self) -> WorkerOptions:
        """These options, validated (UsageError otherwise), the address with its scheme."""
        from gpuwarden.dask.scheduler_link import check_address

        address = check_address(self.scheduler_address)
        if self.gpus != "all" and (isinstance(self.gpus, bool) or not isinstance(self.gpus, int)
                                   or self.gpus < 1):
            raise UsageError(f"gpus={self.gpus!r}: expected a count >= 1 or 'all'",
                             fix="--gpus 2, or --gpus all (every usable GPU)")
        for what, value in (("workers_per_gpu", self.workers_per_gpu),
                            ("nthreads", self.nthreads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{what}={value!r}: must be 1 or more",
                                 fix=f"{what}=1 or more (--{what.replace('_', '-')} on the "
                                 "command line)")
        if self.mem_per_worker is not None:
            from gpuwarden.lease.grant import make_request

            make_request(1, mem=self.mem_per_worker)  # UsageError for a bad size
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise UsageError(f"memory_fraction={self.memory_fraction}: must be in (0, 1]",
                             fix="e.g. 0.45 for two workers per GPU")
        if not self.connect_timeout_s > 0:
            raise UsageError(f"connect timeout {self.connect_timeout_s!r}: must be more than 0",
                             fix="--connect-timeout 30s")
        if self.name is not None and (not self.name.strip() or "/" in self.name):
            raise UsageError(f"worker name prefix {self.name!r}: must be non-empty, without '/'",
                             fix="--name box-a-2 (workers are then box-a-2/GPU0/0, ...)")
        return self if address == self.scheduler_address else \
            dataclasses.replace(self, scheduler_address=address)


@dataclass
class LeasedHost:
    """The outcome of the lease step: this host's name, its GPUs (empty for CPU workers) and
    how to give them back."""

    host: str
    gpus: tuple[GPUSnapshot, ...]
    release: Callable[[], None] = field(default=lambda: None)
    visible_devices: str = ""


def hide_gpus_from_children() -> None:
    """Empty this process's CUDA_VISIBLE_DEVICES (workers get theirs from ``Nanny(env=...)``).

    Only for a process that never uses CUDA itself: the ``gpuwarden worker`` supervisor."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def lease_for_workers(options: WorkerOptions, on_wait: Any = None) -> LeasedHost:
    """Lease the GPUs for the workers (every slot of each GPU: ``workers_per_gpu`` workers share
    a GPU, nobody else does), or name the host for ``cpu`` workers.

    Raises NoGPUError (exit 3) when no GPU can be read or none is visible; the lease errors
    (exit 4) when the GPUs are taken and ``wait`` runs out; UsageError for bad options.
    """
    from gpuwarden.inventory import read_visible
    from gpuwarden.lease import acquire
    from gpuwarden.select import Constraints

    options.check()
    if options.cpu:
        try:  # the inventory's name for this host (a simulated host has its own)
            from gpuwarden.inventory import read_host

            return LeasedHost(read_host().hostname, ())
        except GpuwardenError:  # no NVML: CPU workers need none
            return LeasedHost(socket.gethostname(), ())
    host_snapshot, visible = read_visible()
    if not visible:
        raise NoGPUError("no GPU is visible to this process",
                         fix="check CUDA_VISIBLE_DEVICES / the Slurm allocation, or --cpu for "
                         "CPU workers (testing)")
    label = options.label or f"gpuwarden worker {options.scheduler_address}"
    if options.mem_per_worker is not None:
        from gpuwarden.lease.grant import make_request

        per_worker = make_request(1, mem=options.mem_per_worker).memory_bytes
        grant = acquire(options.gpus, mem=options.workers_per_gpu * per_worker,
                        min_free=options.min_free, wait=options.wait, visible=visible,
                        on_wait=on_wait, label=label,
                        constraints=Constraints(count=1, allow_shared=options.allow_shared))
    else:
        grant = acquire(options.gpus, slots_per_gpu=options.workers_per_gpu,
                        slots_each=options.workers_per_gpu, min_free=options.min_free,
                        wait=options.wait, visible=visible, on_wait=on_wait,
                        constraints=Constraints(count=1, allow_shared=options.allow_shared),
                        label=label)
    return LeasedHost(host_snapshot.hostname, tuple(grant.gpus), grant.release,
                      grant.visible_devices)


class GPUWorkers:
    """The Dask workers of one host, one :class:`~gpuwarden.dask._nanny.GPUNanny` each.

    ``await workers.start()``; ``await workers.wait_closed()`` returns when Dask closed them
    (the scheduler went away); ``await workers.close()`` stops them. Neither releases the GPUs:
    whoever leased them does, after the workers are gone (:func:`serve` does both).
    """

    def __init__(self, options: WorkerOptions, leased: LeasedHost) -> None:
        from gpuwarden.dask.plan import plan_workers

        self.options = options
        self.leased = leased
        # CPU workers (no GPU leased, ``cpu=True``): as many as N GPUs would have had.
        cpu_workers = options.workers_per_gpu * (options.gpus if options.gpus != "all" else 1)
        self.specs = plan_workers(leased.host, leased.gpus, options.workers_per_gpu,
                                  cpu_workers=cpu_workers, name_prefix=options.name)
        self.nannies: list[Any] = []
        self._records = tempfile.mkdtemp(prefix="gpuwarden-dask-")  # 0700: ours alone
        self._closing = False

    @property
    def worker_addresses(self) -> list[str]:
        return [n.worker_address for n in self.nannies if n.worker_address]

    @property
    def deaths(self) -> list[dict[str, Any]]:
        """Every worker death the nannies saw (and reported), oldest first."""
        return [d for n in self.nannies for d in n.deaths]

    async def start(self, on_wait: Callable[[str], None] | None = None) -> None:
        """Reach the scheduler (:func:`~gpuwarden.dask.scheduler_link.first_contact`: waiting
        for it up to ``connect_timeout_s``, ``on_wait`` told once), check that no worker there
        has one of our names, install the scheduler plugin, then start the nannies."""
        from gpuwarden.dask._nanny import GPUNanny
        from gpuwarden.dask._worker_plugin import GPUWorkerPlugin
        from gpuwarden.dask.scheduler_link import check_names, first_contact

        address = self.options.scheduler_address
        identity = await first_contact(address, self.options.connect_timeout_s, on_wait)
        check_names(identity, [s.name for s in self.specs], address)
        await register_scheduler_plugin(address, self.options.connect_timeout_s)
        for i, spec in enumerate(self.specs):
            record = os.path.join(self._records, f"worker-{i}.executing")
            self.nannies.append(GPUNanny(
                address, name=spec.name, nthreads=self.options.nthreads,
                resources=dict(spec.resources) or None, env=dict(spec.env),
                host=self.options.listen_host, death_timeout=self.options.connect_timeout_s,
                silence_logs=self.options.dask_log_level, dashboard=False,
                plugins=(GPUWorkerPlugin(record, self.options.memory_fraction),),
                gpuwarden_info={"host": spec.host, "device": spec.device_label,
                                "cuda_visible_devices": spec.cuda_visible_devices},
                record_path=record))
        started = await asyncio.gather(*(n.start() for n in self.nannies),
                                       return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:
            await self.close()
            # Another command may have taken a name since the check (the race Dask then
            # reports as "name taken" in the worker's log only): say so rather than "down".
            with contextlib.suppress(SchedulerUnreachableError):
                check_names(await first_contact(address, 5.0), [s.name for s in self.specs],
                            address)
            raise SchedulerUnreachableError(
                f"{len(failed)} of {len(self.nannies)} Dask worker(s) could not start at "
                f"{address}", why=f"{type(failed[0]).__name__}: {failed[0]}",
                fix="the lines above are Dask's own; check that the scheduler is up and that "
                "this host's workers can reach it, and --host if the host has several "
                "addresses") from failed[0]

    async def wait_closed(self) -> None:
        """Until Dask closes any of the workers (the scheduler went away or closed them)."""
        waits = [asyncio.ensure_future(n.finished()) for n in self.nannies]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S, *,
                    scheduler_gone: bool = False) -> None:
        """Stop every worker, within a bound: Dask's close (each worker gets ``timeout_s`` to
        finish, then its nanny kills it); then any worker process still alive (a nanny waits
        for a worker that is still starting before it closes it: up to its ``death_timeout``
        when the scheduler is gone) is killed through its process object and joined.
        ``scheduler_gone``: the nannies tell the scheduler nothing more."""
        self._closing = True
        # Each nanny's WorkerProcess, taken now (Nanny.close forgets it): its current process
        # is read after the close, as a restart may have replaced the one there is now.
        handles = [n.process for n in self.nannies if getattr(n, "process", None) is not None]
        for n in self.nannies:
            n.scheduler_gone = n.scheduler_gone or scheduler_gone
        closing = asyncio.gather(*(n.close(timeout=timeout_s) for n in self.nannies),
                                 return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.shield(closing), timeout_s + 0.5)
        except asyncio.TimeoutError:
            pass  # a nanny waits for a worker that is still starting: killed below
        for _ in range(2):  # a restart under way may replace a process once more
            for handle in handles:
                await _kill_and_join(getattr(handle, "process", None), timeout_s)
        shutil.rmtree(self._records, ignore_errors=True)


async def _kill_and_join(process: Any, timeout_s: float) -> None:
    """SIGKILL a worker process that is still alive, through distributed's ``AsyncProcess``
    handle on it (which signals only a child it has not reaped), and wait for it."""
    if process is None:
        return
    with contextlib.suppress(Exception):  # closed handle, already gone: nothing to kill
        if process.is_alive():
            await asyncio.wait_for(process.kill(), timeout_s)
        await process.join(timeout_s)


async def register_scheduler_plugin(address: str, timeout_s: float) -> None:
    """Install gpuwarden's plugin on the scheduler (idempotent); warn when it cannot load it."""
    from distributed.core import rpc
    from distributed.protocol.pickle import dumps

    from gpuwarden.dask.scheduler_plugin import PLUGIN_NAME, GpuwardenSchedulerPlugin

    try:
        async with rpc(address) as scheduler:
            await asyncio.wait_for(scheduler.register_scheduler_plugin(
                plugin=dumps(GpuwardenSchedulerPlugin()), name=PLUGIN_NAME, idempotent=True),
                timeout_s)
    except (OSError, asyncio.TimeoutError) as exc:
        raise SchedulerUnreachableError(
            f"the Dask scheduler at {address} does not answer",
            why=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__,
            fix="start it first (`dask scheduler`), and check the address and that its port is "
            "open from this host") from exc
    except Exception as exc:  # noqa: BLE001 - a remote error: the scheduler lacks gpuwarden
        log.warning("gpuwarden: the scheduler at %s did not install gpuwarden's plugin (%s: %s); "
                    "a worker's death will show as Dask's KilledWorker. Install gpuwarden where "
                    "the scheduler runs, or start it with `dask scheduler --preload "
                    "gpuwarden.dask.scheduler_plugin`", address, type(exc).__name__, exc)


async def serve(workers: GPUWorkers, stop: asyncio.Event,
                on_started: Callable[[GPUWorkers], None] | None = None,
                on_wait: Callable[[str], None] | None = None,
                on_gone: Callable[[], None] | None = None) -> str:
    """Run the workers until ``stop`` is set, Dask closes them, or the scheduler is gone; then
    stop them all (within a bound: :meth:`GPUWorkers.close`).

    Returns why it ended: ``"stopped"`` or ``"scheduler-gone"`` (which covers a scheduler that
    closed, ``client.shutdown()``, and one that died). The GPUs are not released here.
    ``on_wait`` gets a line while the scheduler is waited for; ``on_gone`` is called when it is
    gone, before the workers are stopped.
    """
    from gpuwarden.dask.scheduler_link import watch_scheduler

    await workers.start(on_wait)
    if on_started is not None:
        on_started(workers)
    closed = asyncio.ensure_future(workers.wait_closed())
    stopped = asyncio.ensure_future(stop.wait())
    gone = asyncio.ensure_future(watch_scheduler(workers.options.scheduler_address))
    try:
        await asyncio.wait({closed, stopped, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (closed, stopped, gone):
            task.cancel()
        if stop.is_set():
            await workers.close()
        else:
            if on_gone is not None:
                on_gone()
            await workers.close(GONE_CLOSE_TIMEOUT_S, scheduler_gone=True)
    return "stopped" if stop.is_set() else "scheduler-gone"


class _LoopThread:
    """An asyncio loop in a daemon thread, for the synchronous Python API."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


class WorkerGroup:
    """Workers started by :func:`start_workers`: ``close()`` (or ``with``) stops them and
    releases their GPUs. ``names``, ``gpus`` and ``worker_addresses`` say what runs where."""

    def __init__(self, options: WorkerOptions, leased: LeasedHost, *,
                 thread: _LoopThread | None = None, scheduler: Any = None) -> None:
        self._leased = leased
        self._thread = thread or _LoopThread("gpuwarden-dask")
        self._scheduler = scheduler
        self._closed = False
        self.workers = GPUWorkers(options, leased)
        try:
            self._thread.run(self.workers.start())
        except BaseException:
            if scheduler is not None:
                with contextlib.suppress(Exception):
                    self._thread.run(scheduler.close(), timeout=CLOSE_TIMEOUT_S)
            self._thread.stop()
            leased.release()
            raise

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.workers.specs]

    @property
    def gpus(self) -> tuple[GPUSnapshot, ...]:
        return self._leased.gpus

    @property
    def worker_addresses(self) -> list[str]:
        return self.workers.worker_addresses

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._thread.run(self.workers.close(), timeout=CLOSE_TIMEOUT_S * 3)
            if self._scheduler is not None:
                self._thread.run(self._scheduler.close(), timeout=CLOSE_TIMEOUT_S)
        finally:
            self._thread.stop()
            self._leased.release()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_workers(scheduler_address: str, gpus: int | Literal["all"] = "all",
                  workers_per_gpu: int = 1, **kwargs: Any) -> WorkerGroup:
    """Lease GPUs on this host and start ``workers_per_gpu`` Dask workers on each, connected to
    ``scheduler_address``: what ``gpuwarden worker`` does, from Python. Keyword arguments are
    :class:`WorkerOptions`' (``min_free``, ``memory_fraction``, ``wait``, ``cpu``, ...).

    The workers run on a background event loop of this process; this process holds the leases.
    Raises as :func:`lease_for_workers`, and SchedulerUnreachableError when the scheduler does
    not answer.
    """
    options = WorkerOptions(scheduler_address, gpus, workers_per_gpu, **kwargs).check()
    leased = lease_for_workers(options)
    return WorkerGroup(options, leased)


class LocalGPUCluster(WorkerGroup):
    """A Dask scheduler on loopback plus this host's GPU workers: ``scheduler_address`` is what
    ``distributed.Client`` takes."""

    @property
    def scheduler_address(self) -> str:
        return str(self._scheduler.address)


def local_cluster(gpus: int | Literal["all"] = "all", workers_per_gpu: int = 1,
                  **kwargs: Any) -> LocalGPUCluster:
    """One host, no set-up: a scheduler on 127.0.0.1 (random port) with gpuwarden's plugin and
    this host's GPU workers, in this process's background loop. ``close()`` stops everything
    and releases the GPUs::

        with local_cluster(workers_per_gpu=2) as cluster, Client(cluster.scheduler_address):
            with parallel_config(backend="dask"):
                Parallel()(delayed(train)(lr) for lr in grid)
    """
    from distributed import Scheduler

    from gpuwarden.dask.scheduler_plugin import PLUGIN_NAME, GpuwardenSchedulerPlugin

    probe = WorkerOptions("tcp://127.0.0.1:0", gpus, workers_per_gpu, **kwargs).check()
    leased = lease_for_workers(probe)
    thread = _LoopThread("gpuwarden-dask-scheduler")

    async def start_scheduler() -> Any:
        scheduler = Scheduler(host="127.0.0.1", port=0, dashboard=False,
                              dashboard_address="127.0.0.1:0")
        await scheduler
        await scheduler.register_scheduler_plugin(GpuwardenSchedulerPlugin(), name=PLUGIN_NAME,
                                                  idempotent=True)
        return scheduler

    try:
        scheduler = thread.run(start_scheduler())
    except BaseException:
        thread.stop()
        leased.release()
        raise
    options = WorkerOptions(scheduler.address, gpus, workers_per_gpu, **kwargs).check()
    return LocalGPUCluster(options, leased, thread=thread, scheduler=scheduler)


def describe(workers: GPUWorkers) -> Sequence[str]:
    """One line per worker: name, device, CUDA_VISIBLE_DEVICES, address."""
    lines = []
    for spec, nanny in zip(workers.specs, workers.nannies, strict=True):
        lines.append(f"{spec.name}: {spec.device_label}, CUDA_VISIBLE_DEVICES="
                     f"{spec.cuda_visible_devices!r}, {nanny.worker_address}")
    return lines
