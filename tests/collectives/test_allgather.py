"""Variable-size allgather (ring and Bruck) on in-process ranks."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.bench.data import exact_values
from gradcomm.collectives.allgather import allgather_ints, allgather_sizes, allgatherv
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError, PayloadError

pytestmark = pytest.mark.timeout(120)


def _block(rank: int, size: int) -> np.ndarray:
    """``rank``'s bytes (0..8, drawn per (rank, size): no period, so a misplaced piece shows)."""
    return exact_values(rank, size, "uint8", "sum").astype(np.uint8)


@pytest.mark.parametrize("algorithm", ["ring", "recursive_doubling", "auto"])
@pytest.mark.parametrize("p", range(1, 9))
def test_variable_sizes_every_rank_same_bytes(p: int, algorithm: str) -> None:
    # sizes include 0, 1 and one above the eager limit (rendezvous path)
    sizes = [(0, 1, 5, 70_000, 3, 0, 17, 2)[r] for r in range(p)]

    def fn(t):
        blocks = allgatherv(t, _block(t.rank, sizes[t.rank]), algorithm=algorithm)
        return b"|".join(b.tobytes() for b in blocks)

    res = run_ranks(p, fn)
    want = b"|".join(_block(r, sizes[r]).tobytes() for r in range(p))
    assert all(r == want for r in res)


@pytest.mark.parametrize("p", [1, 3, 5, 8])
def test_sizes_and_ints(p: int) -> None:
    def fn(t):
        return (allgather_sizes(t, t.rank * 10).tolist(),
                allgather_ints(t, [t.rank, -t.rank, 7]).tolist())

    for sizes, rows in run_ranks(p, fn):
        assert sizes == [r * 10 for r in range(p)]
        assert rows == [[r, -r, 7] for r in range(p)]


def test_oversized_block_raises_on_every_rank() -> None:
    def fn(t):
        try:
            allgatherv(t, np.zeros(100 if t.rank == 2 else 4, np.uint8), max_nbytes=50)
        except PayloadError as exc:
            return str(exc)
        return "no error"

    res = run_ranks(4, fn)
    assert all("rank 2 announced a block of 100 bytes" in r for r in res)


def test_known_sizes_skip_the_exchange() -> None:
    def fn(t):
        sizes = np.array([3, 4, 5], np.int64)
        t.stats.reset()
        blocks = allgatherv(t, np.full(sizes[t.rank], t.rank, np.uint8), sizes=sizes,
                            algorithm="ring")
        return [b.tolist() for b in blocks], t.stats.messages_sent

    for blocks, sent in run_ranks(3, fn):
        assert blocks == [[0] * 3, [1] * 4, [2] * 5]
        assert sent == 2                       # p - 1 ring steps, no size round


def test_bad_algorithm() -> None:
    with pytest.raises(ConfigError, match="unknown allgather algorithm"):
        run_ranks(1, lambda t: allgatherv(t, np.zeros(1, np.uint8), algorithm="star"))
