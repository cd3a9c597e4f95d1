"""The powersgd codec's stateless parts: layouts, Gram-Schmidt, the one-payload codec.

The registry-wide codec checks of ``test_codecs.py`` (round trips for every dtype and
count, exact max_nbytes, zeros, NaN/Inf propagation, decompress_sum, out= reuse, registry
round trip) run here on powersgd configurations; the collective is tested in
``tests/collectives/test_powersgd.py`` (this file has another basename: pytest
imports test modules by basename).
"""

from __future__ import annotations

import numpy as np
import pytest

import tests.compressors.test_codecs as common
from gradcomm.compressors import Payload, get, names
from gradcomm.compressors.powersgd import (Layout, PowerSGD, layout, left, matrix_shape,
                                           orthonormalize, product, random_factor, right)
from gradcomm.error_feedback import contractive
from gradcomm.errors import ConfigError, PayloadError

CONFIGS = [{}, {"rank": 3}, {"rank": 2, "min_compression_rate": 0.0},
           {"rank": 64, "min_compression_rate": 1.0}]
IDS = ["default", "rank3", "rate0", "rank64"]


def test_registered_with_its_flags() -> None:
    assert "powersgd" in names()
    c = get("powersgd", rank=4)
    assert isinstance(c, PowerSGD) and c.lossy and c.shared_seed and contractive(c)
    assert c.reduction == "summable"
    assert c.get_config() == {"rank": 4, "min_compression_rate": 2.0, "start_iter": 0,
                              "warm_start": True}


@pytest.mark.parametrize("opts", CONFIGS, ids=IDS)
def test_common_codec_contract(opts: dict) -> None:
    common.test_round_trip_shape_dtype_and_wire("powersgd", opts)
    common.test_max_nbytes_bounds_every_input("powersgd", opts)
    common.test_zeros_decode_to_zeros("powersgd", opts)
    common.test_decompress_sum_is_the_sum("powersgd", opts)
    common.test_registry_round_trip("powersgd", opts)
    common.test_out_arguments("powersgd", opts)
    for bad in (np.nan, np.inf, -np.inf):
        common.test_non_finite_inputs_propagate("powersgd", opts, bad)


@pytest.mark.parametrize("opts,option", [
    ({"rank": 0}, "rank"), ({"rank": 2.0}, "rank"), ({"rank": True}, "rank"),
    ({"rank": 1025}, "rank"), ({"min_compression_rate": -1}, "min_compression_rate"),
    ({"min_compression_rate": float("nan")}, "min_compression_rate"),
    ({"min_compression_rate": float("inf")}, "min_compression_rate"),
    ({"min_compression_rate": "2"}, "min_compression_rate"),
    ({"start_iter": -1}, "start_iter"), ({"start_iter": 1.5}, "start_iter"),
    ({"warm_start": "yes"}, "warm_start"), ({"warm_start": 1}, "warm_start")])
def test_invalid_options_name_the_option(opts: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        get("powersgd", **opts)


def test_unknown_option_and_bad_inputs() -> None:
    with pytest.raises(TypeError):
        get("powersgd", colour="red")
    c = get("powersgd")
    with pytest.raises(ConfigError, match="float16, float32 or float64"):
        c.compress(np.arange(5))
    with pytest.raises(ConfigError, match="numpy array"):
        c.compress([1.0, 2.0])
    with pytest.raises(ConfigError, match="dtype"):
        c.max_nbytes(10, "int32")


def test_matrix_shapes() -> None:
    assert matrix_shape(0) == (0, 0) and matrix_shape(1) == (1, 1)
    assert matrix_shape(10) == (3, 4) and matrix_shape(16) == (4, 4) and \
        matrix_shape(17) == (4, 5)
    for n in range(1, 3000):                           # near-square, less than a row padded
        rows, cols = matrix_shape(n)
        assert rows * cols >= n > (rows - 1) * cols and cols - 1 <= rows <= cols
    assert matrix_shape(60, (3, 4, 5)) == (3, 20)       # PyTorch's view(shape[0], -1)
    assert matrix_shape(7, (7,)) == (7, 1) and matrix_shape(1, ()) == (1, 1)
    assert matrix_shape(0, (0, 5)) == (0, 0)


def test_compress_only_where_pytorch_would() -> None:
    """r = min(rank, rows, cols); compressed iff r (rows + cols) rate < n (PyTorch's
    _should_compress with n = rows * cols)."""
    for rows, cols, rank, rate in [(10, 10, 1, 2.0), (10, 10, 3, 2.0), (4, 4, 1, 2.0),
                                   (4, 4, 1, 1.9), (100, 1, 1, 2.0), (100, 1, 1, 0.0),
                                   (64, 32, 8, 2.0), (64, 32, 64, 0.5)]:
        lay = layout(rows * cols, (rows, cols), rank=rank, min_compression_rate=rate)
        r = min(rank, rows, cols)
        assert lay == Layout(rows, cols, r if r * (rows + cols) * rate < rows * cols else 0)
    assert layout(0).r == 0 and layout(8).r == 0                  # small: sent as they are
    assert layout(1000, rank=2) == Layout(32, 32, 2)


def test_orthonormalize() -> None:
    rng = np.random.default_rng(0)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 1e-5)):
        a = rng.standard_normal((6, 500)).astype(dtype)
        orthonormalize(a)
        assert np.abs(a @ a.T - np.eye(6)).max() < tol
        b = rng.standard_normal((3, 50)).astype(dtype) * 1e30        # no overflow in norms
        b[1] = 0
        orthonormalize(b)
        assert np.isfinite(b).all() and not b[1].any()
        assert abs(np.dot(b[0], b[0]) - 1) < tol and abs(np.dot(b[2], b[0])) < tol
    c = rng.standard_normal((2, 10))
    c[0, 3] = np.inf
    assert np.isnan(orthonormalize(c)).all()                   # non-finite: NaN, everywhere
    d = rng.standard_normal((3, 40))
    d[2] = d[0] + 2 * d[1]                                     # dependent: stays a unit row
    orthonormalize(d)
    assert np.abs(d @ d.T - np.eye(3)).max() < 1e-6


def test_deterministic_bytes() -> None:
    a = np.random.default_rng(1).standard_normal((4, 301)).astype(np.float32)
    assert orthonormalize(a.copy()).tobytes() == orthonormalize(a.copy()).tobytes()
    assert random_factor(2, 9, (1, 2), np.float32).tobytes() == \
        random_factor(2, 9, (1, 2), np.float32).tobytes() != \
        random_factor(2, 9, (1, 3), np.float32).tobytes()
    c, x = get("powersgd", rank=2), np.random.default_rng(2).standard_normal(999)
    assert c.compress(x, seed=5).to_bytes().tobytes() == c.compress(x, seed=5).to_bytes().tobytes()
    assert c.compress(x, seed=5).to_bytes().tobytes() != c.compress(x, seed=6).to_bytes().tobytes()


@pytest.mark.parametrize("n,shape", [(1024, None), (1000, None), (37 * 53, (37, 53)),
                                     (5 * 7 * 11, (5, 7, 11))])
def test_products_match_the_padded_matrix(n: int, shape) -> None:
    """left/right/product on a flat part equal the dense products with the zero-padded
    matrix (the padding is never materialised)."""
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n)
    lay = layout(n, shape, rank=3, min_compression_rate=0)
    m = np.zeros(lay.rows * lay.cols)
    m[:n] = x
    m = m.reshape(lay.rows, lay.cols)
    qt = rng.standard_normal((lay.r, lay.cols))
    pt = left(x, lay, qt, np.empty((lay.r, lay.rows)))
    np.testing.assert_allclose(pt, qt @ m.T, rtol=1e-12, atol=1e-12)
    q2 = right(x, lay, pt, np.empty((lay.r, lay.cols)))
    np.testing.assert_allclose(q2, pt @ m, rtol=1e-12, atol=1e-9)
    out = product(pt, q2, lay, np.empty(n))
    np.testing.assert_allclose(out, (pt.T @ q2).reshape(-1)[:n], rtol=1e-12, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_rank_r_matrices_are_recovered(dtype: str) -> None:
    """One power iteration recovers a matrix of rank <= r (flat layout 48 x 48)."""
    rng = np.random.default_rng(3)
    for r in (1, 2, 4):
        m = (rng.standard_normal((48, r)) @ rng.standard_normal((r, 48))).astype(dtype)
        c = get("powersgd", rank=r)
        y = c.decompress(c.compress(m.reshape(-1), seed=r))
        tol = 1e-4 if dtype == "float32" else 1e-10
        assert np.abs(y - m.reshape(-1)).max() <= tol * np.abs(m).max(), r


def test_a_projection_hence_a_contraction() -> None:
    """decode(encode(x)) = P P^T M: ||x - C(x)||^2 + ||C(x)||^2 = ||x||^2 (Pythagoras)
    when the layout is exact; with a padded last row the padding's share of the
    projection is dropped, so ``<=``. Hence ||x - C(x)|| <= ||x||."""
    c = get("powersgd", rank=2)
    rng = np.random.default_rng(4)
    for s in range(60):
        n = int(rng.integers(30, 3000)) if s % 2 else int(rng.integers(6, 55)) ** 2
        x = rng.standard_normal(n)
        y = c.decompress(c.compress(x, seed=s))
        total = np.dot(x - y, x - y) + np.dot(y, y)
        assert total <= np.dot(x, x) * (1 + 1e-12)
        lay = c.layout(n)
        if lay.rows * lay.cols == n:
            assert abs(total - np.dot(x, x)) <= 1e-9 * np.dot(x, x)


def test_wire_is_r_rows_plus_cols_values() -> None:
    c = get("powersgd", rank=4)
    for dtype, size in (("float16", 4), ("float32", 4), ("float64", 8)):
        p = c.compress(np.ones(100_000, dtype), seed=0)
        lay = c.layout(100_000)
        assert (lay.rows, lay.cols) == (316, 317)
        values = sum(b.nbytes for b in p.buffers.values())
        assert values == 4 * (lay.rows + lay.cols) * size == sum(
            b.nbytes for k, b in p.buffers.items() if k in "pq")
        assert p.nbytes - values < 100


def test_hostile_payloads_are_payload_errors() -> None:
    c = get("powersgd", rank=2)
    good = c.compress(np.random.default_rng(5).standard_normal(500).astype(np.float32), seed=1)
    h, b = dict(good.header), dict(good.buffers)
    cases = [
        ({**h, "rows": 23}, b, "expects"), ({**h, "r": 3}, b, "expects"),
        ({**h, "r": -1}, b, "r="), ({**h, "n": 600}, b, "expects"),
        ({**h, "dt": 5}, b, "dtype"), ({**h, "dt": 4}, b, "buffer .p."), (h, {**b, "p": b["p"][:-1]}, "buffer 'p'"),
        (h, {**b, "q": b["q"].astype(np.float64)}, "buffer 'q'"),
        (h, {**b, "v": np.zeros(3, np.float32)}, "buffer 'v'"),
        ({k: v for k, v in h.items() if k != "cols"}, b, "keys"),
    ]
    for header, buffers, text in cases:
        with pytest.raises(PayloadError, match=text):
            c.decompress(Payload("powersgd", header, buffers))
    with pytest.raises(PayloadError, match="expects"):                  # another rank
        get("powersgd", rank=1).decompress(good)
    wire = good.to_bytes()
    rng = np.random.default_rng(6)
    for trial in range(300):                            # never anything but PayloadError
        bad = wire.copy()
        bad[rng.integers(0, bad.size)] ^= np.uint8(1 << rng.integers(0, 8))
        if trial % 2:
            bad = bad[:rng.integers(0, bad.size)]
        try:
            with np.errstate(all="ignore"):
                c.decompress(Payload.from_bytes(bad))
        except PayloadError:
            pass


def test_seeded_q_is_shared() -> None:
    """Ranks passing the same seed start from the same Q: summing their payloads' P
    before orthogonalising is the collective's round 1 (linearity in M)."""
    c = get("powersgd", rank=2)
    rng = np.random.default_rng(7)
    xs = [rng.standard_normal(900) for _ in range(3)]
    lay = c.layout(900)
    q0 = orthonormalize(random_factor(2, lay.cols, 11, np.float64))
    p_sum = sum(left(x, lay, q0, np.empty((2, lay.rows))) for x in xs)
    p_of_sum = left(sum(xs), lay, q0, np.empty((2, lay.rows)))
    np.testing.assert_allclose(p_sum, p_of_sum, atol=1e-12)
    y = c.decompress(c.compress(sum(xs), seed=11))
    pt = orthonormalize(p_sum.copy())
    qt = sum(right(x, lay, pt, np.empty((2, lay.cols))) for x in xs)
    np.testing.assert_allclose(product(pt, qt, lay, np.empty(900)), y, atol=1e-10)
