"""The DDP hook's worker: tasks run in submission order, on the worker or (``run_here``,
nothing queued or running) on the caller's thread."""

from __future__ import annotations

import threading

import pytest

from gradcomm.errors import GradcommError
from gradcomm.integrations.ddp.worker import Worker


@pytest.fixture
def worker():
    w = Worker(timeout=5.0)
    yield w
    w.close()


def test_run_here_runs_on_the_calling_thread_when_idle(worker):
    seen: list[str] = []
    assert worker.run_here(lambda: seen.append(threading.current_thread().name))
    assert seen == [threading.current_thread().name]
    worker.submit(lambda: seen.append(threading.current_thread().name))
    worker.call(lambda: None)
    assert seen[1] == "gradcomm-ddp-hook"
    assert worker.run_here(lambda: seen.append("again"))      # idle again afterwards


def test_run_here_refuses_while_a_task_is_queued_or_running(worker):
    gate, started = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), gate.wait(5.0)))
    assert started.wait(5.0)
    ran: list[int] = []
    assert not worker.run_here(lambda: ran.append(1))          # running
    worker.submit(lambda: ran.append(2))
    assert not worker.run_here(lambda: ran.append(3))          # queued behind it
    gate.set()
    worker.call(lambda: None)
    assert ran == [2]
    assert worker.run_here(lambda: ran.append(4)) and ran == [2, 4]


def test_a_task_submitted_during_run_here_waits_for_it(worker):
    order: list[str] = []
    inside = threading.Event()

    def here() -> None:
        inside.set()
        worker.submit(lambda: order.append("queued"))   # another thread could do this too
        threading.Event().wait(0.2)                     # the worker is free to run it now
        order.append("here")

    assert worker.run_here(here) and inside.is_set()
    worker.call(lambda: None)
    assert order == ["here", "queued"]


def test_run_here_releases_its_claim_when_the_task_raises(worker):
    def boom() -> None:
        raise ValueError("boom")
    with pytest.raises(ValueError):
        worker.run_here(boom)
    assert worker.run_here(lambda: None)


def test_a_closed_worker_refuses_tasks():
    w = Worker(timeout=5.0)
    w.close()
    for refused in (lambda: w.submit(lambda: None), lambda: w.run_here(lambda: None),
                    w.wait):
        with pytest.raises(GradcommError, match="closed"):
            refused()


def test_wait_returns_after_the_queued_tasks_and_at_once_when_idle(worker):
    worker.wait()                                    # nothing owed
    done: list[int] = []
    gate = threading.Event()
    worker.submit(lambda: (gate.wait(5.0), done.append(1)))
    threading.Timer(0.2, gate.set).start()
    worker.wait()
    assert done == [1]
