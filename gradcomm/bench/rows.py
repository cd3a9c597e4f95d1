"""What a benchmark sweep is given and gives back: the :class:`Variant` s and
:class:`Plan` every rank measures, the :class:`Row` rank 0 fills per (size, variant), the
:class:`Baseline` and :class:`Reporter` protocols, and the arithmetic of iterations,
rounds and bandwidths (:mod:`.sweep` runs the measurement).

Example:
    >>> plan = Plan(sizes=[4096], variants=[Variant("ring", "topk", options=(("ratio", 0.1),))])
    >>> plan.variants[0].label, iterations(4096, plan), round_sizes(7, 3)
    ('ring+topk,ratio=0.1', (100, 10), [3, 2, 2])
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

#: sizes above this many bytes get proportionally fewer iterations
LARGE = 1 << 20

@dataclass(frozen=True)
class Variant:
    """One line of the plot: an algorithm, a compressor, with or without the check.

    ``baseline`` variants call the library directly (e.g. ``MPI_Allreduce``) and have no
    compressor or check. ``error_feedback`` variants call
    ``gradcomm.Allreduce(..., error_feedback=True)`` (the DDP hook's default), one object
    per (size, variant), so residuals carry from call to call.

    Example:
        >>> Variant("ring", "topk", options=(("ratio", 0.01),), error_feedback=True).label
        'ring+topk,ratio=0.01+ef'
    """

    algorithm: str
    compressor: str | None = None
    check: bool = True
    options: tuple[tuple[str, Any], ...] = ()
    baseline: bool = False
    error_feedback: bool = False

    @property
    def label(self) -> str:
        parts = [self.algorithm]
        if self.compressor is not None:
            parts.append(self.compressor + "".join(f",{k}={v}" for k, v in self.options))
        if self.error_feedback:
            parts.append("ef")
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
    rounds: int = 5
    #: "allreduce" or "reduce_scatter" (:mod:`gradcomm.bench.rs`)
    collective: str = "allreduce"
    #: gradcomm allreduce rows return a new array per call (``y = allreduce(x)``) instead
    #: of writing into an ``out=`` array kept for the row, as the baseline's ``recvbuf``
    fresh_result: bool = False


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
    rounds: int = 0
    spread_pct: float | None = None
    error_feedback: bool = False

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


def round_sizes(iters: int, rounds: int) -> list[int]:
    """Timed calls per round: ``iters`` split as evenly as possible over at most
    ``rounds`` rounds (every round has at least one call).

    Example:
        >>> round_sizes(20, 3), round_sizes(2, 5)
        ([7, 7, 6], [1, 1])
    """
    k = max(1, min(rounds, iters))
    base, extra = divmod(iters, k)
    return [base + (1 if i < extra else 0) for i in range(k)]


def bandwidths(size: int, seconds: float, p: int, collective: str = "allreduce"
               ) -> tuple[float, float]:
    """nccl-tests' figures in GB/s: ``algbw = size / time`` and ``busbw = algbw ·
    2(p−1)/p`` (allreduce) or ``algbw · (p−1)/p`` (reduce-scatter; size = the input).

    Example:
        >>> bandwidths(10**9, 0.5, 4), bandwidths(10**9, 0.5, 4, "reduce_scatter")
        ((2.0, 3.0), (2.0, 1.5))
    """
    from .rs import BUS_FACTOR

    algbw = size / seconds / 1e9
    return algbw, algbw * BUS_FACTOR[collective](p)


__all__ = ["Baseline", "LARGE", "Plan", "Reporter", "Row", "Variant", "bandwidths",
           "iterations", "round_sizes"]
