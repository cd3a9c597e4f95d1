"""The DDP hook's measured defaults: warm-up lengths, top-k's sparsity ramp, PowerSGD's
rank and random-k's ratio.

``start_iter="auto"``, ``ramp="auto"``, ``make_comm_hook("powersgd")`` without ``rank=``
and ``make_comm_hook("randomk")`` without ``ratio=`` read them;
the measurements behind each number are in bench/RESULTS.md (issue 13).

Example:
    >>> from gradcomm import compressors
    >>> default_start_iter(compressors.get("powersgd")), POWERSGD_RANK
    (150, 4)
"""

from __future__ import annotations

from typing import Any

#: dense backward passes that ``start_iter="auto"`` runs first for the codecs of
#: :data:`WARMUP_CODECS`. Their compressed updates lag (error feedback holds mass back for
#: steps, PowerSGD's warm start needs settled gradients), and a lag costs most while the
#: gradients change fast: on the synthetic task at 4 ranks (450 steps) 150 dense steps
#: took random-k 25 % from 5.8 points below uncompressed to 0.8 (3 seeds), top-k 1 % from
#: -1.4 to +0.8, top-k 0.1 % (then its ramp) from -1.25 after 100 dense steps to +0.1;
#: 100 were not enough for random-k (bench/RESULTS.md, issue 13). Their bytes are dense: 150 steps in
#: a run of 10^4 are 1.5 % of it.
DENSE_WARMUP = 150
#: the codecs ``start_iter="auto"`` runs :data:`DENSE_WARMUP` dense steps first for
WARMUP_CODECS = ("topk", "randomk", "powersgd")
#: plain Adam steps before 1-bit Adam's compressed ones (``OneBitAdam`` and the hook's
#: Adam route); measured in bench/converge.py (bench/RESULTS.md, issue 13)
DEFAULT_WARMUP = 100
#: steps per stage of the sparsity ramp that ``ramp="auto"`` gives topk below 1 %
SPARSE_RAMP = 25
#: ``make_comm_hook("powersgd")``'s rank (rank 1, the codec's default, fell short of
#: uncompressed accuracy; rank 4 after dense steps came much closer: bench/RESULTS.md,
#: "Convergence")
POWERSGD_RANK = 4
#: ``make_comm_hook("randomk")``'s ratio (the codec's own default stays 0.01). Random-k
#: with error feedback sends each coordinate about once per ``1/ratio`` steps, carrying
#: that many steps' gradients: at 1 % to 10 % it did not train in runs of 10^3 steps,
#: at 25 % it did (bench/RESULTS.md, "Convergence").
#: Random-k sends values only (the positions come from the shared seed), so 25 % is a
#: quarter of the dense bytes.
RANDOMK_RATIO = 0.25


def default_options(compressor: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for a codec given by name, with the measured defaults the codec's own
    lack: :data:`POWERSGD_RANK` for ``"powersgd"`` without ``rank``, :data:`RANDOMK_RATIO`
    for ``"randomk"`` without ``ratio`` or ``k`` (the DDP hook's and ``OneBitAdam``'s).

    Example:
        >>> default_options("randomk", {}), default_options("randomk", {"k": 5})
        ({'ratio': 0.25}, {'k': 5})
    """
    if compressor == "powersgd" and "rank" not in options:
        return {**options, "rank": POWERSGD_RANK}
    if compressor == "randomk" and "ratio" not in options and "k" not in options:
        return {**options, "ratio": RANDOMK_RATIO}
    return options


def default_ramp(codec: Any) -> int | None:
    """``ramp="auto"``: :data:`SPARSE_RAMP` steps per stage of DGC's sparsity warm-up
    (:mod:`.ramp`) for topk below 1 %, else None (no ramp)."""
    if codec is None or codec.name != "topk":
        return None
    return SPARSE_RAMP if float(codec.get_config().get("ratio", 1.0)) < 0.01 else None


def default_start_iter(codec: Any) -> int:
    """``start_iter="auto"``: :data:`DENSE_WARMUP` for the codecs of
    :data:`WARMUP_CODECS` (top-k and random-k at any ratio, PowerSGD), else 0.

    Example:
        >>> from gradcomm import compressors
        >>> default_start_iter(compressors.get("topk", ratio=0.001)), \\
        ...     default_start_iter(compressors.get("int8"))
        (150, 0)
    """
    return DENSE_WARMUP if codec is not None and codec.name in WARMUP_CODECS else 0


__all__ = ["DEFAULT_WARMUP", "DENSE_WARMUP", "POWERSGD_RANK", "RANDOMK_RATIO", "SPARSE_RAMP", "WARMUP_CODECS",
           "default_options",
           "default_ramp", "default_start_iter"]
