"""``gradcomm.Allreduce(...)(x, key, out=)``: the result lands in ``out`` (``x`` itself: in
place) with the bytes a fresh result has, through every route, with and without error
feedback, step after step; ``out`` is used as the working buffer, not filled by a copy;
a mismatched ``out`` is an error on every rank, never a hang."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

import gradcomm
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError, DeadlineError, GradcommError, MismatchError

from tests._cases import small_counts

#: (compressor spec, algorithm): dense, every per-hop and gathered route, the guard on
ROUTES = [(None, "ring"), (None, "auto"), (None, "native"), ("fp16", "ring"),
          ("bf16", "tree"), ("int8", "auto"), ("int8", "rabenseifner"),
          ("qsgd", "recursive_doubling"), ("onebit", "ring"), ("onebit", "allgather"),
          ("topk:ratio=0.01", "sparse_allgather"), ("topk:ratio=0.01", "auto"),
          ("randomk:ratio=0.05", "allgather"), ("powersgd", "auto")]
#: 131075 float32 = 512 KiB + 12 B: from one pipeline chunk on, the reduction reads x where
#: it lies and works in its result buffer (``Reduction.views``), the path out= replaces
COUNTS = [*small_counts(3), 131075]


def _ar(t: Any, spec: str | None, algorithm: str) -> gradcomm.Allreduce:
    name, *kv = (spec or "none").split(":")
    opts = {k: float(v) for k, v in (s.split("=") for s in kv)}
    return gradcomm.Allreduce(t, op="sum", algorithm=algorithm,
                              compressor=None if name == "none" else name, **opts)


def _x(rank: int, step: int, n: int) -> np.ndarray:
    # non-periodic, not exactly representable in 16 bits: every codec rounds something
    return np.random.default_rng([rank, step, n]).standard_normal(n).astype(np.float32)


def _three_ways(x: np.ndarray, out: np.ndarray, fresh: Any, kept: Any, inplace: Any
                ) -> bytes:
    """``x`` reduced into a new array (``fresh(x)``), into ``out`` (``kept(x, out)``, which
    must return ``out`` and leave ``x`` alone) and in place (``inplace`` of a copy, which
    must return it): the three hold the same bytes, returned."""
    before = x.copy()
    a = fresh(x)
    assert kept(x, out) is out and x.tobytes() == before.tobytes()
    c = x.copy()
    assert inplace(c) is c
    assert a.tobytes() == out.tobytes() == c.tobytes()
    return a.tobytes()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec,algorithm", ROUTES)
def test_out_holds_the_bytes_of_a_fresh_result(spec: str | None, algorithm: str) -> None:
    """Three objects in lockstep, three steps of each count: no out, one out reused,
    out=x; every result has the same bytes on every rank, x is left alone but for
    out=x, and the residuals went the same way (the later steps depend on them)."""
    def fn(t: Any) -> list[bytes]:
        got = []
        for n in COUNTS:
            if spec == "powersgd" and n < 2:
                continue
            fresh, kept, inplace = (_ar(t, spec, algorithm) for _ in range(3))
            out = np.full(n, np.nan, np.float32)
            for step in range(3):
                got.append(_three_ways(_x(t.rank, step, n), out,
                                       lambda x: fresh(x, key="w"),
                                       lambda x, o: kept(x, key="w", out=o),
                                       lambda x: inplace(x, key="w", out=x)))
        return got

    res = run_ranks(3, fn, timeout=200)
    assert all(r == res[0] for r in res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", [{}, {"algorithm": "ring"}, {"algorithm": "native"},
                                {"compressor": "fp16"},
                                {"compressor": "topk", "ratio": 0.01,
                                 "algorithm": "sparse_allgather"}])
def test_the_function_takes_out_too(kw: dict) -> None:
    """``gradcomm.allreduce(x, out=)``: the bytes of a fresh result, on the small-call
    path (counts below a pipeline chunk, called twice: the second is resolved) and the
    large one; ``out=x`` is ``allreduce_``."""
    def fn(t: Any) -> list[bytes]:
        got = []
        for n in COUNTS:
            for step in range(2):
                got.append(_three_ways(_x(t.rank, step, n), np.full(n, np.nan, np.float32),
                                       lambda x: gradcomm.allreduce(x, t, **kw),
                                       lambda x, o: gradcomm.allreduce(x, t, out=o, **kw),
                                       lambda x: gradcomm.allreduce(x, t, out=x, **kw)))
        return got

    res = run_ranks(3, fn, timeout=100)
    assert all(r == res[0] for r in res)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shift", [1, -1])
@pytest.mark.parametrize("spec,algorithm", [(None, "ring"), ("fp16", "ring"),
                                            ("int8", "auto"), ("onebit", "allgather"),
                                            ("topk:ratio=0.01", "sparse_allgather")])
def test_out_overlapping_x_gets_the_result(spec: str | None, algorithm: str,
                                           shift: int) -> None:
    """An out that shares memory with x (not x itself), half a vector after it or before
    it, cannot be the working buffer while x is read: the result is copied in at the
    end, with the bytes of a reduction of x apart."""
    n = 131075

    def fn(t: Any) -> bool:
        ar, ref = (_ar(t, spec, algorithm) for _ in range(2))
        mem = np.zeros(n + n // 2, np.float32)
        x, out = (mem[:n], mem[n // 2:]) if shift > 0 else (mem[n // 2:], mem[:n])
        x[:] = _x(t.rank, 0, n)
        want = ref(x.copy(), key="w")
        return ar(x, key="w", out=out) is out and out.tobytes() == want.tobytes()

    assert run_ranks(3, fn) == [True] * 3


def test_a_torch_tensor_out() -> None:
    torch = pytest.importorskip("torch")

    def fn(t: Any) -> bool:
        ar, ref = (gradcomm.Allreduce(t, op="mean", compressor="fp16") for _ in range(2))
        x = torch.from_numpy(_x(t.rank, 0, 131075).reshape(5, -1))
        out = torch.empty_like(x)
        want = ref(x, key="w")
        return ar(x, key="w", out=out) is out and torch.equal(out, want)

    assert run_ranks(2, fn) == [True, True]


@pytest.mark.parametrize("spec,algorithm", [("fp16", "ring"),
                                            ("topk:ratio=0.01", "sparse_allgather")])
def test_out_is_the_working_buffer_not_a_copy_target(spec: str, algorithm: str) -> None:
    """With out, no result buffer is allocated: the peak traced memory of a call (two
    ranks at once) is lower by about their two results than without out, and below one
    result. A result made apart (the sparse route's fresh zero pages) and copied into
    out would show."""
    n = 1 << 20

    def peak(use_out: bool) -> int:
        def fn(t: Any) -> int:
            ar = _ar(t, spec, algorithm)
            x, out = _x(t.rank, 0, n), np.empty(n, np.float32)
            call = (lambda: ar(x, key="w", out=out)) if use_out else (lambda: ar(x, key="w"))
            for _ in range(3):                  # the route's buffers and residuals, made
                call()                          # in the first two calls, are kept after
            t.barrier()
            if t.rank == 0:
                tracemalloc.reset_peak()
                base = tracemalloc.get_traced_memory()[0]
            t.barrier()
            call()
            t.barrier()
            return tracemalloc.get_traced_memory()[1] - base if t.rank == 0 else 0
        tracemalloc.start()
        try:
            return run_ranks(2, fn)[0]
        finally:
            tracemalloc.stop()

    without, with_out = peak(False), peak(True)
    # (both ranks' results: 2 x 4n bytes; with out, less than one result's worth grows)
    assert without - with_out >= 1.5 * 4 * n and with_out < 4 * n, (without, with_out)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kw", [{}, {"compressor": "int8"}, {"check": False}])
@pytest.mark.parametrize("bad", ["shape", "dtype", "read-only", "list"])
@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("fn_api", [False, True])
def test_a_bad_out_is_an_error_on_every_rank(fn_api: bool, p: int, bad: str,
                                             kw: dict) -> None:
    """The rank with the bad out raises ConfigError before any data moves; the others
    learn it from the check (MismatchError) or, without it, from the deadline."""
    def fn(t: Any) -> Any:
        ar = gradcomm.Allreduce(t, op="sum", **kw)
        x = np.full(6, t.rank + 1.0, np.float32)
        out: Any = np.empty(6, np.float32)
        ar(x, key="w", out=out)                                   # a good call first
        gradcomm.allreduce(x, t, out=out, **kw)         # (the small-call path resolved)
        if t.rank == p - 1:
            out = {"shape": np.empty(7, np.float32), "dtype": np.empty(6),
                   "read-only": np.empty(6, np.float32), "list": [0.0] * 6}[bad]
            if bad == "read-only":
                out.flags.writeable = False
        try:
            if fn_api:
                gradcomm.allreduce(x, t, out=out, **kw)
            else:
                ar(x, key="w", out=out)
        except GradcommError as exc:
            return exc
        return None

    errs = run_ranks(p, fn, timeout=30, wait_timeout=0.5)
    assert isinstance(errs[-1], ConfigError) and "out" in str(errs[-1]), errs[-1]
    others = (DeadlineError,) if kw.get("check", True) is False else (MismatchError,)
    for e in errs[:-1]:
        assert isinstance(e, others), (kw, e)
