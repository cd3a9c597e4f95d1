"""gradcomm: communicate less and faster in data-parallel training.

Any compressor with any collective, over MPI, torch.distributed or in-process ranks.
Importing gradcomm imports numpy and msgpack only; mpi4py, torch and cupy load on use.

Example:
    >>> import numpy as np, gradcomm
    >>> from gradcomm.comm import run_ranks
    >>> run_ranks(4, lambda t: gradcomm.allreduce(np.ones(3), t, algorithm="ring").tolist())[0]
    [4.0, 4.0, 4.0]
"""

from __future__ import annotations

import importlib
from typing import Any

from . import comm, compressors, errors
from ._allreduce import allreduce, allreduce_
from .errors import GradcommError

__version__ = "0.1.0"

_LAZY = {
    "Allreduce": "gradcomm._allreduce",
    "sparse_allgather": "gradcomm.collectives.sparse_allgather",
    "gossip_average": "gradcomm.collectives.gossip",
    "Gossip": "gradcomm.collectives.gossip",
    "ErrorFeedback": "gradcomm.error_feedback",
    "reduce_scatter": "gradcomm.compressed.reduce_scatter",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gradcomm' has no attribute {name!r}")


__all__ = ["Allreduce", "ErrorFeedback", "Gossip", "GradcommError", "allreduce", "allreduce_", "comm", "compressors", "errors",
           "gossip_average", "reduce_scatter", "sparse_allgather", "__version__"]
