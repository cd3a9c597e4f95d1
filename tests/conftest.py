"""Shared pytest set-up: make ``tests._cases`` importable under plain ``pytest`` too."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parent.parent)
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
