"""gradcomm.bench.replay: every codec x route x p x count x op agrees with the collective
bitwise, on in-process ranks, over several steps with and without error feedback."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm._dtypes import f32_to_bf16
from gradcomm.bench.replay import ROUTES, replay
from gradcomm.compressed import auto_route, compressed_allreduce, routes
from gradcomm.comm import run_ranks
from gradcomm.error_feedback import ErrorFeedback

pytestmark = pytest.mark.timeout(300)

CODECS = compressors.names()
ROUTES_AUTO = (*ROUTES, "auto")
STEPS = 3


def _inputs(p: int, n: int, dtype: str, step: int) -> list[np.ndarray]:
    """Exact, non-periodic Gaussian inputs per (rank, count, step), in storage dtype."""
    out = []
    for r in range(p):
        g = np.random.default_rng([step, r, n, p]).standard_normal(n)
        if dtype == "float64":
            out.append(g)
        elif dtype == "bfloat16":
            out.append(f32_to_bf16(g.astype(np.float32)))
        else:
            out.append(g.astype(dtype))
    return out


def _check(name: str, route: str, p: int, n: int, *, op: str, ef: bool,
           dtype: str = "float32", steps: int = STEPS, **opts: Any) -> None:
    """``steps`` calls on p ranks (fresh inputs each), each compared with the replay."""
    xs = [_inputs(p, n, dtype, s) for s in range(steps)]

    def fn(t):
        state = ErrorFeedback(enabled=ef)
        outs = []
        for s in range(steps):
            outs.append(compressed_allreduce(t, xs[s][t.rank].copy(), dtype, op=op,
                                             algorithm=route, compressor=name, seed=5,
                                             residuals=state, key="w", **opts).copy())
        concrete = auto_route(t, name, n, dtype, **opts) if route == "auto" else route
        return outs, concrete, state

    res = run_ranks(p, fn, timeout=120)
    stores = [ErrorFeedback(enabled=ef) for _ in range(p)]
    concrete = res[0][1]
    if name == "powersgd":
        concrete = route if route != "auto" else "auto"
    for s in range(steps):
        want = replay(xs[s], dtype=dtype, op=op, algorithm=concrete, compressor=name,
                      seed=5, key="w", residuals=stores, **opts)
        for r in range(p):
            got = res[r][0][s]
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), \
                (name, route, concrete, p, n, op, ef, dtype, s, r,
                 float(np.max(np.abs(got.astype(np.float64) - want))) if n else 0)
    for r in range(p):                       # the residuals (and warm starts) too
        mine = res[r][2].state_dict()
        ref = stores[r].state_dict()
        assert sorted(mine) == sorted(ref), (name, route, p, n, r)
        for k, v in mine.items():
            assert np.asarray(v).tobytes() == np.asarray(ref[k]).tobytes(), (name, route, k)


@pytest.mark.parametrize("route", ROUTES_AUTO)
@pytest.mark.parametrize("name", CODECS)
def test_replay_matrix(name: str, route: str) -> None:
    """p = 1..8, counts 0, 1, below p, not divisible by p, larger; sum and mean
    alternate with the count, error feedback with p (even p: on)."""
    for p in range(1, 9):
        for i, n in enumerate(sorted({0, 1, max(1, p - 1), 2 * p + 3, 203})):
            _check(name, route, p, n, op="mean" if (i + p) % 2 else "sum", ef=p % 2 == 0)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64"])
@pytest.mark.parametrize("name", CODECS)
def test_replay_other_dtypes(name: str, dtype: str) -> None:
    for route in ROUTES_AUTO:
        for p, n in ((3, 37), (4, 64)):
            _check(name, route, p, n, op="mean" if p == 3 else "sum", ef=True, dtype=dtype,
                   steps=2)


@pytest.mark.parametrize("name", [n for n in CODECS if n != "powersgd"])
def test_replay_chunked_ring_and_tree(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several chunks per segment (a small CHUNK_BYTES makes them at small counts); the
    pipelined ring (worker thread) has the same schedule and the same bytes."""
    monkeypatch.setattr(routes, "CHUNK_BYTES", 64)
    for route, p, n in (("ring", 3, 301), ("tree", 5, 301), ("ring", 4, 1001)):
        _check(name, route, p, n, op="mean", ef=True)
    monkeypatch.setenv("GRADCOMM_PIPELINE", "1")
    _check(name, "ring", 3, 301, op="sum", ef=True)


@pytest.mark.parametrize("name", ["onebit", "terngrad", "int8"])
def test_replay_capped_span(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages cut by the span cap (routes.MAX_SPAN_BYTES), not by CHUNK_BYTES: the
    replay cuts the same segments, on both rings and the tree."""
    monkeypatch.setattr(routes, "MAX_SPAN_BYTES", 2048)
    for route, p, n in (("ring", 3, 3001), ("tree", 5, 3001)):
        _check(name, route, p, n, op="mean", ef=True)
    monkeypatch.setenv("GRADCOMM_PIPELINE", "1")
    _check(name, "ring", 2, 4001, op="sum", ef=True)


@pytest.mark.parametrize("name,opts", [("topk", {"k": 5}), ("topk", {"ratio": 0.5}),
                                       ("randomk", {"k": 3}), ("randomk", {"ratio": 1.0}),
                                       ("int8", {"bits": 4, "bucket_size": 16}),
                                       ("powersgd", {"rank": 2})])
def test_replay_options(name: str, opts: dict[str, Any]) -> None:
    """k= (segments keep k/n), dense unions (the sparse switch), other codec options."""
    for route in ROUTES_AUTO:
        for p in (2, 3, 5):
            _check(name, route, p, 150, op="sum", ef=True, steps=4, **opts)


def test_replay_large_real_chunks() -> None:
    """Segments above the real chunk size (fp16: 4 MiB messages) on ring and tree."""
    _check("fp16", "ring", 2, 2_200_001, op="mean", ef=False, steps=1)
    _check("bf16", "tree", 3, 1_100_000, op="sum", ef=True, steps=1)


def test_replay_large_pipelined_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOMM_PIPELINE", "1")
    _check("int8", "ring", 2, 1_500_000, op="mean", ef=True, steps=2)


@pytest.mark.parametrize("name", CODECS)
def test_codecs_are_not_trivial(name: str) -> None:
    """The replay shares the codecs with the collective, so it cannot see a codec that
    decodes to zeros (or to its input's negation): this can. Relative error of one
    round trip on Gaussian data must be below 1 (zeros give exactly 1; TernGrad's may
    exceed it), and the decoded values correlate with the input."""
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)
    codec = compressors.get(name)
    y = codec.decompress(codec.compress(x, seed=1)).astype(np.float64)
    err = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert err < 1 or name == "terngrad", (name, err)     # unbiased, noisier than x
    assert float(np.dot(y, x)) > 0.005 * float(np.dot(x, x)), name   # randomk keeps 1 %


def test_replay_refuses_auto_without_transport() -> None:
    from gradcomm.errors import ConfigError

    with pytest.raises(ConfigError, match="auto_route"):
        replay([np.ones(3, np.float32)] * 2, dtype="float32", algorithm="auto",
               compressor="int8")
