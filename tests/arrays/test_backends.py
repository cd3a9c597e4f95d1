"""gradcomm.arrays: one backend per library, one pair of converters, one placement rule.

The numpy and torch CPU backends run here; the CUDA branches (cupy buffers, torch CUDA
tensors) run in ``tests/devices/`` where a GPU is usable.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from gradcomm import arrays
from gradcomm.arrays import Meta
from gradcomm.arrays._cupy import CUPY
from gradcomm.arrays._numpy import NUMPY
from gradcomm.arrays._torch import TORCH
from gradcomm.errors import ConfigError

torch = pytest.importorskip("torch")


class _Sub(np.ndarray):
    pass


def test_each_backend_declares_its_kind_and_is_picked_by_type() -> None:
    assert [(b.kind, b.host_only) for b in (NUMPY, TORCH, CUPY)] == \
        [("numpy", True), ("torch", False), ("cupy", False)]
    assert arrays.backend(np.zeros(1)) is NUMPY
    assert arrays.backend(np.zeros(1)[None]) is NUMPY
    assert arrays.backend(np.zeros(1).view(_Sub)) is NUMPY             # a subclass
    assert arrays.backend(torch.zeros(1)) is TORCH
    assert arrays.backend(torch.nn.Parameter(torch.zeros(1))) is TORCH
    for junk in (3, [1.0], memoryview(b"ab"), None):
        with pytest.raises(ConfigError, match="expected a numpy array, torch tensor or cupy"):
            arrays.backend(junk)
        arrays.sync(junk)                       # not an array: nothing to wait for


def test_inspecting_numpy_arrays_never_imports_torch() -> None:
    code = ("import sys, numpy as np; from gradcomm import arrays; x = np.ones((2, 3));"
            "buf, meta = arrays.to_flat(x, arrays.placement(arrays.meta_of(x), codecs=True));"
            "arrays.from_flat(buf, meta); arrays.sync(buf); arrays.size(x);"
            "print('torch' in sys.modules, 'cupy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["False", "False"]


def _values(kind: str, dtype: str, shape: tuple[int, ...]):
    v = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape) - 3
    if kind == "numpy":
        return v.astype(dtype)
    return torch.from_numpy(v).to(getattr(torch, dtype))


@pytest.mark.parametrize("where", arrays.PLACEMENTS)
@pytest.mark.parametrize("kind, dtype", [(k, d) for k in ("numpy", "torch") for d in
                                         ("float32", "float16", "bfloat16", "int64", "uint8")
                                         if (k, d) != ("numpy", "bfloat16")])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 4)])
def test_to_flat_and_from_flat_round_trip_every_placement(where, kind, dtype, shape) -> None:
    x = _values(kind, dtype, shape)
    if len(shape) == 2:
        x = x.T                                  # not contiguous
    buf, meta = arrays.to_flat(x, where)
    assert meta == arrays.meta_of(x) and meta.dtype == dtype and meta.shape == tuple(x.shape)
    assert buf.ndim == 1 and arrays.size(buf) == meta.count
    native = where == "native" and kind == "torch"
    assert arrays.kind(buf) == ("torch" if native else "numpy")       # no CUDA here
    assert arrays.dtype_name(buf) == ("uint16" if dtype == "bfloat16" else dtype)
    before = arrays.host(arrays.clone(x)).tobytes()
    arrays.assign(buf, 0)                                              # never aliased
    assert arrays.host(arrays.clone(x)).tobytes() == before
    buf, meta = arrays.to_flat(x, where)
    y = arrays.from_flat(buf, meta)
    assert type(y) is type(x) and arrays.meta_of(y) == meta
    assert arrays.host(arrays.clone(y)).tobytes() == before


def test_from_flat_takes_a_host_buffer_over_without_copying() -> None:
    buf = np.arange(6, dtype=np.float32)
    y = arrays.from_flat(buf, Meta("numpy", "float32", (6,)))
    assert y is buf
    y = arrays.from_flat(buf, Meta("numpy", "float32", (2, 3)))
    assert y.shape == (2, 3) and np.shares_memory(y, buf)
    t = arrays.from_flat(buf, Meta("torch", "float32", (3, 2)))
    assert t.shape == (3, 2) and t.data_ptr() == buf.ctypes.data
    e = arrays.empty(Meta("torch", "bfloat16", (2, 2)))
    assert e.dtype == torch.bfloat16 and e.shape == (2, 2)


def test_placement_dense_needs_a_transport_that_moves_device_buffers() -> None:
    cpu, cuda = Meta("torch", "float32", (2,)), Meta("torch", "float32", (2,), "cuda:0")
    both = {"cpu", "cuda"}
    assert arrays.placement(cpu, both) == "host"
    assert arrays.placement(cuda) == "host"
    assert arrays.placement(cuda, both) == ("device" if arrays.cuda_usable("cupy") else "host")


def test_placement_of_codecs_follows_the_environment_at_each_call(monkeypatch) -> None:
    npy = Meta("numpy", "float32", (2,))
    cpu, cuda = Meta("torch", "float32", (2,)), Meta("torch", "float32", (2,), "cuda:0")
    monkeypatch.delenv("GRADCOMM_CODEC_PLACEMENT", raising=False)
    assert [arrays.placement(m, codecs=True) for m in (npy, cpu, cuda)] == \
        ["host", "host", "native"]
    monkeypatch.setenv("GRADCOMM_CODEC_PLACEMENT", "array")
    assert [arrays.placement(m, codecs=True) for m in (npy, cpu, cuda)] == \
        ["host", "native", "native"]
    monkeypatch.setenv("GRADCOMM_CODEC_PLACEMENT", "")           # empty: the default
    assert arrays.codec_mode() == "auto"
    monkeypatch.setenv("GRADCOMM_CODEC_PLACEMENT", "gpu")
    with pytest.raises(ConfigError, match="must be one of auto, array, got 'gpu'"):
        arrays.placement(npy, codecs=True)
    assert arrays.placement(cpu) == "host"              # dense placement does not read it


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_byte_copies_and_views_of_host_memory(kind) -> None:
    x = _values(kind, "float32", (4,))
    raw = arrays.copy_to_host(x, 8)
    assert raw.dtype == np.uint8 and raw.tobytes() == np.array([-3, -2], np.float32).tobytes()
    with pytest.raises(ConfigError, match="17 bytes requested from an array of 16 bytes"):
        arrays.copy_to_host(x, 17)
    arrays.copy_from_host(x, np.array([7.0], np.float32))
    assert arrays.host(x).tolist() == [7.0, -2.0, -1.0, 0.0]
    v = arrays.byte_view(x)
    assert v.dtype == np.uint8 and v.size == 16 and arrays.data_ptr(v) == arrays.data_ptr(x)
    with pytest.raises(ConfigError, match="C-contiguous numpy array"):
        arrays.copy_from_host(x, np.zeros((2, 2), np.uint8).T)
    assert arrays.torch_bytes(x).numel() == 16 and arrays.nbytes(x) == 16


def test_like_moves_host_arrays_to_the_reference_kind() -> None:
    a = np.arange(3, dtype=np.uint16)
    assert arrays.like(a, np.zeros(1)) is a
    t = arrays.like(a, torch.zeros(1))
    assert t.dtype == torch.uint16 and arrays.host(t).tolist() == [0, 1, 2]
    with pytest.raises(ConfigError, match="like\\(\\) takes a host numpy array, got torch"):
        arrays.like(t, torch.zeros(1))
