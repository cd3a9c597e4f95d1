"""``gradcomm.integrations.mpi.wrap``: a raw mpi4py program under a real mpirun (buffer
specs, IN_PLACE, ops, torch tensors, 16-bit floats, fallbacks to MPI for what gradcomm
does not handle, attribute pass-through, identical bytes on every rank, mismatches; the
staged route that device arrays take on an MPI that is not CUDA-aware, run on host arrays
through the same code), and the parsing and option checks in-process on COMM_SELF.
Device arrays themselves: tests/devices/test_gpu.py (GPU machines).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests._launch import mpirun, require_mpi

SCRIPT = Path(__file__).resolve().parent / "scripts" / "mpi_wrap_check.py"


def _failures(res: dict[str, Any]) -> dict[str, Any]:
    bad: dict[str, Any] = {}
    for k, v in res.items():
        if k in ("rank", "digests", "mismatch", "swapped_all", "swapped_one",
                 "compressed_bytes"):
            continue
        if isinstance(v, dict):
            sub = {kk: vv for kk, vv in v.items() if vv is not True}
            if sub:
                bad[k] = sub
        elif v is not True:
            bad[k] = v
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n,extra", [(2, ()), (3, ("--no-torch",))])
def test_wrap_in_a_raw_mpi4py_program(n: int, extra: tuple[str, ...]) -> None:
    require_mpi()
    results = mpirun(SCRIPT, n, *extra, timeout=100).results(n)
    for r in results:
        assert _failures(r) == {}, f"rank {r['rank']}: {_failures(r)}"
        assert r["mismatch"] == "MismatchError", r["rank"]
        assert r["swapped_all"] == "BufferFormatError", r["rank"]
        assert r["swapped_one"] == ("BufferFormatError" if r["rank"] == 0 else
                                    "MismatchError"), r["rank"]
        staged = {"in_place", "count_in_place", "count_out_of_place", "reinterpreted",
                  "bytearray", "float16", "empty", "min_int", "bitwise_equal_to_direct"}
        staged |= set() if extra else {"torch_in_place", "torch_bfloat16", "torch_spec",
                                       "mixed_kinds"}
        assert staged <= set(r["staged"]), sorted(staged - set(r["staged"]))
        if "compressed_bytes" in r:              # fp16 on the wire: about half the bytes
            compressed, dense = r["compressed_bytes"]
            assert 0 < compressed < 0.6 * dense, r["compressed_bytes"]
    assert ("torch_bfloat16" in results[0]) == (not extra)
    for r in results[1:]:               # non-exact float sums: the same bytes everywhere
        assert r["digests"] == results[0]["digests"], r["rank"]


# -- in-process, on COMM_SELF -------------------------------------------------------------
@pytest.fixture()
def MPI() -> Any:
    require_mpi()
    from mpi4py import MPI

    return MPI


def test_wrap_validates_its_options(MPI: Any) -> None:
    from gradcomm.errors import ConfigError
    from gradcomm.integrations.mpi import wrap

    with pytest.raises(ConfigError, match="unknown algorithm"):
        wrap(MPI.COMM_SELF, algorithm="bogus")
    with pytest.raises(ConfigError, match="compressor options"):
        wrap(MPI.COMM_SELF, ratio=0.1)
    with pytest.raises(ConfigError, match="mpi4py communicator"):
        wrap(object())
    with pytest.raises(KeyError):
        wrap(MPI.COMM_SELF, compressor="no-such-codec")
    w = wrap(MPI.COMM_SELF, algorithm="tree")
    again = wrap(w, algorithm="ring")          # re-wrapping replaces the options
    assert again.gradcomm_options["algorithm"] == "ring"
    assert type(again).__mro__[1:3] == (type(w).__mro__[1], MPI.Intracomm)
    assert "algorithm='ring'" in repr(again)


def test_buffer_specs_are_parsed_like_mpi4py(MPI: Any) -> None:
    from gradcomm.errors import BufferFormatError, ConfigError
    from gradcomm.integrations.mpi import _plan

    comm = MPI.COMM_SELF
    x = np.arange(6.0)
    f = np.zeros(4, np.float32)
    send, recv, dtype, op = _plan(MPI, comm, MPI.IN_PLACE, [x, 4, MPI.DOUBLE], MPI.MAX)
    assert send is None and recv.count == recv.view.size == 4 and dtype == "float64" and \
        op == "max"
    assert np.shares_memory(recv.view, x) and recv.obj is x
    _, recv, dtype, _ = _plan(MPI, comm, MPI.IN_PLACE, [x, "f"], MPI.SUM)   # reinterpreted
    assert dtype == "float32" and recv.count == recv.view.size == 12
    _, recv, dtype, _ = _plan(MPI, comm, MPI.IN_PLACE, [x, 3], MPI.PROD)
    assert dtype == "float64" and recv.count == 3
    send, recv, dtype, _ = _plan(MPI, comm, [x[:4].astype(np.float32), MPI.FLOAT], f, MPI.MIN)
    assert send.count == recv.count == 4 and dtype == "float32"
    ba = bytearray(8)                                   # buffer-protocol objects: numpy
    _, recv, dtype, _ = _plan(MPI, comm, MPI.IN_PLACE, [ba, MPI.FLOAT], MPI.SUM)
    assert isinstance(recv.obj, np.ndarray) and recv.count == 2 and dtype == "float32"
    # handed to MPI: user op, MPI.BYTE, derived types, vector specs, size mismatches,
    # non-contiguous arrays, complex, long double; a read-only receive buffer is refused
    op = MPI.Op.Create(lambda a, b, t: None, commute=True)
    pair = MPI.DOUBLE.Create_contiguous(2).Commit()
    ro = np.zeros(3)
    ro.flags.writeable = False
    try:
        for args in [(MPI.IN_PLACE, x, op), (MPI.IN_PLACE, [x, MPI.BYTE], MPI.SUM),
                     (MPI.IN_PLACE, [x, 3, pair], MPI.SUM),
                     (MPI.IN_PLACE, [x, (2, 0), MPI.DOUBLE], MPI.SUM),
                     (np.ones(5), x, MPI.SUM), (np.ones(6, np.float32), x, MPI.SUM),
                     (MPI.IN_PLACE, x[::2], MPI.SUM),
                     (MPI.IN_PLACE, np.ones(2, complex), MPI.SUM),
                     (MPI.IN_PLACE, [np.ones(2, np.longdouble), MPI.LONG_DOUBLE], MPI.SUM),
                     (MPI.IN_PLACE, np.ones(2, bool), MPI.SUM),
                     (MPI.IN_PLACE, [x, 7, MPI.DOUBLE], MPI.SUM), (MPI.IN_PLACE, x, MPI.LOR)]:
            assert _plan(MPI, comm, *args) is None, args
        assert isinstance(_plan(MPI, comm, MPI.IN_PLACE, ro, MPI.SUM), ConfigError)
        # byte-swapped arrays (MPI would read them as native): refused, as mpi4py does
        sw = np.arange(3.0).astype(np.dtype("f8").newbyteorder("S"))
        for args in [(MPI.IN_PLACE, sw), (MPI.IN_PLACE, [sw, MPI.DOUBLE]),
                     (sw, np.zeros(3)), (np.zeros(3), sw), (MPI.IN_PLACE, memoryview(sw))]:
            got = _plan(MPI, comm, *args, MPI.SUM)
            assert isinstance(got, BufferFormatError) and isinstance(got, BufferError), args
    finally:
        op.Free()
        pair.Free()


def test_plain_arrays_take_the_short_parse_to_the_same_buffers(MPI: Any) -> None:
    """A plain contiguous numpy array (the common spec) is parsed without the byte views,
    to what the general parse (the ``[array, count]`` spec) gives: the same dtype, count,
    memory and writability; other arrays keep the general parse."""
    from gradcomm.integrations.mpi import _PLAIN, _spec

    ro = np.arange(4, dtype=np.int16)
    ro.flags.writeable = False
    for a in [np.arange(5.0), np.arange(12, dtype=np.float32).reshape(3, 4),
              np.zeros((2, 0, 3), np.uint8), np.array(7, np.int64), ro,
              np.arange(6, dtype=np.float16), np.arange(3, dtype=np.uint64)]:
        fast, general = _spec(MPI, a), _spec(MPI, [a, a.size])
        assert fast is not None and general is not None, a
        (fb, fd), (gb, gd) = fast, general
        assert fd == gd and fb.count == gb.count == a.size and fb.obj is a, a
        assert fb.view.dtype == gb.view.dtype and fb.view.shape == gb.view.shape == (a.size,)
        assert fb.view.ctypes.data == gb.view.ctypes.data or a.size == 0
        assert fb.view.flags.writeable == gb.view.flags.writeable == a.flags.writeable
    assert _spec(MPI, np.arange(4.0)[::2]) is None                 # left to MPI, as before
    assert np.dtype(">f8") not in _PLAIN and np.dtype("<f8") in _PLAIN   # byte order


def test_wrap_on_comm_self_runs_gradcomm_and_falls_back(MPI: Any) -> None:
    from gradcomm.integrations.mpi import wrap

    comm = wrap(MPI.COMM_SELF)
    h = np.full(3, 1.5, np.float16)            # MPI cannot reduce float16 here
    comm.Allreduce(MPI.IN_PLACE, h)
    assert h.tolist() == [1.5] * 3
    out = np.zeros(3, np.float16)
    comm.Allreduce(h, out, MPI.MAX)
    assert out.tolist() == [1.5] * 3
    c = np.array([1 + 2j])
    comm.Allreduce(MPI.IN_PLACE, c)            # complex: MPI's own Allreduce
    assert c.tolist() == [1 + 2j]
    with pytest.raises(ValueError, match="count"):
        comm.Allreduce(np.ones(2), np.ones(3))     # mpi4py's own error, as unwrapped
    d = comm.Dup()
    assert type(d) is type(comm) and d.gradcomm_transport is not comm.gradcomm_transport
    d.Free()


def test_host_arrays_route_direct_and_stage_alike(MPI: Any) -> None:
    """Host memory is reduced in place ("direct"); the staged route (device arrays on an
    MPI that is not CUDA-aware) gives the same results on every spec form."""
    from gradcomm.integrations.mpi import _plan, wrap

    comm = wrap(MPI.COMM_SELF)
    for args in [(MPI.IN_PLACE, np.arange(4.0), MPI.SUM),
                 (np.ones(3, np.float16), np.zeros(3, np.float16), MPI.MAX)]:
        assert comm._gradcomm_route(*_plan(MPI, comm, *args)) == "direct"
    for route in ("direct", "staged"):
        out = np.full(6, -1.0)
        comm._gradcomm_allreduce([np.arange(4.0), MPI.DOUBLE], [out, 4, MPI.DOUBLE],
                                 MPI.SUM, route=route)
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0, -1.0, -1.0], route
        h = np.arange(5, dtype=np.float16)
        comm._gradcomm_allreduce(MPI.IN_PLACE, [h, 3], MPI.PROD, route=route)
        assert h.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0], route
