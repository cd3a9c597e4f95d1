"""1-bit Adam (Tang et al. 2021) for DDP: :class:`OneBitAdam` and its ``onebit_adam_hook``.

The code lives in :mod:`gradcomm.integrations.ddp.onebit_adam`, beside the DDP hook's
Adam route that uses it; this is its public name.

Example:
    >>> from gradcomm.integrations.onebit_adam import OneBitAdam, DEFAULT_WARMUP
    >>> DEFAULT_WARMUP
    100
"""

from __future__ import annotations

from .ddp.onebit_adam import DEFAULT_RAMP, DEFAULT_WARMUP, OneBitAdam, onebit_adam_hook

__all__ = ["DEFAULT_RAMP", "DEFAULT_WARMUP", "OneBitAdam", "onebit_adam_hook"]
