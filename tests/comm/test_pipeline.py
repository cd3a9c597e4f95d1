"""The transports' pipeline settings and the deep receive window of ring and tree.

A transport's ``window_bytes`` makes ring keep that many bytes of receives posted ahead of
the one it waits for, and ``chunk_bytes`` picks the message size of the dense pipelined
collectives. Neither may change a result: every case is compared with the exact result
(and across window settings, byte for byte), at counts 0, 1, < p, not divisible by p and
with many chunks per segment, so messages cross segment boundaries. A rank that stalls in
the middle of a deep pipeline makes the others raise DeadlineError, never hang.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest

from gradcomm.collectives import ring, tree
from gradcomm.comm import run_ranks
from gradcomm.comm.base import PIPELINE_CHUNK, Transport
from gradcomm.errors import DeadlineError
from gradcomm.ops import Reducer
from tests._cases import expected, make_input, same_bytes, small_counts

ALGORITHMS = {"ring": ring.allreduce, "tree": tree.allreduce}


class Lead:
    """Counts, on a real transport, how far receives were posted ahead of the receive the
    algorithm waits for (posted minus waited-for, at each wait on one receive)."""

    def __init__(self, t: Transport) -> None:
        self.posted = self.waited = self.most = 0
        self.receives: set[int] = set()
        irecv, waitall = t.irecv, t.waitall

        def counted_irecv(buf: Any, source: int, tag: int = 3) -> Any:
            req = irecv(buf, source, tag)
            self.posted += 1
            self.receives.add(id(req))
            return req

        def counted_waitall(reqs: Any, timeout: float | None = None) -> None:
            if len(reqs) == 1 and id(reqs[0]) in self.receives:
                self.most = max(self.most, self.posted - self.waited)
                self.waited += 1
            waitall(reqs, timeout)

        t.irecv, t.waitall = counted_irecv, counted_waitall    # type: ignore[method-assign]


def run_case(p: int, count: int, algo: str, window: int, chunk: int | None,
             dtype: str = "float32") -> list[tuple[bytes, int]]:
    def fn(t: Transport) -> tuple[bytes, int]:
        t.window_bytes = window
        lead = Lead(t)
        buf = make_input(t.rank, count, dtype, "sum")
        ALGORITHMS[algo](t, buf, Reducer("sum", dtype), chunk_bytes=chunk)
        assert same_bytes(buf, expected(p, count, dtype, "sum")), (t.rank, count)
        return buf.tobytes(), lead.most

    return run_ranks(p, fn, timeout=60)


@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_deep_window_gives_the_exact_bytes_at_every_count(p: int, algo: str) -> None:
    """Chunks of 3 elements, windows of 0 (double buffering), 5 and 40 messages."""
    counts = small_counts(p) + [7 * p + 2, 61]
    for count in counts:
        got = {w: run_case(p, count, algo, w, 12) for w in (0, 60, 480)}
        for w, res in got.items():
            assert len({b for b, _ in res}) == 1, (count, w)         # same on every rank
            assert res[0][0] == got[0][0][0], (count, w)             # window-independent


@pytest.mark.parametrize("p", [2, 3, 4])
def test_ring_posts_as_deep_as_the_window(p: int) -> None:
    """With 4-byte chunks and a window of 8 messages, ring keeps 1 + 8 receives posted
    (segments of 40 chunks); with no window, two (double buffering)."""
    count = 40 * p
    deep = run_case(p, count, "ring", 32, 4)
    shallow = run_case(p, count, "ring", 0, 4)
    assert {lead for _, lead in deep} == {9}, deep
    assert {lead for _, lead in shallow} == {2}, shallow


def test_chunk_bytes_follows_the_transport_and_never_the_rank() -> None:
    """The in-process transport keeps 512 KiB messages; a transport allowing larger ones
    cuts a segment into ``chunks_per_segment`` messages, bounded below and above."""
    def fn(t: Transport) -> tuple[int, int, int, int]:
        threads = t.chunk_bytes(256 << 20)
        t.max_chunk_bytes = 16 << 20
        return threads, t.chunk_bytes(1000), t.chunk_bytes(48 << 20), t.chunk_bytes(1 << 30)

    for res in run_ranks(3, fn):
        assert res == (PIPELINE_CHUNK, PIPELINE_CHUNK, 6 << 20, 16 << 20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("algo", ["ring", "tree"])
def test_a_rank_stalling_mid_pipeline_raises_deadline_on_the_others(algo: str) -> None:
    """Rank 0 stops at its third wait (a hung process) while the deep window has
    many more posted: the waiting ranks raise DeadlineError within about their 0.5 s
    deadline, and run_ranks reports it instead of hanging."""
    def fn(t: Transport) -> None:
        t.window_bytes = 400
        if t.rank == 0:
            waitall, seen = t.waitall, [0]

            def stalling(reqs: Any, timeout: float | None = None) -> None:
                seen[0] += 1
                if seen[0] == 3:
                    time.sleep(3.0)
                waitall(reqs, timeout)

            t.waitall = stalling                    # type: ignore[method-assign]
        buf = np.arange(3000, dtype=np.float32)
        ALGORITHMS[algo](t, buf, Reducer("sum", "float32"), chunk_bytes=40)

    start = time.monotonic()
    with pytest.raises(DeadlineError, match="did not complete within 0.5 s"):
        run_ranks(3, fn, timeout=20, wait_timeout=0.5)
    assert time.monotonic() - start < 10


def launched_pipeline(counts: list[int]) -> dict[str, Any]:
    """On every rank of a real launch (mpirun or gloo): ring and tree at each count,
    with 12-byte chunks and no window, a window of 5 messages and one of 40 (so the
    launch's transport moves many messages posted ahead); digests per case, and the
    transport's own large-message settings."""
    import hashlib

    from gradcomm.comm import get_transport

    t = get_transport(None)
    out: dict[str, Any] = {"window": t.window_bytes, "chunk": t.chunk_bytes(256 << 20),
                           "wrong": [], "digests": {}}
    for algo in ALGORITHMS:
        for count in counts:
            for window in (0, 60, 480):
                t.window_bytes = window
                buf = make_input(t.rank, count, "float32", "sum")
                ALGORITHMS[algo](t, buf, Reducer("sum", "float32"), chunk_bytes=12)
                if not same_bytes(buf, expected(t.size, count, "float32", "sum")):
                    out["wrong"].append(f"{algo}/{count}/{window}")
                out["digests"][f"{algo}/{count}/{window}"] = hashlib.blake2b(
                    buf.tobytes(), digest_size=8).hexdigest()
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("launcher,p", [("mpi", 3), ("gloo", 2)])
def test_deep_window_on_real_transports(launcher: str, p: int) -> None:
    """Both transports default to large messages, and to double buffering here (gloo:
    measured; MPI: every rank on this node, over shared memory: test_mpi.py has the
    network's deep window); ring and tree give the exact bytes with any window, on every
    rank."""
    from tests._launch import mpi_call, require_mpi, require_torch, torch_call

    counts = small_counts(p) + [7 * p + 2, 301]
    if launcher == "mpi":
        require_mpi()
        res = mpi_call(launched_pipeline, p, counts, timeout=180)
    else:
        require_torch()
        res = torch_call(launched_pipeline, p, counts, timeout=180)
    for r in res:
        assert r["wrong"] == [], r["wrong"]
        assert r["chunk"] == 16 << 20, r           # gloo: double buffering (measured)
        assert r["window"] == 0, r
    assert len({json_key(r["digests"]) for r in res}) == 1


def json_key(d: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(d.items()))


def test_receive_buffers_are_kept_after_a_call_and_dropped_after_a_failure() -> None:
    """A dense ring keeps its receive buffers in the transport's state for the next call
    (no page faults per call); one that failed mid-pipeline leaves none behind."""
    def fn(t: Transport) -> tuple[bool, bool, bool]:
        t.window_bytes = 400
        buf = np.arange(3000, dtype=np.float32)
        ring.allreduce(t, buf, Reducer("sum", "float32"), chunk_bytes=40)
        kept = bool(t.state.scratch.get("dense"))
        again = np.arange(3000, dtype=np.float32)
        ring.allreduce(t, again, Reducer("sum", "float32"), chunk_bytes=40)
        same = bool(np.array_equal(again, np.arange(3000, dtype=np.float32) * t.size))
        t.timeout = 0.3
        try:                                # only rank 0 calls: the others never join
            if t.rank == 0:
                ring.allreduce(t, again, Reducer("sum", "float32"), chunk_bytes=40)
        except DeadlineError:
            pass
        return kept, same, "dense" in t.state.scratch

    res = run_ranks(2, fn, timeout=20)
    assert res[0] == (True, True, False) and res[1] == (True, True, True), res
