"""Validators of codec options and arguments: each returns the value or raises ConfigError.

Example:
    >>> positive_int("bits", 4, 1, 8), one_of("rounding", "nearest", ("nearest", "stochastic"))
    (4, 'nearest')
    >>> positive_int("bits", 9, 1, 8)
    Traceback (most recent call last):
    ...
    gradcomm.errors.ConfigError: bits must be an integer in 1..8, got 9
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Sequence

import numpy as np

from .._dtypes import CODES
from ..errors import ConfigError, UnknownOptionError
from .payload import FLOAT_DTYPES


def closest(name: Any, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to ``name`` (ignoring case),
    else ``""``.

    Example:
        >>> closest("ration", ["ratio", "k"]), closest("zzz", ["ratio"])
        (" (did you mean 'ratio'?)", '')
    """
    by_lower = {k.lower(): k for k in known}
    near = difflib.get_close_matches(str(name).lower(), list(by_lower), n=1, cutoff=0.6)
    return f" (did you mean {by_lower[near[0]]!r}?)" if near else ""


def check_keywords(owner: str, given: Iterable[str], known: Sequence[str],
                   also: Sequence[str] = ()) -> None:
    """UnknownOptionError naming the first of ``given`` that ``owner`` does not take,
    its options (``known``) and the closest of ``known`` + ``also`` (names the caller
    takes beside them, such as ``error_feedback``).

    Example:
        >>> check_keywords("compressor 'topk'", ["ration"], ("ratio", "k"))
        Traceback (most recent call last):
        ...
        gradcomm.errors.UnknownOptionError: compressor 'topk' has no option 'ration' (did you mean 'ratio'?); its options: ratio, k
    """
    for name in given:
        if name not in known:
            opts = ", ".join(known) if known else "none"
            raise UnknownOptionError(f"{owner} has no option {name!r}"
                                     f"{closest(name, (*known, *also))}; its options: {opts}")


def positive_int(name: str, value: Any, low: int = 1, high: int | None = None) -> int:
    """Validate an integer option."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low or \
            (high is not None and value > high):
        rng = f">= {low}" if high is None else f"in {low}..{high}"
        raise ConfigError(f"{name} must be an integer {rng}, got {value!r}")
    return int(value)


def one_of(name: str, value: Any, choices: Sequence[Any]) -> Any:
    """Validate an option that takes one of a few values."""
    if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def seed_words(seed: Any) -> np.ndarray:
    """Four uint32 words that key a codec's random stream, from ``seed``.

    ``seed``: None (fresh entropy), a non-negative int, or a tuple/list of them (such as
    ``(seed, step, key_hash, rank)``). Mixed by :class:`numpy.random.SeedSequence`, so
    nearby seeds give independent streams and the same seed gives the same words anywhere.

    Example:
        >>> seed_words((1, 2)).tolist() == seed_words([1, 2]).tolist() != seed_words(1).tolist()
        True
    """
    if seed is not None:
        items = seed if isinstance(seed, (tuple, list)) else (seed,)
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
                raise ConfigError(f"seed must be None, a non-negative int or a tuple of them, "
                                  f"got {seed!r}")
        seed = [int(v) for v in items] if isinstance(seed, (tuple, list)) else int(seed)
    return np.random.SeedSequence(seed).generate_state(4, np.uint32)


def dtype_code(dtype: Any) -> int:
    """Payload code of a float dtype name or numpy dtype (ConfigError otherwise)."""
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in FLOAT_DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(FLOAT_DTYPES)}, got {dtype!r}")
    return CODES[name]
