"""The Compressor contract: every capability is declared on the class and does what it says.

The collectives, error feedback and entry points read these attributes instead of
inspecting a codec's methods, so a declaration that lies would change a route silently:
each one is checked here against the codec's behaviour.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gradcomm import compressors
from gradcomm.compressors import Compressor, Payload, get, names
from gradcomm.errors import UnsupportedError

from tests.compressors.test_codecs import CONFIGS, IDS, data

FLAGS = ("shared_seed", "lossy", "contractive", "sparse", "sparse_pairs", "reuses_out",
         "fuses_feedback", "decodes_add", "uses_shape")


def test_registry_names_its_classes() -> None:
    for name in names():
        cls = compressors._load(name)
        assert cls is not None and issubclass(cls, Compressor) and cls.name == name


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_capabilities_are_declared(name: str, opts: dict) -> None:
    c = get(name, **opts)
    for flag in FLAGS:
        assert isinstance(getattr(c, flag), bool), flag
    assert c.reduction in ("summable", "gathered")
    assert isinstance(c.start_iter, int) and c.start_iter >= 0
    assert not c.sparse_pairs or c.sparse
    # every built-in codec takes add= and decodes in place
    assert c.decodes_add


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_reuses_out_means_the_buffers_are_reused(name: str, opts: dict) -> None:
    c = get(name, **opts)
    x = data(4000)
    p = c.compress(x, seed=1)
    q = c.compress(data(4000, seed=2), seed=1, out=p)
    shared = [k for k, b in q.buffers.items()
              if b.size and np.shares_memory(b, p.buffers.get(k, np.zeros(0)))]
    assert bool(shared) == c.reuses_out, shared


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_sparse_pairs_are_the_decoded_nonzeros(name: str, opts: dict) -> None:
    c = get(name, **opts)
    p = c.compress(data(500), seed=3)
    if not c.sparse_pairs:
        with pytest.raises(UnsupportedError, match="sparse_pairs"):
            c.to_sparse(p)
        return
    n, dt, idx, vals = c.to_sparse(p)
    dense = np.zeros(n, dt)
    dense[idx] = vals
    assert dense.tobytes() == c.decompress(p).tobytes()


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
def test_contractive_codecs_shrink_the_input(name: str, opts: dict) -> None:
    c = get(name, **opts)
    x = data(4096).astype(np.float64)
    err = max(float(np.linalg.norm(c.decompress(c.compress(x, seed=s)) - x))
              for s in range(3))
    if c.contractive:
        assert err < np.linalg.norm(x)


def test_option_dependent_declarations() -> None:
    assert get("int8", bits=2).contractive and not get("int8", bits=1).contractive
    assert get("qsgd", levels=127).contractive and not get("qsgd", levels=4).contractive
    assert not get("terngrad").contractive and get("terngrad").feedback_stable
    assert get("int8", scale=1.0).reduction == "summable" and get("int8").reduction == "gathered"
    assert get("powersgd", start_iter=3).start_iter == 3 and get("topk").start_iter == 0
    assert [n for n in names() if get(n).uses_shape] == ["powersgd"]


class _Plain(Compressor):
    """A codec that declares nothing beyond the required methods."""

    name = "plain_test"

    def compress(self, x: Any, *, seed: Any = None) -> Payload:
        return Payload(self.name, {"n": int(x.size)}, {"v": np.array(x, np.float32)})

    def decompress(self, payload: Payload, out: Any = None) -> np.ndarray:
        return payload.buffers["v"].copy()


def test_defaults_are_conservative() -> None:
    """A codec that declares nothing is given the general path everywhere."""
    c = _Plain()
    assert (c.reduction, c.lossy, c.contractive) == ("gathered", True, True)
    assert not any(getattr(c, f) for f in FLAGS if f not in ("lossy", "contractive"))
    with pytest.raises(UnsupportedError, match="max_nbytes"):
        c.max_nbytes(4)


def test_declarations_are_checked_when_the_class_is_made() -> None:
    with pytest.raises(TypeError, match="reduction"):
        type("Bad", (_Plain,), {"name": "bad", "reduction": "added"})
    with pytest.raises(TypeError, match="sparse_pairs without sparse"):
        type("Bad", (_Plain,), {"name": "bad", "sparse_pairs": True})


@pytest.mark.parametrize("name", names())
def test_declared_options_are_the_init_keywords(name: str) -> None:
    """``options`` (what get() checks names against) lists exactly what __init__ takes."""
    import inspect

    cls = compressors._load(name)
    assert cls is not None
    params = [] if cls.__init__ is object.__init__ else \
        [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert sorted(cls.options) == sorted(params), name
