"""Bad input is a clear gradcomm error on every rank, within the deadline, never a hang.

Every rank catches its own exception and returns it, so the test sees all of them (and
run_ranks never aborts the others early).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import pytest

import gradcomm
from gradcomm.collectives import DENSE, dense_allreduce
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError, DeadlineError, GradcommError, MismatchError

P = 4


def outcomes(p: int, call: Callable[[Any], Any], *, follow_up: bool = True,
             **kw: Any) -> list[BaseException | None]:
    """Run ``call(t)`` on p ranks and return each rank's exception (or None); with
    ``follow_up`` a clean allreduce on the same transports proves they are still usable."""

    def fn(t: Any) -> BaseException | None:
        try:
            call(t)
            err = None
        except GradcommError as exc:
            err = exc
        if follow_up:
            y = gradcomm.allreduce(np.full(3, t.rank, np.int64), t, algorithm="ring")
            assert y.tolist() == [p * (p - 1) // 2] * 3
        return err

    return run_ranks(p, fn, **{"timeout": 30, **kw})


def assert_all(errs: list[BaseException | None], kind: type, *words: str) -> None:
    for rank, e in enumerate(errs):
        assert isinstance(e, kind), f"rank {rank}: {e!r}"
        for w in words:
            assert w in str(e), f"rank {rank}: {w!r} not in {e}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", DENSE + ("auto",))
def test_different_counts(alg: str) -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(10 + (t.rank == 2)), t,
                                                    algorithm=alg))
    assert_all(errs, MismatchError, "count ranges from 10 to 11")


@pytest.mark.timeout(60)
def test_count_zero_on_one_rank() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(0 if t.rank == 0 else 5), t))
    assert_all(errs, MismatchError, "count ranges from 0 to 5")


@pytest.mark.timeout(60)
def test_different_dtypes() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(
        np.ones(8, np.float32 if t.rank else np.float64), t, algorithm="tree"))
    assert_all(errs, MismatchError, "dtype differs")


@pytest.mark.timeout(60)
def test_different_ops() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(8), t,
                                                    op="max" if t.rank == 3 else "sum"))
    assert_all(errs, MismatchError, "op differs")


@pytest.mark.timeout(60)
def test_different_algorithms() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(
        np.ones(8), t, algorithm="ring" if t.rank % 2 else "rabenseifner"))
    assert_all(errs, MismatchError, "algorithm differs")


@pytest.mark.timeout(60)
def test_unknown_algorithm() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(8), t, algorithm="bogus"))
    assert_all(errs, ConfigError, "unknown algorithm 'bogus'", "ring")


@pytest.mark.timeout(60)
def test_unknown_op() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(8), t, op="avg"))
    assert_all(errs, ConfigError, "unknown op 'avg'", "mean")


@pytest.mark.timeout(60)
def test_unknown_name_on_one_rank_only() -> None:
    """The other ranks cannot know the name is bad, but they learn that it differs."""
    errs = outcomes(P, lambda t: gradcomm.allreduce(
        np.ones(8), t, algorithm="bogus" if t.rank == 1 else "ring"))
    assert_all(errs, MismatchError, "algorithm differs")


@pytest.mark.timeout(60)
def test_mean_of_integers() -> None:
    errs = outcomes(P, lambda t: dense_allreduce(t, np.ones(8, np.int32), "mean", "int32"))
    assert_all(errs, ConfigError, "mean", "int32")


@pytest.mark.timeout(60)
def test_unsupported_array() -> None:
    errs = outcomes(P, lambda t: gradcomm.allreduce(np.ones(3, np.complex64), t))
    assert_all(errs, ConfigError, "complex64")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("alg", DENSE)
def test_rank_that_never_joins(alg: str, check: bool) -> None:
    """Rank 2 of 3 skips the collective: every other rank gets a DeadlineError in about
    ``wait_timeout``, small (eager) and large (rendezvous) messages alike."""
    wait = 0.3
    for n in (5, 100_000):
        def call(t: Any) -> None:
            if t.rank != 2:
                dense_allreduce(t, np.ones(n), "sum", "float64", alg, check=check)

        start = time.monotonic()
        errs = outcomes(3, call, follow_up=False, wait_timeout=wait)
        elapsed = time.monotonic() - start
        assert_all(errs[:2], DeadlineError, f"{wait:g} s")
        assert errs[2] is None
        assert elapsed < 10 * wait + 5, elapsed


# -- check="first": a later disagreement is an error on every rank, never mixed data -----
def _first_then(alg: str, change: str) -> Callable[[Any], Any]:
    """Both calls checked once on every rank (so neither checks again), then rank 1
    makes the other call while the rest repeat the first."""
    def call(t: Any) -> None:
        x = np.arange(1, 10, dtype=np.float32) * (t.rank + 1)
        other = dict(op="max", x=x) if change == "op" else dict(op="sum", x=x.astype(np.int32))
        gradcomm.allreduce(x, t, algorithm=alg, check="first")
        gradcomm.allreduce(other["x"], t, op=other["op"], algorithm=alg, check="first")
        if t.rank == 1:
            gradcomm.allreduce(other["x"], t, op=other["op"], algorithm=alg, check="first")
        else:
            gradcomm.allreduce(x, t, algorithm=alg, check="first")
    return call


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", ["op", "dtype"])
@pytest.mark.parametrize("alg", DENSE + ("auto",))
@pytest.mark.parametrize("p", [2, 3])
def test_check_first_later_disagreement_is_an_error_on_every_rank(p: int, alg: str,
                                                                   change: str) -> None:
    """Unchecked calls carry their arguments in the data tag: ranks that disagree wait
    for messages that never come (DeadlineError), instead of returning the sum on some
    ranks and the max (or int32 garbage) on others; native checks every call."""
    errs = outcomes(p, _first_then(alg, change), follow_up=False, wait_timeout=0.5)
    kind = MismatchError if alg == "native" else DeadlineError
    assert_all(errs, kind)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", ["ring", "auto"])
def test_check_first_checks_every_call_where_tags_are_ignored(alg: str) -> None:
    """A transport whose messages ignore tags (NCCL: ``tagged = False``) cannot carry the
    arguments in the tag, so ``check="first"`` checks every call there: a MismatchError
    on every rank, not mixed data."""
    def call(t: Any) -> None:
        t.tagged = False
        _first_then(alg, "op")(t)
    assert_all(outcomes(3, call, follow_up=False, wait_timeout=0.5), MismatchError)


@pytest.mark.timeout(60)
def test_none_versus_codec_is_a_mismatch() -> None:
    """A dense call on one rank and a compressed one on another exchange equal-sized
    checks (a fixed field count) and learn that they differ, on every rank."""
    errs = outcomes(3, lambda t: gradcomm.allreduce(
        np.ones(5, np.float32), t, compressor="int8" if t.rank == 1 else None))
    assert_all(errs, MismatchError, "collective differs")
