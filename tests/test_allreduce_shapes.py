"""``gradcomm.allreduce`` / ``gradcomm.Allreduce`` hand the array's shape to codecs that use
it (``uses_shape``: powersgd): a 2-D gradient is compressed as its own matrix."""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm import arrays
from gradcomm._plan import with_shape
from gradcomm.comm import run_ranks
from gradcomm.compressors.powersgd import PowerSGD

U, V = np.linspace(1.0, 2.0, 64), np.linspace(-1.0, 1.0, 48)


def _rank1(t) -> np.ndarray:
    """Rank ``t.rank``'s multiple of U V^T: the sum over ranks has rank 1."""
    return ((t.rank + 1.0) * np.outer(U, V)).astype(np.float32)


def test_shape_goes_only_to_codecs_that_use_it():
    meta2, meta1 = arrays.meta_of(np.zeros((4, 5))), arrays.meta_of(np.zeros(20))
    assert with_shape("powersgd", meta2, {"rank": 2}) == {"rank": 2, "shape": (4, 5)}
    assert with_shape(PowerSGD(), meta2, {}) == {"shape": (4, 5)}
    assert with_shape("powersgd", meta1, {}) == {}                # flat: codec's layout
    assert with_shape("powersgd", meta2, {"shapes": [(20,)]}) == {"shapes": [(20,)]}
    for other in ("topk", "fp16", None, "no-such-codec"):
        assert with_shape(other, meta2, {}) == {}


@pytest.mark.parametrize("algorithm", ["ring", "native"])
def test_allreduce_class_views_a_matrix_by_its_shape(algorithm: str):
    """Exact (to rounding) only because the (64, 48) view is used: the flat 56 x 56
    layout of the same 3072 values is not rank 1."""
    def fn(t):
        ar = gradcomm.Allreduce(t, op="sum", algorithm=algorithm, compressor="powersgd")
        outs = [ar(_rank1(t), key="w") for _ in range(2)]
        flat = gradcomm.Allreduce(t, op="sum", algorithm=algorithm, compressor="powersgd")
        y = flat(_rank1(t).reshape(-1), key="w")
        return outs, ar.error_feedback.extra("w#q").size, y, flat.error_feedback.extra("w#q").size

    res = run_ranks(3, fn)
    exact = 6.0 * np.outer(U, V)
    outs, qsize, flat, flat_q = res[0]
    assert all(r[0][1].tobytes() == outs[1].tobytes() for r in res)
    for y in outs:
        assert y.shape == (64, 48) and np.abs(y - exact).max() < 1e-4 * np.abs(exact).max()
    assert qsize == 48 and flat_q == PowerSGD().layout(64 * 48).cols == 56
    assert np.abs(flat.reshape(64, 48) - exact).max() > 1e-2 * np.abs(exact).max()


def test_allreduce_function_and_torch_tensors_use_the_shape():
    torch = pytest.importorskip("torch")

    def fn(t):
        m = _rank1(t)
        a = gradcomm.allreduce(m, t, compressor="powersgd")
        b = gradcomm.allreduce(torch.from_numpy(m), t, compressor="powersgd")
        c = gradcomm.allreduce(m, t, compressor="powersgd", shape=(3072,))   # caller wins
        return a, b.numpy(), c

    a, b, c = run_ranks(2, fn)[0]
    exact = 3.0 * np.outer(U, V)
    for y in (a, b):             # each call: one power iteration from its own seeded Q
        assert y.shape == (64, 48) and np.abs(y - exact).max() < 1e-4 * np.abs(exact).max()
    # shape (3072,) is a 3072 x 1 matrix: not worth compressing, so the plain sum
    assert c.shape == (64, 48) and np.array_equal(c, np.outer(U, V).astype(np.float32)
                                                  + (2.0 * np.outer(U, V)).astype(np.float32))
