"""Drop-in gradcomm for raw mpi4py programs: one ``wrap()`` line, nothing else changes.

``wrap(comm)`` returns a communicator that *is* an mpi4py communicator (a subclass of the
wrapped one's class, sharing its MPI handle), so every method, ``isinstance`` check and
MPI call that takes a communicator keeps working. Only ``Allreduce`` is gradcomm's:

- it accepts what mpi4py's accepts: ``MPI.IN_PLACE``, numpy arrays, torch CPU tensors,
  other buffer-protocol objects, ``[buf, MPI.FLOAT]``, ``[buf, count, MPI.DOUBLE]``,
  ``[buf, count]``, typecodes such as ``[buf, "d"]``, and the predefined ops
  ``SUM``, ``MAX``, ``MIN``, ``PROD``;
- it reduces with gradcomm's algorithm (``algorithm=``), on a private duplicate of the
  communicator, with identical bytes on every rank. 16-bit floats work (float16 numpy
  arrays, bfloat16 torch tensors), which this MPI rejects or silently mis-sums;
- with ``compressor=`` the sums of floating-point buffers go through the compressed
  allreduce (stateless: no error feedback; use :class:`gradcomm.Allreduce` for that);
  max/min/prod and integer buffers stay exact (dense);
- compressed sums of device arrays (cupy, torch CUDA; contiguous) run their codecs on the
  device, in the buffers' own library, as :func:`gradcomm.allreduce` does (route
  "device"; only payloads cross to the host): the result is written into the receive
  buffer's memory, with the same bytes as a host array would get.
  ``GRADCOMM_CODEC_PLACEMENT=array`` sends torch CPU tensors this way too (tests);
- other device-array reductions happen where the arrays are when the MPI is CUDA-aware
  (``"cuda" in transport.devices``); otherwise they are staged: copied to host memory after
  the producing stream is synchronised, reduced there, and the result copied back into the
  receive buffer before ``Allreduce`` returns (an MPI that is not CUDA-aware would fault
  on a device pointer);
- anything else (user-defined ops, derived datatypes, ``MPI.BYTE``, vector buffer specs,
  non-contiguous device arrays, intercommunicators) goes to the wrapped communicator's own
  ``Allreduce``, so a program never breaks by being wrapped.

Whether a call is handled depends only on the op and the datatype, which MPI requires to be
the same on every rank, so all ranks take the same path. Communicators derived with
``Dup()`` stay wrapped with the same options; ``Split`` and friends return plain ones.

Example:
    >>> import numpy as np
    >>> from mpi4py import MPI
    >>> comm = wrap(MPI.COMM_SELF, algorithm="ring")
    >>> x = np.arange(4.0)
    >>> comm.Allreduce(MPI.IN_PLACE, [x, MPI.DOUBLE], op=MPI.SUM); x.tolist()
    [0.0, 1.0, 2.0, 3.0]
    >>> comm.Get_rank(), comm.Get_size(), isinstance(comm, MPI.Intracomm), comm == MPI.COMM_SELF
    (0, 1, True, True)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import numpy as np

from .. import arrays
from .._dtypes import storage
from ..collectives import small
from ..errors import BufferFormatError, ConfigError

#: logical dtypes the wrapper reduces itself (bool is left to MPI: it only allows LOR/LAND)
_HANDLED = frozenset({"float16", "bfloat16", "float32", "float64", "int8", "int16", "int32",
                      "int64", "uint8", "uint16", "uint32", "uint64"})
_OPS = (("SUM", "sum"), ("MAX", "max"), ("MIN", "min"), ("PROD", "prod"))
#: numpy dtypes that store a handled dtype as themselves (native byte order), by dtype:
#: a plain contiguous numpy array of one is its own flat typed view (:func:`_spec`)
_PLAIN = {storage(n): n for n in _HANDLED if n != "bfloat16" and storage(n).name == n}
#: where staged sums work, and compressed sums of arrays whose codecs run on the host
_HOST = frozenset({"cpu"})


class _Buf(NamedTuple):
    """One side of an Allreduce: the first ``count`` elements of ``obj``'s memory."""

    obj: Any                   # the user's array (numpy for other buffer-protocol objects)
    view: np.ndarray | None    # flat typed host view of those elements; None on a device
    count: int                 # elements of the storage dtype


class GradcommComm:
    """Mixed into a subclass of the wrapped communicator's class by :func:`wrap`.

    Class attributes (set per ``wrap()`` call, inherited by ``Dup()``): ``gradcomm_options``
    (as given) and ``gradcomm_plan`` (validated).
    Instance attributes: the original object (attribute pass-through) and the transport.
    """

    gradcomm_options: dict[str, Any] = {}
    #: the validated :class:`~gradcomm._plan.Reduction` every handled ``Allreduce`` runs
    gradcomm_plan: Any = None
    _gradcomm_base: type = object
    #: the communicator ``wrap()`` was given (its own attributes pass through); None in a
    #: ``Dup()`` of a wrapped one
    _gradcomm_inner: Any = None
    #: the transport, made at the first reduction
    _gradcomm_transport: Any = None
    #: ``((MPI.IN_PLACE, ""), (MPI.SUM, "sum"), ...)`` where this communicator's dense
    #: checked reductions may take the small-call path, else empty
    _gradcomm_ops: tuple[tuple[Any, str], ...] = ()

    @property
    def gradcomm_transport(self) -> Any:
        """The gradcomm transport (private duplicate) this communicator reduces on."""
        t = self._gradcomm_transport
        if t is None:
            from ..comm import get_transport

            t = get_transport(self, timeout=self.gradcomm_options.get("timeout"))
            self._gradcomm_transport = t
        return t

    def Allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None) -> None:
        """mpi4py's ``Allreduce``, through gradcomm where it can (see the module doc)."""
        name = self._gradcomm_small_op(sendbuf, recvbuf, op) if self._gradcomm_ops else ""
        if not name:
            return self._gradcomm_allreduce(sendbuf, recvbuf, op)
        t, algorithm = self.gradcomm_transport, self.gradcomm_plan.algorithm
        call = small.lookup(t, recvbuf, name, algorithm)
        if call is not None:                    # resolved by an earlier call
            call.run(t, recvbuf, None if sendbuf is self._gradcomm_ops[0][0] else sendbuf)
            return None
        self._gradcomm_allreduce(sendbuf, recvbuf, op)
        small.install(t, recvbuf.size, recvbuf.dtype, name, algorithm)  # completed
        return None

    def _gradcomm_small_op(self, sendbuf: Any, recvbuf: Any, op: Any) -> str:
        """The op's name where the call may take the small-call path
        (:mod:`gradcomm.collectives.small`): a small writable plain numpy ``recvbuf`` of a
        dtype the wrapper reduces itself, reduced in place or from a numpy ``sendbuf`` of
        its dtype and shape, by a predefined op; else ``""``."""
        if type(recvbuf) is not np.ndarray or \
                small.view(self.gradcomm_transport, recvbuf) is None:
            return ""
        name = "sum" if op is None else ""
        for o, n in self._gradcomm_ops:
            if op is o:
                name = n
        if not name or not recvbuf.flags.writeable or recvbuf.dtype not in _PLAIN:
            return ""
        if sendbuf is self._gradcomm_ops[0][0]:
            return name
        return name if type(sendbuf) is np.ndarray and sendbuf.dtype == recvbuf.dtype and \
            sendbuf.shape == recvbuf.shape else ""

    def _gradcomm_allreduce(self, sendbuf: Any, recvbuf: Any, op: Any = None,
                            route: str | None = None) -> None:
        """:meth:`Allreduce`; ``route`` ("direct", "device" or "staged") overrides the
        choice of :meth:`_gradcomm_route` (tests stage host arrays through the same code)."""
        from mpi4py import MPI

        if op is None:
            op = MPI.SUM
        plan = _plan(MPI, self, sendbuf, recvbuf, op)
        if plan is None or isinstance(plan, Exception):
            self._gradcomm_agree_forward(MPI, recvbuf, op, plan)
            return self._gradcomm_base.Allreduce(self, sendbuf, recvbuf, op)
        send, recv, dtype, opname = plan
        route = route or self._gradcomm_route(send, recv, dtype, opname)
        if route == "staged":
            self._gradcomm_staged(send, recv, dtype, opname)
            return None
        if recv.view is None:                      # device memory: its producer is done
            for b in (recv,) if send is None else (send, recv):
                arrays.sync(b.obj)
        view = _native_view if route == "device" else _direct_view
        rview, src = view(recv, dtype), None
        if send is not None and send.count:
            src = view(send, dtype)
            if type(src) is not np.ndarray or type(rview) is not np.ndarray or \
                    np.may_share_memory(src, rview):
                arrays.assign(rview, src)       # device or overlapping: copied in first
                src = None
        self._gradcomm_reduce(rview, dtype, opname, src)
        arrays.sync(rview)                         # device results complete on return
        return None

    def _gradcomm_agree_forward(self, MPI: Any, recvbuf: Any, op: Any,
                                problem: Exception | None) -> None:
        """Before a call goes to MPI's own (blocking, deadline-free) Allreduce: with
        ``check``, the ranks agree on what they pass (the fields gradcomm's own path
        checks, with algorithm "MPI_Allreduce"), so a rank whose op or buffer differs (BAND
        on one rank, SUM on the others) is a MismatchError on every rank within the
        deadline instead of one rank blocked inside MPI. ``problem``: this rank's own
        objection (a read-only receive buffer), raised here on this rank."""
        if not self.gradcomm_options.get("check", True) or not isinstance(
                self, MPI.Intracomm) or self.Get_size() == 1:
            if problem is not None:
                raise problem
            return
        from ..collectives._check import agree
        from ..errors import MismatchError

        count, dtype = _describe(MPI, recvbuf)
        try:
            agree(self.gradcomm_transport, "allreduce", count=count, dtype=dtype,
                  op=_any_op_name(MPI, op), algorithm="MPI_Allreduce",
                  valid=problem is None)
        except MismatchError:
            if problem is not None:
                raise problem from None
            raise
        if problem is not None:
            raise problem

    def _gradcomm_route(self, send: _Buf | None, recv: _Buf, dtype: str, op: str) -> str:
        """"device" for a compressed sum whose codecs run where the buffers are
        (:func:`arrays.placement` says "native"); "direct" when gradcomm can reduce in the
        buffers' own memory: host memory, or device memory that the transport moves
        (CUDA-aware MPI) for a sum that is not compressed; else "staged" through host
        memory."""
        sides = (recv,) if send is None else (send, recv)
        if self._gradcomm_compresses(dtype, op):
            metas = [arrays.meta_of(b.obj) for b in sides]
            if len({(m.kind, m.device) for m in metas}) == 1 and \
                    arrays.placement(metas[0], codecs=True) == "native":
                return "device"
        if all(b.view is not None for b in sides):
            return "direct"
        devices = _HOST if self._gradcomm_compresses(dtype, op) else \
            self.gradcomm_transport.devices
        if all(b.view is None and arrays.placement(arrays.meta_of(b.obj), devices) ==
               "device" for b in sides):
            return "direct"
        return "staged"

    def _gradcomm_staged(self, send: _Buf | None, recv: _Buf, dtype: str, op: str) -> None:
        """Copy the input to host memory (after a stream sync), reduce there, copy the
        result into ``recv``'s memory; any kind or device, host arrays included."""
        st = storage(dtype)
        nbytes = recv.count * st.itemsize
        host = arrays.copy_to_host((recv if send is None else send).obj, nbytes).view(st)
        self._gradcomm_reduce(host, dtype, op)
        arrays.copy_from_host(recv.obj, host)

    def _gradcomm_compresses(self, dtype: str, op: str) -> bool:
        return self.gradcomm_plan.compresses(dtype, op)

    def _gradcomm_reduce(self, buf: Any, dtype: str, op: str, src: Any = None) -> None:
        # buf is the user's recvbuf (host memory in place: the sparse route sums there)
        out = self.gradcomm_plan.run(self.gradcomm_transport, buf, dtype, op=op, src=src,
                                     kept=src is not None and arrays.is_host(buf))
        if out is not buf:
            arrays.assign(buf, out)

    def __getattr__(self, name: str) -> Any:
        # only reached for names the communicator class does not have: the original
        # object's own attributes (e.g. of a user subclass)
        inner = self._gradcomm_inner
        if inner is None or name.startswith("_gradcomm"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(inner, name)

    def __repr__(self) -> str:
        o = self.gradcomm_options
        return (f"<gradcomm wrap of {self._gradcomm_base.__name__}: "
                f"algorithm={o.get('algorithm')!r}, compressor={o.get('compressor')!r}>")


def wrap(comm: Any, algorithm: str = "auto", compressor: Any = None, *, check: bool = True,
         seed: int = 0, timeout: float | None = None, **options: Any) -> Any:
    """A drop-in communicator whose ``Allreduce`` runs gradcomm's ``algorithm``.

    Args:
        comm: an mpi4py communicator (``MPI.COMM_WORLD``, a ``Dup()``, a Cartcomm...).
        algorithm: "auto", "ring", "tree", "recursive_doubling", "rabenseifner",
            "native"; with a compressor also the compressed-only names (e.g. "allgather").
        compressor: None, a codec name (its options in ``**options``) or a Compressor.
        check: verify at each call that all ranks passed the same count, dtype, op
            (MismatchError on every rank instead of a hang or garbage).
        seed: seeds stochastic codecs (same on every rank).
        timeout: deadline in seconds of each wait (default: gradcomm's).

    Example:
        >>> from mpi4py import MPI
        >>> comm = wrap(MPI.COMM_SELF, compressor="fp16")
        >>> comm.Get_size(), comm.gradcomm_options["compressor"]
        (1, 'fp16')
    """
    from mpi4py import MPI

    from .._plan import Reduction

    if not isinstance(comm, MPI.Comm):
        raise ConfigError(f"wrap() needs an mpi4py communicator, got "
                          f"{type(comm).__module__}.{type(comm).__qualname__}")
    plan = Reduction.configure(algorithm=algorithm, compressor=compressor, options=options,
                               check=bool(check), exact_fallback=True, check_algorithm=True)
    plan = dataclasses.replace(plan, seed=seed)      # checked at the first compressed call
    inner = comm._gradcomm_inner if isinstance(comm, GradcommComm) else None
    if inner is None:
        inner = comm
    base = type(comm)._gradcomm_base if isinstance(comm, GradcommComm) else type(comm)
    opts = {"algorithm": algorithm, "compressor": compressor, "check": bool(check),
            "seed": seed, "timeout": timeout, "options": dict(options)}
    ops = ((MPI.IN_PLACE, ""), *((getattr(MPI, a), n) for a, n in _OPS)) \
        if plan.compressor is None and plan.check is True and algorithm in ("auto", "native") \
        and issubclass(base, MPI.Intracomm) else ()
    cls = type(f"Wrapped{base.__name__}", (GradcommComm, base),
               {"gradcomm_options": opts, "gradcomm_plan": plan, "_gradcomm_base": base,
                "_gradcomm_ops": ops, "__module__": __name__})
    wrapped = cls(comm)
    wrapped._gradcomm_inner = inner
    return wrapped


def _op_name(MPI: Any, op: Any) -> str | None:
    for attr, name in _OPS:
        if op == getattr(MPI, attr):
            return name
    return None


#: MPI's predefined ops by name, for the cross-rank check of calls handed to MPI
_MPI_OPS = ("SUM", "MAX", "MIN", "PROD", "LAND", "BAND", "LOR", "BOR", "LXOR", "BXOR",
            "MAXLOC", "MINLOC", "REPLACE", "NO_OP")


def _any_op_name(MPI: Any, op: Any) -> str:
    """The name of a predefined op, or "user-defined" (equal on ranks that create theirs in
    another order)."""
    for attr in _MPI_OPS:
        if op == getattr(MPI, attr, None):
            return attr
    return "user-defined"


def _describe(MPI: Any, spec: Any) -> tuple[int, str]:
    """(bytes, datatype name) of a receive buffer spec handed to MPI, as far as they can
    be told without MPI (-1 / "" where not): what the ranks compare before the call."""
    obj, datatype = spec, None
    if isinstance(spec, (list, tuple)) and spec:
        obj, datatype = spec[0], spec[-1] if len(spec) > 1 else None
    found = _storage_of(obj)
    nbytes = -1 if found is None else int(found[2])
    if isinstance(datatype, MPI.Datatype):
        try:
            return nbytes, datatype.Get_name() or "derived"
        except MPI.Exception:
            return nbytes, "derived"
    return nbytes, "" if found is None else str(found[3])


def _logical(MPI: Any, datatype: Any) -> str | None:
    """gradcomm's dtype name for a predefined MPI datatype (or typecode); None if not one
    the wrapper handles."""
    if isinstance(datatype, str):
        try:
            datatype = MPI.Datatype.fromcode(datatype)
        except (ValueError, KeyError, TypeError):
            return None
    if not isinstance(datatype, MPI.Datatype) or datatype == MPI.DATATYPE_NULL:
        return None
    if datatype == MPI.BYTE or datatype == MPI.PACKED or not datatype.is_predefined:
        return None
    bf16 = getattr(MPI, "BFLOAT16_T", MPI.DATATYPE_NULL)
    if bf16 != MPI.DATATYPE_NULL and datatype == bf16:
        return "bfloat16"
    try:
        name = np.dtype(datatype.tocode()).name
    except (ValueError, TypeError):
        return None
    return name if name in _HANDLED else None


def _storage_of(obj: Any) -> tuple[Any, np.ndarray | None, int, str] | None:
    """(array, flat uint8 host view of its memory or None in device memory, its size in
    bytes, logical dtype), or None to leave ``obj`` to MPI."""
    try:
        k = arrays.kind(obj)
    except ConfigError:
        k = None
    try:
        if k is not None:
            meta = arrays.meta_of(obj)
            if meta.device == "cpu":
                raw = arrays.host_view(obj).view(np.uint8)
                return obj, raw, raw.size, meta.dtype
            if not meta.device.startswith("cuda") or meta.dtype not in _HANDLED or \
                    not arrays.is_contiguous(obj):
                return None                        # e.g. MPS tensors: MPI's own
            return obj, None, meta.count * storage(meta.dtype).itemsize, meta.dtype
        arr = np.asarray(memoryview(obj))          # bytearray, array.array, memoryview...
        if not arr.flags.c_contiguous:
            return None
        raw = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
        return arr, raw, raw.size, arr.dtype.name
    except (ConfigError, TypeError, ValueError, BufferError):
        return None


def _spec(MPI: Any, spec: Any) -> tuple[_Buf, str] | None:
    """Parse an mpi4py buffer spec into (the buffer, its logical dtype); None to leave it
    to MPI. Raises BufferFormatError for a byte-swapped array of a handled dtype (MPI
    would read its bytes as native ones)."""
    if type(spec) is np.ndarray:               # the common case, without the byte views
        name = _PLAIN.get(spec.dtype)
        if name is not None and spec.flags.c_contiguous:
            flat = spec if spec.ndim == 1 else spec.reshape(-1)
            return _Buf(spec, flat, flat.size), name
    count, datatype = None, None
    if isinstance(spec, (list, tuple)):
        if len(spec) == 2:
            obj, second = spec
            if isinstance(second, int) and not isinstance(second, bool):
                count = second
            else:
                datatype = second
        elif len(spec) == 3:
            obj, count, datatype = spec
            if not isinstance(count, int) or isinstance(count, bool):
                return None                        # (count, displ) vector forms
        else:
            return None
    else:
        obj = spec
    found = _storage_of(obj)
    if found is None:
        return None
    arr, raw, nbytes, dtype = found
    if datatype is not None:
        dtype = _logical(MPI, datatype)
        if dtype is None:
            return None
    if dtype not in _HANDLED:
        return None
    if isinstance(arr, np.ndarray) and not arr.dtype.isnative:
        raise BufferFormatError(
            f"Allreduce: a buffer of dtype {arr.dtype.str!r} is not in native byte order; "
            f"mpi4py refuses it too (a native copy: x.astype(x.dtype.newbyteorder('=')))")
    st = storage(dtype)
    if nbytes % st.itemsize:
        return None
    total = nbytes // st.itemsize
    if count is None:
        count = total
    elif not 0 <= count <= total:
        return None
    view = None if raw is None else raw.view(st)[:count]
    return _Buf(arr, view, count), dtype


def _direct_view(buf: _Buf, dtype: str) -> Any:
    """The flat typed view of ``buf``'s elements where they live (numpy or cupy)."""
    if buf.view is not None:
        return buf.view
    st = storage(dtype)
    if buf.count == 0:                             # nothing to move: skip the DLPack view
        return np.empty(0, st)
    return arrays.byte_view(buf.obj)[:buf.count * st.itemsize].view(st)


def _native_view(buf: _Buf, dtype: str) -> Any:
    """The flat storage-typed view of ``buf``'s elements in the array's own library and
    memory (torch stays torch, cupy cupy, numpy numpy): where device codecs run."""
    st = storage(dtype)
    raw = arrays.bitcast(arrays.flat(buf.obj), "uint8")
    return arrays.bitcast(raw[:buf.count * st.itemsize], st.name)


def _plan(MPI: Any, comm: Any, sendbuf: Any, recvbuf: Any,
          op: Any) -> tuple[_Buf | None, _Buf, str, str] | ConfigError | None:
    """(send buffer or None for IN_PLACE, receive buffer, dtype, op), None to hand the
    call to MPI, or the ConfigError of a call that cannot be made (a read-only receive
    buffer, a byte-swapped one: raised on every rank by the agreement)."""
    if not isinstance(comm, MPI.Intracomm):
        return None
    opname = _op_name(MPI, op)
    if opname is None:
        return None
    try:
        recv = _spec(MPI, recvbuf)
        send = None if sendbuf is MPI.IN_PLACE else _spec(MPI, sendbuf)
    except BufferFormatError as exc:
        return exc
    if recv is None:
        return None
    rbuf, dtype = recv
    if rbuf.view is not None and not rbuf.view.flags.writeable:
        return ConfigError("Allreduce: the receive buffer is read-only (the result could "
                           "not be written)")
    if sendbuf is MPI.IN_PLACE:
        return None, rbuf, dtype, opname
    if send is None:
        return None
    sbuf, sdtype = send
    if sdtype != dtype or sbuf.count != rbuf.count:
        return None                                # mpi4py raises its own error
    return sbuf, rbuf, dtype, opname
