"""``gradcomm.bench --calibrate``: the profile it writes, the ``pred(us)`` column, and the
summary's count of how often ``auto`` picks the measured best. Tiny and fast: these test
the plumbing, not the figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gradcomm.bench.calibrate import fit_linear, sizes_upto
from gradcomm.bench.cli import main
from gradcomm.collectives.costmodel import Profile
from tests.bench.test_bench import ROOT, _env, _mpiexec

CAL = ["--calibrate", "--calibrate-max", "4K", "--calibrate-iters", "3", "--no-progress"]
SWEEP = ["--sizes", "4K,64K", "--iters", "2", "--warmup", "1",
         "--algorithms", "ring,tree,recursive_doubling,rabenseifner,native,auto"]


def test_helpers() -> None:
    assert sizes_upto(64) == [8, 64] and sizes_upto(4) == [8]
    a, b = fit_linear([8, 4096, 1 << 20], [2e-6 + 8e-10, 2e-6 + 4096e-10, 2e-6 + 0.1048576e-3])
    assert a == pytest.approx(2e-6, rel=1e-6) and b == pytest.approx(1e-10, rel=1e-6)
    assert fit_linear([8, 64], [5e-6, 4e-6]) == (4.5e-6, 0.0)      # no negative slope


@pytest.mark.timeout(60)
def test_threads_calibrate_saves_a_profile(tmp_path, capsys) -> None:
    path = tmp_path / "p.json"
    assert main(["--transport", "threads", *CAL, "--profile", str(path)]) == 0
    out = capsys.readouterr().out
    prof = Profile.load(str(path))
    assert (prof.transport, prof.ranks) == ("threads", 2)
    assert prof.alpha > 0 and prof.beta >= 0 and prof.gamma["float32"] >= 0
    assert set(prof.gamma) >= {"float32", "float64", "bfloat16", "int8"}
    assert [b for b, _ in prof.native] == [8.0, 64.0, 512.0, 4096.0]
    assert prof.overhead >= 0 and prof.check > 0 and prof.copy > 0
    assert f"# saved profile: {path}" in out and "# auto picks: 4 KiB" in out
    assert "size(B)" not in out                         # no --sizes: no sweep


@pytest.mark.timeout(60)
def test_threads_rows_carry_predictions_and_the_summary_counts_auto(tmp_path, capsys) -> None:
    path, out_json = tmp_path / "p.json", tmp_path / "r.json"
    assert main(["--transport", "threads", *CAL, "--profile", str(path), *SWEEP,
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    assert "pred(us)" in text
    for r in doc["rows"]:
        assert r["wrong"] == 0 and r["extra"]["pred_us"] > 0, r
    s = doc["summary"]
    assert s["auto"]["sizes"] == 2
    assert {d["size"] for d in s["auto"]["detail"]} == {4096, 65536}
    for d in s["auto"]["detail"]:        # the fastest (mean) checked dense row, from the rows
        cands = {r["algorithm"]: r["avg_us"] for r in doc["rows"] if r["size"] == d["size"]
                 and r["check"] and r["compressor"] is None and r["algorithm"] != "auto"}
        assert d["best"] == min(cands, key=cands.get)
        assert d["slowdown"] == pytest.approx(cands[d["auto"]] / min(cands.values()))
    assert s["auto"]["best"] == sum(d["auto"] == d["best"] for d in s["auto"]["detail"])
    # the model is scored only where the calibration did not measure: 4 KiB is one of
    # its sizes (8 B ... --calibrate-max 4K), 64 KiB is held out
    assert Profile.load(str(path)).info["sizes"] == [8, 64, 512, 4096]
    held = [r for r in doc["rows"] if r["size"] == 65536]
    assert s["model"]["rows"] == len(held) and s["model"]["held_out"] is True
    errs = sorted(abs(r["extra"]["pred_us"] / r["avg_us"] - 1) for r in held)
    assert s["model"]["median_rel_error"] == pytest.approx(
        (errs[len(errs) // 2] + errs[(len(errs) - 1) // 2]) / 2)
    assert "auto picks the measured best at" in text and "held-out sizes" in text
    assert "compressed routes use defaults (hand-set, not measured): WIRE_ALPHA" in text
    assert doc["environment"]["profile"]["digest"] == Profile.load(str(path)).digest()

    # the saved profile, used without calibrating
    assert main(["--transport", "threads", "--profile", str(path), *SWEEP]) == 0
    text = capsys.readouterr().out
    assert "# using profile" in text and "auto picks the measured best" in text


def test_a_missing_profile_is_a_clear_error(tmp_path, capsys) -> None:
    assert main(["--transport", "threads", "--profile", str(tmp_path / "no.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_mpirun_two_ranks_calibrate(tmp_path) -> None:
    """Under mpirun: the profile lands where GRADCOMM_PROFILE says, named after the
    transport and rank count; the baseline row is predicted by the native points."""
    out_json = tmp_path / "m.json"
    env = dict(_env(), GRADCOMM_PROFILE=str(tmp_path / "prof-{transport}-{ranks}.json"))
    p = subprocess.run([_mpiexec(), "-n", "2", "--oversubscribe", sys.executable, "-m",
                        "gradcomm.bench", *CAL, *SWEEP, "--json", str(out_json)],
                       capture_output=True, text=True, timeout=80, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    prof = Profile.load(str(tmp_path / "prof-mpi-2.json"))
    assert (prof.transport, prof.ranks) == ("mpi", 2) and len(prof.native) == 4, p.stdout
    doc = json.loads(out_json.read_text())
    base = [r for r in doc["rows"] if r["algorithm"] == "MPI_Allreduce"]
    assert len(base) == 2 and all(r["extra"]["pred_us"] > 0 for r in base), p.stdout
    assert doc["summary"]["auto"]["sizes"] == 2, (doc["summary"], p.stdout)
    assert p.stdout.count("# saved profile:") == 1 and p.stdout.count("# summary:") == 1
