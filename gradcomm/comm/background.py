"""Work a rank does while it waits for the wire.

A rank that has sent its part and waits for its peers' has the CPU to spare. A caller
that has work which does not depend on the messages in flight (a norm of the input, the
first touch of a result's pages) hands it to :func:`background` as :class:`Job` objects;
every transport wait inside the ``with`` block then runs their slices while its requests
are pending: MPI between tests (its TCP transfers advance only inside the library's
calls, so a slice is short), gloo and the in-process threads before they block (their
transfers advance without the waiting rank). Required jobs left over when the block
ends run then, so their results are complete after it; optional ones are dropped.

The jobs belong to the calling thread (a context variable), so the DDP hook's worker and
the training thread never run each other's.

Example:
    >>> import numpy as np
    >>> from gradcomm.comm import run_ranks
    >>> from gradcomm.comm.background import Job, background
    >>> class Count(Job):
    ...     def __init__(self):
    ...         self.left = 3
    ...     def step(self):                  # one slice; True while work remains
    ...         self.left -= 1
    ...         return self.left > 0
    >>> def fn(t):
    ...     job = Count()
    ...     with background(job):
    ...         t.barrier()                  # its waits may run slices of the job
    ...     return job.left                  # and what they left ran at the end
    >>> run_ranks(2, fn)
    [0, 0]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import numpy as np


class Job(ABC):
    """Work in slices, each short (tens of µs): a wait tests its requests between them."""

    #: whether what is left runs when the :func:`background` block ends (else dropped)
    required: bool = True
    #: set once :meth:`step` returned False
    done: bool = False

    @abstractmethod
    def step(self) -> bool:
        """Do one slice; True while work remains."""

    def finish(self) -> None:
        """Do what is left."""
        while not self.done:
            self.done = not self.step()


class Prefault(Job):
    """The first touch of a fresh array's pages (the kernel maps and zeroes each on its
    first write), a stretch per slice; optional: a wait that ends first leaves the rest
    to the writes that follow. It writes a zero per page: for an array whose contents
    do not matter yet (zeros, or a result about to be written whole).

    Example:
        >>> import numpy as np
        >>> a = np.zeros(1 << 20, np.float32)
        >>> job = Prefault(a)
        >>> while job.step():
        ...     pass
        >>> int(np.count_nonzero(a))            # zeros written over zeros
        0
    """

    required = False
    #: bytes per slice: one transparent huge page
    SLICE = 2 << 20

    def __init__(self, a: Any) -> None:
        self.bytes = a.reshape(-1).view(np.uint8)
        self.at = 0

    def step(self) -> bool:
        end = min(self.at + self.SLICE, self.bytes.size)
        self.bytes[self.at:end:4096] = 0          # a write per 4 KiB page
        self.at = end
        return end < self.bytes.size


#: this thread's jobs, outer blocks' first (a wait with none to run reads only this: a
#: C call, no frame of this module on its trip)
JOBS: ContextVar[tuple[Job, ...]] = ContextVar("gradcomm_background", default=())


@contextmanager
def background(*jobs: Job | None) -> Iterator[None]:
    """Let the transport waits inside the block run ``jobs`` (None entries are skipped),
    after those of an enclosing block; on a normal exit, finish the required ones."""
    mine = tuple(j for j in jobs if j is not None)
    if not mine:
        yield
        return
    token = JOBS.set(JOBS.get() + mine)
    try:
        yield
    finally:
        JOBS.reset(token)
    for j in mine:                   # (not after an exception: the result is abandoned)
        if j.required:
            j.finish()


def step() -> bool:
    """Run one slice of this thread's first unfinished job; False if none was left."""
    for j in JOBS.get():
        if not j.done:
            j.done = not j.step()
            return True
    return False


__all__ = ["JOBS", "Job", "Prefault", "background", "step"]
