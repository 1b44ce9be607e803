import pytest

from gpuwarden.errors import UsageError
from gpuwarden.units import format_bytes, parse_duration, parse_size


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
    [("30s", 30), ("10m", 600), ("1h30m", 5400), ("500ms", 0.5), ("2.5", 2.5), ("0", 0), (7, 7)],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "10x", "m10", "10m x", "-5"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(UsageError):
        parse_duration(text, what="--wait")


def test_format_bytes() -> None:
    assert format_bytes(71200 * 1024**2) == "69.5 GiB"
    assert format_bytes(512 * 1024**2) == "512 MiB"
    assert format_bytes(None) == "?"
