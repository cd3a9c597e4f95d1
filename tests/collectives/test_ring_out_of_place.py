"""The out-of-place ring (``gradcomm.collectives.ring``, ``src=``) reads this rank's values
where they lie and never reads ``buf``; the in-place ring is covered by the conformance
matrix (test_conformance.py). (Not test_ring.py: tests/compressed has one.)"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.collectives import dense_allreduce, ring
from gradcomm.collectives._wire import DenseWire
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError
from gradcomm.ops import Reducer
from tests._cases import expected, make_input, same_bytes, small_counts


def garbage(like: np.ndarray) -> np.ndarray:
    """An array like ``like`` with every bit set (NaN for the floats)."""
    out = np.empty_like(like)
    out.view(np.uint8)[...] = 0xFF
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p", [2, 3, 5])
@pytest.mark.parametrize("dtype,op", [("float32", "sum"), ("int16", "max"),
                                      ("bfloat16", "sum"), ("float16", "mean")])
def test_the_out_of_place_ring_reads_src_and_never_buf(p: int, dtype: str, op: str) -> None:
    """``buf`` starts with all bits set (NaN for floats): no element of it reaches the result; ``src``
    is left as it was; exact bytes at counts 0, 1, < p, not divisible, and over many
    chunks per segment with receives posted ahead (window) or double buffered."""
    counts = small_counts(p) + [7 * p + 2, 301]

    def fn(t):
        out = []
        for window in (0, 400):
            t.window_bytes = window
            for n in counts:
                src = make_input(t.rank, n, dtype, op)
                keep = src.copy()
                buf = garbage(src)                # NaN bits for the floats
                ring.allreduce(t, buf, Reducer(op, dtype), chunk_bytes=40, src=src)
                out.append((same_bytes(src, keep), buf))
                via = garbage(src)
                dense_allreduce(t, via, op, dtype, "ring", src=src)   # + finalize (mean)
                other = garbage(src)
                dense_allreduce(t, other, op, dtype, "tree", src=src)  # copies src first
                out.append((same_bytes(src, keep), via, other))
        return out

    res = run_ranks(p, fn, timeout=60)
    k = 0
    for window in (0, 400):
        for n in counts:
            want = expected(p, n, dtype, op)
            for r in range(p):
                kept, buf = res[r][k]
                assert kept and same_bytes(buf, res[0][k][1]), (window, n, r)
                kept, via, other = res[r][k + 1]
                assert kept and same_bytes(via, want) and same_bytes(other, want), \
                    (window, n, r, via, want)
                if op != "mean":
                    assert same_bytes(buf, want), (window, n, r)
            k += 2


def test_src_needs_a_wire_that_folds_from_src() -> None:
    class Other:
        folds_from_src = False

    def fn(t):
        with pytest.raises(ConfigError, match="folds from src"):
            ring.allreduce(t, np.zeros(4), Reducer("sum", "float64"), wire=Other(),
                           src=np.ones(4))
        w = DenseWire(Reducer("sum", "float64"))
        buf = np.zeros(4)
        ring.allreduce(t, buf, Reducer("sum", "float64"), wire=w, src=np.ones(4))
        return buf.tolist()

    assert run_ranks(2, fn, timeout=20) == [[2.0] * 4] * 2
