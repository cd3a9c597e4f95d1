"""Messages as trains of eager slices (``gradcomm.comm._train``): how a message is cut,
and the MPI transport between nodes (``--mca btl tcp,self``, as bench/netns.py runs)
under a real ``mpirun``: the same bytes as unsliced messages on every route, and a
message of another length still an error."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.comm._train import (MAX_TAG, MAX_TRAIN_BYTES, SLICE_BYTES, TAG_CONTINUED, Train,
                                  flat, train)
from tests._launch import mpi_call, require_mpi


class _Part:
    def __init__(self, buf: memoryview, tag: int) -> None:
        self.data, self.tag, self.done, self.tests = bytes(buf), tag, False, 0

    def test(self) -> bool:
        self.tests += 1
        return self.done


def _cut(nbytes: int, limit: int = SLICE_BYTES, tag: int = 3) -> tuple[bytes, list[_Part], object]:
    buf = (np.arange(nbytes, dtype=np.int64) * 7919 % 251).astype(np.uint8)
    parts: list[_Part] = []
    req = train(lambda b, tg: parts.append(_Part(b, tg)) or parts[-1], buf, limit, tag)
    return buf.tobytes(), parts, req


@pytest.mark.parametrize("nbytes", [SLICE_BYTES + 1, 2 * SLICE_BYTES, 2 * SLICE_BYTES + 7,
                                    1_000_003, MAX_TRAIN_BYTES])
def test_a_message_between_the_limits_is_cut_in_order_with_its_length_in_the_tags(
        nbytes: int) -> None:
    data, parts, req = _cut(nbytes, tag=5)
    k = -(-nbytes // SLICE_BYTES)
    assert isinstance(req, Train) and len(parts) == k
    assert b"".join(p.data for p in parts) == data
    assert [len(p.data) for p in parts[:-1]] == [SLICE_BYTES] * (k - 1)
    assert [p.tag for p in parts] == [5] + [5 + TAG_CONTINUED * k] * (k - 1)
    assert max(p.tag for p in parts) <= MAX_TAG - (2**15 - 1 - 5)


@pytest.mark.parametrize("nbytes", [0, 1, SLICE_BYTES, MAX_TRAIN_BYTES + 1])
def test_a_message_outside_the_limits_goes_whole(nbytes: int) -> None:
    data, parts, req = _cut(nbytes)
    assert req is parts[0] and len(parts) == 1 and parts[0].data == data
    assert parts[0].tag == 3


def test_no_limit_and_a_buffer_without_the_buffer_protocol_go_whole() -> None:
    _, parts, req = _cut(3 * SLICE_BYTES, limit=0)
    assert len(parts) == 1 and req is parts[0]

    class Device:                        # like a device array: nbytes, no buffer protocol
        nbytes = 3 * SLICE_BYTES

    got: list[object] = []
    train(lambda b, tg: got.append(b) or _Part(memoryview(b""), tg), Device(), SLICE_BYTES, 3)
    assert len(got) == 1 and isinstance(got[0], Device)


def test_a_train_completes_when_its_slices_do_testing_from_the_first_pending() -> None:
    _, parts, req = _cut(3 * SLICE_BYTES)
    assert isinstance(req, Train)
    assert not req.test()
    parts[0].done = True
    assert not req.test() and parts[0].tests == 2 and parts[2].tests == 0
    parts[1].done = parts[2].done = True
    assert req.test() and req.test()
    assert parts[0].tests == 2                  # known complete: not tested again
    assert flat([parts[0], req]) == [parts[0], *parts]


def _same_bytes_sliced_and_whole() -> dict:
    """Run by mpi_call: every route's result through a sliced transport and through an
    unsliced one (slice_bytes 0) on the same communicator, the hashes of both, how many
    slices went out, and the errors of mismatched lengths."""
    import hashlib

    from mpi4py import MPI

    import gradcomm
    from gradcomm.comm import _train
    from gradcomm.comm.base import TAG_USER
    from gradcomm.comm.mpi import MPITransport
    from gradcomm.errors import DeadlineError, TransportError

    sliced = MPITransport(MPI.COMM_WORLD, timeout=30)
    whole = MPITransport(MPI.COMM_WORLD, timeout=30)
    out: dict = {"slice_bytes": [sliced.slice_bytes, whole.slice_bytes]}
    whole.slice_bytes = 0
    later = [0]
    send = sliced._isend

    def counting(buf, dest, tag):                # slices after a message's first
        later[0] += tag >= _train.TAG_CONTINUED
        return send(buf, dest, tag)

    sliced._isend = counting
    me, p = sliced.rank, sliced.size
    digests: dict[str, list[str]] = {"sliced": [], "whole": []}
    for n in (0, 1, p - 1, 16_127, 16_129, 1_000_003, 1_048_577, 3_000_001):
        x = ((np.arange(n, dtype=np.int64) * 7919 + 104729 * me) % 65521).astype(np.float32)
        x = x / 64 - 512                         # exact, non-periodic, sign changes
        for algo in ("ring", "tree", "rabenseifner", "recursive_doubling", "auto"):
            for comp in (None, "int8", "fp16", "onebit"):
                for name, t in (("sliced", sliced), ("whole", whole)):
                    y = gradcomm.allreduce(x, t, algorithm=algo, compressor=comp, op="sum")
                    digests[name].append(hashlib.sha256(np.ascontiguousarray(y)).hexdigest())
        for name, t in (("sliced", sliced), ("whole", whole)):
            ar = gradcomm.Allreduce(t, op="sum", compressor="int8", error_feedback=True)
            for _ in range(2):
                y = ar(x, key="x")
            digests[name].append(hashlib.sha256(np.ascontiguousarray(y)).hexdigest())
        if n:
            exact = gradcomm.allreduce(x, whole, algorithm="ring", op="sum")
            want = sum(((np.arange(n, dtype=np.int64) * 7919 + 104729 * r) % 65521
                        ).astype(np.float64) / 64 - 512 for r in range(p))
            out[f"exact/{n}"] = bool(np.array_equal(exact, want.astype(np.float32)))
    out["digests"] = digests
    out["slices_sent"] = later[0]
    # sendrecv's messages are isend's: rank 0 exchanges with sendrecv, rank 1 with
    # isend and irecv
    mine = ((np.arange(25_001, dtype=np.int64) * 31 + me) % 257).astype(np.float32)
    got = np.empty_like(mine)
    if me < 2:
        if me == 0:
            sliced.sendrecv(mine, 1, got, 1, TAG_USER)
        else:
            sliced.waitall([sliced.irecv(got, 0, TAG_USER), sliced.isend(mine, 0, TAG_USER)])
        theirs = ((np.arange(25_001, dtype=np.int64) * 31 + 1 - me) % 257).astype(np.float32)
        out["mixed_exchange"] = bool(np.array_equal(got, theirs))
    # lengths that differ: a slice of the wrong size, and a train of more slices
    short = sliced.timeout
    sliced.timeout = 1.0
    s = _train.SLICE_BYTES
    cases = {"last_slice_longer": (3 * s - 10, 3 * s - 20), "train_for_one": (2 * s, 1000),
             "more_slices": (4 * s, 3 * s), "fewer_slices": (130_000, 200_000)}
    for i, (key, (sent, room)) in enumerate(cases.items()):
        if me == 0:
            sliced.waitall([sliced.isend(np.zeros(sent, np.uint8), 1, TAG_USER + 1 + i)])
        elif me == 1:
            try:
                sliced.waitall([sliced.irecv(np.empty(room, np.uint8), 0, TAG_USER + 1 + i)])
                out[key] = "no error"
            except (TransportError, DeadlineError) as exc:
                out[key] = type(exc).__name__
    sliced.timeout = short
    MPI.COMM_WORLD.Barrier()
    sliced.close()
    whole.close()
    return out


@pytest.mark.timeout(240)
def test_sliced_messages_give_the_bytes_of_whole_ones_and_keep_the_size_check() -> None:
    """3 ranks between "nodes" (TCP, no shared memory): each dense algorithm, three
    codecs and a stateful int8 reduction with error feedback give, at counts 0 to
    3 M elements (messages below, between and above the slicing limits), the same bytes
    through the sliced transport as through an unsliced one, on every rank; slices did
    go out; a message of another length than its receive buffer is an error, never a
    quietly shortened read: TransportError where a slice is too long, DeadlineError
    where the trains differ in length (their later slices never match); and sendrecv
    exchanges with isend and irecv."""
    require_mpi()
    env = {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self", "GRADCOMM_PROFILE": "none"}
    res = mpi_call(_same_bytes_sliced_and_whole, 3, timeout=220, env=env)
    for r in res:
        assert r["slice_bytes"] == [SLICE_BYTES, SLICE_BYTES]
        assert r["digests"]["sliced"] == r["digests"]["whole"]
        assert r["digests"]["sliced"] == res[0]["digests"]["sliced"]
        assert r["slices_sent"] > 100
        assert all(v for k, v in r.items() if k.startswith("exact/"))
    assert res[0]["mixed_exchange"] and res[1]["mixed_exchange"]
    assert res[1]["last_slice_longer"] == res[1]["train_for_one"] == "TransportError"
    assert res[1]["more_slices"] == res[1]["fewer_slices"] == "DeadlineError"
