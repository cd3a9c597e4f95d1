"""compressors.get: unknown names and options are clear gradcomm errors that list what is
known and suggest the closest match (and stay KeyError / TypeError for older callers)."""

from __future__ import annotations

import numpy as np
import pytest

from gradcomm.compressors import get, names
from gradcomm.errors import ConfigError, UnknownNameError, UnknownOptionError


@pytest.mark.parametrize("typo,close", [("top-k", "topk"), ("TopK", "topk"),
                                        ("onebits", "onebit"), ("powersdg", "powersgd")])
def test_unknown_name_suggests_the_closest(typo: str, close: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{close}'") as info:
        get(typo)
    assert isinstance(info.value, KeyError) and isinstance(info.value, UnknownNameError)
    for known in names():
        assert known in str(info.value)
    assert str(info.value).startswith("unknown compressor")     # not KeyError's repr


@pytest.mark.parametrize("name,typo,close,valid", [
    ("topk", "ration", "ratio", "ratio, k"), ("randomk", "K", "k", "ratio, k"),
    ("int8", "bucketsize", "bucket_size", "bits, bucket_size, rounding, scale"),
    ("qsgd", "level", "levels", "levels, bits, bucket_size"),
    ("powersgd", "ranks", "rank", "rank, min_compression_rate"),
    ("onebit", "bucket", "bucket_size", "bucket_size")])
def test_unknown_option_names_the_valid_ones(name: str, typo: str, close: str,
                                            valid: str) -> None:
    with pytest.raises(UnknownOptionError, match=f"did you mean '{close}'") as info:
        get(name, **{typo: 1})
    assert isinstance(info.value, TypeError) and valid in str(info.value)
    assert "__init__" not in str(info.value)


def test_options_of_a_codec_without_options_and_of_an_instance() -> None:
    with pytest.raises(UnknownOptionError, match="its options: none"):
        get("fp16", ratio=0.1)
    with pytest.raises(UnknownOptionError, match="Compressor instance"):
        get(get("topk", ratio=0.1), ratio=0.2)
    assert get("topk", ratio=0.5).compress(np.ones(4, np.float32)).header["k"] == 2
