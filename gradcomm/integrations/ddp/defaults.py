"""The DDP hook's measured defaults: warm-up lengths, top-k's sparsity ramp, PowerSGD's
rank and random-k's ratio.

``start_iter="auto"``, ``ramp="auto"``, ``make_comm_hook("powersgd")`` without ``rank=``
and ``make_comm_hook("randomk")`` without ``ratio=`` read them;
the measurements behind each number are in bench/RESULTS.md (issue 13).

Example:
    >>> from gradcomm import compressors
    >>> default_start_iter(compressors.get("powersgd")), POWERSGD_RANK
    (50, 4)
"""

from __future__ import annotations

from typing import Any

from .momentum import MASKED_CODECS

#: dense backward passes that ``start_iter="auto"`` runs first for a sparsifier below 1 %
#: (measured in bench/converge.py: bench/RESULTS.md, issue 13)
SPARSE_WARMUP = 100
#: steps per stage of the sparsity ramp that ``ramp="auto"`` gives topk below 1 %
SPARSE_RAMP = 25
#: ``make_comm_hook("powersgd")``'s rank, and its dense warm-up under ``start_iter="auto"``
#: (rank 1, the codec's default, fell short of uncompressed accuracy; rank 4 after 50
#: dense steps came much closer: bench/RESULTS.md, "Convergence")
POWERSGD_RANK, POWERSGD_WARMUP = 4, 50
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
    """``start_iter="auto"``: :data:`SPARSE_WARMUP` for topk or randomk with a ratio
    below 1 % (top-k 0.1 % loses points from the first steps' stale residuals),
    :data:`POWERSGD_WARMUP` for PowerSGD, else 0.

    Example:
        >>> from gradcomm import compressors
        >>> default_start_iter(compressors.get("topk", ratio=0.001)), \\
        ...     default_start_iter(compressors.get("topk"))
        (100, 0)
    """
    if codec is not None and codec.name == "powersgd":
        return POWERSGD_WARMUP
    if codec is None or codec.name not in MASKED_CODECS:      # the sparsifiers
        return 0
    return SPARSE_WARMUP if float(codec.get_config().get("ratio", 1.0)) < 0.01 else 0


__all__ = ["POWERSGD_RANK", "POWERSGD_WARMUP", "RANDOMK_RATIO", "SPARSE_RAMP", "SPARSE_WARMUP",
           "default_options",
           "default_ramp", "default_start_iter"]
