"""A large message as a train of small ones, each below the library's eager limit.

Open MPI's ob1 sends a message above its eager limit (64 KiB over TCP) by rendezvous:
the receiver's go-ahead must come back before the data moves. Under load that
go-ahead waits behind the bulk data already queued on the same connection (socket
buffers and the link's queue: tens of milliseconds at 1 Gbit/s), and every message
started at once shares the link a fragment at a time, so the first chunk of a pipelined
collective arrives only with the last. Eager messages need no go-ahead and leave in the
order they were started. So a transport with :attr:`~gradcomm.comm.Transport.slice_bytes`
set sends each message above that size as consecutive slices of at most that size, and
receives it the same way. The first slice carries the message's tag, the others that
tag plus :data:`TAG_CONTINUED` times the number of slices, so a message of another
length than the receiver's buffer still fails, as MPI's own size check would: a slice
of the wrong size is a TransportError, a train of another length never matches (a
DeadlineError), and no receive reads part of one message and part of the next. The
bytes and their order are unchanged.

Example:
    >>> import numpy as np
    >>> sent = []
    >>> start = lambda part, tag: sent.append((len(part), tag)) or _Done()
    >>> r = train(start, np.zeros(10, np.uint8), 4, 3)
    >>> sent, r.test()
    ([(4, 3), (4, 98307), (2, 98307)], True)
"""

from __future__ import annotations

from typing import Any, Callable

#: slice size for Open MPI over TCP: its eager limit (64 KiB) less room for its headers
SLICE_BYTES = 63 << 10
#: larger messages go whole: a rendezvous is then a small part of their transfer, and
#: eager slices cost the library an extra copy (at 10 Gbit/s a dense 100 MB ring with
#: 6.25 MB messages ran 1.2x slower sliced; bench/RESULTS.md)
MAX_TRAIN_BYTES = 4 << 20
#: times the number of slices, added to the tag of every slice after a message's first
#: (above the tags gradcomm uses)
TAG_CONTINUED = 1 << 15
#: the largest tag a train uses (an MPI whose ``MPI_TAG_UB`` is lower cannot slice)
MAX_TAG = (1 << 15) - 1 + TAG_CONTINUED * -(-MAX_TRAIN_BYTES // SLICE_BYTES)


def slice_for(tag_ub: int | None) -> int:
    """:data:`SLICE_BYTES` if an MPI whose ``MPI_TAG_UB`` is ``tag_ub`` has the tags a
    train needs, else 0 (no slicing).

    Example:
        >>> slice_for(2**31 - 1) == SLICE_BYTES, slice_for(32767), slice_for(None)
        (True, 0, 0)
    """
    return SLICE_BYTES if (tag_ub or 0) >= MAX_TAG else 0


class Train:
    """The requests of one message's slices; complete when all of them are."""

    __slots__ = ("parts", "done", "_next")

    def __init__(self, parts: list[Any]) -> None:
        self.parts, self.done, self._next = parts, False, 0

    def test(self) -> bool:
        """Tests the slices in order from the first not known complete (they complete in
        order), stopping at the first still pending."""
        parts, i = self.parts, self._next
        while i < len(parts) and parts[i].test():
            i += 1
        self._next = i
        self.done = i == len(parts)
        return self.done


class _Done:
    def test(self) -> bool:
        return True


def train(start: Callable[[Any, int], Any], buf: Any, limit: int, tag: int) -> Any:
    """``start(buf, tag)``, or for a buffer (buffer protocol, contiguous) of more than
    ``limit`` (> 0) and at most :data:`MAX_TRAIN_BYTES` bytes a :class:`Train` of
    ``start(slice, tag')`` over its consecutive slices of at most ``limit`` bytes."""
    if not 0 < limit < buf.nbytes <= MAX_TRAIN_BYTES:
        return start(buf, tag)
    try:
        view = memoryview(buf).cast("B")
    except (TypeError, ValueError):           # not a host buffer: one message
        return start(buf, tag)
    later = tag + TAG_CONTINUED * -(-len(view) // limit)
    return Train([start(view[lo:lo + limit], later if lo else tag)
                  for lo in range(0, len(view), limit)])


def flat(requests: Any) -> list[Any]:
    """``requests`` with every :class:`Train` replaced by its slices' requests."""
    return [p for r in requests for p in (r.parts if isinstance(r, Train) else (r,))]
