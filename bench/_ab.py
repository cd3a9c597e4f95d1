"""What the interleaved MPI A/B scripts (``gather_ab.py``, ``pipeline_ab.py``) share:
their common options, the MPI transport they time on, and one timed call.

Both scripts import it from ``bench/`` (their own folder, first on ``sys.path``).

Example:
    >>> a = options("x", "MPI_Allreduce", ["--size", "64MiB"])
    >>> float32_count(a.size), a.rounds, a.variants
    (16777216, 6, 'MPI_Allreduce')
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Sequence

from gradcomm.bench._util import parse_size


def options(doc: str, variants: str, argv: Sequence[str] | None = None,
            warmup: bool = False) -> argparse.Namespace:
    """``--size`` (bytes of float32), ``--rounds``, ``--variants`` (and ``--warmup``)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--size", default="1e8", help="bytes of float32 (1e8, 64MiB, ...)")
    ap.add_argument("--rounds", type=int, default=6)
    if warmup:
        ap.add_argument("--warmup", type=int, default=1, help="untimed rounds first (JIT)")
    ap.add_argument("--variants", default=variants)
    return ap.parse_args(argv)


def float32_count(size: str) -> int:
    """Elements of float32 in ``size`` bytes (``1e8`` or a unit such as ``64MiB``)."""
    plain = size.replace(".", "").replace("e", "").isdigit()
    return (int(float(size)) if plain else parse_size(size)) // 4


def transport() -> tuple[Any, Any]:
    """``(MPI.COMM_WORLD, its MPITransport)``, with a 300 s deadline per wait."""
    from mpi4py import MPI

    from gradcomm.comm.mpi import MPITransport

    return MPI.COMM_WORLD, MPITransport(MPI.COMM_WORLD, timeout=300)


def timed(comm: Any, call: Callable[[], Any]) -> tuple[float, Any]:
    """``(the slowest rank's seconds, call's result)`` after a barrier."""
    from mpi4py import MPI

    comm.Barrier()
    t0 = time.perf_counter()
    out = call()
    return comm.allreduce(time.perf_counter() - t0, MPI.MAX), out
