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

from gradcomm import _array
from tests.compressors.test_kernels import nasty, specials

torch = pytest.importorskip("torch")
pytest.importorskip("array_api_compat")
X = importlib.import_module("gradcomm.compressors._kernels._xp")
NP = importlib.import_module("gradcomm.compressors._kernels._numpy")

KEY = np.array([0x01234567, 0x89ABCDEF, 7, 0xFFFFFFFF], np.uint32)
COUNTS = (0, 1, 7, 8, 9, 63, 64, 65, 1000, 4099)


def _cupy_usable() -> bool:
    return _array.cuda_usable("cupy")


def _ref(backend: str):
    """An array of the backend's kind and device (what converted inputs are made like)."""
    if backend == "numpy":
        return np.zeros(1)
    if backend == "torch":
        return torch.zeros(1)
    if backend == "torch-cuda":
        return torch.zeros(1, device="cuda")
    import cupy
    return cupy.zeros(1)


BACKENDS = [
    "numpy", "torch",
    pytest.param("torch-cuda", marks=pytest.mark.skipif(
        not _array.cuda_usable("torch"), reason="torch CUDA not usable")),
    pytest.param("cupy", marks=pytest.mark.skipif(
        not _cupy_usable(), reason="cupy CUDA not usable")),
]


@pytest.fixture(params=BACKENDS)
def to(request):
    """Host numpy -> a fresh array of the backend's kind (never sharing the source)."""
    ref = _ref(request.param)
    return lambda a: _array.like(np.array(a, copy=True), ref)


def same(dev, ref: np.ndarray) -> bool:
    h = _array.host(dev)
    return h.dtype == ref.dtype and h.shape == ref.shape and h.tobytes() == ref.tobytes()


# --- random stream and packing ----------------------------------------------------------

@pytest.mark.parametrize("start,count", [(0, 0), (0, 1), (3, 10), (5, 37), (1001, 500),
                                         (7, 100_001), ((1 << 36) + 5, 9)])
def test_philox_words_and_dither(to, start: int, count: int) -> None:
    like = to(np.zeros(1, np.float32))
    w = X.philox_words(KEY, start, count, like)
    assert _array.dtype_name(w) == "int64" and _array.kind(w) == _array.kind(like)
    assert (_array.host(w) == NP.philox_words(KEY, start, count).astype(np.int64)).all()
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
