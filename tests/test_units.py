import pytest

from gpuwarden.errors import UsageError
from gpuwarden.units import format_bytes, format_duration, parse_duration, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20GiB", 20 * 1024**3),
        ("20G", 20 * 1024**3),
        ("20g", 20 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("512M", 512 * 1024**2),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("20GB", 20 * 10**9),
        ("1048576", 1048576),
        (" 1 KiB ", 1024),
        ("0", 0),
    ],
)
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "20XB", "GiB", "-1G", "1,5G", "twenty"])
def test_parse_size_rejects_with_fix(text: str) -> None:
    with pytest.raises(UsageError) as err:
        parse_size(text, what="--min-free")
    assert "--min-free" in err.value.what and repr(text) in err.value.what
    assert "20GiB" in (err.value.fix or "")
    assert err.value.exit_code == 2


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("10m", 600), ("1h30m", 5400), ("500ms", 0.5), ("2.5", 2.5), ("0", 0), (7, 7),
     ("inf", float("inf"))],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10x", "m10", "10m x", "-5", "nan", "NaN"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_duration(text, what="--wait")


def test_format_bytes() -> None:
    assert format_bytes(71200 * 1024**2) == "69.5 GiB"
    assert format_bytes(512 * 1024**2) == "512 MiB"
    assert format_bytes(None) == "?"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(3.25, "3.2s"), (42, "42s"), (119.7, "2m00s"), (599.7, "10m00s"), (3725, "1h02m")],
)
def test_format_duration_never_prints_60_seconds(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_short_command_keeps_the_script_name() -> None:
    from gpuwarden.procs import short_command

    argv = ["/usr/bin/python3", "/very/long/path/" + "x" * 80 + "/4-rendezvous/port_holder.py", "29500"]
    short = short_command(argv)
    assert len(short) == 80 and short.startswith("/usr/bin/python3")
    assert short.endswith("port_holder.py 29500")
    assert short_command(["python", "a.py"]) == "python a.py"


def test_rank_runs_are_ranges_of_consecutive_ranks_in_order() -> None:
    from gpuwarden.units import rank_runs

    assert rank_runs([7, 0, 1, 2, 3, 5]) == ["0-3", "5", "7"]
    assert rank_runs([3, 3, 4]) == ["3-4"]
    assert rank_runs([]) == []
