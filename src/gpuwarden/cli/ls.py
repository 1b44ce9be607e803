"""``gpuwarden ls``: every GPU at a glance, its health, and who runs what on it.

The default view fits 80 columns: one line per GPU (and per MIG instance) with utilization,
memory, temperature, power and compute mode, a line under any GPU that needs an operator's
attention (ECC errors, a memory repair waiting for a reset, clocks held back by power or heat,
a lost GPU), then one line per process with its GPU memory, CPU, host memory and age.
``--long`` shows every reading; ``--watch`` refreshes; ``--json`` gives it all as data
(keys: docs/inventory.md).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from gpuwarden.cli._args import add_simulate_arg, bounded_int
from gpuwarden.cli._output import SCHEMA_VERSION, emit_json, is_terminal
from gpuwarden.errors import EXIT_USAGE, UsageError, VisibilityError
from gpuwarden.inventory.snapshot import ComputeMode, GPUProcess, GPUSnapshot, HostSnapshot
from gpuwarden.safetext import escape_untrusted
from gpuwarden.units import format_bytes, format_duration

DEFAULT_WIDTH = 80  # piped output; a terminal's own width otherwise
MIN_WIDTH = 40  # below this, lines wrap rather than lose more columns
DEFAULT_WATCH_S = 2.0
MIG_ID_IN_ROW = 16  # a MIG instance's shortest unique id up to this long is shown in its row


def _interval(text: str) -> float:
    from gpuwarden.units import parse_duration

    out_of_range = UsageError(f"--watch {text}: the refresh interval must be between 0.1 s "
                              "and 1 h", fix="e.g. --watch 2 (seconds) or --watch 1m")
    if text.strip().startswith("-"):  # not parse_duration's "0 or more": 0 is refused too
        raise out_of_range
    seconds = parse_duration(text, what="--watch")
    if not 0.1 <= seconds <= 3600:
        raise out_of_range
    return seconds


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "ls",
        help="list GPUs: utilization, memory, temperature, power, health, and their processes (NVML)",
        description="List every GPU of this host as NVML reports it, without creating a CUDA "
        "context: one line per GPU (and MIG instance) that fits 80 columns, a warning line "
        "under a GPU that needs attention (uncorrectable ECC errors, memory repair pending a "
        "reset, clocks slowed by power or heat, a lost GPU), and one line per process (GPU "
        "memory, CPU, host memory, age, command). GPUs hidden by CUDA_VISIBLE_DEVICES or Slurm "
        "are listed and marked. Exit 0; 2 when CUDA_VISIBLE_DEVICES or a scenario is malformed "
        "(the host is still listed); 3 without NVML.",
    )
    p.add_argument("-l", "--long", action="store_true",
                   help="every reading of every GPU: clocks, P-state, fan, power limit, ECC, "
                   "retired pages, NVLink, clock event reasons, full command lines")
    p.add_argument("--watch", nargs="?", type=_interval, const=DEFAULT_WATCH_S, default=None,
                   metavar="SECONDS", help=f"refresh every SECONDS (default {DEFAULT_WATCH_S:g}) "
                   "until Ctrl-C, in place on a terminal; %%CPU is then measured between refreshes")
    p.add_argument("--iterations", type=bounded_int("--iterations", 1), default=None,
                   metavar="N", help="with --watch: stop after N refreshes")
    p.add_argument("--gpu", metavar="IDS", default="",
                   help="only these GPUs: indices, GPU-/MIG- UUIDs or their prefixes, comma-separated")
    p.add_argument("--user", metavar="NAME", default=None,
                   help="only NAME's processes, and the GPUs they run on")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1; "
                   "keys in docs/inventory.md)")
    add_simulate_arg(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.cli import inventory_of
    from gpuwarden.select import parse_gpu_ids

    if args.iterations is not None and args.watch is None:
        raise UsageError("--iterations without --watch", fix="gpuwarden ls --watch 2 --iterations 10")
    gpu_ids = parse_gpu_ids(args.gpu, what="--gpu")
    inventory = inventory_of(args)
    if args.watch is not None:
        return _watch(args, inventory, gpu_ids)
    view = read_view(inventory, gpu_ids, args.user)
    if args.json:
        emit_json(view.to_json())
    else:
        width = _width(sys.stdout)
        lines = render_long(view) if args.long else render(view, width)
        _print(lines, sys.stdout)
        for line in view.notes:
            print(line, file=sys.stderr)
    if view.visibility_error is not None:  # listed all the same; the variable is what's wrong
        print(view.visibility_error.render(), file=sys.stderr)
        return EXIT_USAGE
    return 0


# ---- what is shown: the host, filtered, with CUDA's numbering ----------------------------------

@dataclass(frozen=True)
class View:
    host: HostSnapshot
    gpus: tuple[GPUSnapshot, ...]  # after --gpu / --user, each with only the shown processes
    ordinals: Mapping[str, int]  # uuid -> CUDA ordinal for this process (visible devices only)
    restricted: bool  # CUDA's numbering differs from NVML's: show it
    notes: tuple[str, ...]
    visibility_error: VisibilityError | None = None
    # pid -> %CPU measured between two refreshes of --watch
    cpu_pct: Mapping[int, float] | None = None
    # Memory leases of this host (guard.LeaseMemory), None: none held (or no lease directory)
    memory: Any = None

    @property
    def short_ids(self) -> dict[str, str]:
        """uuid -> the shortest prefix (12 characters at least: ``MIG-`` and 8 hex digits) that
        names that device alone on this host: what ``CUDA_VISIBLE_DEVICES`` then accepts."""
        uuids = [u for g in self.host.gpus for u in (g.uuid, *(m.uuid for m in g.mig_devices))]
        return {u: unique_prefix(u, uuids) for u in uuids}

    def to_json(self) -> dict[str, Any]:
        gpus = []
        for g in self.gpus:
            d = g.to_dict()
            d["cuda_ordinal"] = self.ordinals.get(g.uuid)
            d["problems"] = list(problems_of(g)) + self.lease_problems(g.uuid)
            d["memory_leases"] = self.lease_budget(g.uuid)
            for m in d["mig_devices"]:
                m["cuda_ordinal"] = self.ordinals.get(m["uuid"])
            gpus.append(d)
        notes = list(self.notes)
        if self.visibility_error is not None:
            notes.append(self.visibility_error.render())
        return {"host": self.host.to_dict(), "gpus": gpus, "notes": notes}


    def lease_problems(self, uuid: str) -> list[str]:
        """Memory leases past their memory on this GPU, as `ls` flags them."""
        if self.memory is None:
            return []
        return [f"LEASE_MEMORY_EXCEEDED: {o.short()}" for o in self.memory.overuses
                if o.uuid == uuid]

    def lease_budget(self, uuid: str) -> dict[str, Any] | None:
        budget = None if self.memory is None else self.memory.budget_of(uuid)
        if budget is None or not budget.memory_shares:
            return None
        return {"leases": len(budget.shares), "memory_leases": len(budget.memory_shares),
                "leased_bytes": budget.leased_bytes, "room_bytes": budget.room_bytes,
                "reserve_bytes": budget.reserve_bytes, "outside_bytes": budget.outside_bytes}


def read_memory_leases(host: HostSnapshot) -> Any:
    """The memory leases of this host's lease directory and what their processes use, from
    ``host`` (already read); None when there is none, or the directory cannot be read."""
    from gpuwarden.lease import list_leases
    from gpuwarden.lease.guard import lease_memory_of

    try:
        table = list_leases()
    except Exception:  # a lease directory this user may not read: ls lists the GPUs all the same
        return None
    if not any(c.is_memory for h in table.holders for c in h.claims):
        return None
    devices = [d for g in host.gpus for d in (g, *g.mig_devices)]
    return lease_memory_of(devices, table.holders, table.reserve_bytes)


def unique_prefix(uuid: str, uuids: Sequence[str], shortest: int = 12) -> str:
    """The shortest prefix of ``uuid``, at least ``shortest`` long, that no other uuid starts
    with (the whole uuid when another one starts with all of it)."""
    others = [u for u in uuids if u != uuid]
    for n in range(min(shortest, len(uuid)), len(uuid) + 1):
        if not any(o.startswith(uuid[:n]) for o in others):
            return uuid[:n]
    return uuid


def read_view(inventory: Any, gpu_ids: Sequence[str] = (), user: str | None = None,
              cpu_pct: Mapping[int, float] | None = None) -> View:
    from gpuwarden.visibility import parse_visibility

    host = inventory.read_host()
    error: VisibilityError | None = None
    try:
        vis = parse_visibility(host.gpus, inventory.env)
        visible = vis.gpus
        notes = vis.notes
    except VisibilityError as exc:
        visible, notes, error = (), (), exc
    ordinals = {g.uuid: i for i, g in enumerate(visible)}
    whole = [g.uuid for g in host.gpus]
    restricted = error is not None or list(ordinals) != whole
    gpus = filter_gpus(host.gpus, gpu_ids, user)
    return View(host, gpus, ordinals, restricted, tuple(notes), error, cpu_pct,
                read_memory_leases(host))


def filter_gpus(gpus: Sequence[GPUSnapshot], ids: Sequence[str], user: str | None
                ) -> tuple[GPUSnapshot, ...]:
    """``--gpu``: the GPUs (or MIG instances, under their GPU) named; ``--user``: the GPUs
    where NAME has a process, each with only NAME's processes."""
    from gpuwarden.select import unmatched_ids

    if ids:
        every = [*gpus, *(m for g in gpus for m in g.mig_devices)]
        missing = unmatched_ids(every, ids)
        if missing:
            shown = ", ".join(str(g.index) for g in gpus) or "none"
            raise UsageError(f"--gpu {','.join(ids)}: this host has no GPU {missing[0]!r}",
                             why=f"its GPUs are {shown}", fix="name GPUs that `gpuwarden ls` lists")
        def named(dev: GPUSnapshot) -> bool:
            return len(unmatched_ids([dev], ids)) < len(ids)

        kept = []
        for g in gpus:
            migs = tuple(m for m in g.mig_devices if named(m))
            if named(g):
                kept.append(g)
            elif migs:
                kept.append(replace(g, mig_devices=migs))
        gpus = kept
    if user is not None:
        def mine(procs: tuple[GPUProcess, ...]) -> tuple[GPUProcess, ...]:
            return tuple(p for p in procs if p.user == user)

        narrowed = []
        for g in gpus:
            migs = tuple(replace(m, processes=mine(m.processes)) for m in g.mig_devices)
            if mine(g.processes) or any(m.processes for m in migs):
                narrowed.append(replace(g, processes=mine(g.processes),
                                        mig_devices=tuple(m for m in migs if m.processes)))
        gpus = narrowed
    return tuple(gpus)


def problems_of(gpu: GPUSnapshot) -> tuple[str, ...]:
    """What needs an operator's attention on ``gpu``, in words."""
    if gpu.error is not None:
        return (f"unusable: {gpu.error}",)
    return gpu.health.problems()


# ---- the default view: 80 columns --------------------------------------------------------------

_MODE_SHORT = {ComputeMode.DEFAULT: "default", ComputeMode.EXCLUSIVE_PROCESS: "exclusive",
               ComputeMode.EXCLUSIVE_THREAD: "excl-thread", ComputeMode.PROHIBITED: "prohibited"}


def render(view: View, width: int = DEFAULT_WIDTH) -> list[str]:
    """The default view's lines: a title, the GPU table, then the process table."""
    lines = [_title(view)]
    if not view.host.gpus:
        return [*lines, "no GPU: NVML reports none on this host"]
    if not view.gpus:
        return [*lines, "no GPU matches --gpu / --user"]
    head = ["GPU", "name", "util", "memory", "temp", "power", "mode"]
    if view.restricted:
        head.insert(1, "cuda")
    rows: list[list[str]] = []
    extra: dict[int, list[str]] = {}  # row index -> warning lines under it
    for g in view.gpus:
        rows.append(_gpu_row(view, g, str(g.index)))
        problems = problems_of(g)
        if problems:
            extra[len(rows) - 1] = ["! " + "; ".join(problems)]
        extra.setdefault(len(rows) - 1, []).extend(_lease_lines(view, g.uuid))
        for k, m in enumerate(g.mig_devices):
            rows.append(_gpu_row(view, m, f"{g.index}:{k}"))
            short = view.short_ids.get(m.uuid, m.uuid)
            if len(short) > MIG_ID_IN_ROW:  # uuids alike for long: said whole, under the row
                extra[len(rows) - 1] = [f"id {short}"]
            extra.setdefault(len(rows) - 1, []).extend(_lease_lines(view, m.uuid))
    table = _align(head, rows, width, flex=head.index("name"))
    lines.append(table[0])
    for i, line in enumerate(table[1:]):
        lines.append(line)
        lines.extend("    " + _cut(w, width - 4) for w in extra.get(i, ()))
    procs = _process_rows(view)
    if procs:
        cpu_head = "%CPU" if view.cpu_pct is not None else "cpu time"
        lines.append("")
        lines.extend(_align(["GPU", "pid", "user", "GPU mem", cpu_head, "host mem", "age",
                             "command"], procs, width, flex=7))
    return lines


def _lease_lines(view: View, uuid: str) -> list[str]:
    """Under a GPU that memory leases share: what they hold and what is left; a `!` line for
    each lease whose processes use more than it leased."""
    budget = None if view.memory is None else view.memory.budget_of(uuid)
    if budget is None or not budget.memory_shares:
        return []
    n = len(budget.shares)
    lines = [f"leased {format_bytes(budget.leased_bytes)} to {n} lease{'s' if n != 1 else ''}, "
             f"{format_bytes(budget.room_bytes)} left for memory leases"]
    lines += [f"! {line}" for line in view.lease_problems(uuid)]
    return lines


def _title(view: View) -> str:
    host = view.host
    versions = f"driver {host.driver_version or '?'}, CUDA {host.cuda_driver_version or '?'}"
    source = "" if host.source == "nvml" else f" [{host.source}]"
    return f"{escape_untrusted(host.hostname, 64)}: {len(host.gpus)} GPU(s), {versions}{source}"


def _gpu_row(view: View, g: GPUSnapshot, label: str) -> list[str]:
    h = g.health
    name = _short_name(g.name)
    if g.is_mig_instance:  # the uuid CUDA_VISIBLE_DEVICES names it by, then its profile
        profile = name[name.find("MIG ") + 4:] if "MIG " in name else ""
        short = view.short_ids.get(g.uuid, g.uuid)
        # An id is never cut: one too long for the column goes on a line of its own (render)
        name = f"{short} {profile}".rstrip() if len(short) <= MIG_ID_IN_ROW else f"MIG {profile}"
    if g.error is not None:
        row = [label, name, "?", "?", "?", "?", "unusable"]
    else:
        util = "-" if g.is_mig_instance or (g.mig_enabled and g.utilization_gpu_pct is None) \
            else "?" if g.utilization_gpu_pct is None else f"{g.utilization_gpu_pct}%"
        memory = f"{_gib(g.memory_used_bytes)}/{_gib(g.memory_total_bytes)}G"
        temp = "?" if h.temperature_c is None else f"{h.temperature_c}C"
        power = _power(h.power_draw_w, h.power_limit_w)
        mode = "MIG" if g.mig_enabled else _MODE_SHORT[g.compute_mode]
        if g.is_mig_instance:
            temp = power = mode = ""
        row = [label, name, util, memory, temp, power, mode]
    if view.restricted:
        ordinal = view.ordinals.get(g.uuid)
        row.insert(1, "-" if ordinal is None else f"cuda:{ordinal}")
    return row


def _short_name(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'H100 80GB HBM3': the vendor is the same on every line."""
    name = escape_untrusted(name, 40)
    return name[len("NVIDIA "):] if name.startswith("NVIDIA ") else name


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f}"


def _power(draw: float | None, limit: float | None) -> str:
    if draw is None:
        return "?"
    return f"{draw:.0f}W" if limit is None else f"{draw:.0f}/{limit:.0f}W"


def _process_rows(view: View) -> list[list[str]]:
    rows = []
    for g in view.gpus:
        owners: list[tuple[str, GPUSnapshot]] = [(str(g.index), g)]
        owners += [(f"{g.index}:{k}", m) for k, m in enumerate(g.mig_devices)]
        for label, dev in owners:
            for p in dev.processes:
                rows.append([label, str(p.pid), _user(p), _bytes(p.used_memory_bytes),
                             _cpu(p, view.cpu_pct), _bytes(p.host_memory_rss_bytes),
                             "?" if p.elapsed_s is None else format_duration(p.elapsed_s),
                             _command(p)])
    return rows


def _user(p: GPUProcess) -> str:
    return "?" if p.user is None else escape_untrusted(p.user, 16)


def _command(p: GPUProcess) -> str:
    text = "?" if p.command is None else escape_untrusted(p.command, 4096)
    extra = [x for x in (None if p.context == "compute" else p.context, p.note) if x]
    return text + (f" [{'; '.join(extra)}]" if extra else "")


def _bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("G", 1024**3), ("M", 1024**2), ("K", 1024)):
        if n >= size:
            return f"{n / size:.1f}{unit}" if n < 100 * size else f"{n // size}{unit}"
    return f"{n}B"


def _cpu(p: GPUProcess, pct: Mapping[int, float] | None) -> str:
    if pct is not None:
        return f"{pct[p.pid]:.0f}%" if p.pid in pct else "?"
    return "?" if p.cpu_time_s is None else format_duration(p.cpu_time_s)


# Readings a host may lack altogether (a scenario without them, a board without the sensors,
# processes of other users under hidepid): a column with nothing known is left out.
_OPTIONAL_COLUMNS = ("temp", "power", "cpu time", "%CPU", "host mem", "age")
# Dropped in this order when a line cannot fit a narrow terminal (`ls` at 60 columns).
_NARROW_DROP_ORDER = ("power", "host mem", "temp", "age", "cpu time", "%CPU", "mode", "util",
                      "user")


def _align(head: list[str], rows: list[list[str]], width: int, *, flex: int) -> list[str]:
    """Columns padded to their widest cell; the ``flex`` column is cut so a line fits ``width``
    (never below its heading), and a last column is never padded."""
    flex_name = head[flex]
    unknown = [i for i, name in enumerate(head) if name in _OPTIONAL_COLUMNS
               and all(r[i] in ("?", "") for r in rows)]
    if unknown:
        head = [c for i, c in enumerate(head) if i not in unknown]
        rows = [[c for i, c in enumerate(r) if i not in unknown] for r in rows]
        flex = head.index(flex_name)
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    # A narrow terminal: columns go, least needed first, before the flex column is cut below
    # its heading; ids (GPU, pid) and memory never go, and are never cut.
    for name in _NARROW_DROP_ORDER:
        if sum(widths) + 2 * (len(head) - 1) - (widths[flex] - len(head[flex])) <= width:
            break
        if name in head and name != flex_name:
            i = head.index(name)
            head, widths = head[:i] + head[i + 1:], widths[:i] + widths[i + 1:]
            rows = [r[:i] + r[i + 1:] for r in rows]
            flex = head.index(flex_name)
    cols = len(head)
    overflow = sum(widths) + 2 * (cols - 1) - width
    if overflow > 0:
        widths[flex] = max(len(head[flex]), widths[flex] - overflow)
    right = {"util", "memory", "GPU mem", "%CPU", "cpu time", "host mem", "age", "temp", "power"}
    out = []
    for row in [head, *rows]:
        cells = []
        for i, cell in enumerate(row):
            cell = _cut(cell, widths[i])
            last = i == cols - 1
            if head[i] in right:
                cells.append(cell.rjust(widths[i]))
            else:
                cells.append(cell if last else cell.ljust(widths[i]))
        out.append("  ".join(cells).rstrip())
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _width(stream: TextIO) -> int:
    """The terminal's width, narrow ones too (columns are dropped to fit, as nvitop does);
    80 when piped."""
    if is_terminal(stream):
        return max(MIN_WIDTH, shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns)
    return DEFAULT_WIDTH


def _print(lines: Sequence[str], stream: TextIO) -> None:
    stream.write("\n".join(lines) + "\n")
    stream.flush()


# ---- --long: every reading ---------------------------------------------------------------------

def render_long(view: View) -> list[str]:
    lines = [_title(view)]
    for g in view.gpus:
        lines.append("")
        lines.extend(_long_gpu(view, g, f"GPU {g.index}"))
        for k, m in enumerate(g.mig_devices):
            lines.extend("  " + x for x in _long_gpu(view, m, f"MIG {g.index}:{k}"))
    if view.host.gpus and not view.gpus:
        lines.append("no GPU matches --gpu / --user")
    return lines


def _long_gpu(view: View, g: GPUSnapshot, label: str) -> list[str]:
    h = g.health
    ordinal = view.ordinals.get(g.uuid)
    seen = "hidden by CUDA_VISIBLE_DEVICES" if ordinal is None and view.restricted else \
        f"cuda:{ordinal}" if ordinal is not None else ""
    head = f"{label}  {escape_untrusted(g.name, 60)}  {g.uuid}"
    head += f"  {g.pci_bus_id}" if g.pci_bus_id else ""
    out = [head + (f"  ({seen})" if seen else "")]
    if g.error is not None:
        return [*out, f"  unusable   {g.error}"]
    util = "?" if g.utilization_gpu_pct is None else f"{g.utilization_gpu_pct}%"
    out.append(f"  memory     {format_bytes(g.memory_used_bytes)} used of "
               f"{format_bytes(g.memory_total_bytes)}, {format_bytes(g.memory_free_bytes)} free; "
               f"utilization {'n/a (MIG)' if g.is_mig_instance else util}")
    if not g.is_mig_instance:
        mode = g.compute_mode.value + (", MIG on" if g.mig_enabled else "")
        out.append(f"  mode       {mode}")
        out.append("  sensors    " + ", ".join([
            f"{_known(h.temperature_c)} C",
            "fan " + ("?" if h.fan_speed_pct is None else f"{h.fan_speed_pct}%"),
            f"power {_known(h.power_draw_w)} W of {_known(h.power_limit_w)} W",
            f"P{_known(h.performance_state)}"]))
        reasons = "unknown" if h.throttle_reasons is None else \
            ", ".join(h.throttle_reasons) or "none"
        out.append(f"  clocks     SM {_known(h.sm_clock_mhz)} of {_known(h.sm_clock_max_mhz)} MHz, "
                   f"memory {_known(h.memory_clock_mhz)} MHz; event reasons: {reasons}")
        pending = {None: "?", True: "yes", False: "no"}[h.memory_repair_pending]
        out.append(f"  ECC        {_known(h.ecc_errors_uncorrected)} uncorrectable error(s) since "
                   f"the driver loaded, {_known(h.retired_pages)} retired page(s), repair "
                   f"pending a reset: {pending}")
        links = "none (or unknown)" if h.nvlinks_total is None else \
            f"{h.nvlinks_active} of {h.nvlinks_total} links up"
        if h.fabric_state is not None:
            links += f"; fabric {h.fabric_state}" + (f" ({h.fabric_error})" if h.fabric_error else "")
        out.append(f"  NVLink     {links}")
        for problem in h.problems():
            out.append(f"  !          {problem}")
    for line in _lease_lines(view, g.uuid):
        out.append(f"  {'!' if line.startswith('! ') else 'leases':<10} {line.removeprefix('! ')}")
    for p in g.processes:
        out.append(f"  process    pid {p.pid} {_user(p)}: GPU {_bytes(p.used_memory_bytes)}, "
                   f"host {_bytes(p.host_memory_rss_bytes)}, cpu {_cpu(p, view.cpu_pct)}, "
                   f"age {'?' if p.elapsed_s is None else format_duration(p.elapsed_s)}: "
                   f"{_command(p)}")
    return out


def _known(value: object) -> str:
    return "?" if value is None else str(value)


# ---- --watch -----------------------------------------------------------------------------------

def _watch(args: argparse.Namespace, inventory: Any, gpu_ids: Sequence[str]) -> int:
    """Refresh until Ctrl-C (or --iterations): in place on a terminal, appended when piped.
    %CPU of each process is its CPU time used between two refreshes over the time between them."""
    out = sys.stdout
    live = None
    last: dict[int, tuple[float, float]] = {}  # pid -> (cpu_time_s, monotonic at the read)
    done = 0
    try:
        while True:
            now = time.monotonic()
            view = read_view(inventory, gpu_ids, args.user)
            pct = {}
            for g in view.gpus:
                for p in (*g.processes, *(q for m in g.mig_devices for q in m.processes)):
                    if p.cpu_time_s is None:
                        continue
                    before = last.get(p.pid)
                    if before is not None and now > before[1]:
                        pct[p.pid] = max(0.0, 100 * (p.cpu_time_s - before[0]) / (now - before[1]))
                    last[p.pid] = (p.cpu_time_s, now)
            view = replace(view, cpu_pct=pct)
            if args.json:  # JSON Lines: one document per refresh
                body = {"schema_version": SCHEMA_VERSION, **view.to_json(), "time": time.time()}
                out.write(json.dumps(body) + "\n")
                out.flush()
            else:
                lines = render_long(view) if args.long else render(view, _width(out))
                stamp = time.strftime("%H:%M:%S")
                lines[0] += f"  {stamp}, every {args.watch:g}s (Ctrl-C stops)"
                if is_terminal(out):
                    live = _show_live(live, lines, out)
                else:
                    _print([*lines, ""], out)
            done += 1
            if args.iterations is not None and done >= args.iterations:
                break
            time.sleep(max(0.0, args.watch - (time.monotonic() - now)))
    except KeyboardInterrupt:  # the way to leave a watch: not an error
        pass
    finally:
        if live is not None:
            live.stop()
    return 0


def _show_live(live: Any, lines: Sequence[str], out: TextIO) -> Any:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    body = Text("\n".join(lines))  # Text, never markup: command lines are other users' writing
    if live is None:
        live = Live(body, console=Console(file=out), auto_refresh=False, screen=False)
        live.start()
    live.update(body, refresh=True)
    return live
