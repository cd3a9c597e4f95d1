"""The measurement itself: every rank runs :func:`sweep` with the same plan (its
variants, rows and arithmetic are in :mod:`.rows`, whose names import from here too).

For each size every variant is set up and warmed up, then the variants take turns over
``rounds`` rounds of timed calls (a barrier before each, ``time.perf_counter`` on each
rank, as OSU does), so a slow phase of a shared machine lands on all of them alike. Rank
0 gathers the times and fills one :class:`Row` per (size, variant): OSU's avg/min/max,
nccl-tests' algbw/busbw, p50/p95 of the slowest rank, the spread over rounds. Every timed
call is checked outside the timer (dense rows against the exact result, compressed rows
bitwise against :func:`gradcomm.bench.replay.replay`, contractive codecs' round trips);
``#wrong`` counts the mismatching elements. ``bench/README.md`` ("What is measured")
describes the columns and the checks in full.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> plan = Plan(sizes=[64], variants=[Variant("recursive_doubling")], iters=2, warmup=1)
    >>> rows = run_ranks(2, lambda t: sweep(t, plan))[0]
    >>> (rows[0].size, rows[0].count, rows[0].wrong, rows[0].wire_bytes > 0)
    (64, 16, 0, True)
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from .. import arrays
from .._dtypes import storage
from ..collectives.costmodel import Profile
from ..comm.base import Transport
from ..errors import UnsupportedError
from . import data
from ._util import gather, user_array
from .rows import (LARGE, Baseline, Plan, Reporter, Row, Variant, bandwidths, iterations,
                   round_sizes)

#: compressors whose results are exact (checked against the exact expected values)
LOSSLESS = (None, "none")
#: the key every benchmark call uses (its crc32 seeds the stochastic codecs)
KEY = "default"


def sweep(t: Transport, plan: Plan, baseline: Baseline | None = None,
          reporter: Reporter | None = None, profile: Profile | None = None) -> list[Row]:
    """Measure every (size, variant) of ``plan`` on every rank; rows on rank 0 only.

    ``reporter`` (rank 0) gets progress and each row once its size is done. With a
    ``profile`` (the one the ranks agreed on) each dense row carries the model's
    prediction in ``extra["pred_us"]``.
    """
    itemsize = storage(plan.dtype).itemsize
    sizes = [s for s in plan.sizes if s // itemsize > 0]
    if reporter is not None:
        reporter.begin(len(sizes) * len(plan.variants))
    rows: list[Row] = []
    for size in sizes:
        count = size // itemsize
        inputs = _Inputs(t.size, count, plan.dtype, plan.op)
        runs = []
        for v in plan.variants:
            if reporter is not None:
                reporter.step(f"{_human(count * itemsize)} {v.label}: warm-up")
            runs.append(_Run(t, plan, v, count, baseline, inputs))
        per_round = round_sizes(runs[0].iters, plan.rounds) if runs else []
        for r, k in enumerate(per_round):
            for run in runs:
                if reporter is not None:
                    reporter.step(f"{_human(count * itemsize)} round {r + 1}/"
                                  f"{len(per_round)} {run.v.label}")
                run.timed(k, r)
        for run in runs:
            row = run.finish(len(per_round))
            if t.rank == 0:
                pred = predicted(t, profile, run.v, row.size, plan.dtype, plan.op) \
                    if plan.collective == "allreduce" else None
                if pred is not None and not row.note:
                    row.extra["pred_us"] = pred * 1e6
                rows.append(row)
                if reporter is not None:
                    reporter.row(row)
    return rows


def predicted(t: Transport, profile: Profile | None, v: Variant, size: int, dtype: str,
              op: str) -> float | None:
    """The model's seconds for one call of variant ``v`` (None: no profile, compressed,
    or a native allreduce the transport cannot do for this dtype). The baseline is the
    library's allreduce alone; gradcomm rows add the call overhead, the check and the
    input copy; ``auto`` is predicted for the algorithm it picks."""
    if profile is None or v.compressor is not None:
        return None
    base_op = "sum" if op == "mean" else op
    if v.baseline:
        alg = "native"
    elif v.algorithm == "auto":
        from ..collectives.auto import select

        alg = select(t, size, dtype, base_op, native=v.check or t.native_bounded)
    else:
        alg = v.algorithm
    if alg == "native" and not t.native_supports(dtype, base_op):
        return None
    if v.baseline:
        return profile.predict("native", size, t.size, dtype)
    return profile.call_time(alg, size, t.size, dtype, check=v.check, transport=t)


class _Inputs:
    """One size's inputs and references, shared by its variants (built when first asked):
    this rank's exact / Gaussian input, every rank's Gaussian input (for the replay), the
    exact dense result and the float64 Gaussian sum."""

    def __init__(self, p: int, count: int, dtype: str, op: str) -> None:
        self.p, self.count, self.dtype, self.op = p, count, dtype, op
        self._cache: dict[str, Any] = {}

    def _get(self, key: str, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def exact_input(self, rank: int) -> np.ndarray:
        return self._get(f"x{rank}", lambda: data.exact_input(rank, self.count, self.dtype,
                                                              self.op))

    def exact_result(self) -> np.ndarray:
        return self._get("exact", lambda: data.exact_result(self.p, self.count, self.dtype,
                                                            self.op))

    def gaussian_inputs(self) -> list[np.ndarray]:
        return self._get("g", lambda: [data.gaussian_input(r, self.count, self.dtype)
                                       for r in range(self.p)])

    def gaussian_result(self) -> np.ndarray:
        return self._get("gsum", lambda: data.gaussian_result(self.p, self.count,
                                                              self.dtype, self.op))


class _Run:
    """One variant at one size on this rank: its call, its checker, its timings."""

    def __init__(self, t: Transport, plan: Plan, v: Variant, count: int,
                 baseline: Baseline | None, inputs: _Inputs) -> None:
        self.t, self.plan, self.v, self.inputs = t, plan, v, inputs
        self.dtype, self.op = plan.dtype, plan.op
        self.rs = plan.collective == "reduce_scatter"
        size = count * storage(self.dtype).itemsize
        self.iters, self.warmup = iterations(size, plan)
        self.row = Row(size, count, self.dtype, self.op, v.algorithm, v.compressor,
                       None if v.baseline else v.check, v.label, self.iters, self.warmup,
                       error_feedback=v.error_feedback)
        self.exact = v.compressor in LOSSLESS
        self.times: list[float] = []
        self.round_of: list[int] = []
        self.wire = self.msgs = self.wrong = 0
        self.result: np.ndarray | None = None
        self.ar: Any = None
        self.stores: list[Any] = []
        x = inputs.exact_input(t.rank) if self.exact else inputs.gaussian_inputs()[t.rank]
        try:
            self.call = self._make_call(x, baseline)
            if not self.exact:
                self.wrong += self._codec_contract(x)
            for _ in range(self.warmup):
                self._checked(self.call, count_it=False)
        except UnsupportedError as exc:          # raised alike on every rank
            self.row.note = f"unsupported: {exc}"

    # -- the measured call -----------------------------------------------------------------
    def _make_call(self, x: np.ndarray, baseline: Baseline | None) -> Callable[[], Any]:
        t, v = self.t, self.v
        if v.baseline:
            if baseline is None or baseline.name != v.algorithm:
                raise UnsupportedError(f"no {v.algorithm} baseline on the {t.name} transport")
            return baseline.prepare(x, self.dtype, self.op)
        import gradcomm

        arr = user_array(x, self.dtype)
        if self.rs:
            from . import rs

            call, self.stores = rs.make_call(t, v, arr, self.dtype, self.op)
            return call
        options = dict(v.options)
        alg, comp, check, op = v.algorithm, v.compressor, v.check, self.op
        # the result goes where the baseline's does: into an array kept for the row
        out = None if self.plan.fresh_result else arrays.empty(arrays.meta_of(arr))
        if v.error_feedback:
            from ..error_feedback import ErrorFeedback

            self.ar = ar = gradcomm.Allreduce(t, op=op, algorithm=alg, compressor=comp,
                                              error_feedback=True, check=check, **options)
            # the replay's residual stores, one per rank, updated as each rank's is
            self.stores = [ErrorFeedback() for _ in range(t.size)]
            return lambda: ar(arr, key=KEY, out=out)
        return lambda: gradcomm.allreduce(arr, t, op=op, algorithm=alg, compressor=comp,
                                          check=check, out=out, **options)

    def _codec_contract(self, x: np.ndarray) -> int:
        """All ``n`` elements when this rank's codec round trip does not shrink its input,
        for codecs that declare it does (``Compressor.contractive``; not those that only
        take error feedback as ``feedback_stable``, such as TernGrad), else 0."""
        from .. import compressors

        codec = compressors.get(self.v.compressor, **dict(self.v.options))
        if not codec.lossy or not codec.contractive or self.dtype not in (
                "float32", "float64"):
            return 0
        y = np.array(x, copy=True)
        dec = np.asarray(codec.decompress(codec.compress(y.copy(), seed=(0, 0, 0, self.t.rank)),
                                          out=np.empty(y.size, y.dtype)), y.dtype)
        norm = float(np.linalg.norm(y.astype(np.float64)))
        err = float(np.linalg.norm(y.astype(np.float64) - dec.astype(np.float64)))
        return int(y.size) if norm > 0 and not err < norm else 0

    def _checked(self, call: Callable[[], Any], count_it: bool = True,
                 timed: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        """One call (through ``timed`` if given), then its check (never timed)."""
        expected = None
        if not self.exact and not self.v.error_feedback:
            step = _next_plain_step(self.t, self.v.compressor, self.rs)
            expected = lambda: self._replay(step=step)             # noqa: E731
        elif self.v.error_feedback:
            expected = lambda: self._replay(residuals=self.stores)  # noqa: E731
        y = call() if timed is None else timed(call)
        host = y if isinstance(y, np.ndarray) else arrays.host_view(y)
        host = np.ascontiguousarray(host).reshape(-1)
        self.result = host
        if self.exact:
            ref = self._mine(self.inputs.exact_result())
            wrong = data.count_wrong(host, ref)
        else:
            ref = expected()  # type: ignore[misc]
            wrong = _bytes_differ(host, ref)
        if count_it:
            self.wrong += wrong

    def _replay(self, **state: Any) -> np.ndarray:
        from .replay import replay

        v = self.v
        if self.rs:
            from .rs import replayed

            return replayed(self.inputs.gaussian_inputs(), self.t, v, self.dtype, self.op,
                            **state)
        return replay(self.inputs.gaussian_inputs(), dtype=self.dtype, op=self.op,
                      algorithm=v.algorithm, compressor=v.compressor, seed=0, key=KEY,
                      transport=self.t, **state, **dict(v.options))

    def _mine(self, full: np.ndarray) -> np.ndarray:
        """What this rank's result holds of the full reduction: all of it (allreduce) or
        its shard (reduce-scatter)."""
        if not self.rs:
            return full
        from .rs import shard

        return shard(full, self.t.size, self.t.rank)

    def timed(self, k: int, rnd: int) -> None:
        """``k`` timed calls of round ``rnd``."""
        if self.row.note:
            return
        t, st = self.t, self.t.stats

        def one(call: Callable[[], Any]) -> Any:
            t.barrier()
            b, m = st.bytes_sent, st.messages_sent
            t0 = time.perf_counter()
            y = call()
            self.times.append(time.perf_counter() - t0)
            self.wire += st.bytes_sent - b
            self.msgs += st.messages_sent - m
            return y

        try:
            for _ in range(k):
                self.round_of.append(rnd)
                self._checked(self.call, timed=one)
        except UnsupportedError as exc:          # raised alike on every rank
            self.row.note = f"unsupported: {exc}"

    # -- rank 0's row ------------------------------------------------------------------------
    def finish(self, rounds: int) -> Row:
        row, t = self.row, self.t
        if row.note:
            return row
        iters = len(self.times)
        p = t.size
        mine = np.concatenate([self.times, [self.wire / iters, self.msgs / iters,
                                            self.wrong]])
        table = gather(t, mine)
        if table is None:
            return row
        row.iters, row.rounds = iters, rounds
        m_times = table[:, :iters]
        per_rank = m_times.mean(axis=1)
        slowest = m_times.max(axis=0)
        mean = float(per_rank.mean())
        row.avg_us = mean * 1e6
        row.min_us = float(per_rank.min()) * 1e6
        row.max_us = float(per_rank.max()) * 1e6
        row.p50_us = float(np.median(slowest)) * 1e6
        row.p95_us = float(np.percentile(slowest, 95)) * 1e6
        if mean > 0:
            row.algbw_gbs, row.busbw_gbs = bandwidths(row.size, mean, p,
                                                      self.plan.collective)
        which = np.asarray(self.round_of)
        round_us = [float(m_times[:, which == r].mean()) * 1e6 for r in range(rounds)]
        row.extra["round_us"] = round_us
        if mean > 0:
            row.spread_pct = (max(round_us) - min(round_us)) / row.avg_us * 100
        if not (self.v.baseline or self.v.algorithm == "native"):   # opaque library traffic
            row.wire_bytes = float(table[:, iters].mean())
            row.messages = float(table[:, iters + 1].mean())
        row.wrong = int(table[:, iters + 2].sum())
        if not self.exact and self.result is not None:
            row.rel_err = data.relative_error(self.result,
                                              self._mine(self.inputs.gaussian_result()),
                                              self.dtype)
        return row


def _next_plain_step(t: Transport, compressor: str | None, rs: bool = False) -> int:
    """The step the next compressed call without a residual store takes on ``t``: the
    count of earlier such calls there (PowerSGD counts its own, reduce-scatters theirs)."""
    from ..compressed.state import peek_step
    from .rs import FAMILY

    if rs:
        return peek_step(t, FAMILY)
    return peek_step(t, "powersgd" if compressor == "powersgd" else "codec")


def _bytes_differ(got: np.ndarray, ref: np.ndarray) -> int:
    """Elements whose bytes differ (a size mismatch: every element of the longer)."""
    got = np.ascontiguousarray(got).reshape(-1)
    ref = np.ascontiguousarray(ref).reshape(-1)
    if got.size != ref.size or got.dtype.itemsize != ref.dtype.itemsize:
        return max(got.size, ref.size)
    if not got.size:
        return 0
    a = got.view(np.uint8).reshape(got.size, -1)
    b = ref.view(np.uint8).reshape(ref.size, -1)
    return int(np.count_nonzero((a != b).any(axis=1)))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


__all__ = ["Baseline", "KEY", "LARGE", "LOSSLESS", "Plan", "Reporter", "Row", "Variant",
           "bandwidths", "iterations", "predicted", "round_sizes", "sweep"]
