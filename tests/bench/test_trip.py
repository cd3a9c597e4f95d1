"""The bucket's trip (bench/trip.py) on 2 real gloo ranks: the collective never calls back
into the hook, and the trip stays within the files it needs.

The bounds are what the redesign reaches (issue 11; the arithmetic is in bench/trip.py's
report and bench/RESULTS.md): int8 with ``algorithm="auto"`` (allgather at p = 2) and
topk on the per-hop ring, the two ways a compressed bucket travels.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests._launch import torchrun  # noqa: E402

TRIP = Path(__file__).resolve().parents[2] / "bench" / "trip.py"
#: most distinct gradcomm files per configuration: the bucket's own trip (guard off:
#: measured 20 and 27), and with the divergence guard's per-bucket agreement (on by
#: default: compressed/guard.py and a small dense allreduce, 7 files more: 27, 31)
BOUNDS = {"int8:auto:guard=false": 20, "topk:ring:guard=false": 27, "int8:auto": 27,
          "topk:ring": 31}


@pytest.mark.timeout(150)
def test_a_bucket_never_climbs_back_into_the_hook_during_the_collective():
    run = torchrun(TRIP, 2, *BOUNDS, timeout=140)
    results = run.results(2)
    for r in results:
        for cfg, bound in BOUNDS.items():
            trip = r["trips"][cfg]
            where = f"rank {r['rank']} {cfg}"
            assert trip["climbs"] == [], f"{where}: {trip['climbs'][:5]}"
            assert trip["n"] <= bound, f"{where}: {trip['n']} files: {trip['files']}"
            assert set(trip["data"]) <= set(trip["files"]) and trip["n_data"] > 0, where
            assert "error_feedback.py" in trip["files"], where     # its store was used
            assert "compressed/allreduce.py" not in trip["files"], where   # planned route
            assert not any(f.startswith(("compressed/auto", "collectives/costmodel"))
                           for f in trip["files"]), where           # decided once
