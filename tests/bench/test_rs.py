"""Reduce-scatter rows of the microbenchmark (``--collective reduce_scatter``): real ranks
(threads, mpirun), every timed call checked (dense: the exact sum's shard; compressed:
bitwise against the replay), wire bytes as the alpha-beta table says, planted faults
counted as wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.bench import launch
from gradcomm.bench.cli import main
from gradcomm.bench.sweep import Plan, Variant, sweep
from gradcomm.comm import run_ranks
from gradcomm.compressed.reduce_scatter import wire_bytes

ROOT = Path(__file__).resolve().parents[2]


def _rs(argv: list[str], out: Path) -> tuple[int, dict]:
    code = main(["--transport", "threads", "--collective", "reduce_scatter", "--no-progress",
                 "--json", str(out), *argv])
    return code, json.loads(out.read_text())


@pytest.mark.timeout(120)
def test_rows_on_three_ranks_with_uneven_and_empty_shards(tmp_path, capsys):
    # 4 B: one element on 3 ranks (two empty shards); 100 B: 25 elements (9, 8, 8)
    code, doc = _rs(["--np", "3", "--sizes", "4,100,4K", "--iters", "3", "--warmup", "1",
                     "--rounds", "2", "--compressors", "none,int8,topk:ratio=0.1"],
                    tmp_path / "r.json")
    text = capsys.readouterr().out
    assert code == 0, text
    assert doc["benchmark"] == "gradcomm.bench reduce_scatter"
    assert doc["config"]["collective"] == "reduce_scatter"
    labels = {r["label"] for r in doc["rows"]}
    assert labels == {"ring", "auto", "ring+int8", "alltoall+int8", "auto+int8",
                      "ring+int8+ef", "alltoall+int8+ef", "auto+int8+ef",
                      "ring+topk,ratio=0.1", "alltoall+topk,ratio=0.1", "auto+topk,ratio=0.1",
                      "ring+topk,ratio=0.1+ef", "alltoall+topk,ratio=0.1+ef",
                      "auto+topk,ratio=0.1+ef"}
    assert len(doc["rows"]) == 3 * len(labels)
    for r in doc["rows"]:
        assert r["note"] == "" and r["wrong"] == 0, r
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 / 3)
        if r["compressor"] is not None:
            assert r["rel_err"] is not None and r["rel_err"] > 0
            if r["size"] == 4096:          # vs the dense ring's (or auto's) bytes
                assert r["extra"]["compression_ratio"] > 1, r
    assert "reduce_scatter float32 sum, 3 ranks" in text and "busbw = algbw*(p-1)/p" in text
    assert "target" not in doc["summary"].get("latency", {})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("p", [2, 3])
def test_wire_bytes_are_the_routes_table(p):
    """Without the argument check, a compressed row's bytes per rank are the module's
    table (``wire_bytes``), averaged over the ranks; a dense ring's are (p-1)/p of it."""
    n = 1000
    vs = [Variant(a, "int8", check=False) for a in ("ring", "alltoall")] + \
        [Variant("ring", check=False)]
    plan = Plan(sizes=[4 * n], variants=vs, iters=2, warmup=0, rounds=1,
                collective="reduce_scatter")
    rows = run_ranks(p, lambda t: sweep(t, plan))[0]
    codec = compressors.get("int8")
    for r, v in zip(rows[:2], vs):
        want = np.mean([wire_bytes(codec, n, p, q, "float32", v.algorithm) for q in range(p)])
        assert r.wrong == 0 and r.wire_bytes == pytest.approx(want), r.label
    dense = rows[2]          # every segment but its own: n - m_r elements per rank
    assert dense.wrong == 0 and dense.wire_bytes == pytest.approx(4 * n * (p - 1) / p)


def _plant(monkeypatch, fault: str) -> None:
    if fault == "decode_zeros":                 # the codec's decoder returns zeros
        from gradcomm.compressors.int8 import Int8Compressor

        real = Int8Compressor.decompress

        def zeros(self, payload, out=None, add=False):
            if add:
                return out
            res = real(self, payload, out=out)
            res[...] = 0
            return res
        monkeypatch.setattr(Int8Compressor, "decompress", zeros)
    elif fault == "ring_segment":               # the dense ring misplaces part of a shard
        from gradcomm.collectives import reduce_scatter as rsmod

        real_ring = rsmod.ring

        def ring(t, buf, red, **kw):
            real_ring(t, buf, red, **kw)
            lo, hi = rsmod.shard_bounds(buf.size, t.size, t.rank)
            buf[lo:lo + 8] = buf[hi - 16:hi - 8]
        monkeypatch.setattr(rsmod, "ring", ring)
    elif fault == "alltoall_no_residual":       # the all-to-all forgets error feedback
        from gradcomm.compressed import reduce_scatter as crs

        real_a2a = crs.alltoall
        monkeypatch.setattr(crs, "alltoall",
                            lambda t, x, codec, seeds, e, scratch=None, **kw:
                            real_a2a(t, x, codec, seeds, None, scratch, **kw))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", ["none", "decode_zeros", "ring_segment",
                                   "alltoall_no_residual"])
def test_planted_faults_are_wrong_and_exit_nonzero(fault, monkeypatch, tmp_path):
    _plant(monkeypatch, fault)
    code, doc = _rs(["--np", "3", "--sizes", "4K", "--iters", "3", "--warmup", "1",
                     "--rounds", "2", "--compressors", "none,int8"], tmp_path / "f.json")
    wrong = {r["label"]: r["wrong"] for r in doc["rows"]}
    if fault == "none":
        assert code == 0 and not any(wrong.values()), wrong
        return
    culprits = {"decode_zeros": {"ring+int8", "alltoall+int8", "auto+int8", "ring+int8+ef",
                                 "alltoall+int8+ef", "auto+int8+ef"},
                "ring_segment": {"ring", "auto"},
                "alltoall_no_residual": {"alltoall+int8+ef", "auto+int8+ef"}}[fault]
    assert code == 1 and {k for k, v in wrong.items() if v} == culprits, wrong


def _env() -> dict[str, str]:
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    for k in launch.MPI_ENV + ("RANK", "WORLD_SIZE"):
        env.pop(k, None)
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.mark.timeout(120)
def test_mpirun_rows_against_mpi_reduce_scatter(tmp_path):
    out = tmp_path / "m.json"
    mpiexec = launch.find_mpiexec()
    assert mpiexec, "mpiexec and mpi4py are part of the test environment"
    p = subprocess.run([mpiexec, "-n", "2", "--oversubscribe", sys.executable, "-m",
                        "gradcomm.bench", "--collective", "reduce_scatter", "--sizes", "100,4K",
                        "--iters", "2", "--warmup", "1", "--compressors", "none,fp16",
                        "--no-progress", "--json", str(out)],
                       capture_output=True, text=True, timeout=100, env=_env(), cwd=ROOT)
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    base = [r for r in doc["rows"] if r["algorithm"] == "MPI_Reduce_scatter"]
    assert len(base) == 2 and all(r["wrong"] == 0 and r["note"] == "" for r in base)
    assert all(r["wrong"] == 0 for r in doc["rows"])
    assert doc["summary"]["reference"] == "MPI_Reduce_scatter"
