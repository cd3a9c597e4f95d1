"""bench/mutate.py cannot rot silently: every planted fault still applies to the source.

The full mutation run (every fault, its checks) takes ~15 minutes; see bench/README.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "mutate.py"
_spec = importlib.util.spec_from_file_location("gradcomm_bench_mutate", _PATH)
assert _spec and _spec.loader
mutate = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = mutate          # dataclasses need the module registered
_spec.loader.exec_module(mutate)


def test_every_mutant_applies_to_the_current_source_and_compiles():
    assert mutate.verify() == []


def test_the_required_faults_are_planted_and_every_check_exists():
    names = {m.name for m in mutate.MUTANTS}
    touched = {p.path for m in mutate.MUTANTS for p in m.patches}
    for alg in ("ring", "tree", "recursive_doubling", "rabenseifner"):
        assert f"{alg}-misplaced" in names
    assert {"fp16-encodes-zeros", "int8-decodes-zeros", "ef-forgets", "shared-seed-per-rank",
            "powersgd-projection-per-rank", "tree-drops-last-rank",
            "fold-drops-rank0", "planned-adds-stale", "pieces-sum-reversed",
            "planned-flags-silent", "pieces-vote-own", "cast-flags-silent",
            "cast-result-unchecked", "cast-residual-dropped"} <= names
    assert "gradcomm/collectives/_fold.py" in touched
    root = mutate.ROOT
    for m in mutate.MUTANTS:
        assert m.checks and m.patches, m.name
        assert all(p.old != p.new for p in m.patches), m.name
    for check in {c for m in mutate.MUTANTS for c in m.checks}:
        assert mutate.available(root, check), f"check {check}: a test file is missing"


def test_a_moved_line_fails_loudly_and_a_mutant_applies_all_or_nothing(tmp_path):
    m = next(m for m in mutate.MUTANTS if m.name == "ddp-returns-zeros")
    (tmp_path / Path(m.patches[0].path).parent).mkdir(parents=True)
    target = tmp_path / m.patches[0].path
    target.write_text(m.patches[0].old + "\n")
    second = tmp_path / m.patches[1].path
    second.parent.mkdir(parents=True, exist_ok=True)
    if second != target:
        second.write_text("")                              # the second patch's line moved
    with pytest.raises(mutate.MutantError, match="0 copies"):
        mutate.apply(tmp_path, m)
    assert target.read_text() == m.patches[0].old + "\n"   # nothing written
    target.write_text(m.patches[0].old + "\n" + m.patches[0].old + "\n")
    with pytest.raises(mutate.MutantError, match="2 copies"):
        mutate.apply(tmp_path, m)


def test_a_scratch_copy_leaves_the_tree_alone(tmp_path):
    root = tmp_path / "src"
    (root / ".git").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref")
    (root / "gradcomm").mkdir()
    (root / "gradcomm" / "a.py").write_text("x = 1\n")
    m = mutate.Mutant("t", "t", (mutate.Patch("gradcomm/a.py", "x = 1", "x = 2"),), ("codecs",))
    copy = mutate.scratch_copy(tmp_path / "work", root)
    mutate.apply(copy, m)
    assert (copy / "gradcomm" / "a.py").read_text() == "x = 2\n"
    assert (root / "gradcomm" / "a.py").read_text() == "x = 1\n"
    assert not (copy / ".git").exists()
