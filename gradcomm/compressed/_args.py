"""The arguments of a compressed allreduce: which names it accepts, and their checks.

Example:
    >>> check_op("mean", "float32", "fp16")
    >>> check_op("avg", "float32", "fp16")
    Traceback (most recent call last):
    ...
    gradcomm.errors.ConfigError: unknown op 'avg'; known: sum, mean, max, min, prod
    >>> check_seed(None), check_seed(np.uint8(7))
    (0, 7)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import FLOATS
from ..collectives import DENSE
from ..errors import ConfigError, UnsupportedError

#: algorithms that run per hop on a CompressedWire
HOP_ALGORITHMS = ("ring", "tree", "recursive_doubling", "rabenseifner")
#: algorithms that gather the compressed contributions
GATHER_ALGORITHMS = ("allgather", "sparse_allgather")
#: every algorithm name a compressed allreduce accepts
COMPRESSED_ALGORITHMS = (*HOP_ALGORITHMS, *GATHER_ALGORITHMS, "auto")
#: algorithms that can carry PowerSGD's factors (two dense sums)
POWERSGD_ALGORITHMS = (*DENSE, *GATHER_ALGORITHMS, "auto")
OPS = ("sum", "mean")


def check_op(op: str, dtype: str, name: str, algorithm: str | None = None) -> None:
    """Raise unless a compressed allreduce (codec ``name``) can reduce ``dtype`` by ``op``
    (``algorithm``: a gather algorithm chosen without a codec, for the message)."""
    if op not in OPS:
        if op in ("max", "min", "prod") and name == "none" and algorithm in GATHER_ALGORITHMS:
            raise UnsupportedError(f"op={op!r} with algorithm={algorithm!r}: the gathered "
                                   f"routes reduce {', '.join(OPS)} only; use a dense "
                                   f"algorithm ({', '.join(DENSE)} or auto)")
        if op in ("max", "min", "prod"):
            raise UnsupportedError(f"op={op!r} with a compressor: compressed allreduce "
                                   f"supports {', '.join(OPS)}; use compressor=None")
        raise ConfigError(f"unknown op {op!r}; known: sum, mean, max, min, prod")
    if dtype not in FLOATS:
        raise UnsupportedError(f"compressor {name!r} needs a floating dtype, got {dtype}")


def check_algorithm(algorithm: str, name: str, *, dense_rounds: bool = False) -> None:
    """Raise unless ``algorithm`` can carry codec ``name``'s payloads: any of
    :data:`COMPRESSED_ALGORITHMS`, or with ``dense_rounds`` (PowerSGD, whose factors are
    dense sums) any of :data:`POWERSGD_ALGORITHMS`."""
    if dense_rounds:
        if algorithm not in POWERSGD_ALGORITHMS:
            raise ConfigError(f"unknown algorithm {algorithm!r}; powersgd runs on "
                              f"{', '.join(POWERSGD_ALGORITHMS)}")
        return
    if algorithm not in COMPRESSED_ALGORITHMS:
        if algorithm == "native":
            raise UnsupportedError(
                f"algorithm='native' cannot carry {name!r} payloads (only codecs whose "
                "rounds are dense sums can: powersgd); with this compressor use one of "
                f"{', '.join(COMPRESSED_ALGORITHMS)}")
        raise ConfigError(f"unknown algorithm {algorithm!r}; with a compressor use one "
                          f"of {', '.join(COMPRESSED_ALGORITHMS)}")


def check_seed(seed: Any) -> int:
    """The seed of a compressed allreduce as an int (None: 0), checked."""
    seed = 0 if seed is None else seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or \
            not 0 <= seed < 2 ** 63:
        raise ConfigError(f"seed must be an integer in 0..2**63-1, got {seed!r}")
    return int(seed)


def check_key(key: Any) -> str:
    """The key of a compressed allreduce (None: ``"default"``), checked."""
    key = "default" if key is None else key
    if not isinstance(key, str):
        raise ConfigError(f"key must be a str, got {type(key).__name__}")
    return key
