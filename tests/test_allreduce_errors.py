"""Bad input at the entry points (gradcomm.allreduce, allreduce_, Allreduce): a clear
gradcomm error, up front, on every rank where ranks are involved (issue 14)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm.comm import run_ranks
from gradcomm.errors import (ConfigError, DeadlineError, GradcommError, MismatchError,
                             UnknownOptionError, UnsupportedError)


def each_rank(p: int, fn: Any, **kw: Any) -> list[Any]:
    def body(t: Any) -> Any:
        try:
            return fn(t)
        except GradcommError as exc:
            return exc
    return run_ranks(p, body, **{"timeout": 30, **kw})


def test_typo_in_an_allreduce_keyword_names_the_closest() -> None:
    with pytest.raises(UnknownOptionError, match="did you mean 'error_feedback'"):
        gradcomm.Allreduce(None, compressor="topk", ratio=0.1, errorfeedback=False)
    with pytest.raises(UnknownOptionError, match="did you mean 'ratio'"):
        gradcomm.Allreduce(None, compressor="topk", ration=0.1)
    with pytest.raises(UnknownOptionError, match="did you mean 'error_feedback'"):
        gradcomm.Allreduce(None, errorfeedback=False)


def test_unknown_op_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match="unknown op 'avg'.*mean"):
        gradcomm.Allreduce(None, op="avg")
    with pytest.raises(UnsupportedError, match="op='max' with a compressor"):
        gradcomm.Allreduce(None, op="max", compressor="int8")
    assert gradcomm.Allreduce(None, op="max").op == "max"


def test_load_state_dict_of_something_else() -> None:
    ar = gradcomm.Allreduce(None, compressor="int8")
    for bad in (None, 3, ["residual/w"]):
        with pytest.raises(ConfigError, match="load_state_dict takes what state_dict"):
            ar.load_state_dict(bad)


@pytest.mark.timeout(60)
def test_timeout_keyword_says_where_the_deadline_is_set() -> None:
    errs = each_rank(2, lambda t: gradcomm.allreduce(np.ones(2), t, timeout=1))
    for e in errs:
        assert isinstance(e, UnknownOptionError) and "get_transport(comm, timeout=" in str(e)


@pytest.mark.timeout(60)
def test_max_on_a_gathered_algorithm_names_the_algorithm() -> None:
    errs = each_rank(2, lambda t: gradcomm.allreduce(np.ones(2, np.float32), t, op="max",
                                                     algorithm="sparse_allgather"))
    for e in errs:
        assert isinstance(e, UnsupportedError), e
        assert "algorithm='sparse_allgather'" in str(e) and "compressor" not in str(e)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", [{}, {"algorithm": "ring"}, {"compressor": "int8"},
                                {"check": "first"}, {"check": False}])
@pytest.mark.parametrize("p", [2, 3])
def test_allreduce_in_place_on_a_read_only_array(p: int, kw: dict) -> None:
    """The read-only rank raises ConfigError before any data moves; the others learn from
    the check (MismatchError: no rank's array is written) or, where the check was skipped,
    wait out the deadline (DeadlineError: their arrays, reduced in place, are undefined
    then, as with MPI_IN_PLACE); the transports stay usable."""
    def fn(t: Any) -> Any:
        x = np.full(5, t.rank + 1.0, np.float32)
        gradcomm.allreduce_(x.copy(), t, **kw)               # "first": checked once
        x.flags.writeable = t.rank != p - 1
        try:
            gradcomm.allreduce_(x, t, **kw)
        except GradcommError as exc:
            err: Any = exc
        else:
            err = None
        if t.rank != p - 1 and kw.get("check", True) is True:
            assert (x == t.rank + 1).all()                      # nothing was written
        return err

    errs = run_ranks(p, fn, timeout=30, wait_timeout=0.5)
    assert isinstance(errs[-1], ConfigError) and "read-only" in str(errs[-1])
    others = (DeadlineError,) if kw.get("check", True) is not True else (MismatchError,)
    for e in errs[:-1]:
        assert isinstance(e, others), (kw, e)


@pytest.mark.timeout(60)
def test_sparse_and_meta_torch_tensors_are_refused_up_front() -> None:
    torch = pytest.importorskip("torch")
    for x, words in ((torch.ones(3).to_sparse(), "layout torch.sparse_coo"),
                     (torch.eye(3).to_sparse_csr(), "layout torch.sparse_csr"),
                     (torch.ones(3, device="meta"), "meta tensor")):
        errs = each_rank(2, lambda t: gradcomm.allreduce(x, t))
        for e in errs:
            assert isinstance(e, ConfigError) and words in str(e), e


@pytest.mark.parametrize("field", ["op", "algorithm", "compressor"])
def test_memoised_plans_still_see_every_argument(field: str) -> None:
    """gradcomm.allreduce keeps the Reduction of option-free calls; after identical
    calls, a rank that changes one argument still gets its own plan, and the ranks learn
    of the difference (MismatchError on every rank)."""
    other = {"op": ("sum", "max"), "algorithm": ("ring", "tree"),
             "compressor": (None, "fp16")}[field]

    def fn(t: Any) -> Any:
        x = np.arange(1.0, 5.0, dtype=np.float32)
        for _ in range(2):
            gradcomm.allreduce(x, t, **{field: other[0]})
        return gradcomm.allreduce(x, t, **{field: other[t.rank == 1]}).tolist()

    got = each_rank(2, fn)
    assert all(isinstance(g, MismatchError) for g in got), got


def test_memoised_plans_keep_the_check_mode() -> None:
    """check=False after checked calls with the same other arguments skips the exchange
    (fewer messages), check=True after unchecked ones makes it again."""
    def fn(t: Any) -> list[int]:
        x = np.arange(1.0, 5.0, dtype=np.float32)
        sent = []
        for check in (True, True, False, False, True):
            t.stats.reset()
            gradcomm.allreduce(x, t, algorithm="ring", check=check)
            sent.append(t.stats.messages_sent)
        return sent

    for sent in run_ranks(2, fn):
        assert sent[0] == sent[1] == sent[4] > sent[2] == sent[3], sent
