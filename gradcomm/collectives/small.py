"""The small-call path: a checked native allreduce of a small host array, resolved once.

Below one pipeline chunk, a checked dense allreduce whose algorithm is the library's own
(``auto`` picks it there on MPI, or ``algorithm="native"``) moves a few KiB in about
4 us, and :func:`~gradcomm.collectives.dense_allreduce` spent twice that deciding what to
do: the reducer, the packed signature, the algorithm, on every call. :func:`install`
resolves all of it once per (count, dtype, op, algorithm) on a transport, after a call
with those arguments completed the general way; :func:`lookup` finds it on the next call,
and :meth:`SmallCall.run` does exactly what the general path does, no more: the argument
check (one small exchange with the deadline: a mismatch is a MismatchError on every
rank, a rank that never joins a DeadlineError), then the library's allreduce, then the
division of ``mean``. numpy arrays and CPU tensors (through a numpy view of their memory,
:func:`view`) take it from :func:`gradcomm.allreduce` and ``allreduce_``, numpy buffers
from ``wrap(comm).Allreduce``.

Both paths send the same messages, so ranks may take either. What is kept depends only
on the arguments and on state the ranks agree on (the profile: agreeing on a new one
forgets every entry, on every rank alike).

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     install(t, 3, np.dtype("float64"), "sum", "native")
    ...     call = lookup(t, np.zeros(3), "sum", "native")
    ...     return call is not None and call.run(t, np.full(3, t.rank + 1.0)).tolist()
    >>> run_ranks(2, fn)       # the in-process transport has no cheap native call
    [False, False]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import arrays
from ..comm.base import PIPELINE_CHUNK, Transport
from ..errors import GradcommError
from ..ops import Reducer, reducer
from . import auto
from ._check import _Signature, signature, verify

#: the largest array (bytes) the small-call path takes: below one pipeline chunk, where
#: the general path copies its input anyway
SMALL_BYTES = PIPELINE_CHUNK - 1
#: entries a transport keeps (then it starts again)
LIMIT = 256


class SmallCall:
    """A resolved checked native allreduce of ``count`` elements of ``dtype`` (kept in
    its transport's state, so it holds no reference to the transport)."""

    __slots__ = ("sig", "red", "dtype", "mean")

    def __init__(self, sig: _Signature, red: Reducer, dtype: str) -> None:
        self.sig, self.red, self.dtype = sig, red, dtype
        self.mean = red.op == "mean"

    def run(self, t: Transport, buf: np.ndarray, src: np.ndarray | None = None
            ) -> np.ndarray:
        """Reduce C-contiguous host ``buf`` in place across the ranks of ``t`` (the
        transport it was resolved on; ``src``, of ``buf``'s dtype and shape: reduce that
        instead, copied into ``buf`` once the ranks agreed); returns ``buf``."""
        verify(t, self.sig)
        if src is not None:
            np.copyto(buf, src)
        t.native_allreduce(buf, self.red.base_op, self.dtype)
        if self.mean:
            self.red.finalize(buf, t.size)
        return buf


def lookup(t: Transport, x: np.ndarray, op: str, algorithm: str) -> SmallCall | None:
    """The resolved call for numpy ``x`` (C-contiguous, at most :data:`SMALL_BYTES`:
    the caller checks with :func:`view`) reduced by ``op`` with ``algorithm`` and
    ``check=True``, if an earlier call installed it."""
    return t.state.small.get((x.size, x.dtype, op, algorithm))


def install(t: Transport, count: int, dtype: np.dtype, op: str, algorithm: str) -> None:
    """Keep the resolved call of ``count`` elements of numpy ``dtype`` (of an array that
    :func:`view` took; in native byte order) by ``op`` with ``algorithm`` and ``check=True``, where the general path takes
    the library's allreduce for it: after such a call completed (the profile is then
    agreed, as the general path's first checked call makes it)."""
    key = (count, dtype, op, algorithm)
    cache = t.state.small
    if key in cache or not _eligible(t, count, dtype, algorithm):
        return
    name = dtype.name
    try:
        red = reducer(op, name)
    except GradcommError:
        return
    if not t.native_supports(name, red.base_op):
        return
    if algorithm == "auto" and auto.select(t, count * dtype.itemsize, name, red.base_op,
                                           native=True) != "native":
        return
    if red.op == "mean" and name == "float16":      # may redo an overflow in float32
        return
    if len(cache) >= LIMIT:
        cache.clear()
    cache[key] = SmallCall(signature(t, "allreduce", count=count, dtype=name, op=op,
                                     algorithm=algorithm, valid=True), red, name)


def _eligible(t: Transport, count: int, dtype: np.dtype, algorithm: str) -> bool:
    return (t.state.profile_agreed and count > 0 and algorithm in ("auto", "native")
            and dtype.isnative and count * dtype.itemsize <= SMALL_BYTES)


def view(t: Transport, x: Any) -> np.ndarray | None:
    """``x``'s memory as a numpy array the small-call path may take on ``t`` (a
    transport with a cheap native allreduce and more than one rank; numpy or a CPU
    tensor, contiguous, at most :data:`SMALL_BYTES`: :func:`gradcomm.arrays.small_view`),
    else None."""
    if not t.fast_native or t.size == 1:
        return None
    return arrays.small_view(x, SMALL_BYTES)
