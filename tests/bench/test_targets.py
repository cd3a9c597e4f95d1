"""bench/targets.py's verdict: a rate that measured nothing is never "all met"."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "targets.py"


@pytest.fixture()
def targets():
    spec = importlib.util.spec_from_file_location("gradcomm_bench_targets", _PATH)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]


@pytest.mark.parametrize("why", ["no compressor to measure",
                                 "the benchmark wrote no results (exit 1)",
                                 "no native baseline row in the benchmark output"])
def test_an_incomplete_rate_is_missed(targets, why: str, monkeypatch, capsys) -> None:
    monkeypatch.setattr(targets, "run_rate", lambda rate, args: {
        "rate": rate, "rows": [], "link_ok": True, "bench_rc": 0, "incomplete": why})
    assert targets.main(["--rates", "1gbit"]) == 1
    out = capsys.readouterr().out
    assert f"MISSED: 1gbit {why}" in out and "all met" not in out


def test_a_complete_rate_with_met_rows_is_met(targets, monkeypatch, capsys) -> None:
    monkeypatch.setattr(targets, "run_rate", lambda rate, args: {
        "rate": rate, "rows": [{"compressor": "int8", "error_feedback": True, "met": True}],
        "link_ok": True, "bench_rc": 0})
    assert targets.main(["--rates", "1gbit"]) == 0
    assert "all met" in capsys.readouterr().out


def test_the_specs_need_gradcomm(targets, monkeypatch) -> None:
    """No silent empty list when gradcomm does not import (the bench would not run)."""
    assert targets.compressor_specs("1gbit", "none@ring,int8,bogus") == ["none@ring", "int8"]
    monkeypatch.setitem(sys.modules, "gradcomm", None)
    with pytest.raises(ImportError):
        targets.compressor_specs("1gbit", "int8")


def _ddp_rows(fp16: float, ours: float, onebit: float, gap_points: float) -> list[dict]:
    acc = 0.9777
    return [{"variant": "torch-fp16", "step_s_mean": fp16, "test_acc": acc},
            {"variant": "gc-fp16", "step_s_mean": ours, "test_acc": acc},
            {"variant": "gc-onebit", "step_s_mean": onebit,
             "test_acc": acc - gap_points / 100}]


def test_the_ddp_targets_are_judged(targets) -> None:
    """Each DDP target is met, missed, or not judged (a row it needs is absent), from the
    mean step times and the test accuracy."""
    met = lambda rows, floor: [m for _, m, _ in targets.ddp_verdicts(rows, floor)]  # noqa
    assert met(_ddp_rows(0.100, 0.099, 0.049, 0.0), 0.042) == [True, True, True]
    assert met(_ddp_rows(0.100, 0.101, 0.049, 0.0), 0.042) == [False, True, True]
    assert met(_ddp_rows(0.100, 0.099, 0.051, 0.0), 0.045) == [True, False, True]
    assert met(_ddp_rows(0.100, 0.099, 0.049, 0.6), 0.042) == [True, False, True]
    assert met(_ddp_rows(0.100, 0.099, 0.049, 0.0), 0.040) == [True, True, False]
    assert met(_ddp_rows(0.100, 0.099, 0.049, 0.0)[1:], None) == [None, None, None]


def test_a_missed_ddp_target_is_missed(targets, monkeypatch, capsys) -> None:
    monkeypatch.setattr(targets, "run_rate", lambda rate, args: {
        "rate": rate, "rows": [{"compressor": "int8", "error_feedback": True, "met": True}],
        "link_ok": True, "bench_rc": 0})
    verdicts = targets.ddp_verdicts(_ddp_rows(0.100, 0.101, 0.049, 0.0), 0.042)
    monkeypatch.setattr(targets, "run_ddp", lambda rate, args: {"verdicts": verdicts})
    assert targets.main(["--rates", "1gbit", "--ddp"]) == 1
    out = capsys.readouterr().out
    assert "MISSED: 1gbit DDP gc-fp16 <= torch-fp16" in out and "onebit" not in out


def test_a_ddp_run_without_rows_is_missed(targets, monkeypatch, capsys) -> None:
    """bench/train.py that wrote no rows: no DDP target can be met, and the floor is not
    run for nothing."""
    monkeypatch.setattr(targets, "run_rate", lambda rate, args: {
        "rate": rate, "rows": [{"compressor": "int8", "error_feedback": True, "met": True}],
        "link_ok": True, "bench_rc": 0})
    calls = []
    monkeypatch.setattr(targets, "_train", lambda rate, variants, args: (
        calls.append(rate) or (1, [])))
    assert targets.main(["--rates", "1gbit", "--ddp"]) == 1
    assert "MISSED: 1gbit DDP bench/train.py rows" in capsys.readouterr().out
    assert calls == ["1gbit"]


def test_the_docstring_examples_run(targets) -> None:
    import doctest

    result = doctest.testmod(targets)
    assert result.attempted >= 4 and result.failed == 0
