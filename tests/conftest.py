"""Shared pytest set-up: make ``tests._cases`` importable under plain ``pytest`` too."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Tests must not follow a calibrated profile a user saved on this machine
# (``python -m gradcomm.bench --calibrate``): ``auto`` then uses the built-in table, the
# same everywhere. Subprocesses (mpirun, gloo) inherit it. Tests of the profile set their own.
import os  # noqa: E402

os.environ.setdefault("GRADCOMM_PROFILE", "none")
