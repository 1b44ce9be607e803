"""`gpuwarden ls` as a newcomer and an operator meet it: 80 columns, health, MIG, filters, watch,
through main(argv) on the scenarios that ship with gpuwarden."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.cli import main
from gpuwarden.inventory.simulated import SHIPPED_DIR, SimulatedBackend, shipped_scenarios

MIG_1 = "MIG-c41f07b2-9e6d-5b1a-8c3e-2f7d6a5b4c93"


def ls(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["ls", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _plain_host(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUWARDEN_SIMULATE", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS"):
        monkeypatch.delenv(var, raising=False)


def test_every_shipped_scenario_lists_in_80_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert {"two-idle", "example", "eight-idle", "mig", "busy", "sick", "no-gpu"} <= \
        set(shipped_scenarios())
    for name in shipped_scenarios():
        code, out, err = ls(capsys, "--simulate", name)
        assert code == 0 and err == "", (name, err)
        assert out.startswith(SimulatedBackend(SHIPPED_DIR / f"{name}.json").read_host().hostname)
        too_wide = [line for line in out.splitlines() if len(line) > 80]
        assert not too_wide, (name, too_wide)
    _, out, _ = ls(capsys, "--simulate", "example")
    # what nvitop users look for, per GPU and per process
    assert re.search(r"^0 +H100 80GB HBM3 +97% +69\.5/79\.6G +57C +681/700W +default$", out, re.M)
    assert re.search(r"^2 +H100 .* exclusive$", out, re.M)  # not "exclusiv…"
    assert re.search(r"^0 +4242 +bob +69\.0G +11h10m +12\.3G +5h00m +python train_llm\.py", out, re.M)


def test_a_scenario_name_also_works_in_the_variable(capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_SIMULATE", "two-idle")
    assert main(["select", "-n", "2"]) == 0 and capsys.readouterr().out == "0,1\n"
    code, _out, err = ls(capsys, "--simulate", "two_idle")  # a typo: the names are listed
    assert code == 2 and err.startswith("error[SCENARIO_INVALID]: no scenario named 'two_idle'")
    assert "two-idle" in err and err.count("\n") == 1


def test_mig_instances_are_listed_with_their_processes(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    _, out, _ = ls(capsys, "--simulate", "mig")
    assert re.search(r"^0:0 +MIG-5a7c2d1e 3g\.40gb +- +0\.0/39\.2G$", out, re.M)
    assert re.search(r"^0:1 +300 +gina +19\.4G .* python infer\.py --port 8000$", out, re.M)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", MIG_1)  # the instance, not its GPU, is visible
    _, out, _ = ls(capsys, "--simulate", "mig")
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:6]}
    assert rows == {"0": "-", "0:0": "-", "0:1": "cuda:0", "1": "-"}


def test_what_needs_attention_is_said_under_its_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = ls(capsys, "--simulate", "sick")
    lines = out.splitlines()
    after = {lines[i - 1].split()[0]: line.strip() for i, line in enumerate(lines)
             if line.startswith("    !")}
    assert after == {"0": "! slowed: sw_power_cap, hw_thermal_slowdown",
                     "1": "! 2 uncorrectable ECC error(s); memory repair pending a GPU reset",
                     "2": "! 4 of 18 NVLinks down",
                     "3": "! unusable: NVML: GPU is lost"}
    _, out, _ = ls(capsys, "--simulate", "sick", "--json")
    gpus = json.loads(out)["gpus"]
    assert gpus[1]["problems"] == ["2 uncorrectable ECC error(s)",
                                   "memory repair pending a GPU reset"]
    assert gpus[2]["health"]["nvlinks_active"] == 14
    assert gpus[2]["problems"] == ["4 of 18 NVLinks down"]
    _, out, _ = ls(capsys, "--simulate", "sick", "--long")
    assert "NVLink     14 of 18 links up" in out
    assert "clocks     SM 1095 of 1980 MHz, memory 2619 MHz; event reasons: sw_power_cap, " \
        "hw_thermal_slowdown" in out


def test_filters_by_user_and_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = ls(capsys, "--simulate", "example", "--user", "carol", "--json")
    gpus = json.loads(out)["gpus"]
    assert [g["index"] for g in gpus] == [2] and [p["user"] for p in gpus[0]["processes"]] == ["carol"]
    _, out, _ = ls(capsys, "--simulate", "example", "--gpu", "1,3")
    assert [line.split()[0] for line in out.splitlines()[2:]] == ["1", "3"]
    _, out, _ = ls(capsys, "--simulate", "mig", "--gpu", MIG_1, "--json")
    (gpu0,) = json.loads(out)["gpus"]
    assert [m["uuid"] for m in gpu0["mig_devices"]] == [MIG_1]
    code, out, err = ls(capsys, "--simulate", "example", "--gpu", "9")
    assert code == 2 and out == "" and "--gpu 9: this host has no GPU '9'" in err
    _, out, _ = ls(capsys, "--simulate", "example", "--user", "nobody-here")
    assert out.splitlines()[1] == "no GPU matches --gpu / --user"


def test_watch_refreshes_and_measures_cpu_between_refreshes(capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    code, out, _ = ls(capsys, "--simulate", "example", "--watch", "0.1", "--iterations", "2")
    assert code == 0 and out.count("box-a: 4 GPU(s)") == 2
    assert "%CPU" in out and re.search(r"^0 +4242 +bob +69\.0G +0% ", out, re.M)
    code, out, _ = ls(capsys, "--simulate", "two-idle", "--watch", "0.1", "--iterations", "3",
                      "--json")
    docs = [json.loads(line) for line in out.splitlines()]  # JSON Lines, one per refresh
    assert code == 0 and len(docs) == 3 and all(d["schema_version"] == 1 for d in docs)
    for argv, words in ((["--iterations", "2"], "--iterations without --watch"),
                        (["--watch", "0"], "between 0.1 s and 1 h"),
                        (["--watch", "-1"], "between 0.1 s and 1 h")):
        code, _, err = ls(capsys, "--simulate", "example", *argv)
        assert code == 2 and words in err


def test_other_users_command_lines_are_escaped(capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    data: dict[str, Any] = json.loads((SHIPPED_DIR / "example.json").read_text())
    data["gpus"][0]["processes"][0]["command"] = "python x.py\x1b[2J\nerror[FORGED]: \u202eevil"
    data["gpus"][0]["processes"][0]["user"] = "bob\x07"
    path = tmp_path / "hostile.json"
    path.write_text(json.dumps(data))
    for argv in (["ls", "--simulate", str(path)], ["ls", "--simulate", str(path), "-l"],
                 ["select", "--simulate", str(path), "--include", "0"]):
        main(argv)
        out, err = capsys.readouterr()
        text = out + err
        assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text, argv
        assert not any(line.startswith("error[FORGED]") for line in text.splitlines()), argv
        assert "\\x1b[2J" in text, argv


def test_every_scenario_field_and_json_key_is_documented(capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    root = Path(__file__).resolve().parents[1]
    parser = (root / "src/gpuwarden/inventory/simulated.py").read_text()
    fields = set(re.findall(r'\.get\("(\w+)"', parser))
    scenarios_doc = (root / "docs/scenarios.md").read_text()
    assert fields and not [f for f in fields if f"`{f}`" not in scenarios_doc]
    inventory_doc = (root / "docs/inventory.md").read_text()
    keys: set[str] = set()
    for name in ("sick", "mig", "example"):
        _, out, _ = ls(capsys, "--simulate", name, "--json")
        data = json.loads(out)
        keys |= set(data) | set(data["host"])
        for g in data["gpus"]:
            keys |= set(g) | set(g["health"])
            for m in g["mig_devices"]:
                keys |= set(m) | {k for p in m["processes"] for k in p}
            keys |= {k for p in g["processes"] for k in p}
    assert not [k for k in keys if f"`{k}`" not in inventory_doc]


@pytest.mark.parametrize("second", ["MIG-c41f07b2-9e6d-5b1a-8c3e-2f7d6a5b4c93",
                                    "MIG-5a7c2d1e-0d3b-5e0f-9f3a-4d2c1b0a9e81"])
def test_each_mig_id_shown_names_its_instance_alone_in_cuda_visible_devices(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path,
        second: str) -> None:
    """What `ls` shows for an instance is what docs/inventory.md says to put in
    CUDA_VISIBLE_DEVICES: it must name that instance only, also when two uuids share their
    first 8 hex digits (ls showed 'MIG-5a7c2d1e' for both, which then 'matches 2 devices')."""
    import json

    from gpuwarden.inventory.simulated import SHIPPED_DIR

    data = json.loads((SHIPPED_DIR / "mig.json").read_text())
    data["gpus"][0]["mig_devices"][1]["uuid"] = second
    path = tmp_path / "mig.json"
    path.write_text(json.dumps(data))
    _, out, _ = ls(capsys, "--simulate", str(path))
    # in its row, or (uuids alike for long) whole on the line under it
    shown = re.findall(r"^0:(\d) +(MIG-\S+) ", out, re.M) or re.findall(
        r"^0:(\d) .*\n +id (MIG-\S+)$", out, re.M)
    assert [k for k, _ in shown] == ["0", "1"], out
    assert all("…" not in short for _, short in shown)
    for k, short in shown:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", short)
        _, out, err = ls(capsys, "--simulate", str(path))
        rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:6]}
        assert rows[f"0:{k}"] == "cuda:0" and list(rows.values()).count("cuda:0") == 1, err


@pytest.mark.timeout(60)
def test_watch_into_a_reader_that_leaves_ends_quietly() -> None:
    """`gpuwarden ls --watch 1 | head -3`: the reader goes, the watch ends with SIGPIPE's exit
    status and no traceback (it printed a BrokenPipeError traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).with_name("gpuwarden")
    proc = subprocess.Popen([str(exe), "ls", "--simulate", "example", "--watch", "0.1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "GPUWARDEN_SIMULATE": ""})
    assert proc.stdout is not None and proc.stdout.readline().startswith(b"box-a")
    proc.stdout.close()  # as head does after its lines
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 141 and b"Traceback" not in err, err.decode()
