"""The DDP hook's worker thread: buckets are reduced in the order DDP hands them over.

The hook (on the autograd thread) only queues a bucket's reduction and returns; one
worker thread per hook state runs the queued tasks in order, so every rank issues its
collectives in the same order and the next buckets' backward compute overlaps this
bucket's communication. :meth:`Worker.call` runs a function after every queued bucket
and returns its value (checkpoints, loads, flushes).

Example:
    >>> w = Worker(timeout=5.0)
    >>> w.submit(lambda: None); w.call(lambda: 6 * 7)
    42
    >>> w.close()
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

from ...errors import GradcommError


class Worker:
    """One daemon thread running queued tasks in order; ``timeout`` (seconds) bounds
    :meth:`call` (four times it) and :meth:`close`."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_work, args=(self.queue,), daemon=True,
                                        name="gradcomm-ddp-hook")
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        """Queue ``task`` (after the tasks queued before)."""
        if not self._thread.is_alive():
            raise GradcommError("the comm hook's worker thread was closed")
        self.queue.put(task)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the worker thread (after every queued task) and return its value;
        its exception is raised here."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def task() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:   # re-raised in the caller
                box["error"] = exc
            finally:
                done.set()

        self.submit(task)
        deadline = self.timeout * 4
        if not done.wait(deadline):
            raise GradcommError(f"the comm hook's worker did not finish within {deadline:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def close(self) -> None:
        """Stop the thread after the queued tasks. Idempotent."""
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(self.timeout)


def _work(q: queue.SimpleQueue[Callable[[], None] | None]) -> None:
    while True:
        task = q.get()
        if task is None:
            return
        task()


__all__ = ["Worker"]
