"""Every codec through the registry: round trips, wire sizes, options, seeds, edge cases."""

from __future__ import annotations


import numpy as np
import pytest

from gradcomm.compressors import get, names, payload
from gradcomm.compressors.payload import MAX_DECODE_BYTES, Payload
from gradcomm.errors import ConfigError, PayloadError

DTYPES = ("float16", "float32", "float64")
#: one configuration per codec and mode worth covering
CONFIGS = [
    ("none", {}), ("fp16", {}), ("bf16", {}),
    ("int8", {}), ("int8", {"bits": 1, "bucket_size": 16}),
    ("int8", {"bits": 3, "rounding": "stochastic"}), ("int8", {"scale": 4.0, "bits": 6}),
    ("qsgd", {}), ("qsgd", {"bits": 4, "bucket_size": 64}), ("qsgd", {"levels": 1}),
    ("terngrad", {}), ("onebit", {}), ("onebit", {"bucket_size": 8}),
    ("topk", {}), ("topk", {"k": 3}), ("topk", {"ratio": 0.5}),
    ("randomk", {}), ("randomk", {"k": 5}), ("randomk", {"ratio": 0.7}),
]
IDS = [f"{n}-{'-'.join(f'{k}{v}' for k, v in o.items())}" for n, o in CONFIGS]
COUNTS = (0, 1, 2, 7, 8, 9, 100, 1023, 1025, 4099)


def data(n: int, dtype: str = "float32", seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)


def codec(name, opts):
    return get(name, **opts)


def test_names() -> None:
    assert set(names()) >= {"none", "fp16", "bf16", "int8", "qsgd", "terngrad", "topk",
                            "randomk", "onebit"}


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_round_trip_shape_dtype_and_wire(name: str, opts: dict) -> None:
    c = codec(name, opts)
    for dtype in DTYPES:
        for n in COUNTS:
            x = data(n, dtype, n)
            p = c.compress(x, seed=(1, n))
            y = c.decompress(p)
            assert y.dtype == x.dtype and y.shape == (n,)
            wire = p.to_bytes()
            assert wire.size == p.nbytes <= c.max_nbytes(n, dtype)
            assert c.max_nbytes(n, dtype) - p.nbytes <= 32      # the bound is tight
            q = Payload.from_bytes(wire)
            assert c.decompress(q).tobytes() == y.tobytes()
            out = np.full(n, 7, dtype)
            assert c.decompress(q, out=out) is out and out.tobytes() == y.tobytes()


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_max_nbytes_bounds_every_input(name: str, opts: dict) -> None:
    """Random inputs of many sizes never exceed max_nbytes; the gap stays a few bytes."""
    c = codec(name, opts)
    rng = np.random.default_rng(5)
    for n in list(rng.integers(0, 3000, 25)) + [127, 128, 255, 256, 65535, 65536, 70001]:
        n = int(n)
        for x in (data(n, seed=n) * 10.0 ** rng.integers(-30, 30), np.zeros(n, np.float32)):
            p = c.compress(x.astype(np.float32), seed=n)
            assert 0 <= c.max_nbytes(n) - p.nbytes <= 32, (n, p.header)


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_zeros_decode_to_zeros(name: str, opts: dict) -> None:
    c = codec(name, opts)
    for dtype in DTYPES:
        for n in (0, 1, 9, 1000):
            y = c.decompress(c.compress(np.zeros(n, dtype), seed=3))
            assert (y == 0).all() and not np.isnan(y).any()


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_propagate(name: str, opts: dict, bad: float) -> None:
    """The documented rule: a NaN or +-inf input never vanishes silently (unless k = 0)."""
    c = codec(name, opts)
    for dtype in DTYPES:
        for pos in (0, 57, 99):
            x = data(100, dtype)
            x[pos] = bad
            y = c.decompress(c.compress(x, seed=1))
            assert not np.isfinite(y).all(), (dtype, pos)
    assert np.isfinite(get("topk", k=0).decompress(get("topk", k=0).compress(x))).all()


def test_fp16_exact_where_representable_and_overflow_to_inf() -> None:
    c = get("fp16")
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = h[np.isfinite(h)]
    for dtype in ("float32", "float64"):
        assert (c.decompress(c.compress(h.astype(dtype))) == h.astype(dtype)).all()
    assert c.decompress(c.compress(h)).tobytes() == h.tobytes()          # float16: lossless
    y = c.decompress(c.compress(np.array([65504, 65519, 65520, -1e6, 1e-9], np.float32)))
    assert y.tolist() == [65504, 65504, np.inf, -np.inf, 0.0]
    x = data(10_000) * 100
    assert np.all(np.abs(c.decompress(c.compress(x)) - x) <= np.abs(x) * 2.0 ** -11 + 2 ** -25)


def test_bf16_exact_where_representable() -> None:
    c = get("bf16")
    x = (np.arange(65536, dtype=np.uint32) << 16).view(np.float32)
    x = x[np.isfinite(x)]
    assert c.decompress(c.compress(x)).tobytes() == x.tobytes()
    x = data(10_000, seed=2) * 1e30
    assert np.all(np.abs(c.decompress(c.compress(x)) - x) <= np.abs(x) * 2.0 ** -8)


ONTO = ["bf16", "fp16", "int8", "int8:bits=3", "int8:scale=500.0", "onebit", "qsgd",
        "qsgd:levels=3", "terngrad"]


@pytest.mark.parametrize("spec", ONTO)
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16"])
def test_decompress_onto_is_the_copy_then_the_decode_add(spec: str, dtype: str) -> None:
    """``decompress_onto(p, base, out)``: ``out`` ends as copying ``base`` into it and
    ``decompress(p, out, add=True)`` leaves it, ``base`` untouched (one pass for float32,
    the two steps for other dtypes); codecs that do not declare it say so."""
    from gradcomm.errors import UnsupportedError

    assert sorted(n for n in names() if get(n).decodes_onto) == \
        sorted({s.split(":")[0] for s in ONTO})
    name, _, opt = spec.partition(":")
    key, _, val = opt.partition("=")
    c = get(name, **({key: float(val) if "." in val else int(val)} if opt else {}))
    rng = np.random.default_rng(5)
    for n in (0, 1, 9, 70_001):
        x = (rng.standard_normal(n) * 300).astype(dtype)
        base = (rng.standard_normal(n) * 300).astype(dtype)
        if n > 8:
            x[3], x[5], base[4], base[5] = np.nan, np.inf, -np.inf, np.nan
        p, keep = c.compress(x), base.copy()
        want = base.copy()
        c.decompress(p, out=want, add=True)
        got = np.full(n, 7, dtype)
        assert c.decompress_onto(p, base, got) is got
        assert got.tobytes() == want.tobytes() and base.tobytes() == keep.tobytes(), n
    with pytest.raises(UnsupportedError, match="decodes_onto"):
        get("topk").decompress_onto(get("topk").compress(np.ones(3, np.float32)),
                                    np.ones(3, np.float32), np.ones(3, np.float32))


def test_int8_exact_cases_and_error_bound() -> None:
    c = get("int8", bits=8, bucket_size=64)
    x = np.repeat(np.float32([3.25, -1.0, 0.0]), 64)                   # constant buckets
    assert (c.decompress(c.compress(x)) == x).all()
    x = data(4096, seed=4)
    p = c.compress(x)
    unit = np.repeat(p.buffers["unit"], 64)[:4096]
    assert np.all(np.abs(c.decompress(p) - x) <= unit * 0.5 * (1 + 1e-5) + 1e-7)
    for bits in range(1, 9):                           # levels are the bucket's min..max
        c = get("int8", bits=bits, bucket_size=8)
        y = c.decompress(c.compress(np.float32([-2, -1, 0, 0.5, 1, 3, 3, 3])))
        assert y.min() == -2 and y.max() == 3 and len(set(y.tolist())) <= 2 ** bits


def test_int8_shared_scale_is_summable() -> None:
    """With one scale, decode-add-re-encode of on-grid values is exact; beyond it saturates."""
    c = get("int8", bits=8, scale=8.0)
    assert c.reduction == "summable"
    a, b = data(1000, seed=1), data(1000, seed=2)
    pa, pb = c.compress(a), c.compress(b)
    s = c.decompress(pa) + c.decompress(pb)
    codes = lambda p: p.buffers["q"].astype(int) - 127                         # noqa: E731
    assert (codes(c.compress(s)) == codes(pa) + codes(pb)).all()       # no new error
    step = np.float32(8.0 / 127)
    assert (c.decompress(c.compress(s)) == (codes(pa) + codes(pb)).astype(np.float32) * step).all()
    assert c.decompress(c.compress(np.float32([100, -100]))).tolist() == [8.0, -8.0]
    assert get("int8").reduction == "gathered"


def test_topk_and_randomk_exact_when_keeping_everything() -> None:
    x = data(999)
    for c in (get("topk", k=5000), get("topk", ratio=1.0), get("randomk", ratio=1.0)):
        assert (c.decompress(c.compress(x, seed=0)) == x).all()
    for c in (get("topk", k=0), get("randomk", k=0), get("topk", ratio=0.0)):
        p = c.compress(x, seed=0)
        assert p.header["k"] == 0 and (c.decompress(p) == 0).all()
    assert get("topk", ratio=0.01).compress(x).header["k"] == 10
    assert get("topk", ratio=0.07).compress(data(100)).header["k"] == 7      # not ceil(7.000...1)
    assert get("randomk", ratio=0.29).k_for(100) == 29 and get("topk", ratio=1e-9).k_for(5) == 1


def test_topk_keeps_the_largest() -> None:
    c = get("topk", k=3)
    x = np.float32([0.1, -7, 3, 0, 7, -3, 2.9])
    p = c.compress(x)
    assert p.buffers["i"].tolist() == [1, 2, 4] and p.buffers["i"].dtype == np.int32
    assert c.decompress(p).tolist() == [0, -7, 3, 0, 7, 0, 0]


def test_onebit_reconstruction_values() -> None:
    c = get("onebit", bucket_size=8)
    x = np.float32([1, 2, 3, -4, -6, 0, 0.5, -1, 10, -10])
    p = c.compress(x)
    assert p.buffers["pos"].tolist() == [np.float32(6.5 / 5), 10.0]
    assert p.buffers["neg"].tolist() == [np.float32(-11 / 3), -10.0]
    assert np.unpackbits(p.buffers["q"], bitorder="little")[:10].tolist() == \
        [1, 1, 1, 0, 0, 1, 1, 0, 1, 0]


WIRE = {  # codec config -> bytes of the buffers for n elements (of float32 input)
    "fp16": lambda n: 2 * n,
    "bf16": lambda n: 2 * n,
    "int8": lambda n: n + 8 * -(-n // 1024),
    "int8-bits3": lambda n: -(-3 * n // 8) + 8 * -(-n // 1024),
    "int8-scale": lambda n: -(-6 * n // 8),
    "qsgd": lambda n: n + 4 * -(-n // 512),
    "qsgd-bits4": lambda n: -(-4 * n // 8) + 4 * -(-n // 512),
    "terngrad": lambda n: -(-n // 4) + 4 * -(-n // 512),
    "onebit": lambda n: -(-n // 8) + 8 * -(-n // 2048),
    "topk": lambda n: 8 * max(1, round(0.01 * n)),
    "randomk": lambda n: 4 * max(1, round(0.01 * n)),
}
WIRE_CODECS = {"int8-bits3": ("int8", {"bits": 3}), "int8-scale": ("int8", {"bits": 6,
               "scale": 1.0}), "qsgd-bits4": ("qsgd", {"bits": 4})}


@pytest.mark.parametrize("label", sorted(WIRE))
def test_wire_bytes_follow_the_formula(label: str) -> None:
    """Bit-packed for real: nbytes = the declared formula + a small msgpack header."""
    name, opts = WIRE_CODECS.get(label, (label, {}))
    c = get(name, **opts)
    for n in (1, 10, 1000, 4097, 100_003):
        p = c.compress(data(n, seed=n), seed=1)
        body = sum(b.nbytes for b in p.buffers.values())
        assert body == WIRE[label](n), (n, body)
        assert p.nbytes - body <= 90 and p.nbytes == len(p.to_bytes())


def test_onebit_wire_is_an_eighth() -> None:
    n = 1 << 20
    p = get("onebit").compress(data(n))
    assert n / 8 < p.nbytes <= n / 8 + 8 * n / 2048 + 100      # bits + 2 floats per bucket
    assert p.nbytes / (n / 8) < 1.04


STOCHASTIC = [("qsgd", {}), ("terngrad", {}), ("int8", {"rounding": "stochastic"}),
              ("randomk", {"k": 50})]


@pytest.mark.parametrize("name,opts", STOCHASTIC)
def test_seeds_determine_the_bytes(name: str, opts: dict) -> None:
    c = get(name, **opts)
    x = data(5000, seed=9)
    b = lambda seed: c.compress(x, seed=seed).to_bytes().tobytes()          # noqa: E731
    assert b(1) == b(1) == b([1]) and b((3, 4, 5)) == b([3, 4, 5])
    assert b(1) != b(2) and b((1, 2)) != b((2, 1)) and b(None) != b(None)
    for bad in (-1, 1.5, "x", (1, -2), True):
        with pytest.raises(ConfigError, match="seed"):
            c.compress(x, seed=bad)


def test_seed_bytes_are_pinned() -> None:
    """Same seed, same bytes on any machine and numpy version: a few outputs pinned here
    (SeedSequence -> Philox4x32-10 -> dither / draws; changing them breaks compatibility)."""
    x = np.linspace(-1, 1, 64, dtype=np.float32)
    q = get("qsgd", levels=3, bucket_size=64).compress(x, seed=(1, 2)).buffers["q"]
    assert q[:8].tolist() == [64, 81, 20, 104, 129, 162, 64, 1]
    q = get("terngrad", bucket_size=64).compress(x, seed=(1, 2)).buffers["q"]
    assert q[:8].tolist() == [255, 63, 252, 204, 48, 195, 0, 0]
    c = get("randomk", k=4)
    assert c.compress(x, seed=5).header["key"] == [16823399, 2940995229, 2290007392, 1039507385]
    assert c.indices(64, 5).tolist() == [28, 41, 45, 53]


def test_randomk_shared_seed_gives_shared_positions_and_sums() -> None:
    c = get("randomk", ratio=0.1)
    assert c.shared_seed and c.reduction == "summable"
    xs = [data(1000, seed=r) for r in range(4)]
    ps = [c.compress(x, seed=(7, 3)) for x in xs]
    idx = c.indices(1000, (7, 3))
    assert idx.size == 100 and (np.diff(idx) > 0).all()
    want = np.zeros(1000, np.float32)
    want[idx] = ((xs[0][idx] + xs[1][idx]) + xs[2][idx]) + xs[3][idx]
    assert c.decompress_sum(ps).tobytes() == want.tobytes()
    mixed = c.decompress_sum([ps[0], c.compress(xs[1], seed=8)])
    assert np.allclose(mixed, c.decompress(ps[0]) + c.decompress(c.compress(xs[1], seed=8)))


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_decompress_sum_is_the_sum(name: str, opts: dict) -> None:
    c = codec(name, opts)
    ps = [c.compress(data(777, seed=r), seed=(r,)) for r in range(3)]
    want = c.decompress(ps[0])
    for p in ps[1:]:
        want += c.decompress(p)
    assert np.array_equal(c.decompress_sum(ps), want)


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_registry_round_trip(name: str, opts: dict) -> None:
    c = codec(name, opts)
    again = get(c.name, **c.get_config())
    assert again == c and hash(again) == hash(c) and repr(again) == repr(c)
    assert c.reduction in ("summable", "gathered") and isinstance(c.lossy, bool)
    assert c.name == name


def test_reduction_and_flags() -> None:
    summable = {"none", "fp16", "bf16", "randomk"}
    for n in names():
        if n == "powersgd":
            continue
        assert (get(n).reduction == "summable") == (n in summable), n
    assert get("randomk").shared_seed and not get("topk").shared_seed
    assert not get("none").lossy and get("fp16").lossy


BAD_OPTIONS = [
    ("int8", {"bits": 0}, "bits"), ("int8", {"bits": 9}, "bits"), ("int8", {"bits": 2.0}, "bits"),
    ("int8", {"bucket_size": 12}, "bucket_size"), ("int8", {"bucket_size": 0}, "bucket_size"),
    ("int8", {"rounding": "up"}, "rounding"), ("int8", {"scale": -1.0}, "scale"),
    ("int8", {"scale": float("nan")}, "scale"), ("int8", {"scale": 1.0, "bits": 1}, "bits"),
    ("qsgd", {"levels": 0}, "levels"), ("qsgd", {"levels": 128}, "levels"),
    ("qsgd", {"bits": 1}, "bits"), ("qsgd", {"bits": 9}, "bits"),
    ("qsgd", {"bits": 4, "levels": 7}, "levels"), ("qsgd", {"bucket_size": 100}, "bucket_size"),
    ("terngrad", {"bucket_size": -8}, "bucket_size"), ("onebit", {"bucket_size": 7}, "bucket_size"),
    ("topk", {"ratio": 1.5}, "ratio"), ("topk", {"ratio": -0.1}, "ratio"),
    ("topk", {"k": -1}, "k"), ("topk", {"k": 2.5}, "k"), ("topk", {"k": 1, "ratio": 0.1}, "ratio"),
    ("randomk", {"ratio": "half"}, "ratio"), ("randomk", {"k": True}, "k"),
]


@pytest.mark.parametrize("name,opts,option", BAD_OPTIONS)
def test_invalid_options_name_the_option(name: str, opts: dict, option: str) -> None:
    with pytest.raises(ConfigError, match=option):
        get(name, **opts)


@pytest.mark.parametrize("name", ["fp16", "int8", "qsgd", "terngrad", "onebit", "topk",
                                  "randomk", "bf16"])
def test_unknown_option_and_bad_inputs(name: str) -> None:
    with pytest.raises(TypeError):
        get(name, colour="red")
    c = get(name)
    with pytest.raises(ConfigError, match="float16, float32 or float64"):
        c.compress(np.arange(5))
    with pytest.raises(ConfigError, match="numpy array"):
        c.compress([1.0, 2.0])
    with pytest.raises(ConfigError, match="dtype"):
        c.max_nbytes(10, "int32")


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_out_arguments(name: str, opts: dict) -> None:
    c = codec(name, opts)
    x = data(3000)
    p = c.compress(x, seed=4)
    with pytest.raises(PayloadError, match="out"):
        c.decompress(p, out=np.empty(2999, np.float32))
    with pytest.raises(PayloadError, match="out"):
        c.decompress(p, out=np.empty(3000, np.float64))
    if name == "none":                                    # its payload is a view of x
        return
    again = c.compress(x, seed=4, out=p)                  # reuses p's buffers
    assert again.to_bytes().tobytes() == c.compress(x, seed=4).to_bytes().tobytes()
    for name_, b in again.buffers.items():
        if b.size:
            assert np.shares_memory(b, p.buffers[name_]), name_


def test_payload_count_is_bounded_without_out() -> None:
    """A sparse payload of a few bytes cannot make the decoder allocate terabytes."""
    c = get("topk", k=1)
    p = c.compress(data(10))
    huge = Payload("topk", {**p.header, "n": MAX_DECODE_BYTES // 4 + 1}, dict(p.buffers))
    with pytest.raises(PayloadError, match="MAX_DECODE_BYTES"):
        c.decompress(huge)
    c = get("randomk", k=1)
    p = c.compress(data(10), seed=1)
    with pytest.raises(PayloadError, match="MAX_DECODE_BYTES"):
        c.decompress(Payload("randomk", {**p.header, "n": 1 << 40}, dict(p.buffers)))


def test_payload_count_bound_does_not_apply_with_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(payload, "MAX_DECODE_BYTES", 4000)
    c = get("randomk", k=1)
    p = c.compress(data(1001), seed=1)
    with pytest.raises(PayloadError, match="MAX_DECODE_BYTES"):
        c.decompress(p)
    assert np.count_nonzero(c.decompress(p, out=np.empty(1001, np.float32))) == 1


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_fast_path_gives_the_same_payloads(name: str, opts: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Codec level: numba (forced for any size) and numpy give identical payloads."""
    pytest.importorskip("numba")
    c = codec(name, opts)
    for dtype in DTYPES:
        x = data(2000, dtype, 1)
        x[7] = 0
        res = []
        for path in ("numpy", "numba"):
            monkeypatch.setenv("GRADCOMM_KERNELS", path)
            p = c.compress(x, seed=11)
            res.append((p.to_bytes().tobytes(), c.decompress(p).tobytes(),
                        c.decompress_sum([p, p]).tobytes()))
        assert res[0] == res[1], dtype
