"""Where a reduction works on an array: the one placement decision, made once per array.

:func:`placement` answers ``"host"``, ``"device"`` or ``"native"`` (see
:mod:`gradcomm.arrays.base`), and :func:`gradcomm.arrays.to_flat` makes the flat working
copy there:

- dense reductions keep a CUDA array on its device (``"device"``, a cupy buffer) only if
  the transport moves device buffers itself (``"cuda" in transport.devices``, e.g. a
  CUDA-aware MPI) and cupy can run the arithmetic there; everything else is staged
  through host memory;
- compressed reductions (``codecs=True``) run their codecs where the data is
  (``"native"``) for CUDA arrays, and on the host for the rest, unless the environment
  variable ``GRADCOMM_CODEC_PLACEMENT`` is ``"array"``: then every non-numpy array
  (torch CPU tensors included: the device route on a machine without a GPU, which the
  tests use) takes the native route. The variable is read, and checked, at each such
  call; every public entry (``allreduce``, ``wrap().Allreduce``, a DDP bucket) asks once
  per array, so a test may change it between calls.

Example:
    >>> from gradcomm.arrays.base import Meta
    >>> placement(Meta("torch", "float32", (2,), "cuda:0"), {"cpu"})
    'host'
    >>> placement(Meta("torch", "float32", (2,), "cuda:0"), codecs=True)
    'native'
    >>> placement(Meta("numpy", "float32", (2,)), {"cpu", "cuda"}, codecs=True)
    'host'
"""

from __future__ import annotations

import os
from collections.abc import Set

from ..errors import ConfigError
from .base import Meta

#: a transport that moves host buffers only
HOST_ONLY: frozenset[str] = frozenset({"cpu"})
#: ``GRADCOMM_CODEC_PLACEMENT``: "auto" (codecs run on the device for CUDA arrays, on the
#: host otherwise) or "array" (codecs run on every non-numpy array where it lives, torch
#: CPU tensors included: the device route on a machine without a GPU, used by the tests)
CODEC_PLACEMENTS = ("auto", "array")


def cuda_usable(lib: str) -> bool:
    """Whether CUDA works through ``lib`` ("torch" or "cupy"): importable AND a device is
    usable (``import cupy`` may succeed on a machine without a GPU).

    Example:
        >>> cuda_usable("numpy")
        False
    """
    try:
        if lib == "torch":
            import torch

            return bool(torch.cuda.is_available())
        if lib == "cupy":
            import cupy

            return bool(cupy.cuda.is_available())
    except Exception:  # a broken CUDA install raises all sorts of errors: not usable
        return False
    return False


def codec_mode() -> str:
    """``GRADCOMM_CODEC_PLACEMENT`` (default "auto"), checked against
    :data:`CODEC_PLACEMENTS`.

    Example:
        >>> codec_mode() in CODEC_PLACEMENTS
        True
    """
    mode = os.environ.get("GRADCOMM_CODEC_PLACEMENT", "auto") or "auto"
    if mode not in CODEC_PLACEMENTS:
        raise ConfigError(f"GRADCOMM_CODEC_PLACEMENT must be one of "
                          f"{', '.join(CODEC_PLACEMENTS)}, got {mode!r}")
    return mode


def placement(meta: Meta, devices: Set[str] = HOST_ONLY, *, codecs: bool = False) -> str:
    """Where a reduction of the array described by ``meta`` works: "host", "device" or
    "native" (see the module docstring). ``devices``: what the transport moves (its
    ``devices``); ``codecs``: whether the reduction runs codecs (a compressed one).

    Example:
        >>> from gradcomm.arrays.base import Meta
        >>> placement(Meta("numpy", "float32", (2,)), {"cpu", "cuda"})
        'host'
    """
    if codecs:
        mode = codec_mode()
        if meta.kind == "numpy":
            return "host"
        return "native" if meta.device != "cpu" or mode == "array" else "host"
    if meta.device == "cpu" or "cuda" not in devices:
        return "host"
    return "device" if cuda_usable("cupy") else "host"
