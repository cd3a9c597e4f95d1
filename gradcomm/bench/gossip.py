"""Gossip rounds next to an allreduce of the same size: the per-round cost ratio.

For each size, one row per topology (one :func:`gradcomm.gossip_average` round, without
the cross-rank check, as a training loop would run it after its first round) and one row
for ``gradcomm.allreduce(..., algorithm="auto")``, measured the way
:func:`gradcomm.bench.sweep.sweep` measures (barrier before each timed call, per-rank
``perf_counter``, OSU's avg/min/max of per-rank means, p50/p95 of the slowest rank).
Gossip rows carry ``extra = {"topology", "degree", "vs_allreduce"}``: the neighbours per
round and the p50 time relative to the allreduce row of the same size. ``#wrong`` counts
elements further than a few units in the last place from ``W·X`` computed in float64.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> rows = run_ranks(4, lambda t: gossip_rows(t, [4096], ["ring", "exponential"], 3))[0]
    >>> [(r["label"], r["count"], r["wire_bytes"], r["wrong"]) for r in rows]
    [('allreduce:auto', 1024, 8192.0, 0), ('gossip:ring', 1024, 8192.0, 0), ('gossip:exponential', 1024, 4096.0, 0)]
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from .._dtypes import storage
from ..collectives import topologies
from ..collectives.gossip import gossip_average
from ..comm.base import Transport
from ..errors import GradcommError
from . import data
from ._util import gather, user_array
from .sweep import Plan, Row, Variant, iterations, sweep

#: tolerance of the #wrong check, in units of the dtype's epsilon (inputs are -2..2)
_ULPS = 8


def gossip_rows(transport: Transport, sizes: Sequence[int], topologies_: Sequence[str],
                iters: int, *, dtype: str = "float32", warmup: int = 2) -> list[dict[str, Any]]:
    """Rows (dicts, the bench CLI's format) on rank 0; other ranks return ``[]``.

    For each size in bytes: the allreduce row, then one gossip row per topology (a
    topology that does not fit the rank count gives a row with a ``note``).
    """
    t = transport
    itemsize = storage(dtype).itemsize
    out: list[dict[str, Any]] = []
    for size in sizes:
        count = size // itemsize
        if count <= 0:
            continue
        plan = Plan(sizes=[count * itemsize], variants=[Variant("auto", check=False)],
                    dtype=dtype, op="mean", iters=iters, warmup=warmup, min_iters=1)
        ref = sweep(t, plan)
        base = ref[0] if ref else None
        if base is not None:
            base.label = "allreduce:auto"
            out.append(base.to_dict())
        for name in topologies_:
            row = _gossip_row(t, name, count, dtype, plan)
            if row is not None:
                if base is not None and base.p50_us and row.p50_us is not None:
                    row.extra["vs_allreduce"] = row.p50_us / base.p50_us
                out.append(row.to_dict())
    return out


def _gossip_row(t: Transport, name: str, count: int, dtype: str, plan: Plan) -> Row | None:
    size = count * storage(dtype).itemsize
    iters, warmup = iterations(size, plan)
    row = Row(size, count, dtype, "mean", "gossip", None, False, f"gossip:{name}", iters,
              warmup)
    try:
        topo = topologies.get(name, t.size)
    except GradcommError as exc:                  # the same on every rank
        row.note = f"unsupported: {exc}"
        return row if t.rank == 0 else None
    row.extra.update(topology=topo.key,
                     degree=max(len(topo.recv_from(t.rank, s)) for s in range(topo.period)))
    x = user_array(data.exact_input(t.rank, count, dtype, "sum"), dtype)
    step = 0
    for _ in range(warmup):
        gossip_average(x, t, topology=topo, step=step, check=False)
        step += 1
    st = t.stats
    times = np.empty(iters)
    wire = msgs = wrong = 0
    for i in range(iters):
        t.barrier()
        b, m = st.bytes_sent, st.messages_sent
        t0 = time.perf_counter()
        y = gossip_average(x, t, topology=topo, step=step, check=False)
        times[i] = time.perf_counter() - t0
        wire += st.bytes_sent - b
        msgs += st.messages_sent - m
        if i == iters - 1:
            wrong = _wrong(t, topo, step, y, count, dtype)
        step += 1
    table = gather(t, np.concatenate([times, [wire / iters, msgs / iters, wrong]]))
    if table is None:
        return None
    per_rank = table[:, :iters].mean(axis=1)
    slowest = table[:, :iters].max(axis=0)
    p50 = float(np.median(slowest))
    row.avg_us, row.min_us, row.max_us = (float(v) * 1e6 for v in
                                          (per_rank.mean(), per_rank.min(), per_rank.max()))
    row.p50_us = p50 * 1e6
    row.p95_us = float(np.percentile(slowest, 95)) * 1e6
    row.algbw_gbs = size / p50 / 1e9 if p50 > 0 else None
    row.wire_bytes = float(table[:, iters].mean())
    row.messages = float(table[:, iters + 1].mean())
    row.wrong = int(table[:, iters + 2].sum())
    return row


def _host(y: Any) -> np.ndarray:
    from .. import arrays

    return y if isinstance(y, np.ndarray) else arrays.host_view(y)


def _wrong(t: Transport, topo: topologies.Topology, step: int, y: Any, count: int,
           dtype: str) -> int:
    """Elements of this rank's result further than ``_ULPS`` epsilons from W·X."""
    ref = np.zeros(count)
    for j, w in topo.row(t.rank, step):
        ref += w * data.as_float64(data.exact_input(j, count, dtype, "sum"), dtype)
    got = data.as_float64(_host(y), dtype)
    eps = {"float16": 2.0 ** -10, "bfloat16": 2.0 ** -7, "float32": 2.0 ** -23,
           "float64": 2.0 ** -52}[dtype]
    return int(np.count_nonzero(~(np.abs(got - ref) <= _ULPS * eps * (1 + np.abs(ref)))))


__all__ = ["gossip_rows"]
