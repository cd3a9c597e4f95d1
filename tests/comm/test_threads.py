"""run_ranks and the in-process transport: the semantics the collectives rely on."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from gradcomm.comm import ThreadTransport, run_ranks
from gradcomm.comm.base import TAG_DATA, TAG_USER
from gradcomm.comm.threads import EAGER_LIMIT
from gradcomm.errors import (AbortedError, ConfigError, DeadlineError, GradcommError,
                             TransportError)

pytestmark = pytest.mark.timeout(60)


def no_rank_threads_left() -> bool:
    return not any(th.name.startswith("gradcomm-rank") for th in threading.enumerate())


def test_results_in_rank_order() -> None:
    assert run_ranks(5, lambda t: (t.rank, t.size, t.name)) == \
        [(r, 5, "threads") for r in range(5)]
    assert run_ranks(1, lambda t: "alone") == ["alone"]


def test_needs_a_positive_rank_count() -> None:
    with pytest.raises(TransportError, match="n >= 1"):
        run_ranks(0, lambda t: None)


def test_exception_is_raised_naming_the_rank() -> None:
    def fn(t: Any) -> None:
        if t.rank == 2:
            raise KeyError("boom")

    with pytest.raises(KeyError, match="boom") as info:
        run_ranks(4, fn)
    assert info.value.rank == 2  # type: ignore[attr-defined]
    assert any("rank 2 of 4" in note for note in info.value.__notes__)
    assert no_rank_threads_left()


def test_a_failing_rank_aborts_the_others_promptly() -> None:
    seen: list[BaseException] = []

    def fn(t: Any) -> None:
        if t.rank == 0:
            time.sleep(0.05)
            raise ValueError("rank 0 gives up")
        try:
            t.recv(np.empty(4), 0)          # would wait 60 s for a message never sent
        except GradcommError as exc:
            seen.append(exc)
            raise

    start = time.monotonic()
    with pytest.raises(ValueError, match="gives up") as info:
        run_ranks(3, fn, wait_timeout=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 0  # type: ignore[attr-defined]
    assert len(seen) == 2 and all(isinstance(e, AbortedError) for e in seen)
    assert all("rank 0 failed" in str(e) and "ValueError" in str(e) for e in seen)
    assert no_rank_threads_left()


def test_overall_timeout_names_the_ranks_still_running() -> None:
    def fn(t: Any) -> None:
        if t.rank in (1, 3):
            t.recv(np.empty(1), 0)          # blocked far past the overall timeout

    start = time.monotonic()
    with pytest.raises(DeadlineError, match=r"rank\(s\) \[1, 3\] still running"):
        run_ranks(4, fn, timeout=0.5, wait_timeout=60)
    assert time.monotonic() - start < 10
    assert no_rank_threads_left()           # the blocked ranks were woken and ended


def test_wait_timeout_is_a_deadline_error_naming_the_rank() -> None:
    with pytest.raises(DeadlineError, match="rank 1/2 .*0.2 s") as info:
        run_ranks(2, lambda t: t.recv(np.empty(1), 0) if t.rank else None,
                  wait_timeout=0.2)
    assert info.value.rank == 1  # type: ignore[attr-defined]


def exchange_send_first(nbytes: int, **kw: Any) -> list[Any]:
    """Both ranks send, then receive: fine for eager messages, a deadlock otherwise."""
    def fn(t: Any) -> bytes:
        out = np.full(nbytes, t.rank + 1, np.uint8)
        got = np.empty(nbytes, np.uint8)
        t.send(out, 1 - t.rank)
        t.recv(got, 1 - t.rank)
        return bytes(got[:1])

    return run_ranks(2, fn, **kw)


def test_small_sends_are_eager() -> None:
    assert exchange_send_first(EAGER_LIMIT) == [b"\x02", b"\x01"]
    assert exchange_send_first(100, eager_limit=100) == [b"\x02", b"\x01"]


@pytest.mark.parametrize("nbytes,limit", [(EAGER_LIMIT + 1, EAGER_LIMIT), (101, 100)])
def test_large_sends_rendezvous_so_send_send_deadlocks(nbytes: int, limit: int) -> None:
    start = time.monotonic()
    with pytest.raises(DeadlineError, match="did not complete"):
        exchange_send_first(nbytes, eager_limit=limit, wait_timeout=0.3)
    assert time.monotonic() - start < 10
    assert no_rank_threads_left()


def test_rendezvous_send_completes_when_received() -> None:
    def fn(t: Any) -> Any:
        big = np.arange(EAGER_LIMIT, dtype=np.float64)      # 8x the eager limit
        if t.rank == 0:
            req = t.isend(big, 1)
            time.sleep(0.1)
            assert not req.test()                           # nobody has taken it yet
            t.waitall([req])
            return True
        time.sleep(0.2)
        got = np.empty_like(big)
        t.recv(got, 0)
        return bool((got == big).all())

    assert run_ranks(2, fn) == [True, True]


def test_eager_send_buffer_may_be_reused_at_once() -> None:
    def fn(t: Any) -> Any:
        if t.rank == 0:
            buf = np.array([1, 2, 3])
            t.send(buf, 1)
            buf[:] = -1                     # the message already left
            return None
        time.sleep(0.05)
        got = np.empty(3, np.int64)
        t.recv(got, 0)
        return got.tolist()

    assert run_ranks(2, fn)[1] == [1, 2, 3]


def test_receive_size_must_match_exactly() -> None:
    def fn(t: Any) -> None:
        if t.rank == 0:
            t.send(np.zeros(2, np.int32), 1)
        else:
            t.recv(np.empty(4, np.int32), 0)

    with pytest.raises(TransportError, match="message of 8 bytes .* holds 16 bytes"):
        run_ranks(2, fn, wait_timeout=2)


def test_messages_match_by_source_and_tag_in_order() -> None:
    def fn(t: Any) -> Any:
        if t.rank in (0, 1):
            for i in range(3):
                t.send(np.array([10 * t.rank + i]), 2, TAG_DATA)
            t.send(np.array([99 + t.rank]), 2, TAG_USER)
            return None
        got = []
        for src, tag in [(1, TAG_USER), (0, TAG_DATA), (1, TAG_DATA), (0, TAG_USER),
                         (0, TAG_DATA), (0, TAG_DATA), (1, TAG_DATA), (1, TAG_DATA)]:
            b = np.empty(1, np.int64)
            t.recv(b, src, tag)
            got.append(int(b[0]))
        return got

    assert run_ranks(3, fn)[2] == [100, 0, 10, 99, 1, 2, 11, 12]


def test_sendrecv_ring_of_large_messages() -> None:
    def fn(t: Any) -> float:
        out = np.full(100_000, float(t.rank))
        got = np.empty_like(out)
        t.sendrecv(out, (t.rank + 1) % t.size, got, (t.rank - 1) % t.size)
        return float(got[0])

    assert run_ranks(4, fn) == [3.0, 0.0, 1.0, 2.0]


def test_invalid_peers_and_buffers() -> None:
    def fn(t: Any) -> list[str]:
        errors = []
        for call in (lambda: t.isend(np.zeros(1), t.rank), lambda: t.irecv(np.zeros(1), 5),
                     lambda: t.isend(np.zeros(1), -1),
                     lambda: t.isend(np.zeros(4)[::2], 1 - t.rank)):
            try:
                call()
                errors.append("no error")
            except TransportError as exc:
                errors.append(str(exc))
        return errors

    for errs in run_ranks(2, fn):
        assert "invalid peer" in errs[0] and "invalid peer" in errs[1]
        assert "invalid peer" in errs[2] and "contiguous" in errs[3]


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="timeout"):
        run_ranks(2, lambda t: None, wait_timeout=0)


def test_stats_count_what_each_rank_sends_and_receives() -> None:
    def fn(t: Any) -> Any:
        s = t.stats
        assert s.snapshot() == dict(bytes_sent=0, messages_sent=0, bytes_received=0,
                                    messages_received=0)
        peer = 1 - t.rank
        if t.rank == 0:
            t.send(np.zeros(10, np.float32), peer)
            t.send(np.zeros(3, np.int8), peer)
            t.recv(np.empty(2, np.float64), peer)
        else:
            t.recv(np.empty(10, np.float32), peer)
            t.recv(np.empty(3, np.int8), peer)
            t.send(np.zeros(2, np.float64), peer)
        first = s.snapshot()
        s.reset()
        t.barrier()
        return first, s.snapshot()

    (a, ba), (b, bb) = run_ranks(2, fn)
    assert a == dict(bytes_sent=43, messages_sent=2, bytes_received=16, messages_received=1)
    assert b == dict(bytes_sent=16, messages_sent=1, bytes_received=43, messages_received=2)
    assert ba == bb == dict(bytes_sent=1, messages_sent=1, bytes_received=1,
                            messages_received=1)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 8])
def test_barrier_rounds(p: int) -> None:
    rounds = (p - 1).bit_length()          # ceil(log2 p)
    stats = run_ranks(p, lambda t: (t.barrier(), t.stats.messages_sent)[1])
    assert stats == [rounds] * p


def test_barrier_waits_for_everyone() -> None:
    arrived: list[int] = []

    def fn(t: Any) -> int:
        if t.rank == 2:
            time.sleep(0.2)
        arrived.append(t.rank)
        t.barrier()
        return len(arrived)

    assert run_ranks(4, fn) == [4, 4, 4, 4]


def test_native_allreduce_reduces_in_rank_order_repeatedly() -> None:
    def fn(t: Any) -> list[float]:
        out = []
        for i in range(3):
            buf = np.array([t.rank + i, -t.rank], np.float64)
            t.native_allreduce(buf, "sum", "float64")
            out += buf.tolist()
        return out

    res = run_ranks(3, fn)
    assert res[0] == res[1] == res[2] == [3.0, -3.0, 6.0, -3.0, 9.0, -3.0]


def test_transport_type() -> None:
    assert run_ranks(2, lambda t: isinstance(t, ThreadTransport)) == [True, True]
