"""The array-generic kernels (``_xp``) give the numpy reference's bytes on every array kind.

Each quantizer kernel runs on numpy arrays and torch CPU tensors (and torch CUDA / cupy
where a GPU is usable) and is compared byte for byte with :mod:`._numpy` on random and
special inputs: counts around the byte, lane and bucket boundaries, every bit width,
partial buckets, NaN, infinities, -0.0, subnormals and huge values.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from gradcomm import arrays
from tests.devices._devices import KINDS, on
from tests.compressors.test_kernels import nasty, specials

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")
X = importlib.import_module("gradcomm.compressors._kernels._xp")
NP = importlib.import_module("gradcomm.compressors._kernels._numpy")

KEY = np.array([0x01234567, 0x89ABCDEF, 7, 0xFFFFFFFF], np.uint32)
COUNTS = (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099)


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Element-wise torch ops on ~1e5 elements: threads only wait for each other here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=KINDS)
def to(request):
    """Host numpy -> a fresh array of the kind (never sharing the source)."""
    return lambda a: on(request.param, a)


def same(dev, ref: np.ndarray, loose: np.ndarray | None = None) -> bool:
    """Identical bytes. On CUDA a NaN made by arithmetic is CUDA's canonical NaN, not the
    x86 operand's: there NaNs only need to be NaN where the reference has them; so too
    where ``loose`` (NaN + NaN: the reference's own bits depend on the element's place in
    numpy's vector loop)."""
    h = arrays.host(dev)
    if h.dtype != ref.dtype or h.shape != ref.shape:
        return False
    if arrays.meta_of(dev).device != "cpu" and h.dtype.kind == "f":
        loose = np.ones(ref.shape, bool)
    if loose is not None:
        lz = np.isnan(ref) & loose
        return bool(np.isnan(h[lz]).all()) and h[~lz].tobytes() == ref[~lz].tobytes()
    return h.tobytes() == ref.tobytes()


# --- random stream and packing ----------------------------------------------------------

@pytest.mark.parametrize("start,count", [(0, 0), (0, 1), (3, 10), (5, 37), (1001, 500),
                                         (7, 100_001), ((1 << 36) + 5, 9)])
def test_philox_words_and_dither(to, start: int, count: int) -> None:
    like = to(np.zeros(1, np.float32))
    w = X.philox_words(KEY, start, count, like)
    assert arrays.dtype_name(w) == "int64" and arrays.kind(w) == arrays.kind(like)
    assert (arrays.host(w) == NP.philox_words(KEY, start, count).astype(np.int64)).all()
    assert same(X.dither(KEY, start, count, like), NP.dither(KEY, start, count))


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_unpack(to, bits: int) -> None:
    rng = np.random.default_rng(bits)
    for n in COUNTS + (300_001,):
        codes = rng.integers(0, 1 << bits, n).astype(np.uint8)
        ref = NP.pack(codes, bits)
        assert same(X.pack(to(codes), bits), ref)
        out = to(np.full(ref.size, 0xAB, np.uint8))
        assert X.pack(to(codes), bits, out) is out and same(out, ref)
        assert same(X.unpack(to(ref), n, bits), codes)


# --- float casts --------------------------------------------------------------------------

def _f32_bits_cases() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate([
        rng.integers(0, 2 ** 32, 200_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000 - 50, 0x38800000 + 50, 97, dtype=np.uint32),      # subnormals
        np.arange(0x477FE000, 0x47800100, 3, dtype=np.uint32),                 # overflow edge
        np.array([0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001,
                  0xFF800001, 0x7FBFFFFF, 0x477FEFFF, 0x477FF000, 0x47800000, 0x33000000,
                  0x33000001, 0x387FFFFF, 0x38800000, 0x3F800000, 0x00000001, 0x807FFFFF,
                  0x7F7FFFFF, 0xFF7FFFFF, 0x3F808000, 0x3F818000, 0x3F80FFFF], np.uint32)])


def _f64_cases() -> np.ndarray:
    """float64 values at and next to float16 rounding ties (where float64 -> float32 ->
    float16 would round twice), across the normal and subnormal half range."""
    rng = np.random.default_rng(1)
    h = rng.integers(0, 0x7BFF, 20_000).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = (h + 1).astype(np.uint16).view(np.float16).astype(np.float64)
    mid = (lo + hi) / 2
    cases = [mid, np.nextafter(mid, 0), np.nextafter(mid, np.inf), mid * (1 + 2.0 ** -30),
             mid * (1 - 2.0 ** -30), mid * (1 + 2.0 ** -25), mid * (1 - 2.0 ** -25)]
    x = np.concatenate(cases + [-c for c in cases])
    specials64 = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 65504.0, 65519.99,
                           65520.0, 1e300, -1e300, 5e-324, 2.0 ** -25, 2.0 ** -25 * (1 + 1e-15),
                           2.0 ** -24, 3 * 2.0 ** -26, 1e-40, 3.4e38, 3.5e38])
    return np.concatenate([x, specials64, rng.standard_normal(10_000) * 1e3])


def test_f32_to_f16(to) -> None:
    for x in (_f32_bits_cases().view(np.float32), _f64_cases()):
        ref = np.empty(x.size, np.uint16)
        NP.f32_to_f16(x, ref)
        out = to(np.full(x.size, 0xABCD, np.uint16))
        X.f32_to_f16(to(x), out)
        assert same(out, ref), x.dtype


def test_f32_to_bf16(to) -> None:
    x = _f32_bits_cases().view(np.float32)
    ref = np.empty(x.size, np.uint16)
    NP.f32_to_bf16(x, ref)
    out = to(np.full(x.size, 0xABCD, np.uint16))
    X.f32_to_bf16(to(x), out)
    assert same(out, ref)


@pytest.mark.parametrize("add", [False, True])
def test_widen_16_to_f32(to, add: bool) -> None:
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    base = np.resize(_f32_bits_cases().view(np.float32), h.size)   # NaN/inf/-0 in out too
    for ref_fn, xp_fn in ((NP.f16_to_f32, X.f16_to_f32), (NP.bf16_to_f32, X.bf16_to_f32)):
        ref = base.copy()
        ref_fn(h, ref, add=add)
        out = to(base)
        xp_fn(to(h), out, add=add)
        assert same(out, ref, np.isnan(base) if add else None), xp_fn.__name__


# --- quantizers -------------------------------------------------------------------------------

BUCKETS = (8, 64, 512, 1024, 2048)
INPUTS = (("nasty", None), ("nan", np.nan), ("inf", np.inf), ("-inf", -np.inf),
          ("huge", 3e38), ("zeros", 0.0))


def inputs(n: int):
    """(index, float32 input) for every kind of INPUTS."""
    for i, (name, v) in enumerate(INPUTS):
        if name == "zeros":
            yield i, np.zeros(n, np.float32)
        elif name == "nasty":
            yield i, nasty(n, n)
        else:
            yield i, specials(n, v, n)


def buckets(n: int) -> list[int]:
    """The bucket sizes that differ for n elements (all larger ones give one partial one)."""
    return [bs for bs in BUCKETS if bs < n] + [min([bs for bs in BUCKETS if bs >= n]
                                                   or [BUCKETS[-1]])]


def accum(n: int) -> np.ndarray:
    """An ``add=True`` target: values of all scales with NaN, infinities and -0.0."""
    y = nasty(n, n + 1)
    if n >= 8:
        y[[1, 3, 5, 7]] = [np.nan, np.inf, -np.inf, -0.0]
    payloads = np.array([0x7F800001, 0xFFC12345, 0x7FC00000, 0xFF900000], np.uint32)
    y.view(np.uint32)[::37] = np.resize(payloads, y[::37].size)     # NaNs, signaling too
    return y


def check(to, fn: str, args: tuple, outs: list, **kw) -> list[np.ndarray]:
    """Run ``fn`` of the reference on numpy and of ``_xp`` on the backend's arrays with
    copies of ``outs``; the results and every output must be identical. Returns the
    reference's outputs."""
    ref = [o.copy() for o in outs]
    r1 = getattr(NP, fn)(*args, *ref, **kw)
    dev = [to(o) for o in outs]
    conv = [a if a is KEY or not isinstance(a, np.ndarray) else to(a) for a in args]
    r2 = getattr(X, fn)(*conv, *dev, **kw)
    assert r1 == r2 and type(r1) is type(r2), (fn, r1, r2)
    loose = [np.isnan(o) if kw.get("add") else None for o in outs]
    for d, r, m in zip(dev, ref, loose):
        assert same(d, r, m), (fn, args[1:], kw)
    return ref


def junk(n: int, dtype) -> np.ndarray:
    return np.full(n, 0xAB if dtype == np.uint8 else 7, dtype)


def minmax_round_trip(to, x: np.ndarray, bs: int, bits: int, stochastic: bool) -> None:
    n = x.size
    nb = -(-n // bs)
    lo, unit, q = check(to, "minmax_encode", (x, bs, bits, stochastic, KEY),
                        [junk(nb, np.float32), junk(nb, np.float32),
                         junk((n * bits + 7) // 8, np.uint8)])
    for add in (False, True):
        check(to, "minmax_decode", (q, n, bs, bits, lo, unit),
              [accum(n) if add else junk(n, np.float32)], add=add)


def fixed_round_trip(to, x: np.ndarray, bits: int, scale: float, stochastic: bool) -> None:
    n = x.size
    (q,) = check(to, "fixed_encode", (x, bits, scale, stochastic, KEY),
                 [junk((n * bits + 7) // 8, np.uint8)])
    for add in (False, True):
        check(to, "fixed_decode", (q, n, bits, scale),
              [accum(n) if add else junk(n, np.float32)], add=add)


@pytest.mark.parametrize("n", COUNTS)
def test_minmax(to, n: int) -> None:
    bss = buckets(n)
    for i, x in inputs(n):
        for bits in range(1, 9):           # every (input, bits) pair, buckets in rotation
            minmax_round_trip(to, x, bss[(3 * i + bits) % len(bss)], bits, (i + bits) % 2 == 1)


@pytest.mark.parametrize("n", COUNTS)
def test_fixed(to, n: int) -> None:
    for i, x in inputs(n):
        for bits in range(2, 9):
            scale = (2.5, 1e-30, 3e38)[(i + bits) % 3]
            fixed_round_trip(to, x, bits, scale, (i + bits // 2) % 2 == 1)


def test_minmax_and_fixed_large(to) -> None:
    x = specials(300_007, np.nan, 5)
    y = nasty(300_007, 6)
    for bits, bs, stochastic in ((8, 1024, True), (3, 2048, False), (1, 8, True)):
        minmax_round_trip(to, y, bs, bits, stochastic)
    minmax_round_trip(to, x, 512, 4, False)
    fixed_round_trip(to, x, 8, 2.5, True)
    fixed_round_trip(to, y, 5, 1e3, False)


#: (s, bits, l2): qsgd with every code width (s = 2^(bits-1) - 1 and odd levels), terngrad
SIGNLEVEL = [(1, 2, False), (1, 2, True), (3, 3, True), (7, 4, True), (5, 4, False),
             (15, 5, True), (20, 6, True), (63, 7, False), (127, 8, True)]


def signlevel_round_trip(to, x: np.ndarray, bs: int, s: int, bits: int, l2: bool) -> None:
    n = x.size
    nb = -(-n // bs)
    scale, q = check(to, "signlevel_encode", (x, bs, s, bits, l2, KEY),
                     [junk(nb, np.float32), junk((n * bits + 7) // 8, np.uint8)])
    for add in (False, True):
        check(to, "signlevel_decode", (q, n, bs, s, bits, scale),
              [accum(n) if add else junk(n, np.float32)], add=add)


def onebit_round_trip(to, x: np.ndarray, bs: int) -> None:
    n = x.size
    nb = -(-n // bs)
    pos, neg, q = check(to, "onebit_encode", (x, bs),
                        [junk(nb, np.float32), junk(nb, np.float32),
                         junk((n + 7) // 8, np.uint8)])
    for add in (False, True):
        check(to, "onebit_decode", (q, n, bs, pos, neg),
              [accum(n) if add else junk(n, np.float32)], add=add)


@pytest.mark.parametrize("n", COUNTS)
def test_signlevel_and_onebit(to, n: int) -> None:
    bss = buckets(n)
    for i, x in inputs(n):
        for j, (s, bits, l2) in enumerate(SIGNLEVEL):
            signlevel_round_trip(to, x, bss[(i + j) % len(bss)], s, bits, l2)
        for bs in bss:
            onebit_round_trip(to, x, bs)


def test_signlevel_and_onebit_large(to) -> None:
    """~300K elements: several passes' worth of buckets for the numpy reference, and
    buckets of more than 1024 lanes (the reference's cumsum branch)."""
    x, y = specials(300_007, np.inf, 7), nasty(300_007, 8)
    for bs in (1024, 2048):
        signlevel_round_trip(to, y, bs, 127, 8, True)
        signlevel_round_trip(to, x, bs, 1, 2, False)
        onebit_round_trip(to, y, bs)
        onebit_round_trip(to, x, bs)
    z = nasty(70_001, 3)
    signlevel_round_trip(to, z, 65_600, 127, 8, True)
    onebit_round_trip(to, z, 65_600)


def test_corrupt_payloads_decode_alike(to) -> None:
    """Random codes and per-bucket values (signaling NaNs, infinities, levels above s)
    decode to the same bytes and the same count of invalid codes."""
    rng = np.random.default_rng(9)
    n, bs = 4099, 64
    nb = -(-n // bs)
    vals = rng.integers(0, 2 ** 32, nb, dtype=np.uint64).astype(np.uint32)
    vals[::5] = np.resize(np.array([0x7F800001, 0xFFC12345, 0x7F800000, 0x80000000, 1],
                                   np.uint32), vals[::5].size)
    a = vals.view(np.float32)
    b = np.roll(vals, 3).view(np.float32)
    for bits in (2, 5, 8):
        q = rng.integers(0, 256, (n * bits + 7) // 8).astype(np.uint8)
        for add in (False, True):
            out = [accum(n) if add else junk(n, np.float32)]
            check(to, "signlevel_decode", (q, n, bs, 1, bits, a), out, add=add)
            check(to, "minmax_decode", (q, n, bs, bits, a, b), out, add=add)
            check(to, "fixed_decode", (q, n, bits, 2.5), out, add=add)
    q = rng.integers(0, 256, (n + 7) // 8).astype(np.uint8)
    for add in (False, True):
        check(to, "onebit_decode", (q, n, bs, a, b),
              [accum(n) if add else junk(n, np.float32)], add=add)


def test_many_passes(to, monkeypatch: pytest.MonkeyPatch) -> None:
    """Small passes (whole buckets; one bucket when it is larger than a pass): the dither,
    the packed bytes and the bucket values of every pass land where the reference's go."""
    monkeypatch.setattr(X, "_CHUNK_CPU", 4096)
    monkeypatch.setattr(X, "_CHUNK_GPU", 4096)
    x = specials(70_001, np.nan, 11)
    for bs, bits in ((8, 3), (1000, 5), (8192, 8)):
        minmax_round_trip(to, x, bs, bits, True)
        signlevel_round_trip(to, x, bs, 7, 4, True)
        onebit_round_trip(to, x, bs)
    fixed_round_trip(to, x, 7, 2.5, True)


def test_decoders_add_onto_another_array(to, monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode(..., out, add=True, base=b)``: the reference's bytes of ``out = decoded +
    b`` (and its count of invalid codes) on every array kind, ``b`` untouched, ``out``
    starting as garbage; across several passes (a small pass size)."""
    monkeypatch.setattr(X, "_CHUNK_CPU", 4096)
    monkeypatch.setattr(X, "_CHUNK_GPU", 4096)
    rng = np.random.default_rng(12)
    for n, bs in ((4099, 64), (70_001, 1000)):
        nb = -(-n // bs)
        a = specials(nb, np.nan, 1)
        b = specials(nb, -np.inf, 2)
        base = accum(n)
        cases = [("onebit_decode", (rng.integers(0, 256, (n + 7) // 8).astype(np.uint8), n,
                                    bs, a, b))]
        for bits in (2, 5, 8):
            q = rng.integers(0, 256, (n * bits + 7) // 8).astype(np.uint8)
            cases += [("signlevel_decode", (q, n, bs, 1, bits, a)),
                      ("minmax_decode", (q, n, bs, bits, a, b)),
                      ("fixed_decode", (q, n, bits, 2.5))]
        for fn, args in cases:
            ref = junk(n, np.float32)
            r1 = getattr(NP, fn)(*args, ref, True, base)
            dev, dev_base = to(junk(n, np.float32)), to(base)
            conv = [v if not isinstance(v, np.ndarray) else to(v) for v in args]
            assert getattr(X, fn)(*conv, dev, True, dev_base) == r1, fn
            assert same(dev, ref, np.isnan(ref)), (fn, n)
            assert same(dev_base, base), fn
