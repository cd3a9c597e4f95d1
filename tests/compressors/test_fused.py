"""Fused codec operations the compressed collectives use, on both kernel paths.

``decompress(payload, out=y, add=True)`` must equal ``decompress(payload) + y`` (the
decoded value is the left operand, as the unfused wire computed it) for every codec and
dtype, with NaN and infinities, on the numpy path and on the numba path (forced for any
size), and never read anything but ``out``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.compressors import get
from gradcomm.errors import ConfigError

from tests.compressors.test_codecs import CONFIGS, DTYPES, IDS, data

PATHS = ("numpy", "numba")


def _paths(monkeypatch: pytest.MonkeyPatch):
    for path in PATHS:
        if path == "numba":
            pytest.importorskip("numba")
        monkeypatch.setenv("GRADCOMM_KERNELS", path)
        yield path


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The same bytes, except that a NaN may be any NaN (its payload may depend on the
    operand order the compiled loop chose)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))) and a[~nan].tobytes() == b[~nan].tobytes()


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_decompress_add_is_decode_plus_out(name: str, opts: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    c = get(name, **opts)
    for path in _paths(monkeypatch):
        for dtype in DTYPES:
            for n in (0, 1, 9, 2000):
                x = data(n, dtype, 3)
                if n > 8:
                    x[5] = np.nan if name not in ("topk",) else x[5]
                    x[8] = np.inf
                y = data(n, dtype, 4)
                p = c.compress(x, seed=5)
                want = np.add(c.decompress(p), y)
                got = y.copy()
                assert c.decompress(p, out=got, add=True) is got
                sparse = name in ("topk", "randomk")
                if sparse:        # untouched positions keep y itself (0 + -0.0 aside)
                    want = np.where(c.decompress(p) == 0, y, want)
                assert _same(got, want), (path, dtype, n)


@pytest.mark.parametrize("name", ("fp16", "int8", "onebit", "topk"))
def test_add_needs_out(name: str) -> None:
    c = get(name)
    p = c.compress(np.ones(4, np.float32))
    with pytest.raises(ConfigError, match="add=True needs out"):
        c.decompress(p, add=True)


MODES = ("residual", "decoded", "both", "decoded=x", "round trip in x")


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_fused_compress_is_the_composition(name: str, opts: dict,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``compress(x, residual=e, decoded=d)`` gives the payload, residual and decoded
    values of :func:`compose` (y = x + e; encode; decode; e = y - d) on both paths."""
    from gradcomm.compressors.base import compose

    c = get(name, **opts)
    if name == "none":
        pytest.skip("none has no fused compress (lossless: nothing to feed back)")
    for path in _paths(monkeypatch):
        for dtype in DTYPES:
            for n in (1, 9, 3000):
                x = data(n, dtype, 7)
                if n > 8:
                    x[3], x[4], x[6] = np.nan, np.inf, -0.0
                e0 = (data(n, dtype, 8) * 0.25).astype(dtype)
                for mode in MODES:
                    args = {}
                    ref_x, got_x = x.copy(), x.copy()
                    ref_e, got_e = e0.copy(), e0.copy()
                    ref_d, got_d = np.full(n, 9, dtype), np.full(n, 9, dtype)
                    if mode in ("residual", "both"):
                        args = {"residual": (ref_e, got_e)}
                    if mode in ("decoded", "both"):
                        args["decoded"] = (ref_d, got_d)
                    if mode == "decoded=x":
                        args = {"residual": (ref_e, got_e), "decoded": (ref_x, got_x)}
                    if mode == "round trip in x":
                        args = {"decoded": (ref_x, got_x)}
                    want = compose(c, ref_x, 3, None, *(args.get(k, (None,))[0]
                                                        for k in ("residual", "decoded")))
                    got = c.compress(got_x, seed=3, **{k: v[1] for k, v in args.items()})
                    assert got.to_bytes().tobytes() == want.to_bytes().tobytes(), \
                        (path, dtype, n, mode)
                    for a, b in ((ref_x, got_x), (ref_e, got_e), (ref_d, got_d)):
                        assert _same(b, a), (path, dtype, n, mode)


@pytest.mark.parametrize("name", ["fp16", "bf16", "int8", "onebit", "topk", "randomk"])
def test_a_tally_of_four_also_takes_the_input_norm(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``compress(x, residual=e, tally=t)`` with ``t`` of four entries: ``t[:2]`` is the
    new residual's ``(sq_norm, n)``, as with two; ``t[2:]`` is the input's, taken before
    the residual joins it (in the 16-bit casts' fused pass, block by block), bit for bit
    ``sq_norm(x)`` on both paths; the payload and residual are the same bytes. Top-k also
    at a size its sampled pass takes."""
    from gradcomm.compressed.guard import sq_norm

    c = get(name)
    for path in _paths(monkeypatch):
        for n in (1, 9, 10007) + ((300_007,) if name == "topk" else ()):
            x = data(n, "float32", 5)
            e = (data(n, "float32", 6) * 0.25).astype(np.float32)
            e2, e4 = e.copy(), e.copy()
            t2, t4 = np.zeros(2), np.zeros(4)
            p2 = c.compress(x.copy(), seed=1, residual=e2, tally=t2)
            p4 = c.compress(x.copy(), seed=1, residual=e4, tally=t4)
            assert p4.to_bytes().tobytes() == p2.to_bytes().tobytes(), (path, n)
            assert e4.tobytes() == e2.tobytes() and t4[:2].tolist() == t2.tolist()
            assert t4[2:].tolist() == [sq_norm(x), n], (path, n)


def test_fused_arguments_are_checked() -> None:
    c = get("int8")
    x = np.ones(8, np.float32)
    for bad in (np.ones(7, np.float32), np.ones(8, np.float64), np.ones((2, 4), np.float32)):
        with pytest.raises(ConfigError, match="residual must be a flat writable float32"):
            c.compress(x, residual=bad)
    with pytest.raises(ConfigError, match="must not overlap"):
        c.compress(x, residual=x)
    ro = np.ones(8, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ConfigError, match="decoded must be"):
        c.compress(x, decoded=ro)
