"""DGC's exponential sparsity warm-up for the DDP hook: denser top-k in the first steps.

Deep Gradient Compression (Lin et al., ICLR 2018) does not start at its final sparsity:
over the warm-up the kept density falls exponentially, 25 % -> 6.25 % -> 1.5625 % ->
0.4 % -> the target (0.1 %), each stage a quarter of the one before. The first steps'
gradients change fastest; a very sparse codec holds most of their mass back in the
residuals, where it goes stale (the error-feedback residuals of top-k 0.1 % cost points
from the start, bench/RESULTS.md, issue 13). A ramp sends that mass while it is fresh.
The hook's default for top-k below 1 % runs it after its dense steps (``start_iter``):
measured better than either alone (bench/RESULTS.md).

:class:`SparsityRamp` maps the hook's iteration to the codec of that stage: the target
codec's class with a larger ``ratio``. Stages are ``stage_steps`` backward passes long;
a stage whose density is not above the target's is skipped. Every rank computes the
same stage from the same iteration, so the ranks agree without a message; a resumed run
(the hook's ``iter`` is checkpointed) continues in the stage it was in.

Example:
    >>> from gradcomm import compressors
    >>> ramp = SparsityRamp(compressors.get("topk", ratio=0.001), stage_steps=10)
    >>> [ramp.codec(i).get_config()["ratio"] for i in (0, 9, 10, 25, 35, 40, 1000)]
    [0.25, 0.25, 0.0625, 0.015625, 0.00390625, 0.001, 0.001]
    >>> ramp.steps
    40
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .momentum import MASKED_CODECS

#: the stages' densities (DGC: 75 %, 93.75 %, 98.4375 %, 99.6 % sparsity)
DENSITIES = (0.25, 0.0625, 0.015625, 0.00390625)


class SparsityRamp:
    """The codec of each warm-up stage for a ``ratio=`` sparsifier ``target``.

    ``stage_steps``: backward passes per stage (> 0); ``start``: the iteration the
    ramp begins at (the hook's ``start_iter``: dense steps before it stay dense).
    """

    def __init__(self, target: Any, stage_steps: int, start: int = 0) -> None:
        if target is None or target.name not in MASKED_CODECS:
            raise ConfigError(f"ramp= is for the sparsifiers {MASKED_CODECS}, not "
                              f"{None if target is None else target.name!r}")
        ratio = target.get_config().get("ratio")
        if ratio is None:
            raise ConfigError(f"a sparsity ramp needs a ratio= codec, got "
                              f"{target.name} with {target.get_config()}")
        if isinstance(stage_steps, bool) or not isinstance(stage_steps, int) or \
                stage_steps <= 0:
            raise ConfigError(f"ramp must be an int > 0 (steps per stage), None or "
                              f"'auto', got {stage_steps!r}")
        self.target, self.start, self.stage_steps = target, int(start), stage_steps
        self.stages = [type(target)(ratio=d) for d in DENSITIES if d > float(ratio)]

    @property
    def steps(self) -> int:
        """Backward passes the ramp lasts (after ``start``)."""
        return self.stage_steps * len(self.stages)

    def codec(self, step: int) -> Any:
        """The codec of iteration ``step``: a stage's, or the target after the ramp."""
        i = (step - self.start) // self.stage_steps
        return self.stages[i] if 0 <= i < len(self.stages) else self.target


__all__ = ["DENSITIES", "SparsityRamp"]
