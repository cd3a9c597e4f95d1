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
#: most distinct gradcomm files per configuration: the bucket's own trip (guard off),
#: and with the divergence guard (on by default: compressed/guard.py; the residual norm
#: is tallied by the store with kernels its layout chose once). int8 runs the gathered
#: route its plan laid out (compressed/planned.py: no frames, payload, seeds, option or
#: kernel-choice files per bucket; the guard's flags ride on its frames, no agreement of
#: their own): 14 and 15 files; topk on the per-hop ring (not planned) 28 and 32
BOUNDS = {"int8:auto:guard=false": 14, "topk:ring:guard=false": 28, "int8:auto": 15,
          "topk:ring": 32}
#: files on the data path (functions given the bucket's arrays, bytes or payloads)
DATA = {"int8:auto:guard=false": 12, "int8:auto": 13}
#: most distinct files on the call stacks when the transport is entered (hook -> wire,
#: the rule's 8), united over the trip: measured 6 (int8, allgather, with the guard or
#: without: its flags travel in the frames) and 7 (topk, ring: comm/torch_dist.py too);
#: no single stack holds more than 6 (SPINE_ONE)
SPINE = {"int8:auto:guard=false": 6, "topk:ring:guard=false": 7, "int8:auto": 6}
SPINE_ONE = 6
#: the same trips on a model of 16 parameters instead of 4 (layers=8): a bucket enters
#: arrays/ and the residual store (error_feedback/) as often (4 and 4 times, int8), not
#: per parameter
WIDE = {cfg: cfg + ":layers=8" for cfg in ("int8:auto:guard=false", "topk:ring:guard=false")}


@pytest.mark.timeout(150)
def test_a_bucket_never_climbs_back_into_the_hook_during_the_collective():
    run = torchrun(TRIP, 2, *BOUNDS, *WIDE.values(), timeout=140)
    results = run.results(2)
    for r in results:
        for cfg, bound in SPINE.items():
            trip, where = r["trips"][cfg], f"rank {r['rank']} {cfg}"
            assert trip["n_spine"] <= bound, f"{where}: spine {trip['spine']}"
            assert trip["spine_max"] <= SPINE_ONE, f"{where}: {trip['spine_max']}"
            assert "comm/base.py" in trip["spine"] and \
                "integrations/ddp/worker.py" in trip["spine"], f"{where}: {trip['spine']}"
        for cfg, bound in DATA.items():
            trip = r["trips"][cfg]
            assert trip["n_data"] <= bound, f"rank {r['rank']} {cfg}: {trip['data']}"
            assert "compressed/planned.py" in trip["files"] and not {
                "compressed/frames.py", "compressors/payload.py", "compressors/base.py",
                "compressed/seeds.py", "compressors/_kernels/__init__.py"} & set(
                trip["files"]), trip["files"]                   # the layout's plan ran
        guarded = r["trips"]["int8:auto"]["files"]            # the guard's route planned
        assert "compressed/guard.py" in guarded and not {
            "collectives/__init__.py", "collectives/auto.py"} & set(guarded), guarded
        for cfg, wide in WIDE.items():
            trip, wider = r["trips"][cfg], r["trips"][wide]
            where = f"rank {r['rank']} {cfg}"
            assert trip["buckets"] == wider["buckets"] == 1, where
            assert wider["entries"] == trip["entries"], \
                f"{where}: entries per bucket {trip['entries']}, 16 parameters {wider['entries']}"
        for cfg, bound in BOUNDS.items():
            trip = r["trips"][cfg]
            where = f"rank {r['rank']} {cfg}"
            assert trip["climbs"] == [], f"{where}: {trip['climbs'][:5]}"
            assert trip["n"] <= bound, f"{where}: {trip['n']} files: {trip['files']}"
            assert set(trip["data"]) <= set(trip["files"]) and trip["n_data"] > 0, where
            assert "error_feedback/keyed.py" in trip["files"], where   # its store was used
            assert "compressed/allreduce.py" not in trip["files"], where   # planned route
            assert not any(f.startswith(("compressed/auto", "collectives/costmodel"))
                           for f in trip["files"]), where           # decided once
