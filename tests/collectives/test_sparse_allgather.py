"""sparse_allgather: union of (index, value) pairs, duplicates summed, dense switch."""

from __future__ import annotations

import numpy as np
import pytest

import gradcomm
from gradcomm.collectives._check import NATIVE_FIELDS
from gradcomm.collectives import sparse_allgather as sa
from gradcomm.comm import run_ranks
from gradcomm.errors import ConfigError, MismatchError, PayloadError

pytestmark = pytest.mark.timeout(120)


def _pairs(rank: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank's k pairs: overlapping across ranks, with a duplicate inside the rank."""
    rng = np.random.default_rng(rank)
    idx = rng.integers(0, n, k)
    if k >= 2:
        idx[1] = idx[0]                        # duplicate within the rank
    vals = rng.integers(-4, 5, k).astype(np.float64)   # exact sums in any order
    return idx, vals


def _expected(pairs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[list[int], list[float]]:
    acc: dict[int, float] = {}
    for idx, vals in pairs:
        for i, v in zip(idx.tolist(), vals.tolist()):
            acc[i] = acc.get(i, 0.0) + v
    keys = sorted(acc)
    return keys, [acc[k] for k in keys]


@pytest.mark.parametrize("p", range(1, 9))
@pytest.mark.parametrize("n", [1, 50, 5000])
def test_union_summed_sorted(p: int, n: int) -> None:
    ks = [(0, 3, 1, 40, 7, 0, 12, 5)[r] for r in range(p)]   # variable k, including 0
    pairs = [_pairs(r, ks[r], n) for r in range(p)]

    def fn(t):
        i, v = gradcomm.sparse_allgather(*pairs[t.rank], t, size=n)
        return i, v

    res = run_ranks(p, fn)
    want_i, want_v = _expected(pairs)
    for i, v in res:
        assert i.dtype == np.int64 and v.dtype == np.float64
        assert i.tolist() == want_i and v.tolist() == want_v
        assert i.tobytes() == res[0][0].tobytes() and v.tobytes() == res[0][1].tobytes()


def _uses_dense(t, idx, vals, n):
    t.stats.reset()
    out = gradcomm.sparse_allgather(idx, vals, t, size=n)
    return out, t.stats.bytes_sent


def test_dense_switch_same_answer_fewer_bytes() -> None:
    """Above the threshold the union is reduced densely: same result, and fewer bytes
    than gathering the pairs would have cost."""
    p, n = 4, 1000
    pairs_dense = [(np.arange(r, n, 1), np.full(n - r, 1.0 + r)) for r in range(p)]
    pairs_sparse = [(np.arange(r, 40, 4), np.full(10, 1.0 + r)) for r in range(p)]
    for pairs, dense in ((pairs_dense, True), (pairs_sparse, False)):
        k_total = sum(len(i) for i, _ in pairs)
        # n * 8 bytes is below 64 KiB: dense auto is recursive doubling, log2(4) rounds
        assert ((p - 1) * k_total * (4 + 8) > p * 2 * n * (8 + 1)) == dense
        res = run_ranks(p, lambda t: _uses_dense(t, *pairs[t.rank], n))
        want_i, want_v = _expected(pairs)
        for (i, v), sent in res:
            assert i.tolist() == want_i and v.tolist() == want_v
            gathered = (k_total - len(pairs[-1][0])) * 12
            if dense:
                assert sent < gathered         # the switch paid off
                assert sent <= 2 * n * (8 + 1) + 2 * 2 * NATIVE_FIELDS * 8 + 200  # + check, sizes


def test_dense_switch_keeps_explicit_zeros() -> None:
    p, n = 2, 10
    pairs = [(np.arange(n), np.zeros(n)), (np.array([3]), np.array([0.0]))]
    res = run_ranks(p, lambda t: gradcomm.sparse_allgather(*pairs[t.rank], t, size=n))
    for i, v in res:
        assert i.tolist() == list(range(n)) and v.tolist() == [0.0] * n


def test_dense_allreduce_entry_both_paths() -> None:
    n = 64
    for k in (2, 60):                          # sparse path, then the dense switch
        def fn(t):
            idx = np.arange(t.rank, t.rank + k) % n
            return sa.allreduce(t, idx, np.ones(k, np.float32), n)

        res = run_ranks(3, fn)
        want = np.zeros(n, np.float32)
        for r in range(3):
            np.add.at(want, np.arange(r, r + k) % n, 1.0)
        for out in res:
            assert out.tobytes() == want.tobytes()


def test_size_inferred_and_empty_everywhere() -> None:
    def fn(t):
        if t.rank == 1:
            return gradcomm.sparse_allgather(np.array([9]), np.array([2.5]), t)
        return gradcomm.sparse_allgather(np.zeros(0, np.int64), np.zeros(0), t)

    for i, v in run_ranks(3, fn):
        assert i.tolist() == [9] and v.tolist() == [2.5]
    for i, v in run_ranks(3, lambda t: gradcomm.sparse_allgather(np.zeros(0, int),
                                                                 np.zeros(0), t)):
        assert i.size == 0 and v.size == 0


@pytest.mark.parametrize("dtype", ["float16", "float32", "int32"])
def test_value_dtypes(dtype: str) -> None:
    def fn(t):
        return gradcomm.sparse_allgather(np.array([1, 2]), np.array([1, 2], dtype), t)

    for i, v in run_ranks(3, fn):
        assert v.dtype == np.dtype(dtype) and v.tolist() == [3, 6]


def test_torch_in_torch_out() -> None:
    torch = pytest.importorskip("torch")

    def fn(t):
        i, v = gradcomm.sparse_allgather(torch.tensor([t.rank, 4]),
                                         torch.tensor([1.0, 1.0], dtype=torch.bfloat16), t)
        return i, v

    for i, v in run_ranks(2, fn):
        assert isinstance(i, torch.Tensor) and i.dtype == torch.int64
        assert v.dtype == torch.bfloat16
        assert i.tolist() == [0, 1, 4] and v.float().tolist() == [1.0, 1.0, 2.0]


def test_out_of_range_index_raises_on_every_rank() -> None:
    def fn(t):
        idx = np.array([100 if t.rank == 1 else 1])
        try:
            gradcomm.sparse_allgather(idx, np.ones(1), t, size=10)
        except (ConfigError, MismatchError) as exc:
            return type(exc).__name__
        return "no error"

    assert run_ranks(3, fn) == ["MismatchError", "ConfigError", "MismatchError"]


def test_dtype_mismatch_raises_on_every_rank() -> None:
    def fn(t):
        vals = np.ones(1, np.float32 if t.rank else np.float64)
        try:
            gradcomm.sparse_allgather(np.array([0]), vals, t)
        except MismatchError as exc:
            return "dtype" in str(exc)
        return False

    assert run_ranks(3, fn) == [True] * 3


def test_hostile_peer_data_is_rejected() -> None:
    """A peer whose announced range exceeds the agreed size, or whose indices are not
    sorted, is a PayloadError on every rank (no wrong result, no crash)."""
    def announce(t):
        if t.rank == 1:                        # bypass the public validation
            idx, vals = np.array([50]), np.ones(1)
        else:
            idx, vals = np.array([1]), np.ones(1)
        try:
            sa._exchange(t, idx, vals, 10, mask=False)
        except PayloadError as exc:
            return str(exc)

    assert all("rank 1 announced" in r for r in run_ranks(3, announce))

    def unsorted(t):
        idx = np.array([5, 2]) if t.rank == 0 else np.array([1, 3])
        try:
            sa._exchange(t, idx, np.ones(2), 10, mask=False)
        except PayloadError as exc:
            return str(exc)

    assert all("rank 0 sent indices" in r for r in run_ranks(2, unsorted))


def test_indices_travel_as_16_bit_gaps_where_they_fit() -> None:
    """A rank whose first index and gaps fit 16 bits sends 2 + 4 bytes a float32 pair,
    one with a wider gap 4 + 4; either way the sums are exact and alike on every rank."""
    n = 1 << 20
    near = np.arange(7, n, 997)                      # gaps of 997
    far = np.array([3, 70_000, 70_001, n - 1])       # a gap above 65535
    cases = {"short": (near, near + 1), "wide": (near, far)}
    for name, (i0, i1) in cases.items():
        pairs = [(i0, np.linspace(1, 2, i0.size, dtype=np.float32)),
                 (i1, np.linspace(-3, 5, i1.size, dtype=np.float32))]

        def fn(t):
            t.stats.reset()
            out = sa.allreduce(t, *pairs[t.rank], n)
            return out, t.stats.bytes_sent

        res = run_ranks(2, fn)
        want = np.zeros(n, np.float32)
        for i, v in pairs:
            want[i] += v
        for r, (out, sent) in enumerate(res):
            assert out.tobytes() == want.tobytes(), name
            k = pairs[r][0].size
            width = 2 if name == "short" or r == 0 else 4
            assert k * (width + 4) <= sent <= k * (width + 4) + 400, (name, r, sent)


def test_hostile_index_gaps_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad announced width, 16-bit gaps that run past the dense length (under an
    announced range inside it), or repeated indices, are a PayloadError on every rank."""
    real = sa.allgather_ints
    lie: dict[int, int] = {}                # field -> value rank 1 announces

    def lying(t, values, **kw):
        values = list(values)
        if t.rank == 1:
            for field, v in lie.items():
                values[field] = v
        return real(t, values, **kw)

    monkeypatch.setattr(sa, "allgather_ints", lying)
    n = 100_000

    def fn(t, idx1):
        idx = idx1 if t.rank == 1 else np.array([0, 5])
        try:
            sa._exchange(t, idx, np.ones(idx.size), n, mask=False)
        except PayloadError as exc:
            return str(exc)

    lie.update({2: 3})
    assert all("rank 1 announced index width 3" in r
               for r in run_ranks(2, lambda t: fn(t, np.array([1, 4]))))
    lie.clear()
    lie.update({1: 100})                    # a range inside n; the gaps end at 120000
    assert all("rank 1 sent indices" in r
               for r in run_ranks(3, lambda t: fn(t, np.array([2, 60_000, 120_000]))))
    lie.clear()
    assert all("rank 1 sent indices" in r
               for r in run_ranks(3, lambda t: fn(t, np.array([1, 1, 4]))))


def test_merge() -> None:
    i, v = sa.merge(np.array([4, 1, 4, 4, 0]), np.array([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert i.tolist() == [0, 1, 4] and v.tolist() == [5.0, 2.0, 8.0]
