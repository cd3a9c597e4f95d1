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

# relative to this package, so a copy of it under another name (bench/compressed_ab.py's
# baseline) resolves these in the copy, not in the installed gradcomm
_LAZY = {
    "Allreduce": "._allreduce",
    "sparse_allgather": ".collectives.sparse_allgather",
    "gossip_average": ".collectives.gossip",
    "Gossip": ".collectives.gossip",
    "ErrorFeedback": ".error_feedback",
    "reduce_scatter": ".compressed.reduce_scatter",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'gradcomm' has no attribute {name!r}")


__all__ = ["Allreduce", "ErrorFeedback", "Gossip", "GradcommError", "allreduce", "allreduce_", "comm", "compressors", "errors",
           "gossip_average", "reduce_scatter", "sparse_allgather", "__version__"]
