"""``bench/gpu_check.py --cpu``: the GPU readiness script's timing and byte-check steps,
run on torch CPU tensors through the device kernels, so the script keeps working on
machines without a GPU (its GPU run: the lead, on a GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("array_api_compat")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(90)
def test_gpu_check_cpu_mode_times_and_checks_every_codec(tmp_path: Path) -> None:
    from gradcomm import compressors

    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--cpu",
                           "--size", "20000", "--repeat", "2", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=80)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout
    res = json.loads(out.read_text())
    assert res["cpu_mode"] and res["size"] == 20000 and res["failed"] == []
    assert "tests" not in res                           # no pytest step without a GPU
    rows = {(r["codec"], r.get("path")): r for r in res["codecs"]}
    assert rows[("d2d copy", "copy")]["x_copy"] == 1.0
    assert rows[("wrap staging", "d2h+h2d")]["ms"] > 0
    for name in compressors.names():
        if name == "powersgd":                          # no device encoder: staged
            assert "skipped" in rows[(name, None)]
            continue
        for path in ("device", "wire", "staged"):
            r = rows[(name, path)]
            assert r["kind"] == "torch-cpu" and r["ms"] > 0 and r["x_copy"] > 0, r
        dev = rows[(name, "device")]
        assert dev["equal_host"] is True and dev["payload_kinds"] == ["torch"], dev
    checks = {(r["codec"], r["algorithm"]): r for r in res["allreduce"]}
    assert set(checks) == {(n, a) for n in compressors.names() for a in ("allgather", "ring")}
    for key, r in checks.items():
        assert r["equal_host"] is True and r["where"] == "torch cpu native", (key, r)


def test_gpu_check_without_a_gpu_reports_the_environment_only(tmp_path: Path) -> None:
    import importlib.util

    from gradcomm import arrays

    if arrays.cuda_usable("torch") or arrays.cuda_usable("cupy"):
        pytest.skip("a GPU is usable here: the full run is tests/devices/test_gpu.py's")
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "env.json"
    assert mod.main(["--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["gpu"] is False and "codecs" not in res and "tests" not in res
    assert res["environment"]["array_api_compat"] != "unavailable (ModuleNotFoundError)"
