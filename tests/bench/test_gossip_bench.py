"""gradcomm.bench.gossip: gossip rounds next to allreduce, in the bench's row format."""

from __future__ import annotations

import pytest

from gradcomm.bench.gossip import gossip_rows
from gradcomm.bench.sweep import Row
from gradcomm.comm import run_ranks

pytestmark = pytest.mark.timeout(60)


def test_rows_format_traffic_and_correctness():
    rows = run_ranks(4, lambda t: gossip_rows(t, [64, 40000], ["ring", "exponential",
                                                                 "complete"], 3), timeout=30)
    assert rows[1:] == [[], [], []]                   # rows on rank 0 only
    rows = rows[0]
    fields = set(Row(0, 0, "float32", "mean", "", None, None, "").to_dict())
    assert all(set(r) == fields for r in rows)
    assert [r["label"] for r in rows] == ["allreduce:auto", "gossip:ring", "gossip:exponential",
                                          "gossip:complete"] * 2
    for r in rows:
        assert r["wrong"] == 0 and r["note"] == ""
        assert r["min_us"] <= r["avg_us"] <= r["max_us"]
        if r["algorithm"] == "gossip":
            deg = {"ring": 2, "exponential": 1, "complete": 3}[r["extra"]["topology"]]
            assert r["extra"]["degree"] == deg
            assert r["messages"] == deg and r["wire_bytes"] == deg * r["size"]
            assert r["extra"]["vs_allreduce"] > 0
    assert rows[0]["size"] == 64 and rows[0]["count"] == 16


def test_topology_that_does_not_fit_gets_a_note():
    rows = run_ranks(5, lambda t: gossip_rows(t, [4096], ["torus", "ring"], 2,
                                              dtype="float64"), timeout=30)[0]
    torus = next(r for r in rows if r["label"] == "gossip:torus")
    assert "do not fit" in torus["note"] and torus["avg_us"] is None
    ring = next(r for r in rows if r["label"] == "gossip:ring")
    assert ring["wrong"] == 0 and ring["count"] == 512
