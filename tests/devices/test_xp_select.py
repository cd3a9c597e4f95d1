"""The array-generic top-k / random-k kernels (``_xp_select``) give the numpy reference's
bytes (same indices, values and return codes) on numpy arrays, torch CPU tensors and, where
a GPU is usable, torch CUDA tensors and cupy arrays.

Run as a script for a rough speed print: ``python tests/devices/test_xp_select.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import arrays
from gradcomm.compressors._kernels import _numpy as NP
from gradcomm.compressors._kernels._kth_smallest import _torch_kth, kth_smallest
from gradcomm.compressors._kernels import _xp_select as XS
from tests.devices._devices import KINDS, on, ref

torch = pytest.importorskip("torch")

COUNTS = (0, 1, 7, 64, 1000, 4099, 300_007)
DTYPES = ("float16", "float32", "float64")
KEY = np.array([0x01234567, 0x89ABCDEF, 7, 0xFFFFFFFF], np.uint32)


def same(got, want: np.ndarray) -> bool:
    """Same dtype, shape and bytes (``got`` of any kind)."""
    h = arrays.host(got)
    return h.dtype == want.dtype and h.shape == want.shape and h.tobytes() == want.tobytes()


def values(n: int, dtype: str, style: str, seed: int = 0) -> np.ndarray:
    """Test inputs: "nasty" (mixed scales, zeros of both signs, ties, subnormals),
    "ties" (drawn from a tiny set) or "specials" (nasty plus NaNs of several payloads and
    signs, +-inf)."""
    rng = np.random.default_rng(seed)
    if style == "ties":
        return rng.choice(np.array([0.0, -0.0, 1.0, -1.0, 2.0, -2.0], dtype), n)
    with np.errstate(over="ignore"):                   # float16: huge values become inf
        x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(dtype)
    if n >= 16:
        x[rng.integers(0, n, n // 8)] = 0.0
        x[rng.integers(0, n, n // 16)] = -0.0
        x[rng.integers(0, n, n // 16)] = 1.5
        x[rng.integers(0, n, 2)] = np.finfo(dtype).smallest_subnormal
    if style == "specials" and n:
        bits = x.view(f"u{x.itemsize}")
        e = np.finfo(dtype).nmant          # NaN = exponent all ones, mantissa != 0
        top = (1 << (8 * x.itemsize - 1)) - (1 << e)       # +inf's bits
        for j, v in enumerate(rng.integers(0, n, max(3, n // 100))):
            if j % 4 == 0:
                x[v] = np.inf
            elif j % 4 == 1:
                x[v] = -np.inf
            else:                          # NaN payloads 1, 2, ... with either sign
                bits[v] = top + 1 + j % 5 + (j % 2) * (1 << (8 * x.itemsize - 1))
    return x


def ks(n: int) -> list[int]:
    return sorted({k for k in (0, 1, n // 2 - 1, n // 2, n // 2 + 1, n - 1, n, n + 3)
                   if k >= 0})


# --- abs_keys / all_finite -----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_abs_keys_and_all_finite(kind: str, dtype: str) -> None:
    for style in ("nasty", "specials"):
        for n in (0, 1, 7, 1000):
            x = values(n, dtype, style)
            want = NP.abs_keys(x)
            got = arrays.host(XS.abs_keys(on(kind, x)))
            assert got.itemsize == want.itemsize and got.tobytes() == want.tobytes()
            assert XS.all_finite(on(kind, x)) is NP.all_finite(x)
    for v in (np.nan, np.inf, -np.inf, -0.0):
        x = np.zeros(65, dtype)
        x[64] = v
        assert XS.all_finite(on(kind, x)) is NP.all_finite(x) is (v == 0)


# --- topk_select ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ("nasty", "ties", "specials"))
def test_topk_select_matches_reference(kind: str, dtype: str, style: str) -> None:
    for n in COUNTS:
        x = values(n, dtype, style, seed=n)
        xs = on(kind, x)
        for k in ks(n):
            want_i, want_v = NP.topk_select(x, k)
            got_i, got_v = XS.topk_select(xs, k)
            assert same(got_i, want_i), (n, k)
            assert same(got_v, want_v), (n, k)
    assert same(xs, x)                      # the input is left alone


@pytest.mark.parametrize("kind", KINDS)
def test_topk_select_all_equal_and_all_nan(kind: str) -> None:
    """Every key tied: the first k indices; NaNs beat +inf, larger NaN payloads first."""
    for x in (np.full(1000, -0.0, np.float32), np.full(1000, np.nan, np.float16),
              np.full(999, 3.0, np.float64)):
        for k in (1, 10, 500, 998):
            want = NP.topk_select(x, k)
            got = XS.topk_select(on(kind, x), k)
            assert same(got[0], want[0]) and same(got[1], want[1])
            assert arrays.host(got[0]).tolist() == list(range(k))
    x = np.full(10, np.inf, np.float32)
    x.view(np.uint32)[[2, 7]] = [0x7FC00000, 0xFF800001]
    assert arrays.host(XS.topk_select(on(kind, x), 2)[0]).tolist() == [2, 7]
    x.view(np.uint32)[7] = 0xFFC00001                   # -NaN with a larger payload
    assert arrays.host(XS.topk_select(on(kind, x), 1)[0]).tolist() == [7]


def test_kth_smallest_both_ends() -> None:
    """``kth_smallest`` and its torch ``topk`` route (the one CUDA takes) agree with
    a sort at every position, ties included."""
    rng = np.random.default_rng(4)
    for n, dtype in ((1, "int16"), (50, "int16"), (51, "int32"), (4099, "int64")):
        a = rng.integers(0, 7 if n < 100 else 1 << 20, n).astype(dtype)
        want = np.sort(a)
        for j in (range(n) if n < 100 else (0, 1, n // 2 - 1, n // 2, n - 2, n - 1)):
            for got in (kth_smallest(a, j), kth_smallest(torch.from_numpy(a), j),
                        _torch_kth(torch.from_numpy(a), j)):
                assert int(got) == want[j], (n, j)


# --- scatter -------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add", (False, True))
def test_scatter_matches_reference(kind: str, dtype: str, add: bool) -> None:
    rng = np.random.default_rng(3)
    for n in COUNTS:
        out = values(n, dtype, "specials", seed=n + 1)
        for m in sorted({0, 1, n // 3, n}):
            for idx_dtype in ("int64", "int32"):
                idx = np.sort(rng.permutation(n)[:m]).astype(idx_dtype)
                vals = values(m, dtype, "specials", seed=m + 2)
                want = out.copy()
                with np.errstate(all="ignore"):
                    assert NP.scatter(want, idx, vals, add) == 0
                got = on(kind, out)
                assert XS.scatter(got, on(kind, idx), on(kind, vals), add) == 0
                if add:     # NaN + NaN: numpy's payload depends on the loop (SIMD body
                    both = idx[np.isnan(out[idx]) & np.isnan(vals)]  # or tail): ours is
                    bits = want.view(f"u{want.itemsize}")          # the first, quietened
                    quiet = 1 << (np.finfo(dtype).nmant - 1)
                    bits[both] = out.view(bits.dtype)[both] | bits.dtype.type(quiet)
                assert same(got, want), (n, m, idx_dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("add", (False, True))
def test_scatter_rejects_invalid_indices(kind: str, add: bool) -> None:
    n = 10
    out = np.arange(n, dtype=np.float32)
    bad = ([-1, 3], [2, 10], [0, 11], [3, 3], [5, 2], [0, 4, 4, 9], [1, 5, 3, 9], [-5],
           [10], [0, 1, 2, 3, 4, 5, 6, 7, 9, 8], [np.iinfo(np.int64).min, 1])
    for idx in bad:
        for idx_dtype in ("int64", "int32"):
            i = np.array(idx, np.int64)
            if idx_dtype == "int32" and i.min() < -(1 << 31):
                continue
            i = i.astype(idx_dtype)
            vals = np.full(i.size, 100.0, np.float32)
            want = out.copy()
            assert NP.scatter(want, i, vals, add) == 1
            got = on(kind, out)
            assert XS.scatter(got, on(kind, i), on(kind, vals), add) == 1, idx
            assert same(got, out) and same(got, want), idx


# --- random-k ------------------------------------------------------------------------------

def test_draw_matches_reference() -> None:
    """Every draw, n < 2^32 (the 64-bit product) and above (the remainder), extreme words."""
    rng = np.random.default_rng(5)
    w = rng.integers(0, 1 << 32, 20_000, dtype=np.uint64).astype(np.uint32)
    w[:8] = [0, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0, 0xFFFFFFFF, 0xFFFFFFFF, 0]
    ns = [1, 2, 3, 1000, 65535, 65536, 65537, 300_007, 2**31 - 1, 2**31, 2**32 - 1,
          2**32, 2**32 + 1, 2**33 + 12345, 2**40 + 3, 2**52 - 1, 2**61 + 7, 2**62]
    ns += [int(v) for v in rng.integers(1, 2**32, 20)]
    for n in ns:
        want = NP._draw(w, n).astype(np.int64)
        wi = w.astype(np.int64)
        for kind in ("numpy", "torch-cpu"):
            t = on(kind, wi)
            assert same(XS._draw(t[0::2], t[1::2], n), want), n


def _need_xp() -> None:
    """random-k draws through ``_xp.philox_words``."""
    pytest.importorskip("gradcomm.compressors._kernels._xp")


@pytest.mark.parametrize("kind", KINDS)
def test_randomk_indices_match_reference(kind: str) -> None:
    _need_xp()
    like = ref(kind)
    for seed, key in enumerate((KEY, np.array([1, 2, 3, 4], np.uint32))):
        for n in COUNTS[:-1] + (65_537,):
            for k in ks(n):
                want = NP.randomk_indices(key, n, k)
                got = XS.randomk_indices(key, n, k, like)
                assert same(got, want), (seed, n, k)
    n = 300_007                                   # ~300K: both branches, one key
    for k in (1, n // 2 + 1, n - 1):
        assert same(XS.randomk_indices(KEY, n, k, like), NP.randomk_indices(KEY, n, k)), k


@pytest.mark.parametrize("kind", KINDS)
def test_randomk_indices_large_n(kind: str) -> None:
    """n up to 2^31 - 1 and beyond 2^32 (only the k <= n/2 branch: no n-sized arrays)."""
    _need_xp()
    like = ref(kind)
    for n in (2**31 - 1, 2**32 - 1, 2**32, 2**32 + 5, 2**40 + 3, 2**62):
        for k in (1, 5, 1000):
            want = NP.randomk_indices(KEY, n, k)
            assert same(XS.randomk_indices(KEY, n, k, like), want), (n, k)


@pytest.mark.parametrize("kind", KINDS)
def test_randomk_indices_many_repeats(kind: str) -> None:
    """Small n with m close to n/2: many repeated draws and more than one batch."""
    _need_xp()
    like = ref(kind)
    for n in (2, 3, 5, 9, 100, 129):
        for k in range(n + 1):
            want = NP.randomk_indices(KEY, n, k)
            assert same(XS.randomk_indices(KEY, n, k, like), want), (n, k)


if __name__ == "__main__":                              # rough speed print, not a test
    import time

    n, k = 4 << 20, (4 << 20) // 100
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    for name, fn, arg in (("numpy reference", NP.topk_select, x),
                          ("xp on numpy", XS.topk_select, x),
                          ("xp on torch CPU", XS.topk_select, torch.from_numpy(x))):
        fn(arg, k)
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn(arg, k)
            ts.append(time.perf_counter() - t0)
        print(f"topk_select n=4M float32 k=1%: {name:16s} best {min(ts) * 1e3:7.1f} ms")
