"""Checks of the driver, torch's CUDA build, and the GPUs this process would use.

Pure functions: (host snapshot, torch facts, environment) -> Check. The GPU state
is NVML's (or a simulated scenario's); torch's view comes from a subprocess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpuwarden.doctor.model import Check, Status, check
from gpuwarden.doctor.probes import CudaDriverInfo, TorchInfo
from gpuwarden.errors import GpuwardenError, VisibilityError
from gpuwarden.inventory.snapshot import ComputeMode, GPUSnapshot, HostSnapshot
from gpuwarden.mps import MpsState
from gpuwarden.select import Constraints, Refusal, select
from gpuwarden.units import format_bytes
from gpuwarden.visibility import Visibility, parse_visibility

OK, WARN, FAIL, SKIP = Status.OK, Status.WARN, Status.FAIL, Status.SKIP

# Below this share of free memory a GPU is reported as nearly full (CUDA_OOM risk).
LOW_FREE_FRACTION = 0.10


def _gpu_word(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"


def _is_nvml(host: HostSnapshot) -> bool:
    """A real host read through NVML (HostSnapshot.source is "nvml" or "simulated:<path>")."""
    return host.source == "nvml"


def check_driver(host: HostSnapshot | None, error: GpuwardenError | None, torch: TorchInfo) -> Check:
    """NVML and the driver: present, which version, how many GPUs."""
    if host is None:
        wants_gpu = torch.cuda_compiled
        return check(
            "driver", "CUDA_NO_DEVICE", FAIL if wants_gpu else WARN,
            "no NVIDIA driver: NVML cannot be read, no GPU will be used"
            + (f" although torch {torch.version} is a CUDA build" if wants_gpu else
               " (jobs run on CPU with gloo)"),
            why=(error.why or error.what) if error else None,
            fix=error.fix if error else None,
        )
    source = "NVML" if _is_nvml(host) else f"a simulated host ({host.source})"
    evidence = [f"{g.label}: {g.name}, {g.pci_bus_id}, {g.uuid}" for g in host.gpus]
    if not host.gpus:
        return check("driver", "CUDA_NO_DEVICE", FAIL if torch.cuda_compiled else WARN,
                     f"NVIDIA driver {host.driver_version} is loaded but reports no GPU",
                     why="the container or VM was started without GPUs, or the GPUs fell off "
                     "the bus (dmesg: 'fallen off the bus', Xid 79)",
                     fix="start the container with --gpus all; check `nvidia-smi` and dmesg")
    failed = [g for g in host.gpus if g.error is not None]
    if failed:
        return check("driver", "GPU_HARDWARE_FAULT", FAIL,
                     f"{len(failed)} of {_gpu_word(len(host.gpus))} cannot be read: "
                     + ", ".join(f"{g.label} ({g.error})" for g in failed),
                     why="NVML answers 'GPU is lost' for a GPU that fell off the bus or failed "
                     "(dmesg: Xid 79, 'fallen off the bus'); software cannot bring it back",
                     fix="leave it out (gpuwarden never selects it; --exclude for other tools) "
                     "and have an admin reset it (nvidia-smi -r) or drain the node",
                     evidence=evidence)
    return check("driver", "CUDA_NO_DEVICE", OK,
                 f"NVIDIA driver {host.driver_version or '?'} (supports CUDA up to "
                 f"{host.cuda_driver_version or '?'}), {_gpu_word(len(host.gpus))} through {source}",
                 evidence=evidence)


def _version(text: str | None) -> tuple[int, int] | None:
    try:
        parts = (text or "").split(".")
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def _warnings_of(warnings: Sequence[str], code: str) -> list[str]:
    """The runtime warnings that explain's knowledge base calls *code*.

    One vocabulary for both: the texts are knowledge.toml's signatures, not a second list.
    Imported here, when there are warnings at all (loading the KB takes a few ms).
    """
    if not warnings:
        return []
    from gpuwarden.explain import explain_text

    return [w for w in warnings if explain_text(w).primary.code == code]


def check_torch_build(host: HostSnapshot | None, torch: TorchInfo) -> Check:
    """torch.version.cuda against the newest CUDA the driver supports (CUDA_DRIVER_TOO_OLD)."""
    cid, code = "torch_cuda_build", "CUDA_DRIVER_TOO_OLD"
    evidence = [f"python: {torch.python}"]
    if torch.version and torch.imported:
        evidence.append(f"torch {torch.version}, built with CUDA {torch.cuda or '-'}, NCCL "
                        f"{torch.nccl_version or '-'}, imported in a subprocess in "
                        f"{torch.elapsed_s:.1f} s")
    elif torch.version:
        evidence.append(f"torch {torch.version}, built with CUDA {torch.cuda or '-'} (read from "
                        "torch/version.py; a CPU build is not imported)")
    if not torch.installed:
        return check(cid, code, WARN, "torch cannot be imported by this Python",
                     why=torch.error, fix="install torch into this environment (pip install torch)",
                     evidence=evidence)
    if not torch.cuda_compiled:
        return check(cid, code, SKIP, f"torch {torch.version} is a CPU-only build: no CUDA runtime "
                     "to match against the driver", evidence=evidence)
    too_old = _warnings_of(torch.runtime_warnings, "CUDA_DRIVER_TOO_OLD")
    fix = (f"install a newer NVIDIA driver, or a torch wheel built for CUDA "
           f"{host.cuda_driver_version if host and host.cuda_driver_version else 'your driver supports'}"
           " or older (the cuXXX in the wheel's index URL)")
    if too_old:
        return check(cid, code, FAIL, f"the driver is too old for torch's CUDA {torch.cuda} runtime",
                     why=too_old[0], fix=fix, evidence=evidence)
    built, supported = _version(torch.cuda), _version(host.cuda_driver_version if host else None)
    if built is None or supported is None:
        return check(cid, code, SKIP, f"torch is built with CUDA {torch.cuda}; the driver's CUDA "
                     "version is unknown", evidence=evidence)
    evidence.append(f"driver {host.driver_version if host else '?'} supports CUDA up to "
                    f"{supported[0]}.{supported[1]}")
    if built[0] > supported[0]:
        return check(cid, code, FAIL,
                     f"torch is built with CUDA {torch.cuda}, the driver supports only "
                     f"{supported[0]}.{supported[1]}: CUDA will not initialize",
                     why="a CUDA runtime of a newer major version than the driver's refuses to "
                     "start ('CUDA driver version is insufficient for CUDA runtime version')",
                     fix=fix, evidence=evidence)
    if built > supported:
        return check(cid, code, WARN,
                     f"torch is built with CUDA {torch.cuda}, newer than the driver's "
                     f"{supported[0]}.{supported[1]}: it runs through minor-version compatibility",
                     why="within one major version the runtime works on an older driver, but "
                     "PTX JIT and features of the newer minor version fail ('the provided PTX was "
                     "compiled with an unsupported toolchain')",
                     fix=fix, evidence=evidence)
    return check(cid, code, OK, f"torch {torch.version} (CUDA {torch.cuda}) fits the driver "
                 f"(CUDA {supported[0]}.{supported[1]})", evidence=evidence)


def visibility_of(host: HostSnapshot, env: Mapping[str, str]) -> Visibility | VisibilityError:
    try:
        return parse_visibility(host.gpus, env)
    except VisibilityError as exc:
        return exc


def check_visible(host: HostSnapshot | None, vis: Visibility | VisibilityError | None,
                  env: Mapping[str, str]) -> Check:
    """CUDA_VISIBLE_DEVICES (and Slurm's variables) against the GPUs that exist."""
    cid, code = "visible_devices", "CUDA_NO_DEVICE"
    raw = env.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if raw is None else repr(raw)
    if host is None or vis is None:
        return check(cid, code, SKIP, f"CUDA_VISIBLE_DEVICES is {shown}; no GPU to match it against")
    if isinstance(vis, VisibilityError):
        return check(cid, code, FAIL, vis.what, why=vis.why, fix=vis.fix,
                     evidence=[f"host GPUs: {', '.join(g.label for g in host.gpus) or 'none'}"])
    ids = ", ".join(f"cuda:{i} = {g.label}" for i, g in enumerate(vis.gpus))
    if not host.gpus:
        return check(cid, code, SKIP, "no GPU on this host")
    if vis.stopped_at_entry is not None:
        return check(cid, code, WARN, f"CUDA_VISIBLE_DEVICES={raw!r} has an invalid entry "
                     f"({vis.stopped_at_entry!r}): {_gpu_word(len(vis.gpus))} visible",
                     why=vis.notes[-1],
                     fix="remove the invalid entry or fix it (indices or UUIDs from `gpuwarden ls`)",
                     evidence=[ids] if ids else [])
    return check(cid, code, OK, f"{_gpu_word(len(vis.gpus))} of {len(host.gpus)} visible "
                 f"(CUDA_VISIBLE_DEVICES {shown})", evidence=[*vis.notes, *([ids] if ids else [])])


def _visible(vis: Visibility | VisibilityError | None) -> tuple[GPUSnapshot, ...] | None:
    return vis.gpus if isinstance(vis, Visibility) else None


def check_compute_mode(gpus: Sequence[GPUSnapshot] | None) -> Check:
    """Compute mode of every visible GPU; who holds the exclusive ones (CUDA_DEVICES_BUSY)."""
    cid, code = "compute_mode", "CUDA_DEVICES_BUSY"
    if not gpus:
        return check(cid, code, SKIP, "no visible GPU")
    refused, lines = [], []
    for g in gpus:
        if g.compute_mode is ComputeMode.PROHIBITED:
            refused.append(g)
            lines.append(f"{g.label}: prohibited: no process may create a CUDA context on it")
        elif g.compute_mode.is_exclusive and g.processes:
            refused.append(g)
            lines.append(f"{g.label}: {g.compute_mode.value}, held by "
                         + "; ".join(p.describe() for p in g.processes))
        elif g.compute_mode.is_exclusive:
            lines.append(f"{g.label}: {g.compute_mode.value}, free now: the first process to "
                         "create a context takes all of it")
        else:
            others = "; ".join(p.describe() for p in g.processes)
            lines.append(f"{g.label}: default (shared)" + (f", in use by {others}" if others else ""))
    if not refused:
        return check(cid, code, OK, "every visible GPU accepts a new CUDA context", evidence=lines)
    labels = ", ".join(g.label for g in refused)
    return check(cid, code, FAIL if len(refused) == len(gpus) else WARN,
                 f"{len(refused)} of {len(gpus)} visible GPUs refuse a new CUDA context ({labels})",
                 why="a GPU in prohibited mode, or in exclusive_process mode with a process "
                 "already on it, answers 'CUDA-capable device(s) is/are busy or unavailable'",
                 fix="leave those GPUs out (CUDA_VISIBLE_DEVICES, or `gpuwarden select` does it); "
                 "an admin can reset the mode with `nvidia-smi -i N -c DEFAULT`",
                 evidence=lines)


def check_processes(gpus: Sequence[GPUSnapshot] | None) -> Check:
    """Foreign processes and free memory on every visible GPU (CUDA_OOM risk)."""
    cid, code = "gpu_memory", "CUDA_OOM"
    if not gpus:
        return check(cid, code, SKIP, "no visible GPU")
    busy, lines = [], []
    for g in gpus:
        line = (f"{g.label}: {format_bytes(g.memory_free_bytes)} free of "
                f"{format_bytes(g.memory_total_bytes)}")
        low = g.memory_free_bytes < LOW_FREE_FRACTION * g.memory_total_bytes
        if g.processes:
            line += "; in use by " + "; ".join(
                f"{p.describe()} {format_bytes(p.used_memory_bytes)}" for p in g.processes)
        if g.processes or low:
            busy.append(g)
        lines.append(line)
    if not busy:
        return check(cid, code, OK, f"no other process on the {_gpu_word(len(gpus))} visible",
                     evidence=lines)
    return check(cid, code, WARN,
                 f"{len(busy)} of {len(gpus)} visible GPUs are in use by other processes or "
                 f"nearly full ({', '.join(g.label for g in busy)})",
                 why="a job placed there shares the memory with them and can hit 'CUDA out of "
                 "memory' although it fits an empty GPU",
                 fix="pick GPUs with room: `gpuwarden select -n N --min-free SIZE`",
                 evidence=lines)


def check_mig(gpus: Sequence[GPUSnapshot] | None) -> Check:
    """MIG: a MIG-enabled GPU is used through its instances, named by MIG- UUID."""
    cid, code = "mig", "CUDA_NO_DEVICE"
    if not gpus:
        return check(cid, code, SKIP, "no visible GPU")
    parents = [g for g in gpus if g.mig_enabled and not g.is_mig_instance]
    instances = [g for g in gpus if g.is_mig_instance]
    if not parents:
        what = ("MIG instances named in CUDA_VISIBLE_DEVICES: " + ", ".join(g.uuid for g in instances)
                if instances else "MIG is off on every visible GPU")
        return check(cid, code, OK, what)
    evidence = [f"{g.label}: MIG on, instances: "
                + (", ".join(f"{m.uuid} ({format_bytes(m.memory_total_bytes)})" for m in g.mig_devices)
                   or "none configured") for g in parents]
    empty = [g for g in parents if not g.mig_devices]
    return check(cid, code, FAIL if empty and len(empty) == len(gpus) else WARN,
                 f"MIG is on for {', '.join(g.label for g in parents)}: the GPU as a whole "
                 "cannot run CUDA work",
                 why="with MIG on, CUDA sees only MIG instances; a GPU index in "
                 "CUDA_VISIBLE_DEVICES reaches at most one instance, and none when none is "
                 "configured",
                 fix="name instances by UUID in CUDA_VISIBLE_DEVICES (MIG-...), or create "
                 "instances (`nvidia-smi mig -cgi ... -C`)", evidence=evidence)


def check_nproc(gpus: Sequence[GPUSnapshot] | None, nproc: int | None) -> Check:
    """Enough usable GPUs for one rank per GPU (reuses gpuwarden.select's verdicts)."""
    cid, code = "nproc", "NCCL_DUPLICATE_GPU"
    if nproc is None:
        return check(cid, code, SKIP, "no --nproc given")
    if gpus is None or not gpus:
        return check(cid, code, SKIP, f"no visible GPU: {nproc} rank(s) would run on CPU with gloo")
    # The verdicts `gpuwarden launch -n N` acts on: a GPU of its own per rank, never one another
    # job's process is on (launch has no --allow-shared), so doctor and launch agree.
    alone = select(gpus, Constraints(count=nproc))
    if alone.satisfied:
        ids = ",".join(g.cuda_id for g in alone.selected)
        return check(cid, code, OK, f"{nproc} rank(s) fit on GPUs of their own: {ids}",
                     evidence=[v.line() for v in alone.verdicts])
    evidence = [v.line() for v in alone.verdicts]
    free = len(alone.acceptable)
    busy = sum(1 for v in alone.verdicts if v.refusal is Refusal.IN_USE)
    what = (f"{nproc} rank(s) need {nproc} GPUs of their own, {free} of {len(gpus)} visible "
            f"are usable")
    if busy:
        what += f" ({busy} more run other jobs' processes)"
    return check(cid, code, FAIL, what,
                 why="`gpuwarden launch` gives every rank a GPU no other job uses and refuses "
                 "to start with fewer; with torchrun, two ranks on one GPU fail with 'Duplicate "
                 "GPU detected', and a GPU in an exclusive mode refuses them ('busy or "
                 "unavailable')",
                 fix=(f"--nproc {free} or fewer, or " if free else "")
                 + "wait for GPUs to free (`gpuwarden launch --wait 10m`), or free or add GPUs",
                 evidence=evidence)


def _gpu_list(gpus: Sequence[GPUSnapshot]) -> str:
    """'GPUs 0-7', 'GPU 3', 'GPUs 0, 2, 5'."""
    ids = [g.index for g in gpus]
    if len(ids) == 1:
        return f"GPU {ids[0]}"
    if ids == list(range(ids[0], ids[0] + len(ids))):
        return f"GPUs {ids[0]}-{ids[-1]}"
    return "GPUs " + ", ".join(map(str, ids))


def check_cuda_system_ready(host: HostSnapshot | None, driver: CudaDriverInfo | None,
                            torch: TorchInfo) -> Check:
    """Whether CUDA may start on this host at all (CUDA_SYSTEM_NOT_READY).

    Three witnesses, none of which creates a CUDA context here: NVML's fabric state of each
    GPU (NVSwitch systems of Hopper and later; the scenario's ``fabric_state``), the driver's
    answer to cuInit in a subprocess (every NVSwitch generation; the scenario's
    ``cuda_init``), and the warning torch's runtime gave in its own subprocess.
    """
    cid, code = "cuda_system_ready", "CUDA_SYSTEM_NOT_READY"
    if host is None or not host.gpus:
        return check(cid, code, SKIP, "no GPU on this host")
    gpus = [g for g in host.gpus if g.error is None]
    fabric = [g for g in gpus if g.health.fabric_state is not None]
    stuck = [g for g in fabric if g.health.fabric_ready is False]
    evidence = [f"{g.label}: NVLink fabric {g.health.fabric_state}"
                + (f", {g.health.fabric_error}" if g.health.fabric_error else "") for g in fabric]
    if driver is not None:
        evidence.append(driver.describe())
    said = (_warnings_of(torch.runtime_warnings, code) if _is_nvml(host) else [])
    evidence.extend(f"torch's runtime (subprocess): {w}" for w in said)
    driver_not_ready = driver is not None and driver.not_ready
    if stuck or driver_not_ready or said:
        reasons = []
        if stuck:
            states = sorted({g.health.fabric_state or "" for g in stuck})
            reasons.append(f"the NVLink fabric of {_gpu_list(stuck)} is not ready "
                           f"({', '.join(states)}"
                           + (", registration failed" if any(g.health.fabric_error for g in stuck)
                              else "") + ")")
        if driver_not_ready:
            reasons.append("the driver answers cuInit with CUDA_ERROR_SYSTEM_NOT_READY (802: "
                           "system not yet initialized)")
        elif said:
            reasons.append("torch's CUDA runtime says 'system not yet initialized' (802)")
        version = host.driver_version or "the driver's"
        return check(
            cid, code, FAIL, "CUDA cannot start on this host: " + "; ".join(reasons),
            why="the driver is loaded but the system is not ready for CUDA work: on an NVSwitch "
            "system (HGX/DGX A100, H100, H200) the NVIDIA Fabric Manager must register every GPU "
            "in the NVLink fabric first; its service is not running, failed to start, or its "
            "version differs from the driver's. Until then every process on the host fails "
            "('system not yet initialized', torch.cuda.is_available() False); a few seconds "
            "'in_progress' right after boot are normal",
            fix=f"an admin: `systemctl status nvidia-fabricmanager`, then `systemctl start "
            f"nvidia-fabricmanager`, with the fabricmanager package of exactly driver version "
            f"{version}; `nvidia-smi -q` shows the fabric state; no change to the job helps",
            evidence=evidence)
    if driver is not None and driver.name == "CUDA_SUCCESS":
        return check(cid, code, OK, "the CUDA driver initializes"
                     + (f"; the NVLink fabric is registered on {_gpu_list(fabric)}"
                        if fabric else ""), evidence=evidence)
    if fabric:
        return check(cid, code, OK, f"the NVLink fabric is registered on {_gpu_list(fabric)}",
                     evidence=evidence)
    if driver is not None and driver.error is None and driver.name is not None:
        # Another failure (no device, a driver/runtime mismatch ...) is other checks' to name.
        return check(cid, code, OK, f"the system is ready: cuInit answers {driver.name}, not "
                     "CUDA_ERROR_SYSTEM_NOT_READY", evidence=evidence)
    return check(cid, code, SKIP, "nothing says whether CUDA may start: no NVLink fabric state "
                 "and no answer from the CUDA driver", evidence=evidence)


def gpu_checks(host: HostSnapshot | None, host_error: GpuwardenError | None, torch: TorchInfo,
               env: Mapping[str, str], nproc: int | None,
               vis: Visibility | VisibilityError | None,
               driver: CudaDriverInfo | None = None, mps: MpsState | None = None
               ) -> list[Check]:
    """The GPU checks; *vis* is :func:`visibility_of` the host (None without one), *driver*
    the CUDA driver's answer to cuInit (None when nobody asked it), *mps* whether NVIDIA MPS
    runs (None: not looked at)."""
    gpus = _visible(vis)
    ready = check_cuda_system_ready(host, driver, torch)
    extra = [] if mps is None else [check_mps(mps, gpus)]
    return [
        check_driver(host, host_error, torch),
        ready,
        check_torch_build(host, torch),
        check_cuda_runtime(host, vis, torch, not_ready=ready.status is FAIL),
        check_visible(host, vis, env),
        check_compute_mode(gpus),
        check_processes(gpus),
        check_mig(gpus),
        check_nproc(gpus, nproc),
        *extra,
    ]


def check_mps(mps: MpsState, gpus: Sequence[GPUSnapshot] | None) -> Check:
    """Whether NVIDIA MPS runs: then the driver holds a memory lease's process to its lease
    (CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, set by `gpuwarden run --mem`); else only gpuwarden's
    guard watches it."""
    cid, code = "mps", "LEASE_MEMORY_EXCEEDED"
    if not mps.running:
        return check(cid, code, OK, "MPS is not running: a memory lease (`run --mem`) is "
                     "watched by gpuwarden's guard, not enforced by the driver",
                     evidence=[mps.detail], fields={"running": False,
                                                    "pipe_dir": str(mps.pipe_dir)})
    exclusive = [g for g in gpus or () if g.compute_mode.is_exclusive]
    evidence = [mps.describe()]
    if exclusive:
        labels = ", ".join(g.label for g in exclusive)
        return check(cid, code, WARN, f"MPS is up, and {labels} run in an exclusive compute "
                     "mode: memory leases refuse exclusive GPUs",
                     why="a memory lease shares a GPU between processes; gpuwarden judges an "
                     "exclusive GPU by its one process (the MPS server) and refuses it",
                     fix="run MPS with the default compute mode (nvidia-smi -c DEFAULT) to share "
                     "GPUs by memory leases, or lease those GPUs whole",
                     evidence=evidence, fields={"running": True, "pid": mps.pid})
    return check(cid, code, OK, "MPS is up: memory leases get CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, "
                 "so the driver holds each leased process to its lease",
                 evidence=evidence, fields={"running": True, "pid": mps.pid,
                                            "pipe_dir": str(mps.pipe_dir)})


def check_cuda_runtime(host: HostSnapshot | None, vis: Visibility | VisibilityError | None,
                       torch: TorchInfo, *, not_ready: bool = False) -> Check:
    """Whether torch's CUDA runtime sees the GPUs NVML sees (in a subprocess, never here).

    *not_ready*: cuda_system_ready failed, which already names why the runtime sees nothing.
    """
    cid, code = "cuda_runtime", "CUDA_NO_DEVICE"
    if not torch.installed:
        return check(cid, code, SKIP, "torch is not installed")
    if host is None or not host.gpus:
        return check(cid, code, SKIP, "no GPU on this host")
    if not torch.cuda_compiled:
        return check(cid, code, WARN, f"torch {torch.version} is a CPU-only build: it cannot use "
                     f"the {_gpu_word(len(host.gpus))} of this host",
                     why="'Torch not compiled with CUDA enabled'",
                     fix="install a CUDA build of torch (https://pytorch.org/get-started/locally/)")
    if not _is_nvml(host):
        return check(cid, code, SKIP, "simulated host: torch's runtime cannot see simulated GPUs",
                     evidence=[f"runtime device count: {torch.runtime_device_count}"])
    if isinstance(vis, VisibilityError):
        # visible_devices already failed for it; torch seeing nothing is the expected result
        return check(cid, code, SKIP, "visible_devices hides every GPU",
                     evidence=[f"cudaGetDeviceCount: {torch.runtime_device_count}"])
    seen = torch.runtime_device_count or 0
    want = len(vis.gpus) if vis is not None else len(host.gpus)
    evidence = [f"cudaGetDeviceCount: {torch.runtime_device_count}", *torch.runtime_warnings]
    if seen == 0 and want > 0 and not_ready:
        return check(cid, code, SKIP, "CUDA cannot start on this host yet: see "
                     "cuda_system_ready", evidence=evidence)
    if seen == 0 and want > 0:
        return check(cid, code, FAIL, f"NVML sees {_gpu_word(want)} but torch's CUDA runtime "
                     "sees none", why=(torch.runtime_warnings or [torch.error or "unknown"])[0],
                     fix="see the runtime's warning above; usual causes: driver/runtime mismatch, "
                     "a device node missing in the container (/dev/nvidia*), "
                     "CUDA_VISIBLE_DEVICES", evidence=evidence)
    return check(cid, code, OK, f"torch's CUDA runtime sees {_gpu_word(seen)}", evidence=evidence)
