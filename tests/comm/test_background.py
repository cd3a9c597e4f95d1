"""Background work in the transports' waits (gradcomm/comm/background.py): what runs
when, on whose thread, within the deadline, and on every transport."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from gradcomm.comm import run_ranks
from gradcomm.comm.background import JOBS, Job, background, step
from gradcomm.comm.base import poll
from gradcomm.errors import DeadlineError
from tests._launch import mpi_call, require_mpi, require_torch, torch_call


class Slices(Job):
    """``n`` slices (None: endless); logs each into ``log`` with its thread."""

    def __init__(self, n: int | None, log: list | None = None, name: str = "job",
                 required: bool = True) -> None:
        self.n, self.ran, self.log, self.name = n, 0, log, name
        self.required = required

    def step(self) -> bool:
        self.ran += 1
        if self.log is not None:
            self.log.append((self.name, threading.get_ident()))
        return self.n is None or self.ran < self.n


def test_required_jobs_finish_at_the_end_and_optional_ones_are_dropped() -> None:
    need, extra = Slices(5), Slices(5, required=False)
    with background(need, None, extra):
        assert JOBS.get() == (need, extra)                     # None entries skipped
        assert step() and need.ran == 1 and extra.ran == 0     # first job first
    assert need.ran == 5 and need.done
    assert extra.ran == 0 and not extra.done
    assert JOBS.get() == () and not step()                     # nothing outlives the block


def test_after_an_exception_nothing_more_runs() -> None:
    job = Slices(5)
    with pytest.raises(KeyError):
        with background(job):
            step()
            raise KeyError("x")
    assert job.ran == 1 and JOBS.get() == ()


def test_an_inner_block_finishes_its_own_jobs_and_the_outer_ones_come_first() -> None:
    log: list = []
    outer, inner = Slices(5, log, "outer"), Slices(3, log, "inner")
    with background(outer):
        with background(inner):
            for _ in range(2):
                step()
        assert inner.done and not outer.done       # the inner block finished its own
        assert [name for name, _ in log] == ["outer"] * 2 + ["inner"] * 3
    assert outer.done and outer.ran == 5


def test_jobs_belong_to_the_thread_that_made_them() -> None:
    log: list = []

    def worker(name: str) -> None:
        job = Slices(50, log, name)
        with background(job):
            for _ in range(20):
                step()
                time.sleep(0)

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(3)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    owner: dict = {}
    for name, ident in log:
        assert owner.setdefault(name, ident) == ident, "a job ran on another thread"
    assert len(log) == 150


class _Late:
    """A request that completes ``after`` seconds (never if None), logging its tests."""

    def __init__(self, after: float | None, log: list) -> None:
        self.at = None if after is None else time.monotonic() + after
        self.log = log

    def test(self) -> bool:
        self.log.append(("test", 0))
        return self.at is not None and time.monotonic() >= self.at


@pytest.mark.timeout(30)
def test_poll_tests_between_slices_and_keeps_its_deadline() -> None:
    log: list = []
    job = Slices(None, log, required=False)              # endless
    with background(job):
        poll([_Late(0.05, log)], time.monotonic() + 10, lambda: AssertionError("late"))
    kinds = [k for k, _ in log]
    assert kinds[-1] == "test" and job.ran > 0
    assert all(not (a == b == "job") for a, b in zip(kinds, kinds[1:])), \
        "two slices without a test between them"
    start = time.monotonic()
    with background(Slices(None, required=False)):
        with pytest.raises(DeadlineError):
            poll([_Late(None, [])], time.monotonic() + 0.2,
                 lambda: DeadlineError("deadline"))
    assert time.monotonic() - start < 2.0


def _late_exchange(t, delay: float) -> list:
    """Rank 0 sends after ``delay`` s; rank 1 waits for it holding a job of many slices:
    how many ran inside the wait (before the block's end), and the bytes received."""
    job = Slices(10_000)
    buf = np.zeros(4, np.int64)
    if t.rank == 0:
        time.sleep(delay)
        t.send(np.arange(4, dtype=np.int64), 1)
        return [0, 0]
    with background(job):
        t.recv(buf, 0)
        ran = job.ran
    return [ran, int(buf.sum())]


def _late_exchange_on(delay: float) -> list:
    from gradcomm.comm import get_transport

    return _late_exchange(get_transport(None), delay)


def test_the_threads_transport_runs_slices_while_a_message_is_late() -> None:
    ran, total = run_ranks(2, lambda t: _late_exchange(t, 0.2))[1]
    assert ran > 0 and total == 6


@pytest.mark.timeout(60)
def test_the_mpi_transport_runs_slices_while_a_message_is_late() -> None:
    require_mpi()
    ran, total = mpi_call(_late_exchange_on, 2, 0.2, timeout=50)[1]
    assert ran > 0 and total == 6


@pytest.mark.timeout(60)
def test_the_gloo_transport_runs_slices_before_it_blocks() -> None:
    require_torch()
    ran, total = torch_call(_late_exchange_on, 2, 0.2, timeout=50)[1]
    assert ran > 0 and total == 6
