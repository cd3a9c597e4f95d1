"""Codec cost of a compressed reduce-scatter vs a compressed allreduce of the same buffer.

On 2 in-process ranks (threads: the wire costs a memory copy, so the codec work is what is
timed), float32, error feedback on: gradcomm's reduce-scatter routes (alltoall, ring) and
the compressed allreduce routes the DDP hook takes (allgather, ring); the variants take
turns, 7 rounds of 5 calls; prints the median seconds per call (slowest rank), ns per
element of the buffer, and the ratio to the allreduce's allgather route.

    python bench/rs_cost.py [n=4194304] [codec=int8]
"""
import os
import statistics
import sys
import time

import numpy as np
from gradcomm.comm import run_ranks
from gradcomm.compressed import compressed_allreduce
from gradcomm.compressed.reduce_scatter import compressed_reduce_scatter
from gradcomm.error_feedback import ErrorFeedback

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 22
codec = sys.argv[2] if len(sys.argv) > 2 else "int8"
reps = 7
variants = [("rs alltoall", "rs", "alltoall"), ("rs ring", "rs", "ring"),
            ("allreduce allgather", "ar", "allgather"), ("allreduce ring", "ar", "ring")]
def fn(t, kind, alg, iters=5):
    x = np.random.default_rng(t.rank).standard_normal(n).astype(np.float32)
    ef = ErrorFeedback()
    out = []
    for i in range(iters + 1):
        b = x.copy()
        t0 = time.perf_counter()
        if kind == "rs":
            compressed_reduce_scatter(t, b, "float32", op="mean", algorithm=alg, compressor=codec, residuals=ef, key="w", check=False)
        else:
            compressed_allreduce(t, b, "float32", op="mean", algorithm=alg, compressor=codec, residuals=ef, key="w", check=False)
        if i:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)
res = {v[0]: [] for v in variants}
for r in range(reps):
    for name, kind, alg in variants:
        res[name].append(max(run_ranks(2, lambda t: fn(t, kind, alg), timeout=300)))
print(f"# codec cost, {codec}, n={n} float32, 2 threads ranks, EF on, {reps} interleaved repeats x 5 calls; load {os.getloadavg()[0]:.2f}")
base = statistics.median(res["allreduce allgather"])
for name, _, _ in variants:
    m = statistics.median(res[name])
    print(f"{name:22s} {1e3*m:8.2f} ms/call {1e9*m/n:7.2f} ns/elem  {m/base:5.2f}x of allreduce allgather")
