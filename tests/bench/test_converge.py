"""bench/converge.py: one real 2-rank launch of three short variants, then its report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from tests._launch import launch_env  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "converge.py"


@pytest.mark.timeout(240)
def test_a_short_run_reports_accuracy_reach_residuals_and_bytes(tmp_path):
    out = tmp_path / "c.json"
    cmd = [sys.executable, str(SCRIPT), "--np", "2", "--tasks", "digits", "--optims", "sgd",
           "--variants", "ddp,gc-topk:ratio=0.05;opt=1,torch-powersgd:rank=1;start=2",
           "--width", "32", "--depth", "1",
           "--points", "4", "--json", str(out), "--md", str(tmp_path / "c.md"),
           "--plot", str(tmp_path / "c.png")]
    run = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    ddp, topk, reference = rows
    assert ddp["variant"] == "ddp" and ddp["gap_pts"] == 0 and ddp["curve"][-1][3] == 0
    assert topk["curve"][-1][3] > 0                      # its residuals were measured
    assert 0 < topk["bytes_per_step"] < ddp["dense_bytes_per_step"]
    assert topk["steps"] == 15 * 1438 // 64 and not topk["diverged"]
    assert ddp["acc"] > 0.8 and len(ddp["curve"]) >= 4
    # PyTorch's own PowerSGD hook trains beside them, as the reference
    assert reference["variant"] == "torch-powersgd:rank=1;start=2"
    assert reference["acc"] > 0.8 and not reference["diverged"]
    assert reference["loss"] != ddp["loss"]              # its hook did compress
    assert "| `gc-topk:ratio=0.05;opt=1` |" in (tmp_path / "c.md").read_text()
    assert (tmp_path / "c.png").stat().st_size > 1000
    # --report merges saved runs into the same outputs without training
    again = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out), "--md",
                            str(tmp_path / "d.md")], env=launch_env(), capture_output=True,
                           text=True, timeout=60)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "d.md").read_text() == (tmp_path / "c.md").read_text()
