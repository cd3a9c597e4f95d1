"""The data both training examples use (``ddp_train.py``, ``fsdp_train.py``).

scikit-learn's 8x8 handwritten digits (shipped with it: no download), standardised and
split 80/20 with a fixed permutation. The examples import it from their own folder
(``examples/``, first on ``sys.path`` when they run as scripts).

Example:
    >>> (xtr, ytr), (xte, yte) = load_data()
    >>> tuple(xtr.shape), tuple(xte.shape), xtr.dtype
    ((1437, 64), (360, 64), torch.float32)
"""

from __future__ import annotations

import numpy as np
import torch


def load_data(seed: int = 0):
    """Digits, standardised, split 80/20 with a fixed permutation."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    perm = np.random.default_rng(seed).permutation(len(y))
    x, y = torch.tensor(x[perm], dtype=torch.float32), torch.tensor(y[perm])
    cut = int(0.8 * len(y))
    return (x[:cut], y[:cut]), (x[cut:], y[cut:])
