"""The measurement itself: every rank runs :func:`sweep` with the same plan.

For each size (outer loop) and each variant (inner loop) every rank runs ``warmup``
untimed calls, then ``iters`` timed ones. Before each timed call the ranks meet at a
barrier (not timed), then each rank times its own call with ``time.perf_counter`` — the
way OSU's ``osu_allreduce`` does. Rank 0 gathers the per-rank, per-iteration times and
reports:

* ``avg``/``min``/``max``: OSU's columns — the mean over iterations on each rank, then
  the average, minimum and maximum of those means over ranks;
* ``p50``/``p95``: median and 95th percentile over iterations of the iteration time of the
  collective, i.e. the slowest rank's time in that iteration;
* ``algbw = size / p50`` and ``busbw = algbw · 2(p−1)/p`` (nccl-tests' allreduce factor),
  in GB/s (10^9 bytes). The median keeps one descheduled iteration from moving the figure.

Correctness (never timed): for dense and lossless rows the result of the last call is
compared elementwise with the exact expected result on every rank, and ``#wrong`` is the
sum over ranks of differing elements. Compressed rows are lossy by design: ``#wrong`` is
the sum over ranks of elements whose bytes differ from rank 0's (every rank must hold the
same bytes) and ``rel_err`` is ``||result − exact|| / ||exact||`` on Gaussian data.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> plan = Plan(sizes=[64], variants=[Variant("recursive_doubling")], iters=2, warmup=1)
    >>> rows = run_ranks(2, lambda t: sweep(t, plan))[0]
    >>> (rows[0].size, rows[0].count, rows[0].wrong, rows[0].wire_bytes > 0)
    (64, 16, 0, True)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .. import _array
from .._dtypes import storage
from ..collectives.costmodel import Profile
from ..comm.base import TAG_USER, Transport
from ..errors import UnsupportedError
from . import data

#: sizes above this many bytes get proportionally fewer iterations
LARGE = 1 << 20
#: tag of the benchmark's own bookkeeping messages (gathers to rank 0)
TAG_BENCH = TAG_USER + 17
#: compressors whose results are exact (checked against the exact expected values)
LOSSLESS = (None, "none")


@dataclass(frozen=True)
class Variant:
    """One line of the plot: an algorithm, a compressor, with or without the check.

    ``baseline`` variants call the library directly (e.g. ``MPI_Allreduce``) and have no
    compressor or check.
    """

    algorithm: str
    compressor: str | None = None
    check: bool = True
    options: tuple[tuple[str, Any], ...] = ()
    baseline: bool = False

    @property
    def label(self) -> str:
        parts = [self.algorithm]
        if self.compressor is not None:
            parts.append(self.compressor + "".join(f",{k}={v}" for k, v in self.options))
        if not self.check and not self.baseline:
            parts.append("nocheck")
        return "+".join(parts)


class Baseline(Protocol):
    """The library's own allreduce, called directly (no gradcomm in the path)."""

    name: str

    def prepare(self, x: np.ndarray, dtype: str, op: str) -> Callable[[], np.ndarray]:
        """A call that reduces storage-form ``x`` and returns the result (storage form);
        raises :class:`UnsupportedError` for a dtype or op the library cannot do."""
        ...


@dataclass
class Plan:
    """What to measure; identical on every rank."""

    sizes: list[int]
    variants: list[Variant]
    dtype: str = "float32"
    op: str = "sum"
    iters: int = 100
    warmup: int = 10
    min_iters: int = 20


@dataclass
class Row:
    """One measured (size, variant); times in µs, bandwidths in GB/s."""

    size: int
    count: int
    dtype: str
    op: str
    algorithm: str
    compressor: str | None
    check: bool | None
    label: str
    iters: int = 0
    warmup: int = 0
    avg_us: float | None = None
    min_us: float | None = None
    max_us: float | None = None
    p50_us: float | None = None
    p95_us: float | None = None
    algbw_gbs: float | None = None
    busbw_gbs: float | None = None
    wire_bytes: float | None = None
    messages: float | None = None
    rel_err: float | None = None
    wrong: int | None = None
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Reporter(Protocol):
    """Receives progress and rows on rank 0."""

    def begin(self, total: int) -> None: ...

    def step(self, what: str) -> None: ...

    def row(self, row: Row) -> None: ...


def iterations(size: int, plan: Plan) -> tuple[int, int]:
    """(timed, warm-up) iterations for ``size`` bytes: fewer above :data:`LARGE`.

    Example:
        >>> iterations(4096, Plan(sizes=[], variants=[]))
        (100, 10)
        >>> iterations(64 << 20, Plan(sizes=[], variants=[]))
        (20, 2)
    """
    if size <= LARGE:
        return plan.iters, plan.warmup
    scale = LARGE / size
    iters = min(plan.iters, max(plan.min_iters, int(plan.iters * scale)))
    warmup = min(plan.warmup, max(2, int(plan.warmup * scale)))
    return iters, warmup


def sweep(t: Transport, plan: Plan, baseline: Baseline | None = None,
          reporter: Reporter | None = None, profile: Profile | None = None) -> list[Row]:
    """Measure every (size, variant) of ``plan`` on every rank; rows on rank 0 only.

    ``reporter`` (rank 0) gets progress and each row as soon as it is measured. With a
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
        expected: dict[str, Any] = {}     # cached per size: exact / gaussian references
        for v in plan.variants:
            if reporter is not None:
                reporter.step(f"{_human(count * itemsize)} {v.label}")
            row = _measure(t, plan, v, count, baseline, expected)
            if t.rank == 0:
                pred = predicted(t, profile, v, row.size, plan.dtype, plan.op)
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
    return profile.call_time(alg, size, t.size, dtype, check=v.check)


def _measure(t: Transport, plan: Plan, v: Variant, count: int, baseline: Baseline | None,
             expected: dict[str, Any]) -> Row:
    dtype, op, p = plan.dtype, plan.op, t.size
    size = count * storage(dtype).itemsize
    iters, warmup = iterations(size, plan)
    row = Row(size, count, dtype, op, v.algorithm, v.compressor,
              None if v.baseline else v.check, v.label, iters, warmup)
    exact = v.compressor in LOSSLESS
    x = data.exact_input(t.rank, count, dtype, op) if exact else \
        data.gaussian_input(t.rank, count, dtype)
    try:
        call = _call(t, v, x, dtype, op, baseline)
        for _ in range(warmup):
            call()
    except UnsupportedError as exc:          # raised alike on every rank
        row.note = f"unsupported: {exc}"
        return row

    st = t.stats
    times = np.empty(iters)
    wire = msgs = 0
    y = None
    for i in range(iters):
        t.barrier()
        b, m = st.bytes_sent, st.messages_sent
        t0 = time.perf_counter()
        y = call()
        times[i] = time.perf_counter() - t0
        wire += st.bytes_sent - b
        msgs += st.messages_sent - m
    assert y is not None
    result = y
    if exact:
        if "exact" not in expected:
            expected["exact"] = data.exact_result(p, count, dtype, op)
        wrong = data.count_wrong(result, expected["exact"])
    else:
        wrong = _differs_from_root(t, result)

    mine = np.concatenate([times, [wire / iters, msgs / iters, wrong]])
    table = _gather(t, mine)
    if table is None:
        return row
    m_times = table[:, :iters]
    per_rank = m_times.mean(axis=1)
    slowest = m_times.max(axis=0)
    p50 = float(np.median(slowest))
    row.avg_us = float(per_rank.mean()) * 1e6
    row.min_us = float(per_rank.min()) * 1e6
    row.max_us = float(per_rank.max()) * 1e6
    row.p50_us = p50 * 1e6
    row.p95_us = float(np.percentile(slowest, 95)) * 1e6
    row.algbw_gbs = size / p50 / 1e9 if p50 > 0 else None
    row.busbw_gbs = None if row.algbw_gbs is None else row.algbw_gbs * 2 * (p - 1) / p
    if not (v.baseline or v.algorithm == "native"):   # opaque library traffic
        row.wire_bytes = float(table[:, iters].mean())
        row.messages = float(table[:, iters + 1].mean())
    row.wrong = int(table[:, iters + 2].sum())
    if not exact:
        if "gaussian" not in expected:
            expected["gaussian"] = data.gaussian_result(p, count, dtype, op)
        row.rel_err = data.relative_error(result, expected["gaussian"], dtype)
    return row


def _call(t: Transport, v: Variant, x: np.ndarray, dtype: str, op: str,
          baseline: Baseline | None) -> Callable[[], np.ndarray]:
    """A no-argument call that runs one allreduce and returns its result (storage form)."""
    if v.baseline:
        if baseline is None or baseline.name != v.algorithm:
            raise UnsupportedError(f"no {v.algorithm} baseline on the {t.name} transport")
        return baseline.prepare(x, dtype, op)
    import gradcomm

    arr = _user_array(x, dtype)
    options = dict(v.options)
    alg, comp, check = v.algorithm, v.compressor, v.check

    def call() -> np.ndarray:
        y = gradcomm.allreduce(arr, t, op=op, algorithm=alg, compressor=comp, check=check,
                               **options)
        return y if isinstance(y, np.ndarray) else _array.host_view(y)

    return call


def _user_array(x: np.ndarray, dtype: str) -> Any:
    """What a user would pass: numpy, or a torch tensor for bfloat16 (no numpy dtype)."""
    if dtype != "bfloat16":
        return x
    try:
        import torch
    except ImportError:
        raise UnsupportedError("bfloat16 arrays need torch (pip install torch)") from None
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)


def _gather(t: Transport, vec: np.ndarray) -> np.ndarray | None:
    """Rank 0 gets a (size, len) table of every rank's ``vec``; others get None."""
    vec = np.ascontiguousarray(vec, dtype=np.float64)
    if t.rank != 0:
        t.send(vec, 0, TAG_BENCH)
        return None
    table = np.empty((t.size, vec.size))
    table[0] = vec
    for r in range(1, t.size):
        t.recv(table[r], r, TAG_BENCH)
    return table


def _differs_from_root(t: Transport, result: np.ndarray) -> int:
    """Elements where this rank's bytes differ from rank 0's (0 on rank 0)."""
    flat = np.ascontiguousarray(result).reshape(-1).view(np.uint8)
    if t.rank == 0:
        for r in range(1, t.size):
            t.send(flat, r, TAG_BENCH)
        return 0
    root = np.empty_like(flat)
    t.recv(root, 0, TAG_BENCH)
    item = result.dtype.itemsize
    diff = (root != flat).reshape(-1, item).any(axis=1) if flat.size else flat
    return int(np.count_nonzero(diff))


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"
