"""Everything the doctor asks the machine, behind one injectable :class:`Probes`.

The checks (``gpu_checks``, ``host_checks``, ``net_checks``) are pure functions
over the :class:`Facts` gathered here, so tests hand in fakes for the hardware
and the resolver and run every check offline; the real probes run concurrently
so that the slow ones (importing torch in a subprocess, a TCP probe that may
time out) overlap instead of adding up.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuwarden import net
from gpuwarden.errors import GpuwardenError
from gpuwarden.inventory.snapshot import HostSnapshot
from gpuwarden.mps import MpsState, mps_state

TORCH_TIMEOUT_S = 20.0
NET_TIMEOUT_S = 3.0
CUDA_DRIVER_TIMEOUT_S = 15.0

# Run in a fresh interpreter: the doctor's own process must never load CUDA. With
# PYTORCH_NVML_BASED_CUDA_CHECK=1 torch's availability check goes through NVML; the
# runtime's device count (cudaGetDeviceCount: driver init, no context on any GPU) is
# asked explicitly because its warning is what names a too-old driver.
_TORCH_PROBE = r"""
import json, sys, warnings
out = {"installed": False}
try:
    import torch
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(out)); sys.exit(0)
out.update(installed=True, version=torch.__version__, file=torch.__file__,
           cuda=torch.version.cuda, hip=getattr(torch.version, "hip", None))
compiled = hasattr(torch._C, "_cuda_getDeviceCount")
out["cuda_compiled"] = compiled
if compiled:
    try:
        v = torch.cuda.nccl.version()
        out["nccl_version"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        out["nccl_version_error"] = str(exc)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out["runtime_device_count"] = int(torch._C._cuda_getDeviceCount())
        except Exception as exc:
            out["runtime_error"] = f"{type(exc).__name__}: {exc}"
    out["runtime_warnings"] = [str(w.message) for w in caught]
print(json.dumps(out))
"""


@dataclass(frozen=True)
class TorchInfo:
    """torch as a fresh interpreter of this Python sees it."""

    installed: bool
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda: the CUDA runtime the wheel was built with
    cuda_compiled: bool = False
    nccl_version: str | None = None
    runtime_device_count: int | None = None  # cudaGetDeviceCount in that interpreter
    runtime_warnings: tuple[str, ...] = ()
    error: str | None = None  # import failure, timeout, crash of the probe
    python: str = sys.executable
    elapsed_s: float = 0.0
    imported: bool = False  # False: read from torch/version.py only (a CPU build is not imported)


def read_torch_build() -> TorchInfo:
    """torch's version and CUDA build from ``torch/version.py``, without importing torch.

    The file holds plain assignments (``__version__ = '2.5.1+cu121'``, ``cuda = '12.1'``);
    it is parsed, not executed. Takes milliseconds, against 1-2 s for ``import torch``.
    """
    start = time.monotonic()
    try:
        spec = importlib.util.find_spec("torch")  # locates the package; imports nothing
    except (ImportError, ValueError) as exc:
        return TorchInfo(False, error=f"{type(exc).__name__}: {exc}")
    if spec is None or not spec.submodule_search_locations:
        return TorchInfo(False, error="No module named 'torch'")
    path = Path(next(iter(spec.submodule_search_locations))) / "version.py"
    values: dict[str, Any] = {}
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError) as exc:
        return TorchInfo(False, error=f"torch is present but {path} is unreadable: {exc}")
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            values[target.id] = value.value
    cuda, hip = values.get("cuda"), values.get("hip")
    return TorchInfo(True, version=values.get("__version__"), cuda=cuda,
                     cuda_compiled=bool(cuda or hip), elapsed_s=time.monotonic() - start)


def query_torch(env: Mapping[str, str] | None = None, timeout_s: float = TORCH_TIMEOUT_S,
                python: str = sys.executable, *, always_import: bool = False) -> TorchInfo:
    """torch as this Python would load it; never raises (a failure is in ``error``).

    A CPU-only build is described from its version file: with no CUDA in it there is
    nothing a subprocess could add, and skipping ``import torch`` keeps the doctor under
    a second. A CUDA (or ROCm) build is imported in a fresh interpreter, asked for NCCL's
    version and the runtime's device count, with a timeout, in *env* (default: this
    process's environment) so that it sees the CUDA_VISIBLE_DEVICES the doctor checks.
    """
    if python == sys.executable and not always_import:
        static = read_torch_build()
        if not static.installed or not static.cuda_compiled:
            return static
    env = dict(os.environ if env is None else env, PYTORCH_NVML_BASED_CUDA_CHECK="1")
    start = time.monotonic()
    try:
        proc = subprocess.run([python, "-c", _TORCH_PROBE], env=env, capture_output=True,
                              text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return TorchInfo(False, error=f"`import torch` did not finish within {timeout_s:g} s",
                         python=python, elapsed_s=time.monotonic() - start)
    except OSError as exc:
        return TorchInfo(False, error=f"cannot run {python}: {exc}", python=python)
    elapsed = time.monotonic() - start
    try:
        data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return TorchInfo(False, error=f"the torch probe exited {proc.returncode}: {tail}",
                         python=python, elapsed_s=elapsed)
    return TorchInfo(
        installed=bool(data.get("installed")),
        version=data.get("version"),
        cuda=data.get("cuda"),
        cuda_compiled=bool(data.get("cuda_compiled")),
        nccl_version=data.get("nccl_version"),
        runtime_device_count=data.get("runtime_device_count"),
        runtime_warnings=tuple(data.get("runtime_warnings", ())),
        error=data.get("error") or data.get("runtime_error"),
        python=python,
        elapsed_s=elapsed,
        imported=bool(data.get("installed")),
    )


# The CUDA driver's own answer, in a fresh interpreter: cuInit(0) initializes the driver and
# creates no context (that takes cuCtxCreate or a runtime call on a device); the stdlib's ctypes
# is all it needs, so it answers where torch is missing or a CPU build. Only JSON on stdout.
_CUDA_DRIVER_PROBE = r"""
import ctypes, json, sys
out = {}
lib = "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"
try:
    cuda = ctypes.CDLL(lib)
except OSError as exc:
    out["error"] = f"{lib} cannot be loaded: {exc}"
else:
    rc = int(cuda.cuInit(0))
    out["result"] = rc
    for key, fn in (("name", "cuGetErrorName"), ("message", "cuGetErrorString")):
        text = ctypes.c_char_p()
        if getattr(cuda, fn)(rc, ctypes.byref(text)) == 0 and text.value:
            out[key] = text.value.decode("utf-8", "replace")
    number = ctypes.c_int(0)
    if rc == 0 and cuda.cuDeviceGetCount(ctypes.byref(number)) == 0:
        out["device_count"] = number.value
print(json.dumps(out))
"""

# CUresult names and numbers the doctor acts on (cuda.h).
CUDA_SUCCESS = "CUDA_SUCCESS"
CUDA_ERROR_SYSTEM_NOT_READY = "CUDA_ERROR_SYSTEM_NOT_READY"
CUDA_ERROR_SYSTEM_NOT_READY_NUMBER = 802


@dataclass(frozen=True)
class CudaDriverInfo:
    """What the CUDA driver answers to ``cuInit(0)``, asked in a fresh interpreter.

    ``source`` is "driver" (libcuda, in a subprocess) or "scenario" (a simulated host's
    ``cuda_init``: only the name is known). ``error``: why the driver could not be asked
    (no libcuda in this container, a timeout); the other fields are then None.
    """

    result: int | None = None  # the CUresult number
    name: str | None = None  # cuGetErrorName: "CUDA_SUCCESS", "CUDA_ERROR_SYSTEM_NOT_READY"
    message: str | None = None  # cuGetErrorString: "system not yet initialized"
    device_count: int | None = None  # cuDeviceGetCount after a successful cuInit
    error: str | None = None
    source: str = "driver"
    elapsed_s: float = 0.0

    @property
    def not_ready(self) -> bool:
        return (self.name == CUDA_ERROR_SYSTEM_NOT_READY
                or self.result == CUDA_ERROR_SYSTEM_NOT_READY_NUMBER)

    def describe(self) -> str:
        """'cuInit: CUDA_ERROR_SYSTEM_NOT_READY (802: system not yet initialized)'."""
        if self.error is not None:
            return f"cuInit could not be asked: {self.error}"
        number = "" if self.result is None else f"{self.result}"
        detail = ": ".join(x for x in (number, self.message or "") if x)
        shown = self.name or "?"
        where = " (as the scenario states)" if self.source == "scenario" else ""
        count = "" if self.device_count is None else f", {self.device_count} device(s)"
        return f"cuInit: {shown}" + (f" ({detail})" if detail else "") + count + where


def query_cuda_driver(env: Mapping[str, str], host: HostSnapshot,
                      timeout_s: float = CUDA_DRIVER_TIMEOUT_S,
                      python: str = sys.executable) -> CudaDriverInfo | None:
    """The CUDA driver's answer to initialization on this host; never raises.

    A simulated host answers with its scenario's ``cuda_init`` (None when it states none);
    a host NVML reads, with GPUs, is asked through libcuda's ``cuInit`` in a subprocess,
    with CUDA_VISIBLE_DEVICES left out (whether the system is ready is a question about the
    host, and a variable that hides every GPU would answer NO_DEVICE instead). None when
    there is nothing to ask (no GPU).
    """
    if host.source != "nvml":
        return (None if host.cuda_init is None
                else CudaDriverInfo(name=host.cuda_init, source="scenario"))
    if not host.gpus:
        return None
    child_env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
    start = time.monotonic()
    try:
        proc = subprocess.run([python, "-I", "-S", "-c", _CUDA_DRIVER_PROBE], env=child_env,
                              capture_output=True, text=True, timeout=timeout_s,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return CudaDriverInfo(error=f"cuInit did not return within {timeout_s:g} s",
                              elapsed_s=time.monotonic() - start)
    except OSError as exc:
        return CudaDriverInfo(error=f"cannot run {python}: {exc}")
    elapsed = time.monotonic() - start
    try:
        data: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        if not isinstance(data, dict):
            raise ValueError(data)
    except (IndexError, ValueError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return CudaDriverInfo(error=f"the driver probe exited {proc.returncode}: {tail}",
                              elapsed_s=elapsed)
    result = data.get("result")
    count = data.get("device_count")
    return CudaDriverInfo(
        result=result if isinstance(result, int) else None,
        name=_str_or_none(data.get("name")),
        message=_str_or_none(data.get("message")),
        device_count=count if isinstance(count, int) else None,
        error=_str_or_none(data.get("error")),
        elapsed_s=elapsed,
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class ShmInfo:
    path: str
    total_bytes: int
    free_bytes: int


def read_shm(path: str = "/dev/shm") -> ShmInfo | None:
    """Size of the shared-memory mount; None when there is none (no /dev/shm)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return ShmInfo(path, st.f_frsize * st.f_blocks, st.f_frsize * st.f_bavail)


def read_nofile() -> tuple[int, int]:
    """(soft, hard) RLIMIT_NOFILE; -1 for unlimited."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (-1 if soft == resource.RLIM_INFINITY else soft,
            -1 if hard == resource.RLIM_INFINITY else hard)


def _read_host(env: Mapping[str, str]) -> HostSnapshot:
    from gpuwarden.inventory import read_host

    return read_host(env)


@dataclass(frozen=True)
class Probes:
    """The machine as the doctor sees it. Replace any field in tests."""

    read_host: Callable[[Mapping[str, str]], HostSnapshot] = _read_host
    query_torch: Callable[[Mapping[str, str]], TorchInfo] = query_torch
    query_cuda_driver: Callable[[Mapping[str, str], HostSnapshot], CudaDriverInfo | None] = (
        query_cuda_driver)
    resolve: Callable[[str], net.Resolution] = lambda host: net.resolve(host, timeout_s=NET_TIMEOUT_S)
    # (MASTER_ADDR as given, the addresses it resolved to, port): no second resolution
    connect_tcp: Callable[[str, tuple[str, ...], int], net.ProbeResult] = (
        lambda host, addresses, port: net.connect_tcp(addresses, port, timeout_s=NET_TIMEOUT_S,
                                                      host=host))
    port_is_free: Callable[[int], bool] = net.port_is_free
    interfaces: Callable[[], dict[str, tuple[str, ...]]] = net.interface_addresses
    source_address_for: Callable[[str], str | None] = net.source_address_for
    read_shm: Callable[[], ShmInfo | None] = read_shm
    read_nofile: Callable[[], tuple[int, int]] = read_nofile
    hostname: Callable[[], str] = socket.gethostname
    read_mps: Callable[[Mapping[str, str]], MpsState] = mps_state


@dataclass(frozen=True)
class Options:
    """What the user asked the doctor about (validated by the CLI)."""

    nproc: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    nnodes: int = 1
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass(frozen=True)
class RendezvousFacts:
    """MASTER_ADDR/MASTER_PORT as seen from here."""

    addr: str | None
    port: int | None
    port_error: str | None  # MASTER_PORT present but not a port number
    resolution: net.Resolution | None
    local: bool  # MASTER_ADDR is one of this host's addresses (rank 0 would bind here)
    port_free: bool | None  # local only
    probe: net.ProbeResult | None  # remote only
    route_interface: str | None  # the interface traffic to MASTER_ADDR leaves through


@dataclass(frozen=True)
class Facts:
    env: Mapping[str, str]
    host: HostSnapshot | None
    host_error: GpuwardenError | None
    torch: TorchInfo
    shm: ShmInfo | None
    nofile: tuple[int, int]
    hostname: str
    hostname_resolution: net.Resolution
    interfaces: dict[str, tuple[str, ...]]
    rendezvous: RendezvousFacts
    # cuInit's answer (None: no GPU host to ask, or a scenario that states none)
    cuda_driver: CudaDriverInfo | None = None
    mps: MpsState | None = None


def _rendezvous(opts: Options, probes: Probes, interfaces: Future[dict[str, tuple[str, ...]]]
                ) -> RendezvousFacts:
    env = opts.env
    addr = opts.master_addr or env.get("MASTER_ADDR") or None
    port, port_error = opts.master_port, None
    if port is None and env.get("MASTER_PORT"):
        raw = env["MASTER_PORT"]
        if raw.strip().isdigit() and 0 < int(raw) < 65536:
            port = int(raw)
        else:
            port_error = f"MASTER_PORT={raw!r} is not a port number (1-65535)"
    if addr is None and port is None:
        return RendezvousFacts(None, None, port_error, None, False, None, None, None)
    resolution = probes.resolve(addr) if addr else None
    if addr is None:
        local, route = True, None  # torchrun's default for a single node: 127.0.0.1 / this host
    elif resolution is None or not resolution.ok:
        return RendezvousFacts(addr, port, port_error, resolution, False, None, None, None)
    else:
        local, route = locate_master(resolution.addresses, interfaces.result(),
                                     probes.source_address_for)
    if port is None:
        return RendezvousFacts(addr, None, port_error, resolution, local, None, None, route)
    if local:
        return RendezvousFacts(addr, port, port_error, resolution, True, probes.port_is_free(port),
                               None, route)
    assert addr is not None and resolution is not None
    return RendezvousFacts(addr, port, port_error, resolution, False, None,
                           probes.connect_tcp(addr, resolution.addresses, port), route)


def locate_master(addresses: tuple[str, ...], interfaces: Mapping[str, tuple[str, ...]],
                  source_address_for: Callable[[str], str | None]) -> tuple[bool, str | None]:
    """Whether MASTER_ADDR (resolved to ``addresses``) is this host, and the route to it.

    Local: one of the addresses is loopback (any 127/8 binds here, such as Debian's
    127.0.1.1, which no interface lists) or is held by an interface of this host.
    The route is the interface the kernel would send traffic to ``addresses[0]``
    from (None for loopback or no route); the doctor and launch's multi-node
    preflight both decide with this one function.
    """
    mine = {a for addrs in interfaces.values() for a in addrs}
    local = any(net.is_loopback(a) or a in mine for a in addresses)
    if all(net.is_loopback(a) for a in addresses):
        return local, None
    source = source_address_for(addresses[0])
    return local, (net.interface_of(source, interfaces) if source else None)


def gather(opts: Options, probes: Probes) -> Facts:
    """Ask every probe, concurrently; the slowest (torch's subprocess) bounds the wall time."""
    with ThreadPoolExecutor(max_workers=6, thread_name_prefix="doctor") as pool:
        torch_f = pool.submit(probes.query_torch, opts.env)
        host_f = pool.submit(probes.read_host, opts.env)
        ifaces_f = pool.submit(probes.interfaces)
        hostname = probes.hostname()
        hostres_f = pool.submit(probes.resolve, hostname)
        rdzv_f = pool.submit(_rendezvous, opts, probes, ifaces_f)
        shm = probes.read_shm()
        nofile = probes.read_nofile()
        host: HostSnapshot | None = None
        host_error: GpuwardenError | None = None
        try:
            host = host_f.result()
        except GpuwardenError as exc:
            host_error = exc
        # Asked once the host is known (a simulated host answers from its scenario, a real
        # one in a subprocess), still overlapping torch's import.
        driver_f = (pool.submit(probes.query_cuda_driver, opts.env, host)
                    if host is not None else None)
        return Facts(env=opts.env, host=host, host_error=host_error, torch=torch_f.result(),
                     shm=shm, nofile=nofile, hostname=hostname,
                     hostname_resolution=hostres_f.result(), interfaces=ifaces_f.result(),
                     rendezvous=rdzv_f.result(),
                     cuda_driver=driver_f.result() if driver_f is not None else None,
                     mps=probes.read_mps(opts.env))
