"""The array kinds and devices the device-path tests run on.

``numpy`` and ``torch-cpu`` run everywhere (the device kernels are the same code on every
device, so CI covers their logic); ``torch-cuda`` and ``cupy`` run where a GPU is usable
(``cuda_usable``: importing cupy is not enough) and skip cleanly elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm import arrays

GPU_KINDS = [
    pytest.param("torch-cuda", marks=pytest.mark.skipif(
        not arrays.cuda_usable("torch"), reason="no usable CUDA device through torch")),
    pytest.param("cupy", marks=pytest.mark.skipif(
        not arrays.cuda_usable("cupy"), reason="no usable CUDA device through cupy")),
]
#: every kind: numpy and torch CPU, plus the GPU ones
KINDS = ["numpy", "torch-cpu", *GPU_KINDS]


def ref(kind: str):
    """A one-element array of ``kind`` (what converted inputs are made like)."""
    if kind == "numpy":
        return np.zeros(1)
    import torch

    if kind == "torch-cpu":
        return torch.zeros(1)
    if kind == "torch-cuda":
        return torch.zeros(1, device="cuda")
    import cupy

    return cupy.zeros(1)


def on(kind: str, a: np.ndarray):
    """A fresh copy of host ``a`` as an array of ``kind`` (never sharing ``a``)."""
    return arrays.like(np.array(a, copy=True), ref(kind))


def data(n: int, dtype: str, seed: int) -> np.ndarray:
    """``n`` values of mixed scales (1e-3..1e2) with exact zeros and ties, host ``dtype``."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(dtype)
    if n > 20:
        x[rng.integers(0, n, n // 10)] = 0.0
        x[rng.integers(0, n, 3)] = 1.5
    return x


def wire(p) -> bytes:
    """A payload's wire form as bytes (device buffers are copied to the host)."""
    return p.to_bytes().tobytes()
