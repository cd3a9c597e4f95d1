"""The import contract in pyproject.toml (``[tool.importlinter]``), checked by ``lint-imports``.

The floors: errors, _dtypes, ops -> arrays -> comm | compressors -> error_feedback ->
collectives -> compressed -> _plan -> _allreduce -> integrations -> bench, each importing
only from those below it, and no import cycle between the modules of any package.
Imports inside functions count: the last test plants one and sees the contract break.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the checkout at ``root`` (its pyproject.toml, its gradcomm)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or \
        shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' (import-linter)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get(
        "PYTHONPATH", "")])}
    return subprocess.run([exe, "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.timeout(150)
def test_the_import_contract_is_kept() -> None:
    run = lint_imports(ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


@pytest.mark.timeout(150)
def test_a_function_level_import_upward_breaks_the_contract(tmp_path: Path) -> None:
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    shutil.copytree(ROOT / "gradcomm", tmp_path / "gradcomm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    state = tmp_path / "gradcomm" / "comm" / "state.py"
    state.write_text(state.read_text() + "\n\ndef _planted() -> None:\n"
                     "    from ..collectives import auto  # noqa: F401\n")
    run = lint_imports(tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "gradcomm.comm.state -> gradcomm.collectives.auto" in run.stdout
