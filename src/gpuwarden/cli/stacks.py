"""``gpuwarden stacks [JOB]``: every rank's Python stack now, grouped, the odd ones out marked.

The job's launcher asks each of its ranks through the rank's request pipe (the rank's sampling
thread answers under the GIL, in milliseconds), and, on several nodes, every other node's
launcher through the job's own c10d store; the answer comes within about 2 s. Ranks with the
same stack are shown once with their rank list, as fr_trace and py-spy users read them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpuwarden.cli._output import emit_json, is_terminal, note
from gpuwarden.safetext import escape_untrusted
from gpuwarden.units import rank_runs

LINE_CHARS = 300


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stacks",
        help="every rank's current Python stack (every node's), grouped: ranks with the same "
        "stack shown once, the odd ones out marked",
        description="Ask a running `gpuwarden launch` for every rank's Python stack now: ranks "
        "with the same stack are shown once with their rank list, the ranks out of step are "
        "marked, with what each waits in (a collective, its flight-recorder sequence number on "
        "GPUs). On several nodes the other nodes answer through the job's own c10d store. The "
        "script needs no change; nothing is printed in the ranks. JOB: the launcher's pid (the "
        "JOB column of `gpuwarden status`) or a run id prefix; default: your only running "
        "launch. Another user's job is refused by the kernel (its endpoint is in a 0700 "
        "directory). Exit codes: 0; 1 the job did not answer or is another user's; 2 no such "
        "job.",
    )
    p.add_argument("job", nargs="?", metavar="JOB", help="the job (default: your only launch)")
    p.add_argument("--all-threads", action="store_true",
                   help="every Python thread of each rank, not only the script's own")
    p.add_argument("--json", action="store_true", help="machine-readable output (schema_version 1)")
    p.add_argument("--timeout", default="5s", metavar="DURATION",
                   help="how long to wait for the launcher's answer (default 5s)")
    p.set_defaults(run=run)


def fetch(job: str | None, *, all_threads: bool, timeout_s: float) -> dict[str, Any]:
    """The job's answer with the groups added (what --json prints)."""
    from gpuwarden.errors import JobQueryError
    from gpuwarden.jobs import ask_job, find_job
    from gpuwarden.launch.observer.observe import group_stacks

    target = find_job(job)
    answer = ask_job(target, {"op": "stacks", "scope": "job", "all_threads": all_threads},
                     timeout_s)
    if not answer.get("ok"):
        raise JobQueryError(f"the launch {target.pid} could not answer: "
                            f"{escape_untrusted(str(answer.get('error')), 300)}",
                            fix="try again in a moment (a job between two attempts of "
                            "--max-restarts, or ending, has no ranks to ask)")
    ranks = [r for r in answer.get("ranks", []) if isinstance(r, dict)]
    return {"job": {"id": str(target.pid), **(answer.get("job") or {})},
            "nodes": answer.get("nodes", []), "after_s": answer.get("after_s"),
            "ranks": ranks, "groups": group_stacks(ranks, all_threads=all_threads)}


def run(args: argparse.Namespace) -> int:
    from gpuwarden.units import parse_duration

    doc = fetch(args.job, all_threads=args.all_threads,
                timeout_s=parse_duration(args.timeout, what="--timeout"))
    if args.json:
        emit_json(doc)
        return 0
    lines = render(doc, all_threads=args.all_threads)
    if is_terminal(sys.stdout):
        from rich.console import Console
        from rich.text import Text

        console = Console(file=sys.stdout, highlight=False)
        for style, text in lines:
            console.print(Text(text, style=style or ""))
    else:
        sys.stdout.write("".join(text + "\n" for _, text in lines))
    for node in doc["nodes"]:
        if not node.get("answered"):
            note(f"gpuwarden: node {node.get('node')} did not answer: "
                 f"{escape_untrusted(str(node.get('error')), 300)}")
    return 0


def _rank_list(ranks: list[int]) -> str:
    """'0-3, 5, 7' for a rank list."""
    return ", ".join(rank_runs(ranks))


def _frame(f: dict[str, Any]) -> str:
    if f.get("file") == "...":
        return f"  ... {escape_untrusted(str(f.get('func')), 80)}"
    return escape_untrusted(f'  File "{f.get("file")}", line {f.get("line")} in {f.get("func")}',
                            LINE_CHARS)


def render(doc: dict[str, Any], *, all_threads: bool = False) -> list[tuple[str, str]]:
    """(style, line) pairs: the header, then one block per group of identical stacks."""
    job, ranks, groups = doc["job"], doc["ranks"], doc["groups"]
    by_rank = {r["rank"]: r for r in ranks}
    total = len(ranks)
    nodes = doc.get("nodes") or []
    out: list[tuple[str, str]] = []
    where = ", ".join(
        f"node {n.get('node')} ({escape_untrusted(str(n.get('host')), 60)}): "
        + (f"answered in {n.get('after_s', 0):.2f} s" if n.get("answered") else "no answer")
        for n in nodes)
    out.append(("bold", f"job {job['id']}: {escape_untrusted(str(job.get('target')), 80)}, "
                f"{total} rank(s); {where}"))
    multinode = len(nodes) > 1
    for g in groups:
        members = [by_rank[r] for r in g["ranks"] if r in by_rank]
        what = _group_state(g, members)
        label = f"rank {g['ranks'][0]}" if len(g["ranks"]) == 1 else f"ranks {_rank_list(g['ranks'])}"
        if multinode:
            per_node: dict[Any, list[int]] = {}
            for m in members:
                per_node.setdefault(m.get("node"), []).append(m["rank"])
            label += " [" + "; ".join(f"node {n}: {_rank_list(rs)}"
                                      for n, rs in sorted(per_node.items(), key=lambda kv: str(kv[0]))) + "]"
        odd = "  <-- odd one out" if g.get("odd") else ""
        out.append(("", ""))
        out.append(("bold red" if g.get("odd") else "bold",
                    f"{label} ({len(g['ranks'])} of {total}): {what}{odd}"))
        stale = [m for m in members if not m.get("fresh")]
        for m in stale:
            age = m.get("age_s")
            out.append(("yellow", f"  rank {m['rank']} did not answer now (a C extension may hold "
                        f"the GIL): its latest sample{f', {age:.1f} s old' if isinstance(age, (int, float)) else ''}"))
        for m in members:
            for fr in m.get("flight_recorder") or []:
                out.append(("dim", f"  rank {m['rank']}: flight recorder, process group "
                            f"{escape_untrusted(str(fr.get('group')), 40)}: last collective "
                            f"#{fr.get('seq')} {escape_untrusted(str(fr.get('op')), 60)} "
                            f"({escape_untrusted(str(fr.get('state')), 30)})"))
        out += [("", _frame(f)) for f in g.get("main") or []]
        if all_threads:
            for t in g.get("threads") or []:
                out.append(("dim", "  other thread (innermost first):"))
                out += [("dim", "  " + _frame(f)) for f in t]
    empty = [r for r in ranks if not r.get("main")]
    for r in empty:
        out.append(("", ""))
        out.append(("dim", f"rank {r['rank']}: {_phase_words(r)} (no stack to show)"))
    return out


def _group_state(group: dict[str, Any], members: list[dict[str, Any]]) -> str:
    wait = group.get("wait")
    if wait:
        since = [float(m["for_s"]) for m in members if isinstance(m.get("for_s"), (int, float))]
        held = f", the same at every sample for {max(since):.1f} s" if since else ""
        return f"waiting in {escape_untrusted(str(wait.get('what')), 80)} at " \
               f"{escape_untrusted(str(wait.get('site')), 80)}{held}"
    main = group.get("main") or []
    top = next((f for f in main if "/torch/" not in str(f.get("file"))), main[0] if main else None)
    if top is None:
        return "no stack"
    site = f"{str(top.get('file')).rsplit('/', 1)[-1]}:{top.get('line')}"
    return f"running: {escape_untrusted(str(top.get('func')), 80)} at {escape_untrusted(site, 80)}"


def _phase_words(r: dict[str, Any]) -> str:
    phase = r.get("phase")
    if phase == "exited":
        from gpuwarden.procs import describe_exit

        return f"exited ({describe_exit(r.get('returncode'))})"
    return str(phase or "unknown")
