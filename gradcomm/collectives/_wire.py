"""What a dense algorithm puts on the wire for a segment, and how it folds it back in.

Ring, tree, recursive doubling and Rabenseifner are written once against a ``Wire``:
:class:`DenseWire` sends raw values (and receives the allgather phase straight into
place, with no copy); a compressed wire (``gradcomm.compressed.wire``) sends codec
payloads and decodes-adds-re-encodes at each hop. The operations:

- ``partial_buffer(n, like, slot=0)``: a buffer to receive a peer's encoded *partial*
  segment of ``n`` elements (its size must follow from ``n`` alone: receivers post exact
  sizes). It may be reused scratch: the caller is done with it before asking for the same
  ``slot`` again; pipelined algorithms (ring, tree) cycle through as many slots as they
  keep receives posted ahead, so several may be live at once;
- ``encode(seg)``: the buffer to send for a partial segment;
- ``reduce(recv, seg, recv_first)``: ``seg = decode(recv) (op) seg`` (the reverse order if
  not ``recv_first``); callers pass ``recv_first`` = "the peer is the lower rank", so
  every rank evaluates the same expression (:class:`DenseWire` also folds from another
  buffer, ``mine``: the out-of-place ring);
- ``final(seg)``: the buffer to send for a *finished* segment; a lossy wire also replaces
  ``seg`` by ``decode(encode(seg))`` so sender and receivers hold the same bytes. It must
  be deterministic: equal ``seg`` on two ranks gives equal bytes;
- ``final_buffer(n, seg)``: where to receive a finished segment (dense: ``seg`` itself,
  so the allgather phase copies nothing); ring and tree forward what they received,
  unchanged, to the next rank, so every rank decodes the very bytes the owner produced.
  It must therefore stay intact until that send completes (``seg`` itself or a fresh
  buffer per call, never shared scratch);
- ``place(recv, seg)``: ``seg = decode(recv)`` (a no-op when ``recv is seg``).

Buffers returned by ``encode`` and ``final`` are sent asynchronously and must stay intact
until the send completes; ring and tree keep several in flight, so a lossy wire returns a
fresh buffer per call. Algorithms never call these for empty segments (nothing is sent),
and each algorithm's chunking depends on the element count only.

Example:
    >>> import numpy as np
    >>> from gradcomm.ops import Reducer
    >>> w = DenseWire(Reducer("sum", "float32"))
    >>> seg = np.ones(2, np.float32); w.reduce(np.ones(2, np.float32), seg, True); seg
    array([2., 2.], dtype=float32)
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

import numpy as np

from ..comm.base import Transport
from ..ops import Reducer


class Wire(Protocol):
    #: ``encode`` takes views of an out-of-place ring's ``src`` too, and ``reduce`` its
    #: ``mine`` (the segment folded from ``src``): ``ring.allreduce(src=...)`` runs on it
    folds_from_src: bool

    def partial_buffer(self, n: int, like: Any, slot: int = 0) -> Any: ...
    def encode(self, seg: Any) -> Any: ...
    def reduce(self, recv: Any, seg: Any, recv_first: bool, mine: Any = None) -> None: ...
    def final(self, seg: Any) -> Any: ...
    def final_buffer(self, n: int, seg: Any) -> Any: ...
    def place(self, recv: Any, seg: Any) -> None: ...


class DenseWire:
    """Raw values on the wire; reduction with a :class:`Reducer`.

    ``partial_buffer`` hands out one scratch allocation per ``slot``, grown on demand, so
    a collective allocates once however many steps it takes (callers must be done with a
    slot's buffer before asking for that slot again). ``scratch``: a dict that keeps
    the host buffers from call to call (a transport's ``t.state.scratch``); a fresh
    allocation costs several copies in page faults.
    """

    lossy = False
    folds_from_src = True

    def __init__(self, red: Reducer, scratch: dict[Any, Any] | None = None) -> None:
        self.red = red
        self._kept = scratch             # host buffers only: device memory is not held
        self._local: dict[Any, Any] = {}

    def partial_buffer(self, n: int, like: Any, slot: int = 0) -> Any:
        host = isinstance(like, np.ndarray)
        pool = self._kept if host and self._kept is not None else self._local
        key = (slot, like.dtype.str) if host else slot
        s = pool.get(key)
        if s is None or s.size < n or s.dtype != like.dtype:
            s = pool[key] = np.empty_like(like, shape=max(n, 1))
        return s[:n]

    def encode(self, seg: Any) -> Any:
        return seg

    def reduce(self, recv: Any, seg: Any, recv_first: bool, mine: Any = None) -> None:
        """``seg ← recv ⊕ mine`` in rank order; ``mine`` (this rank's own values of the
        segment, default ``seg`` itself): an out-of-place ring's source."""
        mine = seg if mine is None else mine
        if recv_first:
            self.red.combine(recv, mine, seg)
        else:
            self.red.combine(mine, recv, seg)

    def final(self, seg: Any) -> Any:
        return seg

    def final_buffer(self, n: int, seg: Any) -> Any:
        return seg

    def place(self, recv: Any, seg: Any) -> None:
        if recv is not seg:
            seg[...] = recv


@contextlib.contextmanager
def dense_wire(t: Transport, red: Reducer) -> Iterator[DenseWire]:
    """A :class:`DenseWire` whose receive buffers are the transport's, lent to one call
    (``t.state.scratch``): a concurrent call on the same transport gets private ones, and
    a call that fails drops them (an abandoned message may still touch them)."""
    pool = t.state.scratch.pop("dense", None)       # atomic: one call holds the pool
    pool = {} if pool is None else pool
    yield DenseWire(red, pool)
    t.state.scratch["dense"] = pool                 # not reached when the call raised
