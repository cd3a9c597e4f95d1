"""``gradcomm.allreduce``: one call for numpy, torch and cupy arrays, any algorithm,
any compressor.

Example:
    >>> import numpy as np, gradcomm
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(2, lambda t: gradcomm.allreduce(np.arange(3.0), t).tolist())[1]
    [0.0, 2.0, 4.0]
"""

from __future__ import annotations

from typing import Any

from . import _array
from .collectives import dense_allreduce
from .comm import get_transport
from .errors import ConfigError


def allreduce(x: Any, comm: Any = None, *, op: str = "sum", algorithm: str = "auto",
              compressor: Any = None, check: bool = True, **options: Any) -> Any:
    """Reduce ``x`` across the ranks of ``comm``; every rank gets the same bytes.

    Args:
        x: numpy array, torch tensor or cupy array, any shape, contiguous or not. Not
            modified; a new array of the same kind, device, dtype and shape is returned.
        comm: mpi4py communicator, torch ProcessGroup, gradcomm Transport, or None.
        op: "sum", "mean", "max", "min" or "prod" (only sum/mean with a compressor).
        algorithm: "ring", "tree", "recursive_doubling", "rabenseifner",
            "sparse_allgather", "native" or "auto".
        compressor: None, a codec name (options in ``**options``) or a Compressor.
        check: first verify that all ranks passed the same count, dtype, op, algorithm
            and compressor (one tiny exchange); a difference raises MismatchError on
            every rank instead of hanging or returning garbage.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(3, lambda t: allreduce(np.ones(2), t, op="mean").tolist())[2]
        [1.0, 1.0]
    """
    t = get_transport(comm)
    buf, meta = _array.to_flat(x)
    if compressor is None:
        if options:
            raise ConfigError(f"unknown options {sorted(options)} (compressor options need "
                              "compressor=...)")
        dense_allreduce(t, buf, op, meta.dtype, algorithm, check=check)
    else:
        from .collectives.compressed import compressed_allreduce

        buf = compressed_allreduce(t, buf, meta.dtype, op=op, algorithm=algorithm,
                                   compressor=compressor, check=check, **options)
    return _array.from_flat(buf, meta)


def allreduce_(x: Any, comm: Any = None, **kwargs: Any) -> Any:
    """In-place :func:`allreduce`: the result is written into ``x``, which is returned.

    Takes the same arguments. ``x`` must be writable; a non-contiguous ``x`` is updated
    through its strides.

    Example:
        >>> import numpy as np
        >>> from gradcomm.comm import run_ranks
        >>> def fn(t):
        ...     x = np.ones(2); allreduce_(x, t); return x.tolist()
        >>> run_ranks(2, fn)[0]
        [2.0, 2.0]
    """
    y = allreduce(x, comm, **kwargs)
    if _array.kind(x) == "numpy":
        x[...] = y
    else:
        x.copy_(y) if _array.kind(x) == "torch" else x.__setitem__(Ellipsis, y)
    return x
