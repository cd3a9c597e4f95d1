"""Hostile payloads: random, truncated, bit-flipped or forged payloads only ever raise
PayloadError (never IndexError, MemoryError, a crash or a huge allocation); a payload that
does decode gives an array of the announced dtype and count."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradcomm._dtypes import CODES
from gradcomm.compressors import get
from gradcomm.compressors.payload import FLOAT_DTYPES, MAX_DECODE_BYTES, Payload
from gradcomm.errors import PayloadError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")    # garbage values overflow

CODECS = [("fp16", {}), ("bf16", {}), ("int8", {"bucket_size": 16}),
          ("int8", {"bits": 3, "scale": 2.0}), ("qsgd", {"bits": 4, "bucket_size": 16}),
          ("qsgd", {"levels": 5, "bucket_size": 8}), ("terngrad", {"bucket_size": 16}),
          ("onebit", {"bucket_size": 16}), ("topk", {"ratio": 0.2}), ("randomk", {"k": 7}),
          ("none", {})]
IDS = [f"{n}{'-' + '-'.join(map(str, o.values())) if o else ''}" for n, o in CODECS]
FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def wire(name: str, opts: dict, n: int = 75, dtype: str = "float32") -> np.ndarray:
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    return get(name, **opts).compress(x, seed=3).to_bytes()


def decode_or_payload_error(name: str, opts: dict, data: bytes | np.ndarray) -> None:
    c = get(name, **opts)
    try:
        p = Payload.from_bytes(data)
        y = c.decompress(p)
    except PayloadError:
        return
    assert y.dtype.name in FLOAT_DTYPES and y.ndim == 1
    assert y.size == p.header["n"]
    try:
        c.decompress_sum([p, p])
    except PayloadError:
        pass


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
def test_every_truncation_is_rejected(name: str, opts: dict) -> None:
    data = wire(name, opts)
    for cut in range(data.size):
        with pytest.raises(PayloadError):
            get(name, **opts).decompress(Payload.from_bytes(data[:cut]))
    with pytest.raises(PayloadError):
        Payload.from_bytes(np.concatenate([data, np.zeros(1, np.uint8)]))


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
@FUZZ
@given(flips=st.lists(st.integers(0, 10 ** 6), min_size=1, max_size=6))
def test_bit_flips(name: str, opts: dict, flips: list[int]) -> None:
    data = wire(name, opts).copy()
    for f in flips:
        data[(f // 8) % data.size] ^= np.uint8(1 << (f % 8))
    decode_or_payload_error(name, opts, data)


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
@FUZZ
@given(header_flips=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 255)),
                             min_size=1, max_size=4))
def test_header_byte_changes(name: str, opts: dict, header_flips: list) -> None:
    """Byte changes concentrated in the msgpack header (counts, sizes, dtype codes)."""
    data = wire(name, opts).copy()
    hlen = int(data[3]) | int(data[4]) << 8
    for pos, val in header_flips:
        data[7 + pos % max(1, hlen)] = val
    decode_or_payload_error(name, opts, data)


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
@FUZZ
@given(blob=st.binary(min_size=0, max_size=400))
def test_random_bytes(name: str, opts: dict, blob: bytes) -> None:
    decode_or_payload_error(name, opts, blob)
    decode_or_payload_error(name, opts, bytes(wire(name, opts)[:7]) + blob)   # valid prefix


SCALARS = st.one_of(st.integers(-2 ** 63, 2 ** 64 - 1), st.floats(allow_nan=True),
                    st.booleans(), st.none(), st.text(max_size=3),
                    st.lists(st.integers(-5, 2 ** 33), max_size=5))


@pytest.mark.parametrize("name,opts", CODECS, ids=IDS)
@FUZZ
@given(data=st.data())
def test_forged_headers_and_buffers(name: str, opts: dict, data) -> None:
    """Valid msgpack, hostile content: every header field and buffer replaced at random."""
    good = Payload.from_bytes(wire(name, opts))
    header = dict(good.header)
    for key in data.draw(st.lists(st.sampled_from(sorted(header) + ["extra"]), max_size=3)):
        if data.draw(st.booleans()):
            header[key] = data.draw(SCALARS)
        else:
            header.pop(key, None)
    if data.draw(st.booleans()):
        header["n"] = data.draw(st.integers(0, 2 ** 62))
    buffers = dict(good.buffers)
    for key in data.draw(st.lists(st.sampled_from(sorted(buffers) + ["zz"]), max_size=2)):
        dtype = data.draw(st.sampled_from(["uint8", "int32", "int64", "float16", "float32",
                                           "float64", "uint16"]))
        size = data.draw(st.integers(0, 300))
        raw = data.draw(st.binary(min_size=size * np.dtype(dtype).itemsize,
                                  max_size=size * np.dtype(dtype).itemsize))
        buffers[key] = np.frombuffer(raw, dtype).copy()
    forged = Payload(good.codec, header, buffers)
    decode_or_payload_error(name, opts, forged.to_bytes())


def forged(name: str, opts: dict, **changes) -> Payload:
    good = Payload.from_bytes(wire(name, opts))
    header = {**good.header, **{k: v for k, v in changes.items() if not k.startswith("b_")}}
    buffers = {**good.buffers, **{k[2:]: v for k, v in changes.items() if k.startswith("b_")}}
    return Payload.from_bytes(Payload(good.codec, header, buffers).to_bytes())


HOSTILE = [
    ("topk", {"ratio": 0.2}, dict(b_i=np.arange(15, dtype=np.int32)[::-1].copy()), "increasing"),
    ("topk", {"ratio": 0.2}, dict(b_i=np.full(15, 3, np.int32)), "increasing"),
    ("topk", {"ratio": 0.2}, dict(b_i=np.arange(15, dtype=np.int32) * 10), "0..74"),
    ("topk", {"ratio": 0.2}, dict(b_i=np.arange(-1, 14, dtype=np.int32)), "0..74"),
    ("topk", {"ratio": 0.2}, dict(k=76), "k="),
    ("topk", {"ratio": 0.2}, dict(n=1 << 40, b_i=np.arange(15, dtype=np.int64)),
     "MAX_DECODE_BYTES"),
    ("topk", {"ratio": 0.2}, dict(b_i=np.arange(15, dtype=np.int64)), "int32"),
    ("randomk", {"k": 7}, dict(key=[1, 2, 3]), "key"),
    ("randomk", {"k": 7}, dict(key=[1, 2, 3, 1 << 32]), "key"),
    ("randomk", {"k": 7}, dict(k=8), "buffer"),
    ("qsgd", {"levels": 5, "bucket_size": 8}, dict(b_q=np.full(38, 0x77, np.uint8)), "level"),
    ("qsgd", {"levels": 5, "bucket_size": 8}, dict(s=0), "s="),
    ("qsgd", {"levels": 5, "bucket_size": 8}, dict(s=128), "s="),
    ("qsgd", {"levels": 5, "bucket_size": 8}, dict(bs=12), "multiple of 8"),
    ("qsgd", {"levels": 5, "bucket_size": 8}, dict(bs=0), "bs="),
    ("int8", {"bucket_size": 16}, dict(bs=1 << 40), "bs="),
    ("int8", {"bucket_size": 16}, dict(bits=9), "bits="),
    ("int8", {"bucket_size": 16}, dict(dt=5), "dtype code"),
    ("int8", {"bucket_size": 16}, dict(n=76), "buffer"),
    ("int8", {"bits": 3, "scale": 2.0}, dict(sc=float("inf")), "sc="),
    ("int8", {"bits": 3, "scale": 2.0}, dict(sc=-1.0), "sc="),
    ("int8", {"bits": 3, "scale": 2.0}, dict(sc=2), "sc="),
    ("fp16", {}, dict(n=True), "n="),
    ("fp16", {}, dict(n=75.0), "n="),
    ("fp16", {}, dict(extra=1), "keys"),
    ("fp16", {}, dict(b_v=np.zeros(75, np.float32)), "buffer"),
    ("onebit", {"bucket_size": 16}, dict(b_zz=np.zeros(1, np.uint8)), "buffers"),
]


@pytest.mark.parametrize("name,opts,changes,match", HOSTILE)
def test_hostile_fields_name_the_problem(name: str, opts: dict, changes: dict,
                                         match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        get(name, **opts).decompress(forged(name, opts, **changes))


def test_a_payload_of_another_codec_is_rejected() -> None:
    p = get("int8").compress(np.ones(10, np.float32))
    for name in ("fp16", "qsgd", "topk", "onebit"):
        with pytest.raises(PayloadError, match="int8"):
            get(name).decompress(p)
    with pytest.raises(PayloadError, match="Payload"):
        get("int8").decompress(p.to_bytes())


def test_huge_bucket_with_few_elements_allocates_little() -> None:
    """A payload may announce a huge bucket; scratch space follows the element count."""
    c = get("qsgd", bits=4, bucket_size=8)
    p = c.compress(np.ones(5, np.float32), seed=1)
    big = Payload("qsgd", {**p.header, "bs": 1 << 30}, dict(p.buffers))
    want = c.decompress(p)
    from gradcomm.compressors import _kernels
    for path in _kernels.available():
        y = np.empty(5, np.float32)
        _kernels.get(path).signlevel_decode(p.buffers["q"], 5, 1 << 30, p.header["s"], 4,
                                            p.buffers["norm"], y)
        assert (y == want).all()
    assert (c.decompress(big) == want).all()


# -- decode amplification: the output is bounded before anything is allocated ---------------
def _peak(fn) -> int:
    """Peak bytes Python and numpy allocated while ``fn()`` ran (numpy reports its data
    allocations to tracemalloc)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _refused_cheaply(c, p: Payload, **kw) -> None:
    def call() -> None:
        with pytest.raises(PayloadError):
            c.decompress(p, **kw)
    assert _peak(call) < 1 << 20


def test_a_45_byte_topk_payload_cannot_claim_2_gib() -> None:
    c = get("topk", k=1)
    good = c.compress(np.ones(8, np.float64))
    forged = Payload.from_bytes(Payload("topk", {**good.header, "n": 1 << 28},
                                        dict(good.buffers)).to_bytes())
    assert forged.nbytes < 64
    _refused_cheaply(c, forged)                              # 2 GiB of float64: over the cap
    _refused_cheaply(c, forged, out=np.empty(8, np.float64))  # the receiver expects 8


def test_a_small_powersgd_payload_cannot_claim_a_huge_matrix() -> None:
    """rows + cols = 32768 at rank 1 (131 KB of factors) would decode to 2**28 floats."""
    from gradcomm.compressors.powersgd import Layout

    c = get("powersgd", rank=1)
    n = 1 << 28
    lay = c.layout(n)
    assert lay == Layout(16384, 16384, 1)
    header = {"n": n, "dt": CODES["float32"], "rows": lay.rows, "cols": lay.cols, "r": 1}
    forged = Payload("powersgd", header,
                     {"p": np.ones(lay.rows, np.float32), "q": np.ones(lay.cols, np.float32),
                      "v": np.zeros(0, np.float32)})
    assert forged.nbytes < 140_000
    _refused_cheaply(c, forged)
    _refused_cheaply(c, forged, out=np.empty(1000, np.float32))


@pytest.mark.parametrize("name,opts", CODECS + [("powersgd", {"rank": 2})],
                         ids=IDS + ["powersgd-2"])
@FUZZ
@given(claim=st.integers(0, 2 ** 40), expect=st.integers(1, 4096))
def test_a_claimed_count_other_than_expected_is_refused_before_allocation(
        name: str, opts: dict, claim: int, expect: int) -> None:
    """A receiver that expects ``expect`` values (out=) never decodes a payload claiming
    ``claim`` others, and never allocates for it; without out= the cap holds."""
    c = get(name, **opts)
    good = c.compress(np.ones(expect, np.float32), seed=1)
    forged = Payload(good.codec, {**good.header, "n": claim}, dict(good.buffers))
    out = np.empty(expect, np.float32)
    if claim == expect:
        assert c.decompress(forged, out=out) is out
        return

    def expected() -> None:
        with pytest.raises(PayloadError):
            c.decompress(forged, out=out)
    assert _peak(expected) < 1 << 20

    def capped() -> None:
        with pytest.raises(PayloadError):
            c.decompress(forged)
    if claim * 4 > MAX_DECODE_BYTES:
        assert _peak(capped) < 1 << 20
