"""Same bytes: the threads part of bench/golden.py against the recorded digests.

The full comparison (mpirun and gloo at p = 2..8, the DDP hook) is
``python bench/golden.py check``; this runs the in-process part at a few rank counts so
that every commit of a refactor is held to the recorded bytes.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("golden", ROOT / "bench" / "golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)  # type: ignore[union-attr]
RECORDED = json.loads(golden.FILE.read_text())


def _differ(group: str, got: dict[str, str]) -> list[str]:
    return golden.differences(group, got, RECORDED)[0]


@pytest.mark.parametrize("p", [2, 3, 5])
def test_threads_outputs_match_the_recorded_bytes(p: int) -> None:
    bad = _differ(f"threads/{p}", golden.threads(p))
    assert not bad, f"{len(bad)} cases changed bytes, e.g. {bad[:8]}"


def test_payloads_match_the_recorded_bytes() -> None:
    bad = _differ("payloads", golden.payloads())
    assert not bad, f"{len(bad)} payloads changed bytes, e.g. {bad[:8]}"


def test_every_wire_and_rank_count_was_recorded() -> None:
    groups = set(RECORDED) - {golden.MACHINE}
    want = {f"{w}/{p}" for w in ("threads", "mpi", "gloo") for p in golden.PS}
    want |= {f"ddp/{p}" for p in golden.DDP_PS} | {"payloads"}
    assert want <= groups, sorted(want - groups)
    assert any(k.startswith("codec/topk/ring/") for k in RECORDED["mpi/8"])


def test_only_blas_bound_digests_are_excused_on_another_machine() -> None:
    rec = {"g": {"codec/powersgd/x": "a", "codec/topk/x": "b"}, golden.MACHINE: {"g": "elsewhere"}}
    got = {"codec/powersgd/x": "A", "codec/topk/x": "B", "codec/int8/new": "c"}
    assert golden.differences("g", got, rec) == (["codec/int8/new", "codec/topk/x"], 1)
    rec[golden.MACHINE]["g"] = golden.machine("g")
    assert golden.differences("g", got, rec) == (
        ["codec/int8/new", "codec/powersgd/x", "codec/topk/x"], 0)


def test_a_ddp_group_is_excused_whole_on_another_machine() -> None:
    rec = {"ddp/2": {"ddp/int8/ring": "a"}, golden.MACHINE: {"ddp/2": "elsewhere"}}
    got = {"ddp/int8/ring": "A"}
    assert golden.differences("ddp/2", got, rec) == ([], 1)
    rec[golden.MACHINE]["ddp/2"] = golden.machine("ddp/2")
    assert golden.differences("ddp/2", got, rec) == (["ddp/int8/ring"], 0)
