"""The underlying library's own allreduce (``MPI_Allreduce``, ``dist.all_reduce``...).

For comparison and as a fallback. The transport decides how: MPI and torch.distributed
call their library; the in-process transport reduces every rank's input in rank order.
A dtype the library cannot reduce correctly (16-bit floats on MPI) raises
:class:`~gradcomm.errors.UnsupportedError` rather than returning a wrong sum.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.ops import Reducer
    >>> def fn(t):
    ...     buf = np.ones(2); allreduce(t, buf, Reducer("sum", "float64")); return buf.tolist()
    >>> run_ranks(2, fn)[1]
    [2.0, 2.0]
"""

from __future__ import annotations

from typing import Any

from ..comm.base import TAG_DATA, Transport
from ..ops import Reducer


def allreduce(t: Transport, buf: Any, red: Reducer, *, tag: int = TAG_DATA) -> None:
    """Allreduce ``buf`` in place with the transport's library (``mean`` is finalized by the caller)."""
    if t.size == 1 or buf.size == 0:
        return
    t.native_allreduce(buf, red.base_op, red.dtype)
