"""Reduce-scatter, dense and compressed, on in-process ranks.

Bars: the dense ring gives the exact sums (exact inputs) of the shards FSDP2 expects;
every codec's shards on both routes equal the exact replay bit for bit, p = 1..5, counts
0, 1, < p, not divisible by p, with and without error feedback over several steps, in
float32 and bfloat16; error feedback telescopes; bytes sent per rank equal
:func:`wire_bytes`; bad arguments and mismatches raise on every rank.
"""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm import compressors
from gradcomm._dtypes import f32_to_bf16
from gradcomm.bench.replay import replay_reduce_scatter
from gradcomm.collectives.reduce_scatter import dense_reduce_scatter, shard_bounds
from gradcomm.comm import run_ranks
from gradcomm.compressed import routes
from gradcomm.compressed.reduce_scatter import (ROUTES, compressed_reduce_scatter,
                                                wire_bytes)
from gradcomm.error_feedback import ErrorFeedback, contractive
from gradcomm.errors import ConfigError, MismatchError, UnsupportedError
from tests._cases import expected, make_input

pytestmark = pytest.mark.timeout(300)

CODECS = tuple(compressors.names())
OPTIONS = {"topk": {"ratio": 0.3}, "randomk": {"ratio": 0.3}}


def _input(rank: int, n: int, step: int = 0) -> np.ndarray:
    common = np.random.default_rng(1000 + step).standard_normal(n)
    own = np.random.default_rng(rank * 7919 + 31 * step).standard_normal(n)
    return (common + 0.5 * own).astype(np.float32)


def _storage(x: np.ndarray, dtype: str) -> np.ndarray:
    return f32_to_bf16(x) if dtype == "bfloat16" else x.astype(dtype)


# -- dense ----------------------------------------------------------------------------------
@pytest.mark.parametrize("p", range(1, 6))
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int32", "max"),
                                      ("float64", "mean"), ("bfloat16", "sum")])
def test_dense_exact_shards(p: int, dtype: str, op: str) -> None:
    for n in sorted({0, 1, max(p - 1, 1), p, 2 * p + 3, 1001}):
        want = expected(p, n, dtype, op)
        got = run_ranks(p, lambda t, n=n: dense_reduce_scatter(
            t, make_input(t.rank, n, dtype, op), op, dtype).copy())
        for r, g in enumerate(got):
            lo, hi = shard_bounds(n, p, r)
            assert g.tobytes() == want[lo:hi].tobytes(), (p, n, r)


def test_shards_are_fsdp_layout_and_tile() -> None:
    assert [shard_bounds(12, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    for n in range(0, 12):
        for p in range(1, 6):
            cuts = [shard_bounds(n, p, r) for r in range(p)]
            assert cuts[0][0] == 0 and cuts[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
            assert max(b - a for a, b in cuts) - min(b - a for a, b in cuts) <= 1


# -- every codec, bitwise against the replay -------------------------------------------------
def _check_codec(codec: str, route: str, p: int, dtype: str, ef: bool, steps: int) -> None:
    opts = OPTIONS.get(codec, {})
    for n in sorted({0, 1, max(p - 1, 1), 2 * p + 3, 301}):
        stores = [ErrorFeedback(enabled=ef) for _ in range(p)]
        refs = [ErrorFeedback(enabled=ef) for _ in range(p)]
        if ef and contractive(compressors.get(codec, **opts)) and n:
            for r in range(p):      # as after a re-shard: mass in every segment, own too
                e0 = 0.1 * _input(r + 50, n)
                stores[r].residual("w", n, np.float32)[...] = e0
                refs[r].residual("w", n, np.float32)[...] = e0
        for step in range(steps):
            xs = [_storage(_input(r, n, step), dtype) for r in range(p)]
            got = run_ranks(p, lambda t: compressed_reduce_scatter(
                t, xs[t.rank].copy(), dtype, op="mean", algorithm=route, compressor=codec,
                seed=5, residuals=stores[t.rank], key="w", **opts).copy())
            want = replay_reduce_scatter(xs, dtype=dtype, op="mean", algorithm=route,
                                         compressor=codec, seed=5, residuals=refs, key="w",
                                         **opts)
            for r in range(p):
                assert got[r].tobytes() == want[r].tobytes(), (codec, route, p, n, step, r)
                a, b = list(stores[r].names()), list(refs[r].names())
                assert a == b, (a, b)
                for name in a:
                    assert stores[r].residual(name, n, np.float32).tobytes() == \
                        refs[r].residual(name, n, np.float32).tobytes(), (codec, p, n, r)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("codec", [c for c in CODECS if c != "powersgd"])
def test_codec_matches_replay(codec: str, route: str) -> None:
    for p in range(1, 6):
        _check_codec(codec, route, p, "float32", ef=False, steps=1)
    for p in (2, 3, 5):
        _check_codec(codec, route, p, "float32", ef=True, steps=3)
    _check_codec(codec, route, 3, "bfloat16", ef=True, steps=2)


@pytest.mark.parametrize("codec", ["onebit", "int8"])
def test_capped_span_matches_replay(codec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ring's messages cut by routes.MAX_SPAN_BYTES: the replay cuts them alike."""
    monkeypatch.setattr(routes, "MAX_SPAN_BYTES", 256)
    for p in (2, 3):
        _check_codec(codec, "ring", p, "float32", ef=True, steps=2)


# -- error feedback ----------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
def test_error_feedback_telescopes(route: str) -> None:
    """Σ_steps shards + the residual mass at the end == Σ_steps exact shard + the mass at
    the start (a residual loaded from another rank count: non-zero in own segments too),
    in float64, up to float32 rounding."""
    p, n, steps = 3, 200, 6
    stores = [ErrorFeedback() for _ in range(p)]
    for r, s in enumerate(stores):
        s.residual("w", n, np.float32)[...] = _input(r + 50, n)
    total = sum(s.residual("w", n, np.float32).astype(np.float64) for s in stores)
    got_sum = [np.zeros(b - a) for a, b in (shard_bounds(n, p, r) for r in range(p))]
    for step in range(steps):
        xs = [_input(r, n, step) for r in range(p)]
        total += sum(x.astype(np.float64) for x in xs)
        got = run_ranks(p, lambda t: compressed_reduce_scatter(
            t, xs[t.rank].copy(), "float32", op="sum", algorithm=route, compressor="int8",
            bits=2, residuals=stores[t.rank], key="w").copy())
        for r in range(p):
            got_sum[r] += got[r]
    mass = sum(s.residual("w", n, np.float32).astype(np.float64) for s in stores)
    for r in range(p):
        lo, hi = shard_bounds(n, p, r)
        np.testing.assert_allclose(got_sum[r] + mass[lo:hi], total[lo:hi], atol=1e-4)


@pytest.mark.parametrize("codec,opts", [("fp16", {}), ("topk", {"ratio": 0.3})])
def test_alltoall_streams_large_segments_in_chunks(codec: str, opts: dict) -> None:
    """Segments larger than the compressed ring's chunk (fp16: 1 Mi elements) travel in
    several messages per peer, each encoded on its own (chunk seeds, k per chunk); the
    shards and residuals still equal the replay bitwise, the bytes the table."""
    from gradcomm.collectives._segments import chunks
    from gradcomm.compressed.reduce_scatter import ring_chunk

    for p, n in [(2, 2_600_001), (3, 3_500_003)]:
        c = compressors.get(codec, **opts)
        step = ring_chunk(c, n, "float32")
        off = [shard_bounds(n, p, r)[0] for r in range(p)] + [n]
        want_msgs = [sum(len(chunks(off[d], off[d + 1], step)) for d in range(p) if d != r)
                     for r in range(p)]
        assert min(want_msgs) >= 2 * (p - 1)          # really more than one per peer
        stores, refs = [ErrorFeedback() for _ in range(p)], [ErrorFeedback() for _ in range(p)]
        for k in range(2):
            xs = [_input(r, n, k) for r in range(p)]

            def fn(t):
                t.stats.reset()
                y = compressed_reduce_scatter(t, xs[t.rank].copy(), "float32", op="sum",
                                              algorithm="alltoall", compressor=codec,
                                              check=False, residuals=stores[t.rank],
                                              key="w", **opts).copy()
                return y, t.stats.messages_sent, t.stats.bytes_sent
            got = run_ranks(p, fn)
            want = replay_reduce_scatter(xs, dtype="float32", algorithm="alltoall",
                                         compressor=codec, key="w", residuals=refs, **opts)
            for r in range(p):
                assert got[r][0].tobytes() == want[r].tobytes(), (codec, p, k, r)
                assert got[r][1] == want_msgs[r]
                assert got[r][2] == wire_bytes(c, n, p, r, "float32", "alltoall")
                assert stores[r].residual("w", n, np.float32).tobytes() == \
                    refs[r].residual("w", n, np.float32).tobytes()


def test_alltoall_with_an_absent_rank_gives_a_deadline() -> None:
    """Rank 2 of 3 never joins a chunked all-to-all (2 chunks per segment): the others
    raise DeadlineError after the wait deadline instead of hanging."""
    import time

    from gradcomm.errors import DeadlineError

    n = 6_000_003                                  # fp16: 1 Mi elements per chunk

    def fn(t):
        if t.rank == 2:
            return None
        return compressed_reduce_scatter(t, _input(t.rank, n), "float32", op="sum",
                                         algorithm="alltoall", compressor="fp16",
                                         check=False)
    began = time.monotonic()
    with pytest.raises(DeadlineError):
        run_ranks(3, fn, timeout=60, wait_timeout=2.0)
    assert time.monotonic() - began < 40


# -- bytes on the wire -------------------------------------------------------------------------
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("codec", ["fp16", "int8", "topk", "onebit"])
def test_wire_bytes(codec: str, route: str) -> None:
    for p, n in [(2, 1000), (3, 1001), (5, 3), (4, 5_000_000 // 4)]:
        def fn(t):
            x = _input(t.rank, n)
            t.stats.reset()
            compressed_reduce_scatter(t, x, "float32", op="sum", algorithm=route,
                                      compressor=codec, check=False)
            return t.stats.bytes_sent
        sent = run_ranks(p, fn)
        c = compressors.get(codec)
        assert sent == [wire_bytes(c, n, p, r, "float32", route) for r in range(p)]
        dense = n * 4 * (p - 1) / p
        if codec == "fp16" and n > 100_000:
            assert 0.45 * dense < sent[0] < 0.55 * dense      # half of the dense shards


# -- the public function and errors -----------------------------------------------------------
def test_public_reduce_scatter_numpy_and_torch() -> None:
    torch = pytest.importorskip("torch")
    x = np.arange(10, dtype=np.float32).reshape(2, 5)
    got = run_ranks(3, lambda t: gradcomm.reduce_scatter(x, t, op="mean").tolist())
    assert got == [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    tx = torch.arange(8, dtype=torch.bfloat16)
    out = run_ranks(2, lambda t: gradcomm.reduce_scatter(tx, t, compressor="fp16"))
    assert [o.dtype for o in out] == [torch.bfloat16] * 2
    assert torch.cat(out).tolist() == (2 * torch.arange(8.0)).tolist()
    ef = [ErrorFeedback() for _ in range(2)]
    run_ranks(2, lambda t: gradcomm.reduce_scatter(x, t, compressor="int8",
                                                   error_feedback=ef[t.rank], key="k"))
    assert [s.step("k") for s in ef] == [1, 1]


def test_errors_on_every_rank() -> None:
    def bad(t, **kw):
        try:
            compressed_reduce_scatter(t, np.ones(4, np.float32), "float32", **kw)
        except Exception as exc:        # noqa: BLE001 - the type is the result
            return type(exc).__name__
        return "ok"
    assert run_ranks(2, lambda t: bad(t, op="sum", algorithm="auto",
                                      compressor="powersgd")) == ["UnsupportedError"] * 2
    assert run_ranks(2, lambda t: bad(t, op="max", algorithm="auto",
                                      compressor="int8")) == ["UnsupportedError"] * 2
    assert run_ranks(2, lambda t: bad(t, op="sum", algorithm="tree",
                                      compressor="int8")) == ["ConfigError"] * 2
    assert run_ranks(2, lambda t: bad(t, op="sum", algorithm="ring",
                                      compressor="int8" if t.rank else "fp16")) == \
        ["MismatchError"] * 2
    with pytest.raises(ConfigError):
        run_ranks(1, lambda t: gradcomm.reduce_scatter(np.ones(2), t, ratio=0.1))
    assert issubclass(UnsupportedError, gradcomm.GradcommError)
    assert issubclass(MismatchError, gradcomm.GradcommError)
    assert contractive(compressors.get("int8"))


def test_auto_is_the_alltoall_on_two_ranks_and_above() -> None:
    for p, route in [(2, "alltoall"), (3, "alltoall"), (4, "alltoall")]:
        xs = [_input(r, 1003) for r in range(p)]
        got = run_ranks(p, lambda t: compressed_reduce_scatter(
            t, xs[t.rank].copy(), "float32", op="mean", algorithm="auto",
            compressor="qsgd").copy())
        want = run_ranks(p, lambda t: compressed_reduce_scatter(
            t, xs[t.rank].copy(), "float32", op="mean", algorithm=route,
            compressor="qsgd").copy())
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want], p
