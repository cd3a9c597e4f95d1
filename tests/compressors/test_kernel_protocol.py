"""Every kernel path implements the whole :class:`Kernels` function set (and numba, whose
``FUSED`` is True, :class:`FusedKernels`), with the protocol's parameter names and
defaults, so codecs can call any path the same way."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import numpy as np
import pytest

from gradcomm.compressors._kernels._protocol import FusedKernels, Kernels, members

PATHS = ("numpy", "numba", "xp")


def _path(name: str):
    if name == "numba":
        pytest.importorskip("numba")
    if name == "xp":
        pytest.importorskip("array_api_compat")
    return importlib.import_module(f"gradcomm.compressors._kernels._{name}")


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.name != "self"]


@pytest.mark.parametrize("name", PATHS)
def test_every_path_implements_the_whole_set(name: str) -> None:
    mod = _path(name)
    assert mod.NAME == name and isinstance(mod.FUSED, bool)
    want = members(FusedKernels) if mod.FUSED else members(Kernels)
    missing = [m for m in want if not hasattr(mod, m)]
    assert not missing, missing
    for m in want:
        ref = vars(FusedKernels).get(m) or vars(Kernels).get(m)
        if callable(ref):
            assert _params(getattr(mod, m)) == _params(ref), m


def test_only_numba_fuses() -> None:
    assert not _path("numpy").FUSED
    assert not _path("xp").FUSED
    assert _path("numba").FUSED


@pytest.mark.parametrize("name", PATHS)
def test_like_none_means_host(name: str) -> None:
    mod = _path(name)
    key = np.array([1, 2, 3, 4], np.uint32)
    ref = importlib.import_module("gradcomm.compressors._kernels._numpy")
    assert np.asarray(mod.philox_words(key, 3, 9)).tolist() == \
        ref.philox_words(key, 3, 9).tolist()
    assert np.asarray(mod.dither(key, 5, 7)).tobytes() == ref.dither(key, 5, 7).tobytes()
    assert np.asarray(mod.randomk_indices(key, 50, 6)).tolist() == \
        ref.randomk_indices(key, 50, 6).tolist()


def test_xp_select_does_not_import_xp() -> None:
    """No cycle: the top-k / random-k kernels and the stream load without the xp module."""
    pytest.importorskip("array_api_compat")
    code = ("import sys, gradcomm.compressors._kernels._xp_select; "
            "print('gradcomm.compressors._kernels._xp' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"
