"""bench/membw.py: the paired passes really run at the same moment, and the figures are
the bytes over the measured times."""

from __future__ import annotations

import doctest
import json
import subprocess
import sys
from pathlib import Path

import pytest

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
import membw  # noqa: E402  (bench/membw.py)

_PATH = _BENCH / "membw.py"


def test_two_processes_stream_at_the_same_time() -> None:
    rows = membw.measure(4 << 20, procs=2, reps=5)
    assert len(rows) == 2 and membw.overlapped(rows)
    for r in rows:
        assert r["start"] < r["end"]
        assert r["read_gbs"] == pytest.approx((4 << 20) / r["read_s"] / 1e9)
        assert r["copy_gbs"] == pytest.approx(2 * (4 << 20) / r["copy_s"] / 1e9)


def test_windows_apart_are_not_overlapped() -> None:
    rows = [{"start": 0.0, "end": 1.0}, {"start": 1.5, "end": 2.0}]
    assert not membw.overlapped(rows)
    assert membw.overlapped([{"start": 0.0, "end": 1.0}, {"start": 0.5, "end": 2.0}])


def test_the_command_line_writes_every_run(tmp_path) -> None:
    out = tmp_path / "bw.json"
    p = subprocess.run([sys.executable, str(_PATH), "--mb", "2", "--procs", "1,2",
                        "--reps", "3", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert [r["procs"] for r in got["runs"]] == [1, 2]
    assert [len(r["rows"]) for r in got["runs"]] == [1, 2]
    assert "overlapped" in p.stdout


def test_doctests() -> None:
    assert doctest.testmod(membw).failed == 0
