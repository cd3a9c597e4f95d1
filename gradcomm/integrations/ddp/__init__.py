"""PyTorch DDP communication hook: any gradcomm compressor with any collective.

``make_comm_hook(...)`` returns ``(state, hook)`` for
``ddp_model.register_comm_hook(state, hook)``. For every gradient bucket DDP hands over:

1. The hook (on the autograd thread) only queues the bucket and returns a
   ``torch.futures.Future``; a single worker thread per state takes buckets in order, so
   every rank issues its collectives in the same order and the next buckets' backward
   compute overlaps this bucket's communication. Callbacks never ``.wait()``.
2. The gradients are multiplied by ``1/p`` before the reduction (exactly as DDP's built-in
   reducer does, so fp16 sums cannot overflow).
3. Without a compressor (or before ``start_iter``) the bucket is summed in its own dtype by
   the chosen dense algorithm; ``"auto"`` there means the library's own allreduce (what
   DDP runs, and what overlaps best on gloo), or gradcomm's choice for dtypes the
   library cannot reduce (16-bit floats under MPI).
4. With a compressor the bucket is reduced in float32 (float64 for float64 buckets): the
   error-feedback residual of every parameter is added to its slice, the compressed
   collective runs, and each parameter's residual keeps what its slice lost. Later
   buckets of the same layout run the route the first one took, planned
   (:mod:`gradcomm.compressed.planned`); under ``"auto"`` at p = 2 int8 and onebit take
   the planned allgather, the same bytes as the per-hop ring in one exchange.
5. The future completes with the reduced bucket; DDP copies it into ``.grad``.

**Residuals are keyed by parameter name**, not by bucket, so they survive DDP's bucket
rebuild and a change of ``bucket_cap_mb`` (:mod:`.residuals`). Names come from ``model=``
(or ``state.bind(model)``): ``named_parameters()`` of the module DDP wraps, e.g.
``"0.weight"``. Unbound, the hook names parameters ``"param.<i>"`` in the order DDP first
hands them over and warns once: bind the model to make checkpoints robust to layout
changes and resumes bitwise.

**PowerSGD** (``make_comm_hook("powersgd", rank=r)``) compresses each parameter on its
own, viewed as ``(shape[0], rest)`` as PyTorch's hook does (``state.residuals.shapes``; a
name mapped to None there keeps the flat near-square layout); 1-D parameters go
uncompressed; its warm-start ``Q`` is kept per parameter (``"<name>#q"``) and
checkpointed. Its rounds are dense sums, so it runs on every dense algorithm,
``"native"`` included (counted in ``stats["native_nbytes"]``); other lossy codecs refuse
``"native"``.

**Checkpoints** (:mod:`.checkpoint`). ``state.state_dict()`` is collective: call it on
every rank; every rank then holds every rank's residuals (``rank0_only=True``: only rank
0 does, the others get ``{}``), so one ``torch.save`` on rank 0 is a complete checkpoint
(``torch.load(path, weights_only=True)`` reads it). ``load_state_dict`` is local and
accepts a checkpoint taken at any rank count, keeping the total error mass. The first
iteration after a load replays the saved bucket layout (:mod:`.replay`), so a resumed
run reduces the same groups as the unbroken one and, on CPU, ends with bitwise the same
parameters.

**Parity.** ``make_comm_hook(None)`` (``"auto"``) and ``algorithm="native"`` run gloo's
allreduce on the same scaled bucket, hence are bitwise equal to DDP's built-in path at
any rank count. Any other algorithm at two ranks computes ``fl(a + b)`` per element,
bitwise equal too; at more ranks only the order of summation differs.

**Errors and lifecycle** (:mod:`.lifecycle`). A failed reduction is raised by the hook
itself at the iteration's last bucket, so ``backward()`` raises the GradcommError with its
type (an exception set on the future would reach the user as DDP's "Unable to cast"
RuntimeError); sparse gradients are refused there too. ``state.close()`` (idempotent,
``with state:``) joins the worker and releases the gloo group and MPI duplicate the hook
made; it also runs at interpreter exit and from ``torch.distributed.destroy_process_group``
before torch destroys the group. A checkpoint of another configuration is refused.

**Join** (``with ddp_model.join():``): a rank that ran out of data runs the hook on zero
buckets, so collectives still match; gradients are divided by the full ``p``.

**GPU and NCCL** (:mod:`.routes`, :mod:`.groups`). The worker waits for a CUDA event the
hook records on the autograd stream. A compressed CUDA bucket stays on its device (only
payload bytes cross to the host transport); uncompressed buckets and PowerSGD are
staged through host memory, except on NCCL, whose own allreduce sums uncompressed
``auto``/``native`` buckets in place. ``state_dict`` brings device residuals to the
host; they move back at their next bucket. ``GRADCOMM_CODEC_PLACEMENT=array`` sends CPU
buckets down the device path too (same bytes). With an NCCL process group
``make_comm_hook`` creates a gloo group over the same ranks for the hook's messages:
call it on every rank of the group, like DDP's construction. Other transports that move
only device buffers are refused: pass a gloo group or ``transport="mpi"``.

**Convergence** (issue 13; measured by ``bench/converge.py``, in bench/RESULTS.md).
``make_comm_hook(name, optimizer=opt)`` turns on DGC's momentum correction for topk,
randomk and onebit (:mod:`.momentum`), which top-k and 1-bit need to match uncompressed
SGD with momentum; topk, randomk and powersgd run 150 dense steps first (``start_iter``,
:data:`.defaults.DENSE_WARMUP`); top-k below 1 % then ramps its sparsity
(``ramp``, :mod:`.ramp`, DGC's exponential warm-up); random-k defaults to ratio 0.25 and
is clipped (``clip``) so that it cannot diverge; the divergence guard (``guard``, on by
default) keeps one non-finite step from poisoning the residuals. With
``torch.optim.Adam``/``AdamW`` topk, randomk, onebit and terngrad take the Adam route
(:mod:`.adam`: 1-bit Adam's frozen variance and compressed momentum, on the user's own
optimizer, after 100 plain Adam steps).

Tuning: a longer ``start_iter`` leaves more of the first, fast-changing phase
uncompressed, for other codecs too; on gloo every message costs
milliseconds, so prefer few, large buckets (``bucket_cap_mb``) and an algorithm with few
rounds; under ``mpirun`` pass ``transport="mpi"`` (microseconds per message).

Example:
    >>> import torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> model = DDP(torch.nn.Linear(4, 2))
    >>> state, hook = make_comm_hook("int8", bits=4, model=model)
    >>> model.register_comm_hook(state, hook)
    >>> model(torch.ones(3, 4)).sum().backward()
    >>> state.iter, sorted(state.state_dict()["ranks"][0]["residuals"])
    (1, ['bias', 'weight'])
    >>> dist.destroy_process_group()                 # closes the state too
"""

from .checkpoint import STATE_FORMAT, STATE_VERSION
from .hook import CommHookState, UnboundModelWarning, comm_hook
from .make import make_comm_hook

__all__ = ["CommHookState", "STATE_FORMAT", "STATE_VERSION", "UnboundModelWarning",
           "comm_hook", "make_comm_hook"]
