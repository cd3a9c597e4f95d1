"""``make_comm_hook``: the DDP hook's front door, its options and their defaults.

Example:
    >>> from gradcomm.comm import run_ranks
    >>> def fn(t):
    ...     state, hook = make_comm_hook("topk", ratio=0.01, transport=t)
    ...     state.close()
    ...     return hook is comm_hook
    >>> run_ranks(1, fn)
    [True]
"""

from __future__ import annotations

from typing import Any, Callable

from .hook import CommHookState, comm_hook


def make_comm_hook(compressor: Any = None, *, algorithm: str = "auto",
                   error_feedback: bool = True, process_group: Any = None,
                   transport: Any = None, start_iter: int | str = "auto", model: Any = None,
                   **options: Any) -> tuple[CommHookState, Callable[..., Any]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        compressor: None (plain averaging), a codec name with its options in
            ``**options`` (e.g. ``ratio=0.01``), or a Compressor. ``"powersgd"``
            without ``rank=`` gets rank :data:`~.defaults.POWERSGD_RANK` (4) here, not the
            codec's 1; ``"randomk"`` without ``ratio=``/``k=`` gets ratio
            :data:`~.defaults.RANDOMK_RATIO` (0.25), not the codec's 0.01: random-k with
            error feedback sends each coordinate once per ``1/ratio`` steps with that
            many steps' gradients, and at 1 % it does not train in runs of 10^3 steps
            (bench/RESULTS.md); at 25 % it sends a quarter of the
            dense bytes (values only: the positions come from the shared seed).
        algorithm: any gradcomm allreduce algorithm the compressor composes with.
        error_feedback: keep per-parameter residuals of the compression error.
        process_group: DDP's process group (default: the default group). For an NCCL
            group a gloo group over its ranks is created here for the hook's messages
            (collective: every rank of the group calls ``make_comm_hook``).
        transport: None (point-to-point over ``process_group``), ``"mpi"``
            (``MPI.COMM_WORLD``, for jobs started with mpirun), an mpi4py communicator or a
            gradcomm Transport.
        start_iter: backward passes to run uncompressed first; ``"auto"``:
            :data:`~.defaults.DENSE_WARMUP` (150) for ``topk``, ``randomk`` and
            ``powersgd``, else 0. Their compressed updates lag the gradient (error
            feedback holds mass back), which costs most in the first, fast-changing
            steps: random-k 25 % without the dense steps ended 5.8 points below
            uncompressed in a 450-step run, 0.8 with them (bench/RESULTS.md). The
            dense steps cost dense bytes: 1.5 % of a 10^4-step run.
        ramp: **DGC's sparsity warm-up** (:mod:`.ramp`): steps per stage of densities
            25 %, 6.25 %, 1.5625 %, 0.39 % before the codec's own ratio (stages not
            above it are skipped), from ``start_iter`` on; ``"auto"``:
            :data:`~.defaults.SPARSE_RAMP` (25) for topk below 1 %, else None (no
            ramp). Top-k 0.1 %'s residuals hold the early, fast-changing steps' mass
            back until it is stale: after the dense steps the ramp lets the residuals
            fill gradually (measured closer to uncompressed than either the dense
            steps or the ramp alone, for a fraction more of the warm-up's bytes:
            bench/RESULTS.md).
        model: the DDP model (or its module), to name residuals after its parameters.
        optimizer: the training's optimizer; ``"auto"`` (default): the hook finds it
            at its first ``step()`` (torch's global step pre-hook; the first backward
            pass goes uncorrected); None: no optimizer, no watch. A
            ``torch.optim.SGD`` with momentum turns
            on **momentum correction** (:mod:`.momentum`, DGC) for ``topk``, ``randomk``
            and ``onebit``: the hook compresses each rank's velocity instead of its
            gradient and undoes SGD's own momentum on the result, so ``SGD(momentum=m)``
            performs DGC's update. These codecs need it: their error feedback holds
            mass back for many steps, and SGD's momentum then amplifies the stale
            updates (top-k loses accuracy, random-k diverges; bench/RESULTS.md).
            Other codecs' errors are small and fresh: not applied. A
            ``torch.optim.Adam`` or ``AdamW`` takes the hook's **Adam route** for
            ``topk``, ``randomk``, ``onebit`` and ``terngrad`` (:mod:`.adam`: 1-bit
            Adam on the user's optimizer: ``start_iter`` (default 100) plain Adam
            steps, then the variance frozen and each rank's preconditioned momentum
            averaged through the codec at ``step()``; compressed Adam *gradients*
            cost these codecs up to 5.6 points). ``terngrad`` keeps error feedback
            with SGD (it diverges without) and drops it for any other optimizer.
            With ``optimizer=None`` the hook cannot see Adam and keeps its SGD-safe
            settings (TernGrad's error feedback, random-k's clip 0.1), which cost
            those two 24 to 27 points with AdamW (bench/RESULTS.md): with Adam leave
            it ``"auto"`` or pass the optimizer.
        momentum: hook-side momentum correction without ``optimizer``: the hook keeps
            the velocity (factor ``momentum``) and returns the reduced velocity; use it
            with momentum-free SGD.
        guard: the **divergence guard** (:mod:`gradcomm.compressed.guard`): after a
            bucket whose result or residuals hold a non-finite value (or a residual norm
            above ``residual_bound`` times the largest earlier input norm) on any rank,
            every rank resets that unit's residuals, codec state and velocity
            (``stats["guard_resets"]``, a GuardWarning); one small allreduce per
            compressed bucket. The NaN step's own result stays NaN, as AMP's scaler
            expects; the later steps are finite.
        residual_bound: see ``guard`` (default 1000; None: only non-finite values).
        clip: **clipping that respects error feedback**: a reduced bucket longer than
            ``clip`` times the sum of the ranks' input norms is scaled down to it and
            what is cut off goes back into the residuals (nothing is lost, it arrives
            later). ``"auto"``: for ``randomk`` ``sqrt(ratio)`` below 25 % (unclipped,
            its error feedback sends many steps' worth of a coordinate at once and
            diverges at momentum 0.9); from 25 % on (the default 0.25) 1 once the hook
            corrects the optimizer's momentum or finds a non-SGD optimizer, 0.1 before
            and with ``optimizer=None`` (an uncorrected SGD momentum on the stale mass
            diverged at clips 0.25-1); None (off) for the other codecs
            (:func:`~gradcomm.compressed.guard.default_clip`).
        options: codec options, plus ``seed`` (stochastic codecs) and ``timeout``
            (seconds per blocking wait).

    Convergence (bench/converge.py, bench/RESULTS.md): the defaults find the optimizer
    (momentum correction for topk, randomk and onebit with SGD; TernGrad's error feedback
    with SGD only); topk, randomk and powersgd run 150 dense steps first, and top-k below
    1 % then ramps its sparsity; random-k
    defaults to 25 %. With Adam/AdamW the sparsifiers, onebit and TernGrad take the Adam
    route (above); fp16, bf16, int8, qsgd and powersgd compress Adam's gradients (within
    a point of uncompressed AdamW). ``OneBitAdam(params, compressor=name)``
    (:class:`~gradcomm.integrations.onebit_adam.OneBitAdam`) is the same mechanism as an
    optimizer, for any codec.

    See the module docstring for the steps, checkpoints and parity.
    """
    state = CommHookState(compressor, algorithm=algorithm, error_feedback=error_feedback,
                          process_group=process_group, transport=transport,
                          start_iter=start_iter, model=model, **options)
    return state, comm_hook


__all__ = ["make_comm_hook"]
