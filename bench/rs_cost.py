"""Codec cost per element: the FSDP2 path against the DDP hook, one interleaved run.

On 2 in-process ranks (threads: the wire is a memory copy, so what is timed is the codec
work plus the copies each path makes), float32, error feedback on, for each codec:

- ``fsdp``: :class:`gradcomm.integrations.fsdp.comm.CompressedReduceScatter`, the object
  ``compress_fsdp`` installs, called as FSDP2 calls it (a flat gradient, ``op=AVG``);
  ``fsdp:alltoall`` / ``fsdp:ring`` pin the route (``auto`` = alltoall);
- ``ddp``: the DDP hook's per-bucket work (``make_comm_hook``'s state reducing one bucket
  on its transport: ``Routes.reduce``, the route ``auto`` picks, per-parameter residuals).

The variants take turns (``--rounds`` rounds of ``--calls`` calls each, after one warm-up
call); per variant: the median over rounds of the slowest rank's mean call time, ns per
element of the gradient, and the ratio to ``ddp`` of the same codec and run, with the
spread of the per-round ratios.

    python bench/rs_cost.py [--n 4194304] [--codecs int8,topk:ratio=0.01] [--rounds 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from gradcomm.bench.plan import parse_compressor
from gradcomm.comm import run_ranks
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.integrations.ddp import make_comm_hook
from gradcomm.integrations.fsdp.comm import CompressedReduceScatter
from gradcomm import compressors


def _fsdp(t, codec, opts, alg, x):
    rs = CompressedReduceScatter(compressors.get(codec, **opts), ef=ErrorFeedback(),
                                 key="w", algorithm=alg, side_group=t)
    out = torch.empty(x.numel() // t.size)

    def call():
        rs(out, x.clone(), None, dist.ReduceOp.AVG)
    return call, lambda: None


def _ddp(t, codec, opts, x):
    # every call compressed (not start_iter="auto"'s dense warm-up): the same work as fsdp's
    state, _ = make_comm_hook(codec, transport=t, **{"start_iter": 0, **opts})
    n = x.numel()

    def call():
        state._reduce(x.clone(), ["w"], [n])
    return call, state.close


def _rank(t, n, variants, rounds, calls):
    torch.set_num_threads(1)
    x = torch.from_numpy(np.random.default_rng(t.rank).standard_normal(n)
                         .astype(np.float32))
    made = []
    for label, codec, opts, kind in variants:
        made.append(_fsdp(t, codec, opts, kind, x) if kind != "ddp" else
                    _ddp(t, codec, opts, x))
    for call, _ in made:
        call()                                   # warm-up: buffers, codec kernels
    times = [[0.0] * rounds for _ in variants]
    for r in range(rounds):
        for i, (call, _) in enumerate(made):
            t.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                call()
            times[i][r] = (time.perf_counter() - t0) / calls
    for _, close in made:
        close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 22)
    ap.add_argument("--codecs", default="int8,topk:ratio=0.01")
    ap.add_argument("--routes", default="auto,alltoall",
                    help="FSDP routes to time next to the DDP hook (auto, alltoall, ring)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args()
    variants = []
    for spec in a.codecs.split(","):
        name, opts = parse_compressor(spec)
        o = dict(opts)
        variants.append((f"{spec} ddp", name, o, "ddp"))
        for route in a.routes.split(","):
            variants.append((f"{spec} fsdp:{route}", name, o, route))
    load0 = os.getloadavg()[0]
    per_rank = run_ranks(2, lambda t: _rank(t, a.n, variants, a.rounds, a.calls),
                         timeout=3600)
    slowest = np.max(np.array(per_rank), axis=0)          # [variant][round]
    print(f"# codec cost per element: n={a.n} float32, 2 threads ranks, error feedback on, "
          f"{a.rounds} interleaved rounds x {a.calls} calls; load {load0:.2f} -> "
          f"{os.getloadavg()[0]:.2f}")
    base = {}
    for i, (label, name, _, kind) in enumerate(variants):
        if kind == "ddp":
            base[label.rsplit(" ", 1)[0]] = i
    for i, (label, *_rest) in enumerate(variants):
        m = statistics.median(slowest[i])
        b = base[label.rsplit(" ", 1)[0]]
        ratios = slowest[i] / slowest[b]
        print(f"{label:32s} {1e3 * m:8.2f} ms/call {1e9 * m / a.n:7.2f} ns/elem  "
              f"{statistics.median(ratios):5.2f}x ddp (rounds {ratios.min():.2f}-"
              f"{ratios.max():.2f})")


if __name__ == "__main__":
    main()
