"""bench/train.py: what a gc variant passes to make_comm_hook."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import train  # noqa: E402  (bench/train.py)

ARGS = argparse.Namespace(hook_transport="torch")


def test_every_gc_codec_compresses_from_the_first_step():
    # the timed steps follow --warmup untimed ones: a codec that started compressing at
    # the first timed step compiled its kernels inside them (bench/RESULTS.md, 12-06)
    for codec in ("fp16", "int8", "onebit", "topk:ratio=0.001", "randomk", "powersgd"):
        name, kw = train.hook_options(train.parse_variant(f"gc-{codec}"), ARGS)
        assert kw["start_iter"] == 0 and kw["error_feedback"] is True, (codec, kw)


def test_a_variant_keeps_its_own_start_iter_and_transport():
    _, kw = train.hook_options(train.parse_variant("gc-topk:start_iter=150;ef=0"),
                               argparse.Namespace(hook_transport="mpi"))
    assert kw == {"start_iter": 150, "error_feedback": False, "transport": "mpi"}
