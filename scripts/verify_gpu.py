"""One real-GPU verification run: gpu tests, every story, the GPU benchmarks, one report.

    scripts/verify-gpu [OUTDIR] [--budget-s 420] [--wheelhouse .whl]   # OUTDIR defaults to $OUT

Writes OUTDIR/report.md and OUTDIR/report.json (schema_version 1), plus each command's output
under OUTDIR/logs/ and what NVML answered under OUTDIR/nvml.json.

On a machine that reaches no package index (the lent GPU machine), ``--wheelhouse DIR`` makes
the run self-contained: a throw-away virtual environment on top of the given interpreter's
packages (torch, the image's own), with DIR's wheels installed --no-index --no-deps (what the
image lacks: scripts/gpu-wheelhouse fetches them) and gpuwarden from this checkout's src/, its
`gpuwarden` command and `torchrun` beside the interpreter as the tests expect. Nothing is
installed into the given interpreter and nothing is fetched; a missing wheel shows as a
module that does not import, in the report's environment section.

Read-only towards the card: versions come from a torch subprocess, NVML and `nvidia-smi
--query-gpu` (a query); nothing here changes a setting (no -c, -pm, -mig, --reset).

Every process it starts runs in its own session (process group) and carries the variable
GPUWARDEN_VERIFY_RUN=<id>; whatever ends, is interrupted or times out, its group is killed, and
at the end any process still carrying the id (one that left its group) is killed and reported.

Time: the whole run is bounded by --budget-s (default 540 s, under 10 minutes on one H100);
each stage gets a share and each command is killed at its stage's deadline.

Exit code: 0 all as expected, 1 something failed or timed out, 2 usage, 3 no GPU (NVML reports
none; --allow-no-gpu runs anyway, for testing this script on a CPU machine).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The checkout's gpuwarden is the one verified, installed or not (the lent machine's python
# has none); the stories' catalog sits beside the stories.
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "examples" / "stories")]
import catalog  # noqa: E402

SCHEMA_VERSION = 1
RUN_ENV = "GPUWARDEN_VERIFY_RUN"
# Benchmarks opt in with a line "# verify-gpu: ARGS" (the arguments for a short GPU run).
BENCH_MARKER = re.compile(r"^# verify-gpu:(.*)$", re.MULTILINE)
# Stage shares of the budget; what a stage leaves unused goes to the next ones. NVML's own
# answers come first: they are what no CPU machine can show.
STAGE_SHARES = {"versions": 0.04, "nvml": 0.08, "tests": 0.33, "stories": 0.40,
                "benchmarks": 0.15}
STAGES = ("nvml", "tests", "stories", "benchmarks")
# gpu-marked test files in the order they run (the rest follow): NVML first, the slow
# multi-process ones (stalls, restarts, Dask) last.
FIRST_TEST_FILES = ("test_nvml_contract", "test_forksafe", "test_pool_gpu", "test_launch_gpu",
                    "test_status_gpu", "test_launch_stall_gpu", "test_launch_restart",
                    "test_dask_gpu")
# What gpuwarden, its tests, stories and benchmarks import; the environment section says which
# of these the interpreter lacks (a missing wheel) before anything runs.
NEEDED_MODULES = ("gpuwarden", "torch", "pynvml", "psutil", "rich", "cloudpickle", "joblib",
                  "numpy", "pytest", "pytest_timeout", "threadpoolctl", "dask", "distributed")

_TORCH_PROBE = r"""
import json, torch
out = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
       "cudnn": None, "nccl": None, "devices": []}
try:
    out["cudnn"] = torch.backends.cudnn.version()
except Exception:
    pass
try:
    out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:
    pass
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                               "memory_total_bytes": p.total_memory})
print(json.dumps(out))
"""


class Interrupted(Exception):
    """SIGTERM/SIGINT/SIGHUP reached verify-gpu: stop, clean up, write what we have."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"received {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class Groups:
    """Process groups started by this run; every one is SIGKILLed before we leave."""

    run_id: str
    alive: set[int] = field(default_factory=set)

    def kill_all(self) -> None:
        for pgid in sorted(self.alive):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.alive.clear()

    def strays(self) -> list[dict[str, Any]]:
        """Processes still carrying this run's id (they left their group): killed, listed."""
        try:
            import psutil
        except ImportError:
            return []
        found = []
        me = os.getpid()
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if proc.pid == me:
                continue
            try:
                if proc.environ().get(RUN_ENV) != self.run_id:
                    continue
                cmd = " ".join(proc.info["cmdline"] or [])[:160]
                proc.kill()
                found.append({"pid": proc.pid, "command": cmd})
            except (psutil.Error, OSError):
                continue
        return found


@dataclass
class Result:
    name: str
    argv: list[str]
    exit_code: int | None
    seconds: float
    timed_out: bool
    log: str  # path relative to the output directory
    output: str = ""


def run_command(name: str, argv: list[str], *, cwd: Path, env: dict[str, str], timeout_s: float,
                groups: Groups, logs: Path) -> Result:
    """Run one command in its own session, bounded, output to logs/<name>.log; kill its group."""
    log_path = logs / f"{_slug(name)}.log"
    if timeout_s <= 0:
        log_path.write_text("not run: no time left in the budget\n")
        return Result(name, argv, None, 0.0, True, str(log_path.relative_to(logs.parent)))
    exit_code, out, seconds, timed_out = catalog.run_in_session(
        argv, cwd=cwd, env=env, timeout_s=timeout_s, on_start=groups.alive.add,
        on_end=groups.alive.discard)
    log_path.write_text(f"$ {' '.join(argv)}\n(cwd {cwd}, exit {exit_code}, {seconds:.1f} s"
                        f"{', killed at the deadline' if timed_out else ''})\n\n{out}")
    return Result(name, argv, exit_code, seconds, timed_out,
                  str(log_path.relative_to(logs.parent)), out)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:120]


# ---- what is read about the machine -----------------------------------------------------------


def nvml_facts() -> dict[str, Any]:
    """Driver, CUDA driver version and GPUs, read through gpuwarden's own NVML backend."""
    from gpuwarden.errors import GpuwardenError
    from gpuwarden.inventory.nvml import NvmlBackend

    try:
        host = NvmlBackend().read_host()
    except GpuwardenError as exc:
        return {"error": exc.what}
    return {"driver": host.driver_version, "cuda_driver": host.cuda_driver_version,
            "gpus": [g.to_dict() for g in host.gpus]}


def gpu_count(facts: dict[str, Any]) -> int:
    return len(facts.get("gpus", []))


# ---- a self-contained interpreter on a machine without a package index ----------------------

# The interpreter's package folders: its venv's, and the system's when the venv includes them.
_SITE_PATHS = ("import json, sys; print(json.dumps([sys.version_info[:2], "
               "[p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))]]))")
_SHIMS = {  # console scripts the tests and benchmarks look for beside sys.executable
    "gpuwarden": "from gpuwarden.cli import console_main as main",
    "torchrun": "from torch.distributed.run import main",
    "dask": "from dask.__main__ import main",
}


def prepare_environment(python: str, wheelhouse: Path, env_dir: Path) -> tuple[str, dict[str, Any]]:
    """A venv at ``env_dir`` that sees ``python``'s packages, the wheelhouse and src/.

    Returns the new interpreter and what was done (for the report). Raises RuntimeError with
    the command's output when a step fails: the run cannot go on without an interpreter.
    """
    info: dict[str, Any] = {"base_python": python, "wheelhouse": str(wheelhouse),
                            "env": str(env_dir)}
    wheels = sorted(str(p) for p in wheelhouse.glob("*.whl"))
    info["wheels"] = [Path(w).name for w in wheels]
    done = _checked([python, "-c", _SITE_PATHS])
    version, site_paths = json.loads(done.splitlines()[-1])
    _checked([python, "-m", "venv", "--without-pip", str(env_dir)])
    extra = env_dir / "wheels"
    if wheels:
        # --no-index: the lent machine reaches no registry, and a rehearsal must fail the same
        # way; PIP_CONFIG_FILE: no index or option from a user's pip.conf applies either.
        _checked([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                  "--no-compile", "--no-cache-dir", "--disable-pip-version-check",
                  "--target", str(extra), *wheels],
                 env={**os.environ, "PIP_CONFIG_FILE": os.devnull})
    site = env_dir / "lib" / f"python{version[0]}.{version[1]}" / "site-packages"
    site.mkdir(parents=True, exist_ok=True)
    paths = [str(ROOT / "src"), str(extra), *site_paths]
    (site / "_gpuwarden_verify.pth").write_text("\n".join(dict.fromkeys(paths)) + "\n")
    new_python = env_dir / "bin" / "python"
    for name, import_line in _SHIMS.items():
        shim = env_dir / "bin" / name
        # The guard matters: a spawned child (Dask's nanny) imports the main script again.
        shim.write_text(f"#!{new_python}\nimport sys\n{import_line}\n"
                        "if __name__ == '__main__':\n    sys.exit(main())\n")
        shim.chmod(0o755)
    probe = ("import importlib, json\nmissing = []\n"
             f"for m in {NEEDED_MODULES!r}:\n"
             "    try:\n        importlib.import_module(m)\n"
             "    except Exception as exc:\n        missing.append(f'{m} ({exc!r:.200})')\n"
             "print(json.dumps(missing))")
    info["missing_modules"] = json.loads(_checked([str(new_python), "-c", probe]).splitlines()[-1])
    return str(new_python), info


def _checked(argv: list[str], env: dict[str, str] | None = None) -> str:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:6])} ... exited {done.returncode}:\n"
                           f"{(done.stdout + done.stderr)[-3000:]}")
    return done.stdout


# ---- stages -----------------------------------------------------------------------------------


def stage_versions(ctx: Context) -> dict[str, Any]:
    versions: dict[str, Any] = {"python": sys.version.split()[0], "nvml": ctx.nvml}
    # importing torch takes seconds on a quiet machine, tens of them on a loaded one
    res = ctx.run("versions: torch", [ctx.python, "-c", _TORCH_PROBE], ROOT,
                  max(60.0, ctx.left("versions")))
    try:
        versions["torch"] = json.loads(res.output.strip().splitlines()[-1])
    except (ValueError, IndexError):
        versions["torch"] = {"error": f"torch probe exit {res.exit_code}", "log": res.log}
    smi = ctx.run("versions: nvidia-smi", ["nvidia-smi", "--query-gpu=index,name,driver_version,"
                  "memory.total,compute_mode,mig.mode.current", "--format=csv"], ROOT, 30) \
        if _which("nvidia-smi") else None
    versions["nvidia_smi"] = smi.output.strip() if smi and smi.exit_code == 0 else None
    if _which("nvidia-smi"):  # the whole reading, to set beside NVML's answers (a query only)
        ctx.run("versions: nvidia-smi -q", ["nvidia-smi", "-q"], ROOT, 30)
    return versions


def _which(cmd: str) -> bool:
    import shutil

    return shutil.which(cmd) is not None


def stage_nvml(ctx: Context) -> dict[str, Any]:
    """NVML's raw answers, snapshot timings, a CUDA process as listed, the simulated round
    trip (scripts/verify_gpu_nvml.py, in its own process: it creates a CUDA context)."""
    res = ctx.run("nvml probe", [ctx.python, str(ROOT / "scripts" / "verify_gpu_nvml.py"),
                                 str(ctx.out)], ROOT, max(30.0, ctx.left("nvml")))
    path = ctx.out / "nvml.json"
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {"error": f"the probe wrote no nvml.json (exit {res.exit_code})"}
    data.update(exit_code=res.exit_code, seconds=round(res.seconds, 1), timed_out=res.timed_out,
                log=res.log, ok=res.exit_code == 0 and not res.timed_out)
    return data


def stage_tests(ctx: Context) -> dict[str, Any]:
    """Every gpu-marked test; the story tests are left to the stories stage (same commands)."""
    junit = ctx.out / "gpu-tests.xml"
    # Quick, informative files first: a stage cut short at its deadline (SIGINT: pytest still
    # writes the junit file) has then answered the most.
    tests = ROOT / "tests"
    first = [tests / f"{name}.py" for name in FIRST_TEST_FILES if (tests / f"{name}.py").exists()]
    # One process, in the files' order, without the project's xdist options (-o addopts): the
    # card's image has its own pytest-xdist, of whatever version, and these tests share one GPU.
    argv = [ctx.python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfE",
            "-o", "addopts=", "-p", "no:randomly", "--ignore", str(tests / "test_stories.py"), f"--junitxml={junit}",
            *map(str, first), str(tests), *(["-k", ctx.test_filter] if ctx.test_filter else [])]
    res = ctx.run("gpu tests", argv, ROOT, ctx.left("tests"))
    summary = parse_junit(junit)
    summary.update(exit_code=res.exit_code, seconds=round(res.seconds, 1), timed_out=res.timed_out,
                   log=res.log)
    # pytest: 0 passed, 5 nothing collected; anything else (or a timeout) is a failure
    summary["ok"] = res.exit_code in (0, 5) and not res.timed_out
    return summary


def parse_junit(path: Path) -> dict[str, Any]:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    cases: list[dict[str, str]] = []
    if not path.exists():
        return {"counts": counts, "cases": cases}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for tag, word in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(tag) is not None:
                outcome = word
                break
        counts[outcome] += 1
        cases.append({"test": name, "outcome": outcome, "seconds": case.get("time", "")})
    return {"counts": counts, "cases": cases}


def story_verdict(run: catalog.StoryRun, res: Result, code: str | None) -> str:
    if res.timed_out:
        return "timed out"
    if res.exit_code == catalog.SKIP_EXIT:
        return "skipped (needs a GPU)" if run.gpu_only else "FAILED (skipped unexpectedly)"
    if res.exit_code != run.expect_exit:
        return f"FAILED (exit {res.exit_code}, expected {run.expect_exit})"
    if run.expect_code is not None and code != run.expect_code:
        return f"FAILED (explain said {code}, expected {run.expect_code})"
    return "ok"


def stage_stories(ctx: Context) -> list[dict[str, Any]]:
    rows = []
    for run in ctx.stories:
        res = ctx.run(f"story {run.name}", [ctx.python, run.script, *run.args],
                      catalog.STORIES_DIR / run.story, min(run.timeout_s, ctx.left("stories")))
        code = None
        if res.exit_code not in (0, None, catalog.SKIP_EXIT):
            code = catalog.explain_code(res.output)
        verdict = story_verdict(run, res, code)
        rows.append({"story": run.story, "script": run.script, "args": list(run.args),
                     "gpu_only": run.gpu_only, "exit_code": res.exit_code,
                     "expected_exit": run.expect_exit, "explain_code": code,
                     "expected_code": run.expect_code, "seconds": round(res.seconds, 1),
                     "verdict": verdict, "ok": verdict == "ok" or verdict.startswith("skipped"),
                     "log": res.log})
    return rows


def gpu_benchmarks(bench_dir: Path) -> list[tuple[Path, list[str]]]:
    found = []
    for path in sorted(bench_dir.glob("*.py")):
        m = BENCH_MARKER.search(path.read_text(errors="replace"))
        if m:
            found.append((path, m.group(1).split()))
    return found


def stage_benchmarks(ctx: Context) -> list[dict[str, Any]]:
    rows = []
    found = [(path, args) for path, args in gpu_benchmarks(ROOT / "benchmarks")
             if not ctx.benchmarks or path.name in ctx.benchmarks]
    for done, (path, args) in enumerate(found):
        # An equal share of what is left, so that one slow benchmark cannot starve the others.
        share = ctx.left("benchmarks") / (len(found) - done)
        res = ctx.run(f"benchmark {path.name}", [ctx.python, str(path), *args], ROOT, share)
        skipped = res.exit_code == catalog.SKIP_EXIT and gpu_count(ctx.nvml) == 0
        rows.append({"benchmark": path.name, "args": args, "exit_code": res.exit_code,
                     "seconds": round(res.seconds, 1), "timed_out": res.timed_out,
                     "skipped": skipped, "ok": (res.exit_code == 0 or skipped) and not res.timed_out,
                     "output": res.output.strip()[-4000:], "log": res.log})
    return rows


# ---- the run ----------------------------------------------------------------------------------


class Context:
    def __init__(self, out: Path, python: str, budget_s: float, nvml: dict[str, Any],
                 stories: list[catalog.StoryRun], stages: list[str] | None = None) -> None:
        self.out = out
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.nvml = nvml
        self.stories = stories
        self.test_filter: str | None = None  # pytest -k expression (--tests)
        self.benchmarks: list[str] = []  # file names (--benchmark); empty: all
        self.groups = Groups(uuid.uuid4().hex[:12])
        self.env = {**os.environ, RUN_ENV: self.groups.run_id, "PYTHONUNBUFFERED": "1"}
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.deadlines: dict[str, float] = {}
        # The shares of the stages that run, scaled to the whole budget: a rerun of one stage
        # (--stages tests) gets all of it rather than its usual third.
        chosen = {s: share for s, share in STAGE_SHARES.items()
                  if stages is None or s == "versions" or s in stages}
        total = sum(chosen.values())
        t = self.start
        for stage in STAGE_SHARES:
            t += chosen.get(stage, 0.0) / total * budget_s
            self.deadlines[stage] = t

    def left(self, stage: str) -> float:
        """Seconds this stage may still use: up to its cumulative deadline."""
        return max(0.0, self.deadlines[stage] - time.monotonic())

    def run(self, name: str, argv: list[str], cwd: Path, timeout_s: float) -> Result:
        return run_command(name, argv, cwd=cwd, env=self.env, timeout_s=timeout_s,
                           groups=self.groups, logs=self.logs)


def run_all(ctx: Context, stages: list[str]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": os.uname().nodename, "budget_s": ctx.budget_s, "run_id": ctx.groups.run_id,
        "stages_requested": stages, "interrupted": None,
    }
    try:
        report["versions"] = stage_versions(ctx)
        if "nvml" in stages:
            report["nvml"] = stage_nvml(ctx)
        if "tests" in stages:
            report["tests"] = stage_tests(ctx)
        if "stories" in stages:
            report["stories"] = stage_stories(ctx)
        if "benchmarks" in stages:
            report["benchmarks"] = stage_benchmarks(ctx)
    except Interrupted as exc:
        report["interrupted"] = str(exc)
        report["interrupted_signal"] = exc.signum
    except Exception:  # a bug here must still leave a report and no process behind
        import traceback

        report["error"] = traceback.format_exc()
    finally:
        ctx.groups.kill_all()
        report["stray_processes_killed"] = ctx.groups.strays()
        report["elapsed_s"] = round(time.monotonic() - ctx.start, 1)
    report["ok"] = overall_ok(report)
    return report


def overall_ok(report: dict[str, Any]) -> bool:
    if report.get("interrupted") or report.get("error") or report.get("stray_processes_killed"):
        return False
    parts = [report.get("tests", {"ok": True})["ok"], report.get("nvml", {"ok": True})["ok"]]
    parts += [row["ok"] for row in report.get("stories", [])]
    parts += [row["ok"] for row in report.get("benchmarks", [])]
    return all(parts)


def render_markdown(report: dict[str, Any]) -> str:
    v = report.get("versions", {})
    torch_v = v.get("torch", {}) or {}
    nvml = v.get("nvml", {}) or {}
    lines = [f"# gpuwarden GPU verification — {'OK' if report['ok'] else 'FAILED'}", "",
             f"Host {report['host']}, started {report['started_at']}, {report['elapsed_s']} s "
             f"of a {report['budget_s']:g} s budget, run id {report['run_id']}.", ""]
    if report.get("interrupted"):
        lines += [f"**Interrupted**: {report['interrupted']}", ""]
    if report.get("error"):
        lines += ["**verify-gpu itself failed**:", "", "```", report["error"].rstrip(), "```", ""]
    lines += ["## Versions", "",
              f"- Python {v.get('python')}; torch {torch_v.get('torch')} (CUDA runtime "
              f"{torch_v.get('cuda_runtime')}, cuDNN {torch_v.get('cudnn')}, NCCL {torch_v.get('nccl')})",
              f"- driver {nvml.get('driver')}, CUDA driver {nvml.get('cuda_driver')}"
              + (f" (NVML: {nvml['error']})" if "error" in nvml else "")]
    for gpu in nvml.get("gpus", []):
        lines.append(f"- GPU {gpu['index']}: {gpu['name']}, {gpu['memory_total_bytes'] / 2**30:.1f} GiB, "
                     f"compute mode {gpu['compute_mode']}")
    for dev in torch_v.get("devices", []):
        lines.append(f"- torch sees cuda:{dev['index']}: {dev['name']} (sm {dev['capability']})")
    env = report.get("environment") or {}
    if env.get("wheelhouse"):
        missing = env.get("missing_modules") or []
        lines += ["", "## Environment", "",
                  f"A throw-away venv on {env['base_python']}'s packages, with "
                  f"{len(env['wheels'])} wheel(s) from {env['wheelhouse']} (--no-index): "
                  f"{', '.join(env['wheels']) or 'none'}; gpuwarden from the checkout's src/.",
                  "", "Modules that do not import: " + (", ".join(missing) or "none") + "."]
    if "nvml" in report:
        lines += render_nvml(report["nvml"])
    if "tests" in report:
        t = report["tests"]
        c = t["counts"]
        lines += ["", "## gpu-marked tests", "",
                  f"{c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                  f"{c['skipped']} skipped in {t['seconds']} s (exit {t['exit_code']}"
                  f"{', timed out' if t['timed_out'] else ''}; log `{t['log']}`)", ""]
        for case in t["cases"]:
            if case["outcome"] != "passed":
                lines.append(f"- {case['outcome']}: `{case['test']}`")
    if "stories" in report:
        lines += ["", "## Stories", "",
                  "| story | script | exit | explain | seconds | verdict |",
                  "|---|---|---|---|---|---|"]
        for row in report["stories"]:
            script = " ".join([row["script"], *row["args"]])
            lines.append(f"| {row['story']} | `{script}` | {row['exit_code']} | "
                         f"{row['explain_code'] or '-'} | {row['seconds']} | {row['verdict']} |")
    if "benchmarks" in report:
        lines += ["", "## Benchmarks", ""]
        if not report["benchmarks"]:
            lines.append("(no benchmark in benchmarks/ carries a `# verify-gpu:` line)")
        for row in report["benchmarks"]:
            lines += [f"### {row['benchmark']} {' '.join(row['args'])}", "",
                      f"exit {row['exit_code']}, {row['seconds']} s"
                      f"{', timed out' if row['timed_out'] else ''}", "", "```",
                      row["output"], "```", ""]
    strays = report.get("stray_processes_killed", [])
    lines += ["", "## Clean-up", "",
              f"{len(strays)} process(es) had left their group and were killed"
              + "".join(f"\n- pid {s['pid']}: `{s['command']}`" for s in strays)]
    return "\n".join(lines) + "\n"


def render_nvml(nvml: dict[str, Any]) -> list[str]:
    lines = ["", "## NVML on the card", "",
             f"Probe exit {nvml.get('exit_code')}, {nvml.get('seconds')} s (log `{nvml.get('log')}`, "
             "every raw answer in `nvml.json`). Nested PID namespace: "
             f"{nvml.get('nested_pid_namespace')}; nvidia-ml-py {nvml.get('pynvml_version')}."]
    if "error" in nvml:
        lines += ["", f"**{nvml['error']}**"]
    for part in ("raw", "libcuda", "timing", "process", "round_trip"):
        answer = nvml.get(part)
        if isinstance(answer, dict) and "error" in answer:
            lines += ["", f"Part {part} failed: `{_last_line(answer['error'])}`"]
    timing = nvml.get("timing") or {}
    if timing and "error" not in timing:
        lines += ["", "Snapshot time: " + ", ".join(f"{k} {v}" for k, v in timing.items()) + "."]
    raw = nvml.get("raw") or {}
    for i, gpu in enumerate(raw.get("gpus", []) if isinstance(raw, dict) else []):
        refused = sorted(f"{name} ({answer['error'].replace('NVMLError_', '')})"
                         for name, answer in gpu.items()
                         if isinstance(answer, dict) and "error" in answer)
        lines += ["", f"GPU {i}: queries NVML refused: " + ("; ".join(refused) or "none") + "."]
        fabric = gpu.get("fabric") or {}
        lines.append("Fabric (NVSwitch) state: " + "; ".join(
            f"{name}: {answer.get('value', answer.get('error', answer))}"
            for name, answer in fabric.items()) + ".")
    for label, steps in (nvml.get("libcuda") or {}).items():
        if isinstance(steps, dict) and "error" not in steps:
            first = next((k for k in ("start", "import pynvml", "nvmlInit", "memory query",
                                      "process query", "read_host") if steps.get(k)), None)
            lines += ["", f"libcuda in a process that only reads NVML ({label}): first mapped at "
                      f"{first or 'no step'}; holds a CUDA context: "
                      f"{steps.get('holds_a_cuda_context')}; torch/cuda modules at start "
                      f"{steps.get('modules_at_start')}, at end {steps.get('modules_at_end')}."]
    proc = nvml.get("process") or {}
    if proc and "error" not in proc:
        listed = proc.get("listed_by_gpuwarden") or []
        lines += ["", "A CUDA context holding 1 GiB: " + (
            f"torch reserved {proc.get('torch_reserved_bytes')} B; gpuwarden listed "
            f"{listed[0] if listed else 'NOTHING'}; context overhead "
            f"{proc.get('context_overhead_bytes')} B; GPU 0 used {proc.get('gpu0_used_before_bytes')}"
            f" → {proc.get('gpu0_used_while_bytes')} → {proc.get('gpu0_used_after_bytes')} B; "
            f"still listed after exit: {proc.get('still_listed_after_exit')}.")]
    trip = nvml.get("round_trip") or {}
    diffs = trip.get("differences")
    if diffs is not None:
        lines += ["", f"Real snapshot → scenario → simulated backend: {len(diffs)} field(s) differ"
                  + (":" if diffs else ".")]
        lines += [f"- `{d['field']}`: NVML {d['nvml']!r}, simulated {d['simulated']!r}"
                  for d in diffs[:40]]
    return lines


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def write_report(out: Path, report: dict[str, Any]) -> None:
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(render_markdown(report))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/verify-gpu", description=__doc__.splitlines()[0],
                                epilog="Exit: 0 ok, 1 failure, 2 usage, 3 no GPU.")
    p.add_argument("outdir", nargs="?", default=os.environ.get("OUT"),
                   help="where report.md/report.json and logs/ go (default: $OUT)")
    p.add_argument("--budget-s", type=float, default=540.0,
                   help="bound on the whole run in seconds (default 540)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter with torch and gpuwarden (default: this one)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma list of {', '.join(STAGES)} (default: all)")
    p.add_argument("--story", action="append", default=[], metavar="FOLDER",
                   help="run only this story folder (repeatable), e.g. 4-rendezvous-stall")
    p.add_argument("--tests", metavar="EXPR",
                   help="only the gpu tests pytest -k EXPR selects (a rerun of what failed)")
    p.add_argument("--benchmark", action="append", default=[], metavar="FILE",
                   help="run only this benchmark (repeatable), e.g. bench_pool.py")
    p.add_argument("--wheelhouse", metavar="DIR",
                   help="wheels to install --no-index into a throw-away venv on top of --python "
                   "(for a machine without a package index; scripts/gpu-wheelhouse fetches them)")
    p.add_argument("--allow-no-gpu", action="store_true",
                   help="run without a GPU (the GPU-only story parts then skip): for testing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if not args.outdir:
        print("verify-gpu: no output directory: give one, or set $OUT", file=sys.stderr)
        return 2
    stages = [s for s in args.stages.split(",") if s]
    unknown = set(stages) - set(STAGES)
    if unknown or args.budget_s <= 0:
        print(f"verify-gpu: bad --stages {sorted(unknown)} or --budget-s {args.budget_s}",
              file=sys.stderr)
        return 2
    known = {path.name for path, _ in gpu_benchmarks(ROOT / "benchmarks")}
    if set(args.benchmark) - known:
        print(f"verify-gpu: no GPU benchmark named {sorted(set(args.benchmark) - known)} "
              f"(those with a '# verify-gpu:' line: {', '.join(sorted(known))})", file=sys.stderr)
        return 2
    stories = [r for r in catalog.ALL if not args.story or r.story in args.story]
    if args.story and not stories:
        print(f"verify-gpu: no story folder named {args.story}", file=sys.stderr)
        return 2
    import shutil

    # Commands run in other directories (the story folders): the interpreter needs a full path.
    args.python = os.path.abspath(shutil.which(args.python) or args.python)
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    nvml = nvml_facts()
    if gpu_count(nvml) == 0 and not args.allow_no_gpu:
        print(f"verify-gpu: no GPU ({nvml.get('error', 'NVML reports 0 GPUs')}); "
              "--allow-no-gpu to run anyway", file=sys.stderr)
        return 3
    environment: dict[str, Any] = {"python": args.python}
    if args.wheelhouse:
        wheelhouse = Path(args.wheelhouse)
        if not wheelhouse.is_dir():
            print(f"verify-gpu: --wheelhouse {args.wheelhouse}: not a directory", file=sys.stderr)
            return 2
        import tempfile

        env_dir = Path(tempfile.mkdtemp(prefix="gpuwarden-verify-env-"))
        try:
            args.python, environment = prepare_environment(args.python, wheelhouse.resolve(),
                                                           env_dir)
        except (RuntimeError, OSError, ValueError) as exc:
            shutil.rmtree(env_dir, ignore_errors=True)
            print(f"verify-gpu: could not prepare the environment: {exc}", file=sys.stderr)
            return 1
    ctx = Context(out, args.python, args.budget_s, nvml, stories, stages)
    ctx.test_filter, ctx.benchmarks = args.tests, args.benchmark

    def interrupt(signum: int, _frame: Any) -> None:
        raise Interrupted(signum)

    old_handlers = {sig: signal.signal(sig, interrupt)
                    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        report = run_all(ctx, stages)
    finally:  # main() is also called in-process (tests): give the handlers back
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if args.wheelhouse:
            shutil.rmtree(environment["env"], ignore_errors=True)
    report["environment"] = environment
    write_report(out, report)
    print(f"verify-gpu: {'ok' if report['ok'] else 'FAILED'} in {report['elapsed_s']} s; "
          f"report: {out / 'report.md'}", file=sys.stderr)
    if report.get("interrupted"):
        return 128 + int(report["interrupted_signal"])
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
