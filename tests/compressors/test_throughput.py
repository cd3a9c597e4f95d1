"""gradcomm.bench.codecs: the codec throughput rows and the table (not a timed test)."""

from __future__ import annotations

import json

import numpy as np

from gradcomm.bench.codecs import DEFAULT, codec_throughput, main, parse_spec
from gradcomm.compressors import get


def test_rows_describe_each_codec() -> None:
    n = 70_000
    specs = ["none", "fp16", "topk:ratio=0.01", "int8:bits=4,rounding=stochastic"]
    rows = codec_throughput(n, specs, repeats=2)
    assert [r["codec"] for r in rows] == ["none", "fp16", "topk:ratio=0.01",
                                          "int8:bits=4,rounding=stochastic"]
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    for r in rows:
        name, opts = parse_spec(r["codec"])
        c = get(name, **opts)
        assert r["config"] == c.get_config() and r["n"] == n
        assert r["wire_bytes"] == c.compress(x, seed=(0, 2)).nbytes
        assert r["encode_s"] >= 0 and r["decode_s"] > 0 and r["copy_s"] > 0
        assert r["decode_add_s"] > 0
        assert r["compression"] == x.nbytes / r["wire_bytes"]
    assert rows[0]["rel_error"] == 0 and rows[1]["rel_error"] < 1e-3
    assert 0.9 < rows[2]["rel_error"] < 1 and rows[2]["target"] == 5.0


def test_spec_parsing_and_defaults() -> None:
    assert parse_spec("int8:bits=4,rounding=stochastic,scale=None") == \
        ("int8", {"bits": 4, "rounding": "stochastic", "scale": None})
    assert parse_spec("topk:ratio=0.5") == ("topk", {"ratio": 0.5})
    for spec in DEFAULT:
        name, opts = parse_spec(spec)
        get(name, **opts)


def test_main_prints_a_table(tmp_path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert main(["--n", "5000", "--codecs", "fp16,int8:bits=4+rounding=stochastic",
                 "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "x copy" in text and "add ms" in text and "int8:bits=4,rounding=stochastic" in text
    assert [r["codec"] for r in json.loads(out.read_text())] == \
        ["fp16", "int8:bits=4,rounding=stochastic"]
