"""Interleaved timing of compressed allreduce variants (and, optionally, a baseline tree).

On a shared machine, rows measured one after the other (``gradcomm.bench``) drift with
the load; here every variant runs once per round, round after round, so all of them see
the same load, and each is reported as min and median of the slowest rank's time and as
a ratio to the first variant's median. Run under mpirun (or netns.py)::

    mpirun -n 2 python bench/compressed_ab.py --count 4194304 --iters 12 \\
        dense/auto fp16/auto int8/auto onebit/auto topk:ratio=0.01/auto
    # against another version of gradcomm (a source tree, e.g. from git archive):
    git archive <commit> | tar -x -C /tmp/base
    mpirun -n 2 python bench/compressed_ab.py --baseline /tmp/base --count 4194304 \\
        new:dense/auto base:dense/auto new:fp16/auto base:fp16/auto

A variant is ``[new:|base:]codec[:key=value...]/algorithm`` (``dense``: no compressor).
The options ``ef=1`` and ``guard=0|1`` time a stateful ``gradcomm.Allreduce(op="sum",
error_feedback=True, guard=...)`` (one per variant, one key) instead of the stateless
call, e.g. ``onebit:ef=1:guard=1/auto onebit:ef=1:guard=0/auto`` for the divergence
guard's cost, ``out=1`` writes each call's result into an ``out=`` array kept for the
variant (as ``MPI_Allreduce``'s recvbuf; without it every call returns a new array), and
``pipe=0|1`` sets ``GRADCOMM_PIPELINE`` for that variant's calls only
(the pipelined compressed ring off or forced), and ``chunk=BYTES`` sets
``gradcomm.compressed.routes.CHUNK_BYTES`` (the compressed message of the per-hop ring
and tree) and ``span=BYTES`` its ``MAX_SPAN_BYTES`` (the most dense bytes one message
covers) likewise. float32 sum of Gaussian data; other settings (and
``GRADCOMM_PIPELINE`` for variants without ``pipe=``) come from the environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--count", type=int, default=1 << 22, help="float32 elements")
    ap.add_argument("--iters", type=int, default=12)
    ap.add_argument("--baseline", default=None, help="a gradcomm source tree (its root)")
    args = ap.parse_args()

    from mpi4py import MPI

    import gradcomm
    from gradcomm.bench._util import number

    mods = {"new": gradcomm}
    if args.baseline:
        tmp = tempfile.mkdtemp(prefix="gradcomm-ab-")
        shutil.copytree(os.path.join(args.baseline, "gradcomm"),
                        os.path.join(tmp, "gradcomm_baseline"))
        sys.path.insert(0, tmp)
        import gradcomm_baseline  # noqa: F401 - relative imports inside

        mods["base"] = gradcomm_baseline
    world = MPI.COMM_WORLD
    comms = {name: world.Dup() for name in mods}
    x = np.random.default_rng(world.rank).standard_normal(args.count).astype(np.float32)

    def parse(spec: str) -> Callable[[], Any]:
        head, sep, tail = spec.partition(":")
        pkg, rest = (head, tail) if sep and head in mods else ("new", spec)
        codec, alg = rest.rsplit("/", 1)
        name, *kv = codec.split(":")
        opts = {k: number(v) for k, v in (s.split("=", 1) for s in kv)}
        comp = None if name == "dense" else name
        mod, comm = mods[pkg], comms[pkg]
        pipe = opts.pop("pipe", None)
        chunk = opts.pop("chunk", None)
        span = opts.pop("span", None)
        out = np.empty_like(x) if opts.pop("out", 0) else None
        if opts.pop("ef", 0):
            ar = mod.Allreduce(comm, op="sum", algorithm=alg, compressor=comp,
                               error_feedback=True, guard=bool(opts.pop("guard", 1)), **opts)
            assert type(ar).__module__.startswith(mod.__name__ + "."), \
                f"{spec}: {type(ar).__module__} is not {pkg}'s code"
            call = (lambda: ar(x, key="x")) if out is None else \
                (lambda: ar(x, key="x", out=out))
        else:
            kept = {} if out is None else {"out": out}
            call = lambda: mod.allreduce(  # noqa: E731
                x, comm, algorithm=alg, compressor=comp, **kept, **opts)
        if pipe is None and chunk is None and span is None:
            return call
        routes = mod.compressed.routes

        def patched() -> Any:
            old, old_chunk = os.environ.get("GRADCOMM_PIPELINE"), routes.CHUNK_BYTES
            old_span = routes.MAX_SPAN_BYTES
            if span is not None:
                routes.MAX_SPAN_BYTES = int(span)
            if pipe is not None:
                os.environ["GRADCOMM_PIPELINE"] = str(int(pipe))
            if chunk is not None:
                routes.CHUNK_BYTES = int(chunk)
            try:
                return call()
            finally:
                routes.CHUNK_BYTES, routes.MAX_SPAN_BYTES = old_chunk, old_span
                if old is None:
                    os.environ.pop("GRADCOMM_PIPELINE", None)
                else:
                    os.environ["GRADCOMM_PIPELINE"] = old
        return patched

    calls = [parse(s) for s in args.variants]
    for call in calls:
        call()
        call()
    times = np.zeros((len(calls), args.iters))
    for i in range(args.iters):
        for j, call in enumerate(calls):
            world.Barrier()
            t0 = time.perf_counter()
            call()
            worst = np.array([time.perf_counter() - t0])
            world.Allreduce(MPI.IN_PLACE, worst, op=MPI.MAX)
            times[j, i] = worst[0]
    if world.rank == 0:
        load = os.getloadavg() if hasattr(os, "getloadavg") else ()
        print(f"# {world.size} ranks, {args.count} float32, {args.iters} rounds, load "
              f"{' '.join(f'{v:.2f}' for v in load)}; ms of the slowest rank")
        ref = np.median(times[0])
        for spec, row in zip(args.variants, times):
            print(f"{spec:40s} min {row.min() * 1e3:9.2f}  p50 {np.median(row) * 1e3:9.2f}"
                  f"  p50/first {np.median(row) / ref:5.2f}")


if __name__ == "__main__":
    main()
