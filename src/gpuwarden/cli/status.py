"""``gpuwarden status``: every gpuwarden job on this host, and what each rank of yours is doing.

A live view on a terminal (rich, refreshed every ``--interval``; Ctrl-C leaves), plain text
once when piped or with ``--once``, ``--json`` with ``schema_version``. Another user's jobs are
listed without their ranks (docs/status.md says what is shown to whom, and why).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.cli._output import emit_json, is_terminal, note
from gpuwarden.safetext import escape_untrusted
from gpuwarden.units import format_bytes, format_duration

WHERE_CHARS = 80
COMMAND_CHARS = 90


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "status",
        help="every gpuwarden job on this host (launches, pools, `run` leases, Dask workers) and "
        "what each rank of your launches is doing: phase, collective, CPU, GPU memory, stalls "
        "and stragglers",
        description="List every gpuwarden job of this host: id (the launcher's pid), user, kind, "
        "age, GPUs leased, command. For your own launches, every rank: pid, GPU, phase "
        "(starting, in rendezvous, running, in a collective and for how long, exited), CPU use, "
        "GPU memory (NVML), and whether a stall is suspected or a straggler holds the others "
        "back. Another user's jobs are listed without their ranks: their details sit behind "
        "the kernel's permissions. Nothing is asked of the ranks: the launcher answers from "
        "the samples it already takes. Exit codes: 0, 2 (an unknown JOB).",
    )
    p.add_argument("job", nargs="?", metavar="JOB",
                   help="only this job: its pid (the JOB column) or a run id prefix")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.add_argument("--once", action="store_true", help="print once, even on a terminal")
    p.add_argument("--interval", default="1s", metavar="DURATION",
                   help="refresh period of the live view (default 1s)")
    p.set_defaults(run=run)


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The status document (what --json prints, what the views render)."""
    from gpuwarden.cli import inventory_of
    from gpuwarden.jobs import add_gpu_memory, add_memory_leases, gpu_memory_by_pid, list_jobs

    table = list_jobs()
    if any(j.launch for j in table.jobs):
        add_gpu_memory(table, gpu_memory_by_pid(inventory_of(args)))
    add_memory_leases(table, inventory_of(args))
    doc = table.to_dict()
    if args.job is not None:
        doc["jobs"] = [j for j in doc["jobs"] if _matches(j, args.job)]
        if not doc["jobs"]:
            from gpuwarden.errors import JobNotFoundError

            raise JobNotFoundError(f"no gpuwarden job {args.job!r} on this host",
                                   fix="`gpuwarden status` lists them (JOB column), or give a "
                                   "run id prefix")
    return doc


def _matches(job: dict[str, Any], wanted: str) -> bool:
    if job["id"] == wanted:
        return True
    run_id = (job.get("launch") or {}).get("run_id")
    return not wanted.isdigit() and isinstance(run_id, str) and run_id.startswith(wanted)


def run(args: argparse.Namespace) -> int:
    from gpuwarden.units import parse_duration

    interval = parse_duration(args.interval, what="--interval")
    if args.json:
        emit_json(collect(args))
        return 0
    if args.once or not is_terminal(sys.stdout):
        doc = collect(args)
        if is_terminal(sys.stdout):
            from rich.console import Console

            console = Console(file=sys.stdout)
            console.print(to_rich(build_view(doc), console.width))
        else:
            sys.stdout.write(to_plain(build_view(doc)))
        for text in doc.get("notes", []):
            note(f"gpuwarden: {escape_untrusted(text, 300)}")
        return 0
    return _live(args, max(0.2, interval))


def _live(args: argparse.Namespace, interval: float) -> int:
    from rich.console import Console
    from rich.live import Live

    console = Console(file=sys.stdout)
    try:
        with Live(to_rich(build_view(collect(args)), console.width), console=console,
                  auto_refresh=False, screen=False) as live:
            while True:
                time.sleep(interval)
                live.update(to_rich(build_view(collect(args)), console.width), refresh=True)
    except KeyboardInterrupt:
        return 0


# ---- the view: sections of tables, rendered plain or with rich --------------------------


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    marked: set[int] = field(default_factory=set)  # rows to highlight (odd ranks, stragglers)
    lines: list[tuple[str, str]] = field(default_factory=list)  # (style, text) after the table


def _phase(row: dict[str, Any]) -> str:
    phase = row.get("phase") or "?"
    if phase == "collective":
        return f"in {row.get('op') or 'a collective'}"
    if phase == "rendezvous":
        diag = row.get("diagnosis") or {}
        return f"in rendezvous ({diag['code']})" if diag.get("code") else "in rendezvous"
    if phase == "exited":
        from gpuwarden.procs import describe_exit

        return f"exited ({describe_exit(row.get('returncode'))})"
    return str(phase)


def _num(value: Any, fmt: str) -> str:
    return "-" if not isinstance(value, (int, float)) else format(value, fmt)


def _ranks_summary(launch: dict[str, Any]) -> str:
    from collections import Counter

    phases = Counter(_phase(r) for r in launch.get("ranks", []))
    parts = ", ".join(f"{n} {p}" for p, n in phases.most_common())
    return f"{len(launch.get('ranks', []))} ({parts})" if parts else "0"


def build_view(doc: dict[str, Any]) -> list[Section]:
    jobs = doc.get("jobs", [])
    head = Section(
        f"gpuwarden status: host {escape_untrusted(str(doc.get('host')), 80)}, {len(jobs)} "
        f"job(s), {time.strftime('%H:%M:%S', time.localtime(doc.get('generated_at')))}",
        ["JOB", "USER", "KIND", "AGE", "GPUS", "RANKS", "STATE", "COMMAND"], [])
    sections = [head]
    for i, job in enumerate(jobs):
        launch = job.get("launch")
        gpus = ",".join(_gpu_cell(g) for g in job.get("gpus", [])) or "-"
        state = "-"
        if launch is not None:
            flags = []
            if (launch.get("stall") or {}).get("reported"):
                flags.append("STALL reported")
            elif (launch.get("stall") or {}).get("suspected"):
                flags.append("stall suspected")
            if launch.get("straggler"):
                flags.append(f"straggler: rank {launch['straggler']['rank']}")
            if job.get("findings"):
                flags.append("over its memory lease")
            state = "; ".join(flags) or "running"
            if launch.get("nnodes", 1) > 1:
                state = f"node {launch.get('node_rank')}/{launch.get('nnodes')}; {state}"
        elif job.get("findings"):
            state = "over its memory lease"
        elif job.get("private"):
            state = "(another user's job)"
        elif job.get("note"):
            state = "(no answer)" if "did not answer" in job["note"] else "(no endpoint)"
        head.rows.append([job["id"], escape_untrusted(str(job.get("user")), 32), job.get("kind", "?"),
                          format_duration(job["age_s"]) if isinstance(job.get("age_s"), float) else "-",
                          gpus, _ranks_summary(launch) if launch else "-", state,
                          escape_untrusted(str(job.get("command", "")), COMMAND_CHARS)])
        if launch is not None and (launch.get("straggler") or (launch.get("stall") or {}).get(
                "suspected")):
            head.marked.add(i)
        for finding in job.get("findings", []):
            head.marked.add(i)
            head.lines.append(("bold yellow", f"{job['id']}: warning[{finding.get('code')}]: "
                               f"{escape_untrusted(str(finding.get('what')), 600)}"))
        if launch is not None:
            sections.append(_job_section(job, launch))
        elif job.get("mine") and "did not answer" in (job.get("note") or ""):
            head.lines.append(("dim", f"{job['id']}: {escape_untrusted(job['note'], 300)}"))
    if not jobs:
        head.lines.append(("dim", "no gpuwarden job runs on this host"))
    return sections


def _gpu_cell(gpu: dict[str, Any]) -> str:
    """'0', or '0 (12.0/20.0 GiB)' for a memory lease: what its processes use of it."""
    index = str(gpu.get("index"))
    leased = gpu.get("memory_bytes")
    if not isinstance(leased, int):
        return index
    used = gpu.get("used_bytes")
    shown = format_bytes(leased) if not isinstance(used, int) else \
        f"{format_bytes(used).replace(' GiB', '')}/{format_bytes(leased)}"
    return f"{index} ({shown})"


def _job_section(job: dict[str, Any], launch: dict[str, Any]) -> Section:
    run_id = escape_untrusted(str(launch.get("run_id")), 40)
    title = (f"job {job['id']}: {escape_untrusted(str(launch.get('target')), 80)}, run {run_id}, "
             f"node {launch.get('node_rank')} of {launch.get('nnodes')}, attempt "
             f"{int(launch.get('attempt') or 0) + 1} of {int(launch.get('max_restarts') or 0) + 1}, "
             f"up {format_duration(float(launch.get('uptime_s') or 0))}, sampled every "
             f"{_num(launch.get('sample_interval_s'), 'g')} s")
    sec = Section(title, ["RANK", "PID", "GPU", "PHASE", "SEEN FOR", "CPU", "GPU MEM", "WHERE"], [])
    straggler = launch.get("straggler") or {}
    stall = launch.get("stall") or {}
    odd = set(stall.get("elsewhere") or []) | ({straggler["rank"]} if straggler else set())
    for i, row in enumerate(launch.get("ranks", [])):
        mem = row.get("gpu_memory_bytes")
        sec.rows.append([str(row.get("rank")), str(row.get("pid")), "cpu" if row.get("gpu") is None else str(row["gpu"]),
                         _phase(row),
                         f"{row['for_s']:.1f} s" if isinstance(row.get("for_s"), (int, float)) else "-",
                         _num(row.get("cpu_cores"), ".2f"),
                         format_bytes(mem) if isinstance(mem, int) else "-",
                         escape_untrusted(str(row.get("where") or ""), WHERE_CHARS)])
        if row.get("rank") in odd:
            sec.marked.add(i)
    stuck: dict[str, list[dict[str, Any]]] = {}
    for row in launch.get("ranks", []):
        if (row.get("diagnosis") or {}).get("code"):
            stuck.setdefault(str(row["diagnosis"]["code"]), []).append(row)
    for code, rows in stuck.items():
        diag = rows[0]["diagnosis"]
        sec.lines.append(("bold red", escape_untrusted(
            f"rank(s) {_ranks([r.get('rank') for r in rows])} in rendezvous: {code}: "
            f"{diag.get('what')}; rank {rows[0].get('rank')} printed: {diag.get('line')}", 600)))
    if straggler:
        sec.lines.append(("bold yellow", f"straggler: {escape_untrusted(straggler.get('text', ''), 600)}"))
    if stall:
        verb = "stall reported" if stall.get("reported") else "stall suspected"
        sec.lines.append((
            "bold red",
            f"{verb}: rank(s) {_ranks(stall.get('waiting'))} wait in {stall.get('point')} with an "
            f"unchanged stack while rank(s) {_ranks(stall.get('elsewhere'))} are elsewhere "
            f"(reported at --stall-timeout {_num(launch.get('stall_timeout_s'), 'g')} s); "
            f"`gpuwarden stacks {job['id']}` shows where"))
    peers = launch.get("peers")
    if peers is not None and not peers.get("store_connected"):
        sec.lines.append(("dim", "other nodes: not reachable through the job's store yet "
                          "(before init_process_group)"))
    return sec


def _ranks(ranks: Any) -> str:
    return ", ".join(map(str, ranks)) if isinstance(ranks, list) and ranks else "-"


def to_plain(sections: list[Section]) -> str:
    out: list[str] = []
    for sec in sections:
        if out:
            out.append("")
        out.append(sec.title)
        if sec.rows:
            widths = [max(len(c), *(len(r[i]) for r in sec.rows)) for i, c in enumerate(sec.columns)]
            for n, row in enumerate((sec.columns, *sec.rows)):
                line = "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
                out.append(line + ("  <" if n - 1 in sec.marked else ""))
        out += [text for _, text in sec.lines]
    return "\n".join(out) + "\n"


# Columns dropped, in this order, when a table cannot fit the terminal (`status` at 60 columns).
NARROW_DROP_ORDER = ("KIND", "AGE", "CPU", "SEEN FOR", "GPU MEM", "USER", "RANKS", "GPUS", "GPU")
MIN_LAST_COLUMN = 12


def to_rich(sections: list[Section], width: int = 120) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts: list[Any] = []
    for sec in sections:
        # The title is a line of its own, wrapped at the terminal's width (as a table title it
        # wrapped at the table's).
        parts.append(Text(sec.title, style="bold"))
        if not sec.rows:
            parts += [Text(text, style=style) for style, text in sec.lines]
            parts.append(Text(""))
            continue
        columns, rows = sec.columns, sec.rows
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]
        # A narrow terminal: whole columns go (least needed first) before any id is squeezed;
        # the ids `stacks` and `kill` need (JOB, RANK, PID) are never cut.
        for name in NARROW_DROP_ORDER:
            if sum(widths[:-1]) + 3 * (len(widths) - 1) + MIN_LAST_COLUMN <= width:
                break
            if name in columns[:-1]:
                i = columns.index(name)
                columns, widths = columns[:i] + columns[i + 1:], widths[:i] + widths[i + 1:]
                rows = [r[:i] + r[i + 1:] for r in rows]
        # One line per row: the short columns keep their width, the last one (a command, where
        # a rank is) gets what is left of the terminal and is cut there.
        room = max(MIN_LAST_COLUMN, width - sum(widths[:-1]) - 3 * (len(widths) - 1))
        table = Table(show_edge=False, pad_edge=False)
        for col, w in zip(columns[:-1], widths, strict=False):
            table.add_column(col, no_wrap=True, min_width=w)
        table.add_column(columns[-1], no_wrap=True, overflow="ellipsis", max_width=room)
        for n, row in enumerate(rows):
            cells = [*row[:-1], row[-1] if len(row[-1]) <= room else row[-1][:room - 1] + "…"]
            table.add_row(*(Text(cell) for cell in cells),
                          style="bold yellow" if n in sec.marked else None)
        parts.append(table)
        parts += [Text(text, style=style) for style, text in sec.lines]
        parts.append(Text(""))
    return Group(*parts)
