"""The DDP hook's parameter names: residuals and checkpoints are keyed by them.

Bound to a model, a parameter is named as ``named_parameters()`` names it; unbound, by
the position it was first seen in (``param.<i>``, with a warning once).

Example:
    >>> import torch
    >>> lin = torch.nn.Linear(2, 1)
    >>> ParameterNames().bind(lin).keys(list(lin.parameters()))
    ['weight', 'bias']
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from ...errors import ConfigError


class UnboundModelWarning(UserWarning):
    """The hook names parameters by position because no model was bound."""


class ParameterNames:
    """Names of the parameters a DDP hook reduces (:meth:`bind` a model first)."""

    def __init__(self) -> None:
        #: ``id(parameter) -> name`` of the bound model, or None (unbound)
        self.names: dict[int, str] | None = None
        self._position: dict[int, str] = {}
        self._warned = False

    def bind(self, model: Any) -> ParameterNames:
        """Name parameters after ``model``'s (a DDP model or the module it wraps)."""
        module = getattr(model, "module", model)
        try:
            named = list(module.named_parameters())
        except AttributeError:
            raise ConfigError(f"bind() needs a torch.nn.Module or DDP model, got "
                              f"{type(model).__qualname__}") from None
        self.names = {id(p): name for name, p in named}
        return self

    def keys(self, params: Sequence[Any]) -> list[str]:
        """The names of ``params`` (a bucket's), in order."""
        if self.names is not None:
            try:
                return [self.names[id(p)] for p in params]
            except KeyError:
                raise ConfigError("a bucket holds a parameter that is not in the bound "
                                  "model; bind the model that DDP wraps") from None
        if not self._warned:
            self._warned = True
            warnings.warn("make_comm_hook: no model bound; residuals are keyed by parameter "
                          "position ('param.<i>'). Pass model= (or state.bind(model)) so that "
                          "checkpoints name parameters", UnboundModelWarning, stacklevel=3)
        keys = []
        for p in params:
            k = self._position.get(id(p))
            if k is None:
                k = self._position[id(p)] = f"param.{len(self._position)}"
            keys.append(k)
        return keys


__all__ = ["ParameterNames", "UnboundModelWarning"]
