"""``gradcomm._plan.Reduction``: one validated configuration and routing shared by
``gradcomm.allreduce``, ``gradcomm.Allreduce`` and ``wrap(comm).Allreduce``."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm._plan import Reduction
from gradcomm.comm import run_ranks
from gradcomm.compressors.base import Compressor
from gradcomm.errors import ConfigError, UnsupportedError


def test_configure_validates_and_resolves_the_codec() -> None:
    plan = Reduction.configure(compressor="topk", options={"ratio": 0.1}, seed=3)
    assert isinstance(plan.compressor, Compressor) and plan.compressor.name == "topk"
    assert plan.options == {} and plan.seed == 3
    with pytest.raises(ConfigError, match="compressor options need"):
        Reduction.configure(options={"ratio": 0.1})
    with pytest.raises(ConfigError, match="seed"):
        Reduction.configure(compressor="fp16", seed=-1)
    with pytest.raises(KeyError, match="known"):
        Reduction.configure(compressor="no-such-codec")
    with pytest.raises(UnsupportedError, match="cannot carry 'fp16'"):   # the collective's words
        Reduction.configure(compressor="fp16", algorithm="native", check_algorithm=True)
    with pytest.raises(ConfigError, match="with a compressor use one of"):
        Reduction.configure(compressor="fp16", algorithm="bogus", check_algorithm=True)
    Reduction.configure(compressor="powersgd", algorithm="native", check_algorithm=True)
    Reduction.configure(compressor="none", algorithm="native", check_algorithm=True,
                        lossless_dense=True)                     # the DDP hook: dense
    with pytest.raises(ConfigError, match="unknown algorithm 'allgather'"):
        Reduction.configure(algorithm="allgather", check_algorithm=True)
    Reduction.configure(compressor="fp16", algorithm="native")      # checked per call


def test_which_calls_are_compressed() -> None:
    assert not Reduction().compresses("float32")
    assert Reduction(algorithm="allgather").compresses("float32")      # the "none" codec
    assert Reduction(compressor="int8").compresses("int32")            # refused per call
    wrap = Reduction(compressor="int8", exact_fallback=True)
    assert wrap.compresses("float32", "sum")
    assert not wrap.compresses("float32", "max") and not wrap.compresses("int32", "sum")


def test_exact_fallback_reduces_what_a_codec_cannot() -> None:
    plan = Reduction.configure(algorithm="allgather", compressor="int8", exact_fallback=True)

    def fn(t):
        x = np.full(5, t.rank + 1, np.int32)
        y = plan.run(t, x, "int32", op="max")
        z = plan.run(t, np.full(5, t.rank + 1.0, np.float32), "float32")
        return y.tolist(), z.dtype.name
    assert run_ranks(3, fn)[0] == ([3] * 5, "float32")


def test_an_out_of_place_call_reads_its_input_where_it_lies() -> None:
    """``Reduction.views``: a view of a C-contiguous host input and an empty result buffer
    (so ``gradcomm.allreduce`` copies nothing in; with a codec, the route decides); None
    where the input must be copied (non-contiguous, foreign byte order) or it is below
    one pipeline chunk (latency algorithms copy it in anyway). In place (``allreduce_``):
    the view is the buffer, at any size and with a codec too."""
    torch = pytest.importorskip("torch")

    def fn(t):
        dense, coded = Reduction(), Reduction(compressor="int8")
        x = np.arange(6 << 17, dtype=np.float32).reshape(2, 3 << 17)    # 3 MiB
        view, buf, meta = dense.views(x, t)
        ok = [np.shares_memory(view, x), not np.shares_memory(buf, x),
              buf.shape == (6 << 17,) and buf.dtype == x.dtype, meta.shape == x.shape,
              dense.views(x[:, :100], t) is None]             # below one pipeline chunk
        xt = torch.arange(6 << 17, dtype=torch.bfloat16)
        view, buf, _ = dense.views(xt, t)
        ok += [view.ctypes.data == xt.data_ptr(), buf.dtype == np.uint16]
        ok += [dense.views(x.T, t) is None, dense.views(x.astype(">f4"), t) is None,
               np.shares_memory(coded.views(x, t)[0], x),
               dense.views(xt.reshape(2, -1).T, t) is None]
        small = x[:, :100].copy()                       # in place: any size, any codec
        for plan in (dense, coded):
            src, buf, _ = plan.views(small, t, in_place=True)
            ok += [src is None, np.shares_memory(buf, small), buf.shape == (200,),
                   plan.views(x.T, t, in_place=True) is None]
        return ok

    assert all(all(r) for r in run_ranks(2, fn, timeout=20))
