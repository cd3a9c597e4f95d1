"""Fused codec operations the compressed collectives use, on both kernel paths.

``decompress(payload, out=y, add=True)`` must equal ``decompress(payload) + y`` (the
decoded value is the left operand, as the unfused wire computed it) for every codec and
dtype, with NaN and infinities, on the numpy path and on the numba path (forced for any
size), and never read anything but ``out``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.compressors import get
from gradcomm.errors import ConfigError

from tests.compressors.test_codecs import CONFIGS, DTYPES, IDS, data

PATHS = ("numpy", "numba")


def _paths(monkeypatch: pytest.MonkeyPatch):
    for path in PATHS:
        if path == "numba":
            pytest.importorskip("numba")
        monkeypatch.setenv("GRADCOMM_KERNELS", path)
        yield path


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same bytes, except that a NaN may be any NaN (its payload may depend on the
    operand order the compiled loop chose)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))) and a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_decompress_add_is_decode_plus_out(name: str, opts: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    c = get(name, **opts)
    for path in _paths(monkeypatch):
        for dtype in DTYPES:
            for n in (0, 1, 9, 2000):
                x = data(n, dtype, 3)
                if n > 8:
                    x[5] = np.nan if name not in ("topk",) else x[5]
                    x[8] = np.inf
                y = data(n, dtype, 4)
                p = c.compress(x, seed=5)
                want = np.add(c.decompress(p), y)
                got = y.copy()
                assert c.decompress(p, out=got, add=True) is got
                sparse = name in ("topk", "randomk")
                if sparse:        # untouched positions keep y itself (0 + -0.0 aside)
                    want = np.where(c.decompress(p) == 0, y, want)
                assert _same(got, want), (path, dtype, n)


@pytest.mark.parametrize("name", ("fp16", "int8", "onebit", "topk"))
def test_add_needs_out(name: str) -> None:
    c = get(name)
    p = c.compress(np.ones(4, np.float32))
    with pytest.raises(ConfigError, match="add=True needs out"):
        c.decompress(p, add=True)
