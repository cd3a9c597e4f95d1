"""The gathered route's pipeline (``gradcomm.compressed.pipeline``): pieces cut at the
codec's ``piece_quantum`` leave, on real thread ranks, the same result and residual bytes
as the one-shot route and as the exact replay (which models the one-shot route), over
several error-feedback steps, for p = 2 and 3, with piece counts that do and do not
divide the buffer; a payload that does not decode is a PayloadError on every rank, with
nothing left in flight (the next call is right); the cost model's choice."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.bench.data import gaussian_input
from gradcomm.bench.replay import replay
from gradcomm.collectives.costmodel import gather_pieces as model_pieces
from gradcomm.comm import run_ranks
from gradcomm.compressed import compressed_allreduce, pipeline, routes
from gradcomm.error_feedback import ErrorFeedback
from gradcomm.errors import PayloadError

STEPS = 3


def _run(p: int, n: int, name: str, pieces: int, options: dict) -> list:
    def fn(t):
        state, outs = ErrorFeedback(), []
        for s in range(STEPS):
            g = gaussian_input(t.rank + 7 * s, n, "float32")
            outs.append(compressed_allreduce(t, g, "float32", op="sum", algorithm="allgather",
                                             compressor=name, residuals=state, key="w",
                                             **options).copy())
        return outs, state._residuals["w"].copy()

    old = routes.GATHER_PIECES
    routes.GATHER_PIECES = pieces
    try:
        return run_ranks(p, fn, timeout=120)
    finally:
        routes.GATHER_PIECES = old


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,options", [("onebit", {"bucket_size": 64}),
                                          ("int8", {"bucket_size": 40}),
                                          ("int8", {"bits": 4, "bucket_size": 16})])
@pytest.mark.parametrize("p,n,pieces", [(2, 10_007, 5), (3, 4_099, 4), (2, 64 * 50, 7)])
def test_pieces_keep_the_one_shot_bytes(name: str, options: dict, p: int, n: int,
                                        pieces: int) -> None:
    piped, whole = _run(p, n, name, pieces, options), _run(p, n, name, 1, options)
    stores = [ErrorFeedback() for _ in range(p)]
    for s in range(STEPS):
        ref = replay([gaussian_input(r + 7 * s, n, "float32") for r in range(p)],
                     dtype="float32", op="sum", algorithm="allgather", compressor=name,
                     residuals=stores, key="w", **options)
        for r in range(p):
            assert piped[r][0][s].tobytes() == ref.tobytes() == whole[r][0][s].tobytes(), \
                (s, r)
    for r in range(p):
        assert piped[r][1].tobytes() == whole[r][1].tobytes() == \
            stores[r]._residuals["w"].tobytes(), r


def test_pieces_are_cut_at_the_quantum() -> None:
    for n, k, q in [(10_007, 5, 64), (100, 3, 8), (4_099, 4, 40), (64, 7, 64)]:
        b = pipeline.bounds(n, k, q)
        assert b[0][0] == 0 and b[-1][1] == n and len(b) <= k
        assert all(hi == lo2 for (_, hi), (lo2, _) in zip(b, b[1:]))
        assert all(lo % q == 0 for lo, _ in b)


@pytest.mark.timeout(60)
def test_a_corrupt_piece_raises_on_every_rank_and_leaves_nothing_in_flight() -> None:
    codec = compressors.get("onebit", bucket_size=64)
    real = type(codec).compress

    def bad(self, x, *a, **kw):              # a payload announcing too many elements
        out = real(self, x, *a, **kw)
        if self.corrupt and x.size < 1000:
            out.header["n"] = x.size + 1
        return out

    def fn(t):
        c = compressors.get("onebit", bucket_size=64)
        c.corrupt = t.rank == 1
        c.compress = bad.__get__(c)
        x = gaussian_input(t.rank, 3000, "float32")
        try:
            compressed_allreduce(t, x.copy(), "float32", op="sum", algorithm="allgather",
                                 compressor=c)
            first = "none raised"
        except PayloadError as exc:
            first = str(exc)
        c.corrupt = False
        y = compressed_allreduce(t, x.copy(), "float32", op="sum", algorithm="allgather",
                                 compressor=c)
        return first, y

    old = routes.GATHER_PIECES
    routes.GATHER_PIECES = 4
    try:
        res = run_ranks(2, fn, timeout=50)
    finally:
        routes.GATHER_PIECES = old
    ref = replay([gaussian_input(r, 3000, "float32") for r in range(2)], dtype="float32",
                 op="sum", algorithm="allgather", compressor="onebit", bucket_size=64)
    for first, y in res:
        assert "rank 1's payload" in first, first
        assert y.tobytes() == ref.tobytes()


def test_the_cost_model_pipelines_where_the_wire_is_slow() -> None:
    """One thread: the codec's time overlaps the wire's, each piece costs its messages."""
    k, s = model_pieces(2, 25_000_000, 2048, 1e-4, coding=0.056, wire=0.026)
    assert k > 1 and s < 0.9 * 0.082
    assert model_pieces(2, 25_000_000, 2048, 1e-4, coding=0.056, wire=0.0005)[0] == 1
    assert model_pieces(2, 25_000_000, 0, 1e-4, coding=0.056, wire=0.026)[0] == 1
    assert model_pieces(2, 100_000, 2048, 1e-4, coding=0.001, wire=0.001)[0] == 1
    codec = compressors.get("topk", ratio=0.01)                 # pieces change its bytes
    assert run_ranks(2, lambda t: routes.gather_pieces(t, codec, 10**7, "float32", 4)) \
        == [1, 1]
    assert compressors.get("int8", rounding="stochastic").piece_quantum == 0
    assert compressors.get("int8", scale=0.5).piece_quantum == 0
    assert compressors.get("onebit").piece_quantum == 2048
