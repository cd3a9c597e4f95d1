"""The DDP hook's worker thread: buckets are reduced in the order DDP hands them over.

The hook (on the autograd thread) queues a bucket's reduction and returns; one worker
thread per hook state runs the queued tasks in order, so every rank issues its
collectives in the same order and the next buckets' backward compute overlaps this
bucket's communication. :meth:`Worker.run_here` runs a task on the caller's thread
instead when none is queued or running (the iteration's last bucket: nothing is left to
overlap, and the hand-off costs a few ms). :meth:`Worker.call` runs a function after
every queued bucket and returns its value (checkpoints, loads).

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
        self._count = threading.Lock()     # guards ``_owed``
        self._owed = 0                     # tasks submitted or claimed, not finished
        self._running = threading.Lock()   # held while a task runs, on either thread
        self._closed = False
        self._thread = threading.Thread(target=self._work, daemon=True,
                                        name="gradcomm-ddp-hook")
        self._thread.start()

    def submit(self, task: Callable[[], None]) -> None:
        """Queue ``task`` (after the tasks queued before)."""
        self._open()
        with self._count:
            self._owed += 1
        self.queue.put(task)

    def _open(self) -> None:
        if self._closed or not self._thread.is_alive():
            raise GradcommError("the comm hook's worker thread was closed")

    def run_here(self, task: Callable[[], None]) -> bool:
        """Run ``task`` on the calling thread if no task is queued or running (False:
        not run). The order stays the submission order: a task submitted meanwhile
        waits for this one."""
        self._open()
        with self._count:
            if self._owed:
                return False
            self._owed += 1
        self._run(task)
        return True

    def _run(self, task: Callable[[], None]) -> None:
        """Run a task owed (claimed or queued), alone; then it is no longer owed."""
        try:
            with self._running:
                task()
        finally:
            with self._count:
                self._owed -= 1

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

    def wait(self) -> None:
        """Return once every task submitted so far has run (at once if none is owed)."""
        self._open()
        with self._count:
            if not self._owed:
                return
        self.call(lambda: None)

    def close(self) -> None:
        """Stop the thread after the queued tasks. Idempotent."""
        self._closed = True
        if self._thread.is_alive():
            self.queue.put(None)
            self._thread.join(self.timeout)

    def _work(self) -> None:
        while True:
            task = self.queue.get()
            if task is None:
                return
            self._run(task)


__all__ = ["Worker"]
