"""Helpers the benchmark's modules share: size parsing, gathers to rank 0, the timer.

The CLI, the sweep, the calibration and the overhead and gossip tools all import from
here and not from one another, so the benchmark's modules form no import cycle.

Example:
    >>> parse_sizes("4,4K,1MiB")
    [4, 4096, 1048576]
    >>> from gradcomm.comm import run_ranks
    >>> import numpy as np
    >>> run_ranks(2, lambda t: gather(t, np.array([t.rank + 0.5])))[0].tolist()
    [[0.5], [1.5]]
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from ..comm.base import TAG_USER, Transport
from ..errors import ConfigError, UnsupportedError

#: tag of the benchmark's own bookkeeping messages (gathers to rank 0)
TAG_BENCH = TAG_USER + 17
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'4', '4K', '64MiB' -> bytes (binary units)."""
    s = text.strip().upper()
    num = s.rstrip("KMGIB")
    try:
        value = int(num) * _UNITS[s[len(num):]]
    except (ValueError, KeyError):
        raise ConfigError(f"bad size {text!r}: expected e.g. 4, 4K, 64MiB") from None
    if value <= 0:
        raise ConfigError(f"sizes must be > 0 bytes, got {text!r}")
    return value


def number(text: str) -> Any:
    """``text`` as an int, else as a float, else as it is (option values on command lines).

    Example:
        >>> number("4"), number("0.01"), number("ring")
        (4, 0.01, 'ring')
    """
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_sizes(text: str) -> list[int]:
    """'4,4K,1MiB' -> bytes of each."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def user_array(x: np.ndarray, dtype: str) -> Any:
    """What a user would pass: numpy, or a torch tensor for bfloat16 (no numpy dtype)."""
    if dtype != "bfloat16":
        return x
    try:
        import torch
    except ImportError:
        raise UnsupportedError("bfloat16 arrays need torch (pip install torch)") from None
    return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)


def gather(t: Transport, vec: np.ndarray) -> np.ndarray | None:
    """Rank 0 gets a (size, len) table of every rank's ``vec``; others get None."""
    vec = np.ascontiguousarray(vec, dtype=np.float64)
    if t.rank != 0:
        t.send(vec, 0, TAG_BENCH)
        return None
    table = np.empty((t.size, vec.size))
    table[0] = vec
    for r in range(1, t.size):
        t.recv(table[r], r, TAG_BENCH)
    return table


def agree_status(t: Transport, code: int) -> int:
    """Rank 0's ``code`` on every rank (collective), so every rank exits alike."""
    buf = np.array([code], np.int64)
    if t.rank == 0:
        for r in range(1, t.size):
            t.send(buf, r, TAG_BENCH + 1)
        return code
    t.recv(buf, 0, TAG_BENCH + 1)
    return int(buf[0])


def median_slowest_us(t: Transport, fn: Callable[[], Any], iters: int,
                      warmup: int) -> float | None:
    """Median over iterations of the slowest rank's time, µs (rank 0; None elsewhere)."""
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    for i in range(iters):
        t.barrier()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    table = gather(t, times)
    return None if table is None else float(np.median(table.max(axis=0))) * 1e6
