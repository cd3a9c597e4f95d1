"""Compressors: stateless codecs with self-describing wire payloads, one file each.

Example:
    >>> import gradcomm.compressors as C
    >>> "topk" in C.names()
    True
    >>> C.get("none").name
    'none'
"""

from __future__ import annotations

import importlib
from typing import Any

from .base import Compressor, Payload

#: codec name -> module under gradcomm.compressors defining the class
_MODULES = {
    "none": "none", "fp16": "fp16", "bf16": "bf16", "int8": "int8", "qsgd": "qsgd",
    "terngrad": "terngrad", "topk": "topk", "randomk": "randomk", "onebit": "onebit",
    "powersgd": "powersgd",
}


def names() -> tuple[str, ...]:
    """Names of the codecs this installation provides."""
    return tuple(n for n in _MODULES if _load(n) is not None)


def _load(name: str) -> type[Compressor] | None:
    try:
        module = importlib.import_module(f"{__name__}.{_MODULES[name]}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{_MODULES[name]}":
            return None
        raise
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Compressor) and \
                getattr(obj, "name", None) == name:
            return obj
    return None


def get(name: str | Compressor, **options: Any) -> Compressor:
    """A compressor by name with its options; an instance is returned as is."""
    if isinstance(name, Compressor):
        if options:
            raise TypeError(f"options {sorted(options)} given with a Compressor instance")
        return name
    cls = _load(name) if isinstance(name, str) and name in _MODULES else None
    if cls is None:
        raise KeyError(f"unknown compressor {name!r}; known: {', '.join(names())}")
    return cls(**options)


__all__ = ["Compressor", "Payload", "get", "names"]
