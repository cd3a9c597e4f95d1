"""``wrap(comm)`` in a raw mpi4py program, under a real mpirun.

Each check records True/False (or an error name) on this rank, plus whether gradcomm
handled the call (bytes on the wrapper's private transport) or handed it to MPI. The
digests of non-exact float sums let the test compare bytes across ranks. Prints
``RESULT {json}``.

    mpirun -n 3 python -m mpi4py tests/integrations/scripts/mpi_wrap_check.py [--no-torch]

``--no-torch`` leaves out the torch tensor checks (importing torch costs seconds).
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import numpy as np
from mpi4py import MPI


class MyComm(MPI.Intracomm):
    """A program's own communicator subclass with an attribute of its own."""

    label = "mine"


def main() -> int:
    import gradcomm
    from gradcomm.collectives import DENSE
    from gradcomm.errors import GradcommError
    from gradcomm.integrations.mpi import wrap

    world = MPI.COMM_WORLD
    rank, p = world.Get_rank(), world.Get_size()
    comm = wrap(world, algorithm="ring")
    t = comm.gradcomm_transport
    res: dict[str, Any] = {"rank": rank}

    def handled(fn: Any) -> tuple[bool, Any]:
        """(did gradcomm move bytes, fn's result)."""
        before = t.stats.bytes_sent + t.stats.messages_sent
        out = fn()
        return t.stats.bytes_sent + t.stats.messages_sent > before, out

    tri = p * (p - 1) // 2                                 # sum of ranks

    # IN_PLACE and out-of-place numpy, default op
    x = np.arange(5.0) + rank
    res["in_place"] = handled(lambda: comm.Allreduce(MPI.IN_PLACE, x))[0] and \
        x.tolist() == [p * i + tri for i in range(5)]
    s, r = np.full(4, rank, np.int32), np.zeros(4, np.int32)
    res["out_of_place"] = handled(lambda: comm.Allreduce(s, r, op=MPI.SUM))[0] and \
        r.tolist() == [tri] * 4 and s.tolist() == [rank] * 4

    # buffer specs: [buf, type], [buf, count, type] (only count elements), [buf, count],
    # typecodes
    f = np.full(6, rank + 1, np.float32)
    res["spec_type"] = handled(lambda: comm.Allreduce(MPI.IN_PLACE, [f, MPI.FLOAT]))[0] and \
        f.tolist() == [float(tri + p)] * 6
    d = np.full(6, rank + 1.0)
    res["spec_count_in_place"] = handled(
        lambda: comm.Allreduce(MPI.IN_PLACE, [d, 4, MPI.DOUBLE]))[0] and \
        d.tolist() == [float(tri + p)] * 4 + [rank + 1.0] * 2
    s, r = np.full(6, rank + 1.0), np.full(6, -1.0)
    res["spec_count"] = handled(
        lambda: comm.Allreduce([s, 3, MPI.DOUBLE], [r, 3, MPI.DOUBLE], op=MPI.MAX))[0] and \
        r.tolist() == [float(p)] * 3 + [-1.0] * 3
    s, r = np.full(5, rank + 1.0), np.zeros(5)
    res["spec_typecode_and_count"] = handled(
        lambda: comm.Allreduce([s, 2], [r, 2, "d"], op=MPI.MIN))[0] and \
        r.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    b = np.frombuffer(np.full(3, rank, np.int64).tobytes(), np.uint8).copy()
    res["reinterpreted_bytes"] = handled(
        lambda: comm.Allreduce(MPI.IN_PLACE, [b, MPI.INT64_T]))[0] and \
        b.view(np.int64).tolist() == [tri] * 3
    ba = bytearray(np.full(2, rank + 1, np.float64).tobytes())
    res["bytearray"] = handled(lambda: comm.Allreduce(MPI.IN_PLACE, [ba, MPI.DOUBLE]))[0] \
        and np.frombuffer(ba).tolist() == [float(tri + p)] * 2

    # ops
    v = np.array([rank - 1, 2, -rank], np.int64)
    out = {}
    for name in ("SUM", "MAX", "MIN", "PROD"):
        y = np.empty(3, np.int64)
        out[name] = handled(lambda: comm.Allreduce(v, y, op=getattr(MPI, name)))[0] and \
            y.tolist() == ref(world, v, getattr(MPI, name)).tolist()
    res["ops"] = out

    # torch CPU tensors, 16-bit floats (MPI rejects float16 / mis-sums bfloat16 here)
    if "--no-torch" not in sys.argv[1:]:
        import torch

        tt = torch.full((2, 3), float(rank + 1))
        res["torch_in_place"] = handled(lambda: comm.Allreduce(MPI.IN_PLACE, tt))[0] and \
            torch.equal(tt, torch.full((2, 3), float(tri + p)))
        bf = torch.full((7,), rank + 1.5, dtype=torch.bfloat16)
        bo = torch.zeros(7, dtype=torch.bfloat16)
        res["torch_bfloat16"] = handled(lambda: comm.Allreduce(bf, bo))[0] and \
            torch.equal(bo, torch.full((7,), float(tri + 1.5 * p), dtype=torch.bfloat16))
        ts = torch.arange(4.0, requires_grad=True) * (rank + 1)
        to = torch.zeros(4)
        res["torch_spec"] = handled(lambda: comm.Allreduce([ts.detach(), 2, MPI.FLOAT],
                                                           [to, 2, MPI.FLOAT]))[0] and \
            to.tolist() == [0.0, float(tri + p), 0.0, 0.0]
    h = np.full(9, rank + 0.5, np.float16)
    res["float16"] = handled(lambda: comm.Allreduce(MPI.IN_PLACE, h))[0] and \
        h.tolist() == [tri + 0.5 * p] * 9

    res["staged"] = staged_checks(comm, rank, p, "--no-torch" not in sys.argv[1:])

    # identical bytes on every rank for sums that are not exact
    rnd = np.random.default_rng(rank).standard_normal(10007).astype(np.float32)
    digests = {}
    for algo in DENSE:
        a = wrap(world, algorithm=algo)
        y = np.empty_like(rnd)
        a.Allreduce(rnd, y)
        digests[algo] = hashlib.blake2b(y.tobytes(), digest_size=8).hexdigest()
        if algo != "native":
            z = np.empty_like(rnd)
            world.Allreduce(rnd, z)                        # MPI's own, unwrapped
            res[f"close_to_mpi/{algo}"] = bool(np.allclose(y, z, rtol=1e-5, atol=1e-4))
        e = np.arange(11, dtype=np.int64) * (rank + 1)
        eref = np.empty_like(e)
        world.Allreduce(e, eref)
        a.Allreduce(MPI.IN_PLACE, e)
        res[f"equal_to_mpi/{algo}"] = e.tolist() == eref.tolist()
    res["digests"] = digests

    # fallbacks: a user-defined op, an exotic (derived) datatype, complex numbers
    def absmax(inbuf: Any, inout: Any, datatype: Any) -> None:
        a = np.frombuffer(inbuf, np.float64)
        b = np.frombuffer(inout, np.float64)
        np.copyto(b, np.maximum(np.abs(a), np.abs(b)))

    myop = MPI.Op.Create(absmax, commute=True)
    u = np.array([-(rank + 1.0), 0.5])
    used, _ = handled(lambda: comm.Allreduce(MPI.IN_PLACE, u, op=myop))
    res["user_op"] = (not used) and u.tolist() == [float(p), 0.5]
    myop.Free()
    pair = MPI.DOUBLE.Create_contiguous(2).Commit()      # derived type, with a user op
    pairop = MPI.Op.Create(absmax, commute=True)
    w = np.array([-(rank + 1.0), 0.5] * 3)
    wy = np.zeros(6)
    used, _ = handled(lambda: comm.Allreduce([w, 3, pair], [wy, 3, pair], op=pairop))
    res["derived_type"] = (not used) and wy.tolist() == [float(p), 0.5] * 3
    pairop.Free()
    pair.Free()
    ld = np.full(3, rank + 1, np.longdouble)              # MPI.LONG_DOUBLE: not ours
    used, _ = handled(lambda: comm.Allreduce(MPI.IN_PLACE, [ld, MPI.LONG_DOUBLE]))
    res["long_double"] = (not used) and ld.tolist() == [float(tri + p)] * 3
    c = np.full(3, 1 + 1j * rank)
    used, _ = handled(lambda: comm.Allreduce(MPI.IN_PLACE, c))
    res["complex"] = (not used) and c.tolist() == [complex(p, tri)] * 3

    # everything else is the wrapped communicator's
    res["passthrough"] = {
        "rank_size": (comm.Get_rank(), comm.Get_size(), comm.rank, comm.size) ==
        (rank, p, rank, p),
        "isinstance": isinstance(comm, MPI.Intracomm),
        "same_comm": comm == world and comm.Compare(world) == MPI.IDENT,
        "bcast": comm.bcast({"k": rank}, root=0) == {"k": 0},
        "allreduce_pickle": comm.allreduce(rank) == tri,
        "barrier": comm.Barrier() is None,
        "dup_stays_wrapped": type(comm.Dup()).__name__ == type(comm).__name__ and
        comm.Dup().gradcomm_options["algorithm"] == "ring",
        "split_plain": type(comm.Split(0, rank)) is MPI.Intracomm,
        "subclass_attr": wrap(MyComm(world)).label == "mine",
        "gradcomm_allreduce": gradcomm.allreduce(np.ones(3), comm).tolist() == [float(p)] * 3,
        "missing_attr": not hasattr(comm, "no_such_attribute"),
    }

    # ranks that pass different counts: MismatchError on every rank, not a hang
    try:
        comm.Allreduce(MPI.IN_PLACE, np.ones(4 + (rank == p - 1)))
        res["mismatch"] = "none raised"
    except GradcommError as exc:
        res["mismatch"] = type(exc).__name__

    # byte-swapped buffers (MPI would sum their bytes as native ones): BufferFormatError
    # where they are passed, MismatchError on the other ranks, not garbage or a hang
    swapped = np.dtype("f8").newbyteorder("S")
    for name, rank_swaps in (("swapped_all", True), ("swapped_one", rank == 0)):
        sb = np.arange(4.0) + rank
        try:
            comm.Allreduce(sb.astype(swapped) if rank_swaps else sb, np.zeros(4))
            res[name] = "none raised"
        except GradcommError as exc:
            res[name] = type(exc).__name__

    # compressed sums (fp16: exact on these small integers), max stays dense
    if "fp16" in gradcomm.compressors.names():
        cc = wrap(world, algorithm="ring", compressor="fp16")
        ct = cc.gradcomm_transport
        from gradcomm.bench.data import exact_input, exact_result

        g = exact_input(rank, 4096, "float32", "sum")        # per-rank integers, no period
        ct.stats.reset()
        cc.Allreduce(MPI.IN_PLACE, g)
        compressed = ct.stats.bytes_sent
        dense_g = exact_input(rank, 4096, "float32", "sum")
        t.stats.reset()
        comm.Allreduce(MPI.IN_PLACE, dense_g)
        res["compressed_sum"] = g.tobytes() == dense_g.tobytes() == \
            exact_result(p, 4096, "float32", "sum").tobytes()
        res["compressed_bytes"] = [compressed, t.stats.bytes_sent]
        m = np.full(5, float(rank))
        cc.Allreduce(MPI.IN_PLACE, m, op=MPI.MAX)
        res["compressed_max_dense"] = m.tolist() == [float(p - 1)] * 5
    else:
        res["compressed_sum"] = "fp16 codec missing"
    print("RESULT " + json.dumps(res), flush=True)
    return 0


def staged_checks(comm: Any, rank: int, p: int, with_torch: bool) -> dict[str, Any]:
    """The staged route (device arrays on an MPI that is not CUDA-aware: copy to host,
    reduce, copy back) run on host arrays, which take the same code and the same
    ``arrays`` copy functions: results must equal the direct route's, bitwise."""
    from gradcomm.integrations.mpi import wrap

    t = comm.gradcomm_transport
    tri = p * (p - 1) // 2
    out: dict[str, Any] = {}

    def staged(send: Any, recv: Any, op: Any = MPI.SUM, c: Any = comm) -> bool:
        before = t.stats.messages_sent + c.gradcomm_transport.stats.messages_sent
        c._gradcomm_allreduce(send, recv, op, route="staged")
        return t.stats.messages_sent + c.gradcomm_transport.stats.messages_sent > before

    x = np.arange(5.0) + rank
    out["in_place"] = staged(MPI.IN_PLACE, x) and x.tolist() == [p * i + tri for i in range(5)]
    d = np.full(6, rank + 1.0)                      # only `count` elements are written back
    out["count_in_place"] = staged(MPI.IN_PLACE, [d, 4, MPI.DOUBLE]) and \
        d.tolist() == [float(tri + p)] * 4 + [rank + 1.0] * 2
    s, r = np.full(6, rank + 1.0, np.float32), np.full(6, -1.0, np.float32)
    out["count_out_of_place"] = staged([s, 3, MPI.FLOAT], [r, 3, MPI.FLOAT], MPI.MAX) and \
        r.tolist() == [float(p)] * 3 + [-1.0] * 3 and s.tolist() == [rank + 1.0] * 6
    b = np.frombuffer(np.full(3, rank, np.int64).tobytes(), np.uint8).copy()
    out["reinterpreted"] = staged(MPI.IN_PLACE, [b, MPI.INT64_T]) and \
        b.view(np.int64).tolist() == [tri] * 3
    ba = bytearray(np.full(2, rank + 1, np.float64).tobytes())
    out["bytearray"] = staged(MPI.IN_PLACE, [ba, MPI.DOUBLE]) and \
        np.frombuffer(ba).tolist() == [float(tri + p)] * 2
    h = np.full(9, rank + 0.5, np.float16)
    out["float16"] = staged(MPI.IN_PLACE, h) and h.tolist() == [tri + 0.5 * p] * 9
    z = np.zeros(0, np.float32)
    staged(MPI.IN_PLACE, z)
    out["empty"] = z.size == 0
    m = np.array([rank, -rank, 7], np.int32)
    mo = np.zeros(3, np.int32)
    out["min_int"] = staged(m, mo, MPI.MIN) and mo.tolist() == [0, -(p - 1), 7]
    rnd = np.random.default_rng(100 + rank).standard_normal(3001).astype(np.float32)
    a, b2 = rnd.copy(), np.empty_like(rnd)
    comm.Allreduce(MPI.IN_PLACE, a)                  # direct
    staged(rnd, b2)
    out["bitwise_equal_to_direct"] = a.tobytes() == b2.tobytes()
    if with_torch:
        import torch

        tt = torch.full((2, 3), float(rank + 1))
        out["torch_in_place"] = staged(MPI.IN_PLACE, tt) and \
            torch.equal(tt, torch.full((2, 3), float(tri + p)))
        bf = torch.full((7,), rank + 1.5, dtype=torch.bfloat16)
        bo = torch.zeros(7, dtype=torch.bfloat16)
        out["torch_bfloat16"] = staged(bf, bo) and \
            torch.equal(bo, torch.full((7,), float(tri + 1.5 * p), dtype=torch.bfloat16))
        ts = torch.arange(4.0) * (rank + 1)
        to = torch.zeros(4)
        out["torch_spec"] = staged([ts, 2, MPI.FLOAT], [to, 2, MPI.FLOAT]) and \
            to.tolist() == [0.0, float(tri + p), 0.0, 0.0]
        mixed = torch.zeros(5, dtype=torch.float64)          # numpy in, torch out
        out["mixed_kinds"] = staged(np.full(5, rank + 1.0), mixed) and \
            mixed.tolist() == [float(tri + p)] * 5
    if "fp16" in __import__("gradcomm").compressors.names():
        cc = wrap(comm, algorithm="ring", compressor="fp16")
        from gradcomm.bench.data import exact_input, exact_result

        g = exact_input(rank, 4096, "float32", "sum")        # per-rank integers, no period
        gd = g.copy()
        cc.Allreduce(MPI.IN_PLACE, gd)                       # direct
        out["compressed"] = staged(MPI.IN_PLACE, g, c=cc) and g.tobytes() == gd.tobytes() \
            and g.tobytes() == exact_result(p, 4096, "float32", "sum").tobytes()
    return out


def ref(world: Any, v: np.ndarray, op: Any) -> np.ndarray:
    y = np.empty_like(v)
    world.Allreduce(v, y, op=op)
    return y


if __name__ == "__main__":
    sys.exit(main())
