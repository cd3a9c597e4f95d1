"""The DDP hook's cast route (gradcomm/integrations/ddp/cast.py): fp16/bf16 payloads summed
by the library's allreduce, in-process and on real gloo processes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gradcomm import compressors  # noqa: E402
from gradcomm.comm import run_ranks  # noqa: E402
from gradcomm.error_feedback import ErrorFeedback  # noqa: E402
from gradcomm.integrations.ddp import cast  # noqa: E402
from tests._launch import torchrun  # noqa: E402

CHECKS = Path(__file__).parents[1] / "scripts" / "ddp_checks.py"


def _inputs(p: int, n: int) -> list[np.ndarray]:
    """Non-periodic float32 inputs spanning several binades, one per rank."""
    rng = np.random.default_rng(7)
    return [(rng.standard_normal(n) * np.exp(rng.uniform(-6, 6, n))).astype(np.float32)
            for _ in range(p)]


@pytest.mark.parametrize("p, n", [(2, 1), (3, 1001), (5, 4)])
def test_cast_allreduce_is_the_16_bit_sum_and_keeps_the_rounding_as_residual(p, n):
    """In-process ranks (their native sum adds in rank order): the result is the float16
    sum of each rank's rounded input, in rank order, widened; each rank's residual is
    exactly what its rounding lost; every rank holds the same bytes."""
    xs = _inputs(p, n)

    def fn(t):
        ef = ErrorFeedback()
        out = cast.allreduce(t, xs[t.rank].copy(), compressors.get("fp16"), ef, "u")
        return out, ef.residual("u", n, np.float32).copy()

    res = run_ranks(p, fn)
    h = [x.astype(np.float16) for x in xs]
    total = h[0]
    for v in h[1:]:
        total = total + v                   # float16 addition, rounded each time
    for r, (out, e) in enumerate(res):
        assert out.tobytes() == total.astype(np.float32).tobytes(), r
        assert e.tobytes() == (xs[r] - h[r].astype(np.float32)).tobytes(), r


def test_cast_allreduce_without_feedback_leaves_no_residual():
    xs = _inputs(2, 33)

    def fn(t):
        ef = ErrorFeedback(enabled=False)
        cast.allreduce(t, xs[t.rank].copy(), compressors.get("bf16"), ef, "u")
        return sorted(ef.names())

    assert run_ranks(2, fn) == [[], []]


def test_the_cast_route_only_where_the_transport_prefers_the_library():
    """Not on the in-process transport as it is (it prefers gradcomm's algorithms); on one
    declared to prefer its library: fp16 and bf16 host float32 units of several ranks
    only, not other codecs, float64 or device units, or one rank."""
    x = np.zeros(4, np.float32)
    fp16, bf16, int8 = (compressors.get(c) for c in ("fp16", "bf16", "int8"))

    def fn(t):
        plain = (cast.wire_dtype(t, fp16, x), cast.wire_dtype(t, int8, x))
        t.native_preferred = True
        return plain, [cast.wire_dtype(t, c, a) for c, a in (
            (fp16, x), (bf16, x), (int8, x), (None, x), (fp16, x.astype(np.float64)),
            (fp16, torch.zeros(4)))]

    assert run_ranks(2, fn) == [((None, None), ["float16", "bfloat16", None, None, None,
                                                None])] * 2

    def one(t):
        t.native_preferred = True
        return cast.wire_dtype(t, fp16, x)

    assert run_ranks(1, one) == [None]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("p", [2, 3])
def test_fp16_and_bf16_hooks_on_gloo_sum_the_payload_with_gloo(p):
    """Real gloo processes: fp16/bf16 with algorithm="auto" take the cast route; results
    bitwise equal to an independent replay of the 16-bit sum at p = 2 (within a rounding
    per addition at p = 3), residuals exact, no gradcomm messages (tests/integrations/
    scripts/ddp_checks.py, check_cast)."""
    run = torchrun(CHECKS, p, "cast", timeout=140)
    info = run.clean_results(p)[0]["info"]
    assert len(info["cast"]) == 2, info
