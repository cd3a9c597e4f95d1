"""``gradcomm.bench``: the allreduce microbenchmark (``python -m gradcomm.bench``).

Rows in the columns OSU and nccl-tests users read, for every algorithm and compressor
against the library's own allreduce; see ``bench/README.md`` for the options and how the
times are taken.

Example:
    >>> from gradcomm.bench import main
    >>> main(["--transport", "threads", "--sizes", "4K", "--algorithms", "recursive_doubling",
    ...       "--iters", "2", "--warmup", "1"])  # doctest: +ELLIPSIS, +NORMALIZE_WHITESPACE
    # gradcomm.bench ...
    ... 4096 1024 float32 recursive_doubling - yes 2 ... 0
    # summary: ...
    0
"""

from __future__ import annotations

from .cli import main

__all__ = ["main"]
