"""Reduce-scatter rows of the microbenchmark (``--collective reduce_scatter``).

The sweep (:mod:`gradcomm.bench.sweep`) times these as it times the allreduce rows; this
module supplies what differs: the call (``gradcomm.reduce_scatter``, dense ring or a
compressed route), the library's own reduce-scatter as the baseline
(``MPI_Reduce_scatter`` with gradcomm's shard counts, or ``dist.reduce_scatter_tensor``),
the reference each rank's shard is checked against (the exact sum's shard, or bitwise the
exact replay :func:`gradcomm.bench._replay_rs.replay_reduce_scatter`), and the
bandwidth convention of nccl-tests for reduce-scatter: ``size`` is the whole input,
``algbw = size / time``, ``busbw = algbw · (p−1)/p``.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.bench.sweep import Variant
    >>> x = np.arange(6, dtype=np.float32)
    >>> run_ranks(2, lambda t: make_call(t, Variant("ring"), x, "float32", "sum")[0]()
    ...           .tolist())
    [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]]
    >>> BUS_FACTOR["reduce_scatter"](4), BUS_FACTOR["allreduce"](4)
    (0.75, 1.5)
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..collectives.reduce_scatter import shard_bounds
from ..errors import UnsupportedError

#: the collectives ``--collective`` measures
COLLECTIVES = ("allreduce", "reduce_scatter")
#: dense reduce-scatter algorithms; compressed ones add ``alltoall``
DENSE_ALGORITHMS = ("ring",)
COMPRESSED_ALGORITHMS = ("ring", "alltoall")
#: busbw / algbw by collective (nccl-tests' factors)
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
}
#: the step counter of compressed reduce-scatters without a residual store
FAMILY = "reduce_scatter"


def shard(x: np.ndarray, p: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s shard of flat ``x`` on ``p`` ranks (gradcomm's segments)."""
    lo, hi = shard_bounds(x.size, p, rank)
    return x[lo:hi]


def make_call(t: Any, v: Any, arr: Any, dtype: str, op: str
              ) -> tuple[Callable[[], Any], list[Any]]:
    """The timed call of variant ``v`` on this rank's input ``arr`` and the replay's
    residual stores (one per rank; empty without error feedback)."""
    from ..compressed.reduce_scatter import reduce_scatter
    from ..error_feedback import ErrorFeedback

    options = dict(v.options)
    alg, comp, check = v.algorithm, v.compressor, v.check
    ef = ErrorFeedback() if v.error_feedback else None
    stores = [ErrorFeedback() for _ in range(t.size)] if ef is not None else []
    return (lambda: reduce_scatter(arr, t, op=op, algorithm=alg, compressor=comp,
                                   error_feedback=ef, key="default", check=check,
                                   **options)), stores


def replayed(inputs: Sequence[np.ndarray], t: Any, v: Any, dtype: str, op: str,
             **state: Any) -> np.ndarray:
    """This rank's shard as the exact replay computes it (``state``: ``step=`` or
    ``residuals=``, as the sweep passes them)."""
    from ._replay_rs import replay_reduce_scatter

    return replay_reduce_scatter(inputs, dtype=dtype, op=op, algorithm=v.algorithm,
                                 compressor=v.compressor, seed=0, key="default", **state,
                                 **dict(v.options))[t.rank]


class MPIReduceScatter:
    """``comm.Reduce_scatter(x, out, recvcounts, op)`` with gradcomm's shard counts."""

    name = "MPI_Reduce_scatter"

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def prepare(self, x: np.ndarray, dtype: str, op: str) -> Callable[[], np.ndarray]:
        from mpi4py import MPI

        if dtype in ("float16", "bfloat16"):
            raise UnsupportedError(f"MPI cannot reduce {dtype}")
        mpi_op = {"sum": MPI.SUM, "mean": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN,
                  "prod": MPI.PROD}[op]
        comm, p, rank = self.comm, self.comm.Get_size(), self.comm.Get_rank()
        counts = [b - a for a, b in (shard_bounds(x.size, p, r) for r in range(p))]
        out = np.empty(counts[rank], x.dtype)
        mean = op == "mean"

        def call() -> np.ndarray:
            comm.Reduce_scatter(x, out, recvcounts=counts, op=mpi_op)
            if mean:
                out[...] /= out.dtype.type(p)
            return out

        return call


class TorchReduceScatter:
    """``dist.reduce_scatter_tensor`` (FSDP2's call); counts must divide by p."""

    name = "dist.reduce_scatter_tensor"

    def __init__(self, group: Any) -> None:
        self.group = group

    def prepare(self, x: np.ndarray, dtype: str, op: str) -> Callable[[], np.ndarray]:
        import torch
        import torch.distributed as dist

        from .. import arrays

        p = dist.get_world_size(self.group)
        if x.size % p:
            raise UnsupportedError(f"dist.reduce_scatter_tensor needs a count divisible by "
                                   f"{p} ranks, got {x.size}")
        src = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) \
            if dtype == "bfloat16" else torch.from_numpy(x)
        out = torch.empty(x.size // p, dtype=src.dtype)
        R = dist.ReduceOp
        rop = {"sum": R.SUM, "mean": R.SUM, "max": R.MAX, "min": R.MIN,
               "prod": R.PRODUCT}[op]
        group, mean = self.group, op == "mean"

        def call() -> np.ndarray:
            dist.reduce_scatter_tensor(out, src, op=rop, group=group)
            if mean:
                out.div_(p)
            return arrays.host_view(out)

        return call


def baseline_for(base: Any) -> Any:
    """The reduce-scatter baseline of the launcher whose allreduce baseline is ``base``."""
    from .launch import MPIBaseline

    if isinstance(base, MPIBaseline):
        return MPIReduceScatter(base.comm)
    return TorchReduceScatter(base.group)


__all__ = ["BUS_FACTOR", "COLLECTIVES", "COMPRESSED_ALGORITHMS", "DENSE_ALGORITHMS",
           "MPIReduceScatter", "TorchReduceScatter", "baseline_for", "make_call",
           "replayed", "shard"]
