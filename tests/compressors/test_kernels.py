"""The two kernel paths: the numpy reference and the numba twin give identical bytes.

The numpy path defines every codec's bytes; the numba path (the ``fast`` extra) must agree
bit for bit on every input, including zeros of both signs, subnormals, huge values, NaN and
infinities, partial buckets and every bit width.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.compressors import _kernels
from gradcomm.compressors._kernels import _numpy as NP

pytest.importorskip("numba")
NB = _kernels.get("numba")

KEY = np.array([0x01234567, 0x89ABCDEF, 7, 0xFFFFFFFF], np.uint32)
COUNTS = (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099)


def nasty(n: int, seed: int = 0) -> np.ndarray:
    """float32 values of mixed scales with exact zeros, -0.0, ties and subnormals."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n)).astype(np.float32)
    if n >= 16:
        x[rng.integers(0, n, n // 8)] = 0.0
        x[rng.integers(0, n, n // 16)] = -0.0
        x[rng.integers(0, n, n // 16)] = 1.5
        x[rng.integers(0, n, 2)] = np.float32(1e-40)
    return x


def specials(n: int, value: float, seed: int = 0) -> np.ndarray:
    x = nasty(n, seed)
    if n:
        x[np.random.default_rng(seed).integers(0, n, max(1, n // 300))] = value
    return x


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_philox_known_answers() -> None:
    """Random123's known-answer vectors for Philox4x32-10, through both paths."""
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                     0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for ctr, key, want in cases:
        c = [np.array([v], np.uint64) for v in ctr]
        assert NP.philox_blocks(*c, *key).tolist() == list(want)
        u = [np.uint32(v) for v in (*ctr, *key)]
        assert [int(w) for w in NB._philox(*u)] == list(want)
    # the stream: word m is output m % 4 of counter (m // 4, 0, c2, c3)
    k = np.array([0xA4093822, 0x299F31D0, 0x13198A2E, 0x03707344], np.uint32)
    c = [np.array([v], np.uint64) for v in (5, 0, 0x13198A2E, 0x03707344)]
    for impl in (NP, NB):
        assert impl.philox_words(k, 20, 4).tolist() == \
            NP.philox_blocks(*c, 0xA4093822, 0x299F31D0).tolist()


@pytest.mark.parametrize("start,count", [(0, 1), (3, 10), (5, 37), (1001, 500)])
def test_philox_slices_agree(start: int, count: int) -> None:
    whole = NP.philox_words(KEY, 0, start + count)
    assert same(NP.philox_words(KEY, start, count), whole[start:])
    assert same(NB.philox_words(KEY, start, count), whole[start:])


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_round_trip(bits: int) -> None:
    rng = np.random.default_rng(bits)
    for n in COUNTS:
        codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
        packed = NP.pack(codes, bits)
        assert packed.size == (n * bits + 7) // 8
        assert same(NB.pack(codes, bits), packed)
        assert same(NP.unpack(packed, n, bits), codes)
        assert same(NB.unpack(packed, n, bits), codes)
    # bit i*b+j of the little-endian stream holds bit j of code i
    bitstream = np.unpackbits(NP.pack(codes, bits), bitorder="little")[:n * bits]
    want = ((codes[:, None] >> np.arange(bits)) & 1).reshape(-1)
    assert (bitstream == want).all()


def test_half_casts_match_numpy_and_each_other() -> None:
    rng = np.random.default_rng(0)
    bits = np.concatenate([
        rng.integers(0, 2 ** 32, 400_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000 - 50, 0x38800000 + 50, 97, dtype=np.uint32),      # subnormals
        np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                  0x477FEFFF, 0x477FF000, 0x47800000, 0x33000000, 0x33000001, 0x387FFFFF,
                  0x38800000, 0x3F800000], np.uint32)])
    x = bits.view(np.float32)
    h_np, h_nb = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    NP.f32_to_f16(x, h_np)
    NB.f32_to_f16(x, h_nb)
    assert same(h_np, h_nb)
    finite = ~np.isnan(x)
    with np.errstate(over="ignore"):
        assert same(h_np[finite], x[finite].astype(np.float16).view(np.uint16))
    assert set(h_np[~finite].tolist()) <= {0x7E00, 0xFE00}
    for f32_to_16, f16_to_32 in ((NP.f32_to_bf16, NP.bf16_to_f32),
                                 (NB.f32_to_bf16, NB.bf16_to_f32)):
        b = np.empty(x.size, np.uint16)
        f32_to_16(x, b)
        from gradcomm._dtypes import f32_to_bf16
        assert same(b, f32_to_bf16(x))
    halves = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    for narrow in (NP.f16_to_f32, NB.f16_to_f32):
        y = np.empty(65536, np.float32)
        narrow(halves, y)
        ref = halves.view(np.float16).astype(np.float32)
        ok = ~np.isnan(ref)
        assert same(y[ok], ref[ok]) and np.isnan(y[~ok]).all()
    y_np, y_nb = np.empty(65536, np.float32), np.empty(65536, np.float32)
    NP.f16_to_f32(halves, y_np)
    NB.f16_to_f32(halves, y_nb)
    assert same(y_np, y_nb)


@pytest.mark.parametrize("widen", ["f16_to_f32", "bf16_to_f32"])
def test_widen_and_add_onto_another_array(widen: str) -> None:
    """``widen(h, out, add=True, base=b)`` is ``out = widen(h) + b`` with ``b`` untouched:
    on both paths, the bytes of copying ``b`` into ``out`` and adding there (NaN, inf,
    -0.0 and subnormals among both operands; ``out`` starts as garbage)."""
    rng = np.random.default_rng(3)
    for n in COUNTS + (70_001,):
        h = rng.integers(0, 65536, n, dtype=np.uint64).astype(np.uint16)
        b = specials(n, np.nan, n)
        if n > 8:
            b[1::7] = np.inf
            h[2::5] = 0x7C00 if widen == "f16_to_f32" else 0x7F80         # +inf
        keep = b.copy()
        for impl in (NP, NB):
            want = b.copy()
            getattr(impl, widen)(h, want, True)
            got = np.full(n, 7.0, np.float32)
            getattr(impl, widen)(h, got, True, b)
            assert same(got, want) and same(b, keep), (impl.NAME, n)


INPUTS = [("nasty", 0.0), ("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf), ("huge", 3e38),
          ("zeros", None)]


def inputs(n: int):
    for name, v in INPUTS:
        if name == "zeros":
            yield name, np.zeros(n, np.float32)
        else:
            yield name, specials(n, v, n) if name != "nasty" else nasty(n, n)


def run_both(fn_name: str, outs, *args):
    """Call kernel ``fn_name`` of both paths with fresh copies of ``outs``; return both."""
    res = []
    for impl in (NP, NB):
        bufs = [np.full_like(o, 0xAB if o.dtype == np.uint8 else 7) for o in outs]
        ret = getattr(impl, fn_name)(*args, *bufs)
        res.append((ret, bufs))
    (r1, b1), (r2, b2) = res
    assert r1 == r2, fn_name
    for a, b in zip(b1, b2):
        assert same(a, b), fn_name
    return b1


@pytest.mark.parametrize("n", COUNTS)
def test_minmax_and_fixed_agree(n: int) -> None:
    for bs in (8, 64, 1000):
        nb = -(-n // bs)
        for bits in (1, 2, 3, 4, 7, 8):
            for stochastic in (False, True):
                for _, x in inputs(n):
                    lo, unit, q = run_both("minmax_encode", [np.empty(nb, np.float32),
                                           np.empty(nb, np.float32),
                                           np.empty((n * bits + 7) // 8, np.uint8)],
                                           x, bs, bits, stochastic, KEY)
                    run_both("minmax_decode", [np.empty(n, np.float32)], q, n, bs, bits, lo,
                             unit)
    for bits in (2, 4, 5, 8):
        for stochastic in (False, True):
            for _, x in inputs(n):
                (q,) = run_both("fixed_encode", [np.empty((n * bits + 7) // 8, np.uint8)],
                                x, bits, 2.5, stochastic, KEY)
                run_both("fixed_decode", [np.empty(n, np.float32)], q, n, bits, 2.5)


@pytest.mark.parametrize("n", COUNTS)
def test_signlevel_and_onebit_agree(n: int) -> None:
    for bs in (8, 64, 1000, 4104):
        nb = -(-n // bs)
        for s, bits, l2 in ((1, 2, False), (1, 2, True), (7, 4, True), (127, 8, True),
                            (5, 4, False), (20, 6, True)):
            for _, x in inputs(n):
                scale, q = run_both("signlevel_encode", [np.empty(nb, np.float32),
                                    np.empty((n * bits + 7) // 8, np.uint8)],
                                    x, bs, s, bits, l2, KEY)
                run_both("signlevel_decode", [np.empty(n, np.float32)], q, n, bs, s, bits,
                         scale)
        for _, x in inputs(n):
            pos, neg, q = run_both("onebit_encode", [np.empty(nb, np.float32),
                                   np.empty(nb, np.float32), np.empty((n + 7) // 8, np.uint8)],
                                   x, bs)
            run_both("onebit_decode", [np.empty(n, np.float32)], q, n, bs, pos, neg)


def test_big_buckets_use_the_long_lane_sum() -> None:
    """Buckets of more than 1024 lanes take the numpy path's cumsum branch."""
    n, bs = 70_001, 65_600
    x = nasty(n, 3)
    nb = -(-n // bs)
    run_both("signlevel_encode", [np.empty(nb, np.float32), np.empty(n, np.uint8)],
             x, bs, 127, 8, True, KEY)
    run_both("onebit_encode", [np.empty(nb, np.float32), np.empty(nb, np.float32),
                               np.empty((n + 7) // 8, np.uint8)], x, bs)


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64"])
def test_topk_selection_agrees(dtype: str) -> None:
    rng = np.random.default_rng(1)
    for n in (0, 1, 10, 1000, 70_000, 300_001):
        x = np.clip(nasty(n, n), -6e4, 6e4).astype(dtype)
        if n > 100:
            x[rng.integers(0, n, n // 10)] = 1.0         # many ties
            x[5], x[7], x[9] = np.nan, -np.inf, np.inf
        for k in (0, 1, 3, n // 100, n // 10, n // 9, n - 1, n, n + 3):
            if k < 0:
                continue
            i1, v1 = NP.topk_select(x, k)
            i2, v2 = NB.topk_select(x, k)
            assert same(i1, i2) and same(v1, v2), (n, k)
            assert i1.size == min(k, n) and (np.diff(i1) > 0).all()
    # adversarial for a strided sample: the fast path falls back and still agrees
    x = np.zeros(200_000, np.float32)
    x[::64] = 1.0
    for k in (10, 3125, 3126, 5000):
        assert same(NP.topk_select(x, k)[0], NB.topk_select(x, k)[0])


def test_topk_is_the_canonical_set() -> None:
    """Largest |x|, NaN above inf above finite, ties to the lower index, ascending."""
    x = np.array([1.0, -5.0, np.nan, 5.0, -np.inf, 2.0, 5.0], np.float32)
    for impl in (NP, NB):
        assert impl.topk_select(x, 2)[0].tolist() == [2, 4]
        assert impl.topk_select(x, 4)[0].tolist() == [1, 2, 3, 4]
        assert impl.topk_select(x, 5)[0].tolist() == [1, 2, 3, 4, 6]


def test_scatter_checks_indices() -> None:
    for impl in (NP, NB):
        for dtype in ("float16", "float32", "float64"):
            out = np.zeros(10, dtype)
            vals = np.ones(3, dtype)
            assert impl.scatter(out, np.array([1, 4, 9], np.int32), vals, False) == 0
            assert impl.scatter(out, np.array([1, 4, 9], np.int64), vals, True) == 0
            assert out.tolist() == [0, 2, 0, 0, 2, 0, 0, 0, 0, 2]
            for bad in ([1, 1, 2], [3, 2, 5], [0, 4, 10], [-1, 2, 3]):
                assert impl.scatter(out, np.array(bad, np.int32), vals, False) == 1


def test_randomk_indices_agree() -> None:
    for n in (0, 1, 5, 63, 64, 65, 1000, 70_000, 300_001):
        for k in (0, 1, 2, n // 3, n // 2, n // 2 + 1, n - 1, n, n + 5):
            if k < 0:
                continue
            a, b = NP.randomk_indices(KEY, n, k), NB.randomk_indices(KEY, n, k)
            assert same(a, b), (n, k)
            assert a.size == min(k, n) and (np.diff(a) > 0).all()
            assert a.size == 0 or (0 <= a[0] and a[-1] < n)
    # the draws above 2**32 elements use u mod n: same definition on both paths
    draws = NP.philox_words(KEY, 0, 64)
    assert same(NP._draw(draws, 3 << 32), draws.astype("<u4").view("<u8") % np.uint64(3 << 32))


def test_all_finite() -> None:
    for impl in (NP, NB):
        for dtype in ("float16", "float32", "float64"):
            x = np.ones(100, dtype)
            assert impl.all_finite(x)
            for v in (np.nan, np.inf, -np.inf):
                x[50] = v
                assert not impl.all_finite(x)
                x[50] = 1


@pytest.mark.parametrize("bf16", [False, True])
def test_finite16_sees_every_infinity_and_nan(bf16: bool) -> None:
    """Both paths: the largest finite values and subnormals of either sign are finite;
    one inf, -inf or NaN anywhere (at each end too, past a 4099-element run) is not."""
    wide = np.array([0.0, -0.0, 1.0, -2.5, 1e-7, -1e-7, 65504.0, -65504.0], np.float32)
    if bf16:
        bits = np.empty(wide.size, np.uint16)
        NP.f32_to_bf16(wide * np.float32(1e30), bits)    # up to 6.5e34, finite
        bad = [0x7F80, 0xFF80, 0x7FC0, 0xFFC1]
    else:
        bits = wide.astype(np.float16).view(np.uint16)
        bad = [0x7C00, 0xFC00, 0x7E00, 0xFC01]
    h = np.resize(bits, 4099)
    for impl in (NP, NB):
        assert impl.finite16(h, bf16) and impl.finite16(h[:0], bf16)
        for v in bad:
            for at in (0, 2048, 4098):
                g = h.copy()
                g[at] = v
                assert not impl.finite16(g, bf16), (impl.NAME, hex(v), at)


def test_choice_of_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADCOMM_KERNELS", "numpy")
    assert _kernels.get().NAME == "numpy" and _kernels.for_size(1 << 30).NAME == "numpy"
    monkeypatch.setenv("GRADCOMM_KERNELS", "numba")
    assert _kernels.for_size(3).NAME == "numba"
    monkeypatch.setenv("GRADCOMM_KERNELS", "auto")
    assert _kernels.for_size(3).NAME == "numpy"
    assert _kernels.for_size(_kernels.FAST_MIN).NAME == "numba"
    monkeypatch.setenv("GRADCOMM_KERNELS", "cuda")
    from gradcomm.errors import ConfigError
    with pytest.raises(ConfigError, match="numpy"):
        _kernels.get()


@pytest.mark.parametrize("n", COUNTS + (1 << 16,))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_momentum_correction_kernels_match_the_reference(n: int, dtype) -> None:
    """DGC's velocity (``u = u * m + x``, ``x = u``) and the optimizer's momentum undone
    (``now = o``, ``o -= prev * m``): the numba twin and the array-generic path (torch CPU
    tensors) give the reference's bytes, each operation rounded alone (no fused
    multiply-add), for zeros of both signs, subnormals, huge values and infinities."""
    torch = pytest.importorskip("torch")
    XP = _kernels.get("xp") if "xp" in _kernels.available() else None
    u0, x0 = specials(n, np.inf, 1).astype(dtype), nasty(n, 2).astype(dtype)
    o0, p0 = nasty(n, 3).astype(dtype) * 3, specials(n, -np.inf, 4).astype(dtype)
    m = 0.9

    def run(mod, wrap):
        u, x, o, p = (wrap(a.copy()) for a in (u0, x0, o0, p0))
        now = wrap(np.zeros(n, dtype))
        mod.velocity_in(u, x, m)
        mod.momentum_undo(o, p, now, m)
        return [np.asarray(a).tobytes() for a in (u, x, o, now)]

    want = run(NP, lambda a: a)
    with np.errstate(invalid="ignore", over="ignore"):
        assert run(NB, lambda a: a) == want
        if XP is not None:
            assert run(XP, torch.from_numpy) == want
    u, x = u0.copy(), x0.copy()
    assert want[0] == (u0 * dtype(m) + x0).tobytes() == want[1]
    assert want[2] == (o0 - p0 * dtype(m)).tobytes() and want[3] == o0.tobytes()


@pytest.mark.parametrize("n", COUNTS + (1 << 16,))
def test_onebit_adam_kernels_match_the_reference_and_torch(n: int) -> None:
    """1-bit Adam's compressed step (integrations/ddp/onebit_adam.py): the variance's
    floor and bias correction, the preconditioned momentum, the released average. The
    numba twin and the array-generic path give the reference's bytes, and the reference
    gives the bytes of the torch operations OneBitAdam used before (``torch.maximum(v,
    g * g * c2)``, ``v / bc2``, ``d + eps``, ``m / d``, ``z * d``, ``z / bc1``), NaN in
    ``v`` or ``g`` included (planted: ``maximum`` keeping ``v`` where ``g`` is NaN
    fails it; NaN payloads are not compared)."""
    torch = pytest.importorskip("torch")
    XP = _kernels.get("xp") if "xp" in _kernels.available() else None
    f = np.float32
    g0 = nasty(n, 5).astype(f)
    v0 = np.abs(specials(n, np.inf, 6)).astype(f)
    if n > 3:
        g0[1], v0[2] = np.nan, np.nan
    m0, z0 = nasty(n, 7).astype(f), nasty(n, 8).astype(f)
    c2, bc2, eps, bc1 = 1 - 0.999, 1 - 0.999 ** 37, 1e-8, 1 - 0.9 ** 5

    def run(mod, wrap):
        g, v, m, z = (wrap(a.copy()) for a in (g0, v0, m0, z0))
        d, x, step = (wrap(np.zeros(n, f)) for _ in range(3))
        mod.adam_floor_denom(g, v, d, c2, bc2)
        mod.adam_precondition(m, d, x, eps)
        mod.adam_release(z, d, m, step, bc1, True)
        return [canon(np.asarray(a)) for a in (v, d, x, m, step)]

    def canon(a: np.ndarray) -> bytes:       # NaN payloads differ between engines
        return np.where(np.isnan(a), np.float32(np.nan), a).tobytes()

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        want = run(NP, lambda a: a)
        assert run(NB, lambda a: a) == want
        if XP is not None:
            assert run(XP, torch.from_numpy) == want
    G, V, M, Z = (torch.from_numpy(a.copy()) for a in (g0, v0, m0, z0))
    torch.maximum(V, torch.mul(G, G).mul_(c2), out=V)
    D = torch.div(V, bc2).add_(eps)
    X = M / D
    assert [canon(t.numpy()) for t in (V, D, X, Z * D, Z / bc1)] == want


def _decoders(rng, n: int):
    """(kernel name, argument tuple before ``out``) of each bucketed decoder on random codes
    of ``n`` elements (levels above ``s`` among signlevel's: corrupt codes are counted)."""
    bs = 64
    nb = -(-n // bs)
    scales = specials(nb, np.nan, n + 1)
    for bits in (3, 8):
        q = rng.integers(0, 256, (n * bits + 7) // 8, dtype=np.uint64).astype(np.uint8)
        yield "minmax_decode", (q, n, bs, bits, nasty(nb, 1), specials(nb, np.inf, 2))
        yield "fixed_decode", (q, n, bits, 500.0)
        yield "signlevel_decode", (q, n, bs, (1 << (bits - 1)) - 2, bits, scales)
    q = rng.integers(0, 256, (n + 7) // 8, dtype=np.uint64).astype(np.uint8)
    yield "onebit_decode", (q, n, bs, nasty(nb, 3), specials(nb, -np.inf, 4))


def test_decoders_add_onto_another_array() -> None:
    """``decode(..., out, add=True, base=b)`` is ``out = decoded + b`` with ``b`` untouched:
    on both paths, the bytes (and the count of corrupt codes) of copying ``b`` into
    ``out`` and adding there; ``out`` starts as garbage."""
    rng = np.random.default_rng(11)
    for n in COUNTS + (70_001,):
        b = specials(n, np.nan, n)
        if n > 8:
            b[1::7] = np.inf
        keep = b.copy()
        for name, args in _decoders(rng, n):
            for impl in (NP, NB):
                want = b.copy()
                bad = getattr(impl, name)(*args, want, True)
                got = np.full(n, 7.0, np.float32)
                assert getattr(impl, name)(*args, got, True, b) == bad, (impl.NAME, name, n)
                assert same(got, want) and same(b, keep), (impl.NAME, name, n)
