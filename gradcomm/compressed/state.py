"""What compressed allreduces keep from call to call, in the transport's ``t.state``.

The :class:`~gradcomm.comm.state.TransportState` holds this layer's step counters for
calls made without a residual store (one per route family: PowerSGD counts its calls
apart from the other codecs; :func:`next_step`) and, in its ``arena`` slot, the reusable
:class:`Scratch` (a byte :class:`Arena` for frames and landings, float scratch, the
payload layouts learned per codec and size). :func:`session` lends the scratch to one
call (a private one when another call on the same transport holds it) and drops the
arena after a failed call.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     steps = [next_step(t, "codec", None, "w") for _ in range(3)]
    ...     with session(t) as s:
    ...         frame = s.arena.take(100)
    ...     return steps, frame.size, frame.ctypes.data % 64
    >>> run_ranks(2, fn)[1]
    ([0, 1, 2], 100, 0)
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np

from ..comm.base import Transport
from ..error_feedback import ResidualStore

_ALIGN = 64
#: prefix of this layer's step counters in the transport's state
_COUNTER = "compressed:"


def aligned(nbytes: int, zero: bool = False) -> np.ndarray:
    """A flat uint8 array of ``nbytes`` bytes starting on a 64-byte boundary."""
    raw = (np.zeros if zero else np.empty)(nbytes + _ALIGN, np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    return raw[skip:skip + nbytes]


class Arena:
    """The byte buffers of one compressed allreduce (frames, landings), carved from one
    block that later calls reuse.

    Every buffer handed out during a call is distinct, so frames in flight, forwarded
    landings and finished payloads stay intact until the call returns; the next call
    starts over (all sends of the previous one have completed). A call that needs more
    than the block gets separate buffers, and the block grows to that call's need. A fresh
    allocation costs several memory copies in page faults; reuse makes repeated calls
    (training steps) cheap. Thread-safe (a pipelined ring takes buffers from two threads).
    """

    def __init__(self) -> None:
        self.block: np.ndarray | None = None
        self.pos = self.used = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        size = (max(nbytes, 1) + _ALIGN - 1) & ~(_ALIGN - 1)
        with self._lock:
            self.used += size
            b = self.block
            if b is not None and self.pos + size <= b.size:
                self.pos += size
                return b[self.pos - size:self.pos - size + nbytes]
        return aligned(nbytes)

    def reset(self) -> None:
        """Start a call: grow the block to what the previous call used."""
        with self._lock:
            if self.used > (0 if self.block is None else self.block.size):
                self.block = None
                self.block = aligned(self.used, zero=True)
            self.pos = self.used = 0

    def discard(self) -> None:
        """Forget the block (after a failed call, a peer's late message may still land)."""
        with self._lock:
            self.block, self.pos, self.used = None, 0, 0


class Scratch:
    """What one call borrows: the arena, float scratch and the payload layouts learned
    per (codec, count, dtype) (see :mod:`~gradcomm.compressed.frames`)."""

    def __init__(self) -> None:
        self.arena = Arena()
        self.layouts: dict[tuple[Any, ...], Any] = {}
        self._floats: dict[tuple[int, str], np.ndarray] = {}
        self.busy = False

    def floats(self, slot: int, n: int, dtype: Any) -> np.ndarray:
        """Scratch of ``n`` elements of ``dtype``; one per ``slot``, grown on demand."""
        dt = np.dtype(dtype)
        s = self._floats.get((slot, dt.name))
        if s is None or s.size < n:
            s = self._floats[slot, dt.name] = np.empty(max(n, 1), dt)
        return s[:n]


def next_step(t: Transport, family: str, residuals: ResidualStore | None, key: str) -> int:
    """This call's step: that of ``key`` in ``residuals``, else the count of earlier calls
    of route ``family`` on ``t`` (which it advances)."""
    if residuals is not None:
        return residuals.step(key)
    return t.state.next_step(_COUNTER + family)


def peek_step(t: Transport, family: str) -> int:
    """The step the next call of ``family`` without a residual store takes on ``t``."""
    return t.state.step(_COUNTER + family)


@contextlib.contextmanager
def session(t: Transport) -> Iterator[Scratch]:
    """The transport's reusable scratch for one call (a private one if another call on the
    same transport is running); after an error the arena is dropped, not reused."""
    ts = t.state
    with ts.lock:
        st = ts.arena
        if st is None:
            st = ts.arena = Scratch()
        if st.busy:
            st = Scratch()
        st.busy = True
    st.arena.reset()
    try:
        yield st
    except BaseException:
        st.arena.discard()
        raise
    finally:
        st.busy = False
