"""Bucket-layout replay: the first iteration after a checkpoint load reduces the saved units.

DDP starts a new process with its initial bucket layout and rebuilds it only after one
iteration; a checkpoint stores the units (groups of parameters) of the last iteration, and
:class:`Replay` regroups the new process's buckets into them, so that a resumed run reduces
the same groups as the unbroken one (and, on CPU, ends with bitwise the same parameters).

Example:
    >>> import numpy as np
    >>> rep = Replay([["a", "b"]])
    >>> rep.add(np.zeros(3), ["b", "a"], [1, 2], "future")    # one bucket, both parameters
    >>> [unit for unit, views in rep.ready()]
    [['a', 'b']]
    >>> rep.done(["a", "b"]), rep.left()
    ([('future', array([0., 0., 0.]))], [])
"""

from __future__ import annotations

from typing import Any


class Replay:
    """Regroups the buckets of one iteration into a saved layout of parameter units.

    Units are reduced in the saved order as soon as all their parameters have arrived.
    At the last bucket the rest goes in a fixed order, so that every rank does the same
    even if the layout does not fit the model exactly: unfinished saved units (without
    the parameters that never came), then parameters outside the layout, per bucket.
    """

    def __init__(self, layout: list[list[str]]) -> None:
        self.units = layout
        self.next = 0
        self.views: dict[str, Any] = {}
        self.order: list[list[str]] = []                     # keys of each bucket
        self.buckets: list[tuple[Any, Any, set[str]]] = []   # (fut, buf, keys left)

    def add(self, buf: Any, keys: list[str], lengths: list[int], fut: Any) -> None:
        offset = 0
        for k, n in zip(keys, lengths):
            self.views[k] = buf[offset:offset + n]
            offset += n
        self.order.append(list(keys))
        self.buckets.append((fut, buf, set(keys)))

    def ready(self) -> Any:
        while self.next < len(self.units) and all(k in self.views for k in
                                                  self.units[self.next]):
            unit = self.units[self.next]
            self.next += 1
            yield unit, [self.views[k] for k in unit]

    def finish(self) -> list[tuple[list[str], list[Any]]]:
        """Everything not yet reduced, once the last bucket has arrived."""
        rest = [[k for k in u if k in self.views] for u in self.units[self.next:]]
        self.next = len(self.units)
        saved = {k for u in self.units for k in u}
        rest += [[k for k in keys if k not in saved] for keys in self.order]
        return [(u, [self.views[k] for k in u]) for u in rest if u]

    def done(self, keys: list[str]) -> list[tuple[Any, Any]]:
        """Mark ``keys`` reduced; the (future, buffer) of buckets now complete."""
        complete = []
        for entry in self.buckets:
            fut, buf, left = entry
            if left:
                left.difference_update(keys)
                if not left:
                    complete.append((fut, buf))
        return complete

    def left(self) -> list[str]:
        return [k for u in self.units[self.next:] for k in u] + \
            [k for _, _, left in self.buckets for k in left]

    def fail(self, exc: BaseException) -> None:
        for fut, _, _ in self.buckets:
            if not fut.done():
                fut.set_exception(exc)


__all__ = ["Replay"]
