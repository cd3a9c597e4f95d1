"""Selection of the j-th smallest element of a flat array, on its own kind and device:
the threshold top-k needs (:func:`._xp_select.topk_select`), without a full sort.

Example:
    >>> import numpy as np
    >>> int(kth_smallest(np.array([5, 1, 4, 2], np.int32), 1))
    2
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import arrays


def kth_smallest(a: Any, j: int) -> Any:
    """The element of flat ``a`` that a sort would put at position ``j`` (0-based), as a
    0-d array of ``a``'s kind and device (no host sync): a selection, not a full sort.

    Example:
        >>> import numpy as np
        >>> int(kth_smallest(np.array([5, 1, 4, 2], np.int32), 1))
        2
    """
    k = arrays.kind(a)
    if k == "torch":
        if a.device.type == "cpu":          # numpy's introselect is ~1.5x torch's on CPU
            import torch

            return torch.from_numpy(np.partition(a.detach().numpy(), j)[j:j + 1]).reshape(())
        return _torch_kth(a, j)
    if k == "cupy":
        import cupy

        with a.device:                      # a copy, sorted in full by older cupy
            return cupy.partition(a, j)[j]
    return np.partition(a, j)[j]


def _torch_kth(a: Any, j: int) -> Any:
    """:func:`kth_smallest` of a torch tensor by ``topk`` (on CUDA a multi-block radix
    select for a large 1-D tensor; ``kthvalue`` runs one thread block per row there), from
    whichever end is nearer.

    Example:
        >>> import torch
        >>> a = torch.tensor([5, 1, 4, 2, 2], dtype=torch.int16)
        >>> [int(_torch_kth(a, j)) for j in range(5)]
        [1, 2, 2, 4, 5]
    """
    n = int(a.numel())
    if n - j <= j + 1:
        return a.topk(n - j, largest=True, sorted=False).values.min()
    return a.topk(j + 1, largest=False, sorted=False).values.max()
