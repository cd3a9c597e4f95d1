"""Properties from the papers, measured over many seeds (fixed seeds: deterministic tests).

Tolerances come from the variance. For unbiasedness each decoded element is
``x_i + step_i * (B - p_i)`` with ``B`` a Bernoulli(p_i) draw, so its variance is
``step_i^2 p_i (1 - p_i)``; the mean of R draws stays within Bernstein's bound
``sqrt(2 var L / R) + 2/3 step L / R`` (``L = ln(2 / delta)``, delta = 1e-7 per element)
plus the codec's documented bias allowance (the 16-bit dither and float32 rounding:
2^-16 of a step). Other tests compare a mean with its target within Z standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from gradcomm.compressors import get

R = 1500          # draws per statistical test
Z = 5.5
L = math.log(2 / 1e-7)
#: float32 rounding of scale * (s / scale)
REL = 1e-6


def draws(c, x: np.ndarray, r: int = R) -> np.ndarray:
    """R independent draws of C(x): x tiled R times (buckets stay aligned) is compressed
    once, so each copy takes its own stretch of the random stream."""
    y = c.decompress(c.compress(np.tile(x, r), seed=99))
    return y.reshape(r, x.size).astype(np.float64)


def draws_per_seed(c, x: np.ndarray, r: int) -> np.ndarray:
    """R draws with R seeds (how a training loop calls the codec)."""
    return np.stack([c.decompress(c.compress(x, seed=(99, i))) for i in range(r)]).astype(
        np.float64)


def vectors(n: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(n)
    sparse = np.zeros(n, np.float32)
    sparse[rng.integers(0, n, n // 20)] = rng.standard_normal(n // 20)
    return {"gauss": rng.standard_normal(n).astype(np.float32),
            "heavy": (rng.standard_cauchy(n) * 1e-3).astype(np.float32),
            "sparse": sparse,
            "const": np.full(n, -0.75, np.float32)}


def assert_unbiased(samples: np.ndarray, x: np.ndarray, step: np.ndarray,
                    pos: np.ndarray) -> None:
    """Per element: |mean - x| within Bernstein's bound for steps of ``step`` taken with
    probability ``p = frac(pos)`` (``pos``: the position in steps)."""
    r = samples.shape[0]
    p = pos - np.floor(pos)
    var = step ** 2 * p * (1 - p)
    tol = np.sqrt(2 * var * L / r) + 2 / 3 * step * L / r + 2.0 ** -16 * step + \
        REL * np.abs(x)
    err = np.abs(samples.mean(axis=0) - x)
    bad = np.flatnonzero(err > tol)
    assert bad.size == 0, [(int(i), float(x[i]), float(err[i]), float(tol[i])) for i in bad[:5]]


@pytest.mark.parametrize("levels,bucket", [(1, 64), (7, 64), (127, 256)])
def test_qsgd_is_unbiased(levels: int, bucket: int) -> None:
    c = get("qsgd", levels=levels, bucket_size=bucket)
    for x in vectors(256).values():
        x64 = x.astype(np.float64)
        norms = np.sqrt(np.add.reduceat(x64 ** 2, np.arange(0, 256, bucket)))
        step = np.repeat(norms, bucket)[:256] / levels
        assert_unbiased(draws(c, x), x64, step, np.abs(x64) / np.maximum(step, 1e-300))


def test_qsgd_is_unbiased_across_seeds() -> None:
    c = get("qsgd", levels=3, bucket_size=64)
    x = vectors(128)["gauss"].astype(np.float64)
    step = np.repeat(np.sqrt((x.reshape(2, 64) ** 2).sum(axis=1)), 64) / 3
    assert_unbiased(draws_per_seed(c, x.astype(np.float32), 400), x, step, np.abs(x) / step)


def test_terngrad_is_unbiased() -> None:
    c = get("terngrad", bucket_size=64)
    for x in vectors(256).values():
        x64 = x.astype(np.float64)
        scale = np.repeat(np.abs(x64).reshape(4, 64).max(axis=1), 64)
        assert_unbiased(draws(c, x), x64, scale, np.abs(x64) / np.maximum(scale, 1e-300))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_int8_stochastic_is_unbiased(bits: int) -> None:
    c = get("int8", bits=bits, bucket_size=64, rounding="stochastic")
    for x in vectors(256).values():
        x64 = x.astype(np.float64).reshape(4, 64)
        lo = np.repeat(x64.min(axis=1), 64)
        step = np.repeat(np.ptp(x64, axis=1), 64) / (2 ** bits - 1)
        x64 = x64.reshape(-1)
        assert_unbiased(draws(c, x), x64, step, (x64 - lo) / np.maximum(step, 1e-300))


@pytest.mark.parametrize("levels,bucket", [(1, 512), (2, 512), (7, 64), (127, 512)])
def test_qsgd_variance_bound(levels: int, bucket: int) -> None:
    """E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2, bucket by bucket (d = bucket)."""
    c = get("qsgd", levels=levels, bucket_size=bucket)
    n = 1024
    for name, x in vectors(n).items():
        err = ((draws(c, x, 400) - x) ** 2).reshape(400, -1, bucket).sum(axis=2)   # (R, nb)
        v2 = (x.astype(np.float64) ** 2).reshape(-1, bucket).sum(axis=1)
        bound = min(bucket / levels ** 2, math.sqrt(bucket) / levels) * v2
        mean, se = err.mean(axis=0), err.std(axis=0, ddof=1) / math.sqrt(400)
        assert np.all(mean <= bound * (1 + REL) + Z * se), (name, mean / np.maximum(bound, 1e-30))
        total = min(n / levels ** 2, math.sqrt(n) / levels) * v2.sum()
        assert err.sum(axis=1).mean() <= total * (1 + REL) + Z * err.sum(axis=1).std() / 20


def test_qsgd_variance_bound_is_nearly_tight_for_flat_vectors() -> None:
    """A flat vector with s = 1 has variance (sqrt(d) - 1) ||v||^2: the test can fail."""
    d = 256
    c = get("qsgd", levels=1, bucket_size=d)
    x = np.full(d, 0.5, np.float32)
    err = ((draws(c, x, 1000) - x) ** 2).sum(axis=1)
    want = (math.sqrt(d) - 1) * float((x.astype(np.float64) ** 2).sum())
    assert abs(err.mean() - want) <= Z * err.std() / math.sqrt(1000) + REL * want


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_topk_contraction(dtype: str) -> None:
    """||x - C(x)||^2 <= (1 - k/n) ||x||^2 for every input (not only on average)."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(1, 3000))
        kind = trial % 4
        x = [rng.standard_normal(n), rng.standard_cauchy(n), np.round(rng.standard_normal(n)),
             np.ones(n)][kind].astype(dtype)
        for k in (0, 1, max(1, n // 100), n // 3, n):
            c = get("topk", k=k)
            y = c.decompress(c.compress(x)).astype(np.float64)
            x64 = x.astype(np.float64)
            assert ((x64 - y) ** 2).sum() <= (1 - k / n) * (x64 ** 2).sum() * (1 + 1e-12)


def test_randomk_contracts_on_average() -> None:
    """E||x - C(x)||^2 = (1 - k/n) ||x||^2 for random-k without rescaling."""
    n, k = 200, 30
    x = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    c = get("randomk", k=k)
    err = ((draws_per_seed(c, x, 1000) - x) ** 2).sum(axis=1)
    want = (1 - k / n) * float((x.astype(np.float64) ** 2).sum())
    assert abs(err.mean() - want) <= Z * err.std() / math.sqrt(1000)


def test_onebit_never_increases_the_error() -> None:
    """Group means minimise the squared error given the signs: ||x - C(x)|| <= ||x||."""
    rng = np.random.default_rng(2)
    for bucket in (8, 64, 2048):
        c = get("onebit", bucket_size=bucket)
        for x in list(vectors(5000).values()) + [rng.standard_normal(5000).astype(np.float32)]:
            y = c.decompress(c.compress(x)).astype(np.float64)
            x64 = x.astype(np.float64)
            assert ((x64 - y) ** 2).sum() <= (x64 ** 2).sum() * (1 + 1e-6)
            # and the bucket means are reproduced
            m = x64[:bucket]
            assert math.isclose(y[:bucket].sum(), m.sum(), rel_tol=1e-5, abs_tol=1e-6)


def test_quantizers_error_shrinks_with_bits() -> None:
    x = np.random.default_rng(3).standard_normal(4096).astype(np.float32)

    def err(c) -> float:
        return float(np.linalg.norm(c.decompress(c.compress(x, seed=1)) - x) / np.linalg.norm(x))
    assert err(get("int8", bits=8)) < err(get("int8", bits=4)) < err(get("int8", bits=2))
    assert err(get("qsgd", bits=8)) < err(get("qsgd", bits=4)) < err(get("qsgd", bits=2))
    assert err(get("int8", bits=8)) < 0.01 and err(get("fp16")) < 1e-3
