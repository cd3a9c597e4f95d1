"""Issue 11's house rules for the package, checked so that they stay kept: no module of
``gradcomm/`` outside ``compressors/_kernels/`` over :data:`MAX_LINES` lines, and every
module's docstring says what it is for with a runnable example (``>>>``; the doctests
run them). The import contract is ``tests/test_layers.py``'s.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "gradcomm"
#: the issue's "about 500 lines" for a module outside the kernels
MAX_LINES = 500
#: modules whose docstring need not carry an example: ``python -m gradcomm.bench``'s shim
NO_EXAMPLE = {"bench/__main__.py"}


def modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_kernels" not in p.parts)


def test_there_are_modules_to_check() -> None:
    assert len(modules()) > 50


def test_no_module_outside_the_kernels_is_over_500_lines() -> None:
    long = {str(p.relative_to(PACKAGE)): n for p in modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these modules (lines): {long}"


def test_every_module_docstring_has_a_runnable_example() -> None:
    bare = [str(p.relative_to(PACKAGE)) for p in modules()
            if str(p.relative_to(PACKAGE)) not in NO_EXAMPLE
            and ">>>" not in (ast.get_docstring(ast.parse(p.read_text())) or "")]
    assert not bare, f"module docstrings without an example: {bare}"


def test_every_test_module_has_its_own_basename() -> None:
    """pytest's default ("prepend") import mode imports test files by basename, so a second
    ``test_x.py`` anywhere under ``tests/`` fails the whole collection, which a run of one
    folder does not show."""
    tests = Path(__file__).resolve().parent
    seen: dict[str, list[str]] = {}
    for p in tests.rglob("test_*.py"):
        seen.setdefault(p.name, []).append(str(p.relative_to(tests)))
    twice = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twice, f"rename one of each: {twice}"
