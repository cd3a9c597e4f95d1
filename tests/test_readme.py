"""The README's two commands are the ones CI and users run."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _line_after(text: str, marker: str) -> str:
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(marker))
    return lines[i + 1].strip()


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    command = _line_after(readme, "# 2. set up, then run the whole test suite")
    assert command == _line_after(ci, "# README-TEST-COMMAND")
    assert command.endswith("python -m pytest")


def test_readme_main_command_sets_up_the_same_way():
    readme = (ROOT / "README.md").read_text()
    main = _line_after(readme, "#    and a short demo of every compressor")
    test = _line_after(readme, "# 2. set up, then run the whole test suite")
    setup = test.removesuffix("python -m pytest")
    assert main.startswith(setup) and "python -m gradcomm.bench" in main
