"""The α-β-γ cost model behind ``algorithm="auto"``, and the measured profile it reads.

A :class:`Profile` holds what ``python -m gradcomm.bench --calibrate`` measured for one
transport and rank count: α (seconds per message: one point-to-point exchange of a few
bytes through the transport; per algorithm, where measured, the cost per step of the
algorithm itself on a tiny message, which includes its own software overhead), β (seconds per byte of an exchange, sending and receiving
at once), γ (seconds per byte reduced, per dtype) and δ (the fixed cost of one reduction
call), plus the library's own allreduce measured at several sizes (``native``), the fixed
cost of a ``gradcomm.allreduce`` call and of its argument check, the input copy per byte,
and codec encode/decode seconds per byte.

Modelled time of one allreduce of ``n`` bytes on ``p`` ranks (q = 2^floor(log2 p),
r = p − q, k = log2 q, d = ceil(log2 p); ring and tree move messages of c bytes, m of
them per segment, and wait out a message's latency once per w − 1 of them, w the
receives they keep posted):

================== =========================================================================
ring               2(p−1)·l·α + 2(p−1)/p·n·β + (p−1)/p·n·γ + (p−1)·m·δ,  m = ceil(n/p / c),
                   l = ceil(m / (w − 1))
recursive_doubling k·(α + nβ + nγ + δ) + F,  F = [r > 0]·(2(α + nβ) + nγ + δ) (the fold)
rabenseifner       2k·α + 2(q−1)/q·n·β + (q−1)/q·n·γ + k·δ + F
tree               2d·m·α + 2d·n·β + d·n·γ + d·m·δ,  m = ceil(n / c) (double buffered)
native             measured: interpolated linearly between the calibrated sizes
================== =========================================================================

β in each term is :meth:`Profile.beta_at` the size of that algorithm's messages (n/p and
at most c for ring, n for recursive doubling, n/2 for Rabenseifner, at most c for tree):
the fitted β, or more where the calibrated exchanges of that size took longer per byte.
c and w are the transport's (``transport=``: its :meth:`~gradcomm.comm.Transport.chunk_bytes`
of the segment, and w = 1 + max(1, window_bytes // c) as the ring posts them, from the
class's ``window_bytes`` so that every rank models the same); without one, c =
:data:`CHUNK_BYTES` and w = 2 (double buffering), the pipeline the profiles were first
calibrated with.

**Compressed routes** (:func:`route_times`, behind a compressed ``algorithm="auto"``):
``T = α·messages + β·bytes sent + e·elements encoded + g·elements decoded`` per rank,
for n elements, c = ``max_nbytes`` of the whole buffer, p ranks (q, k as above,
m = ceil(c/p / chunk) chunks per segment):

======================  ==============  ============  ========  ========================
route                   messages        bytes sent    encoded   decoded
======================  ==============  ============  ========  ========================
ring (per hop)          2(p−1)·m        2(p−1)/p·c    n         (2p−1)/p·n
rabenseifner (per hop)  2k (+2 fold)    2(q−1)/q·c    n         (2q−1)/q·n
recursive doubling      k (+2 fold)     k·c           (k+1)·n   (2k+1)·n
tree (per hop)          2·log2(p)·m     2·log2(p)·c   n         2n
allgather               p−1 (Bruck:     (p−1)·c       n         p·n
                        ceil(log2 p))
sparse_allgather        p (Bruck: +1)   (p−1)·c       n         n (zero fill; scatter k·p)
======================  ==============  ============  ========  ========================

allgather with a codec ``piece_quantum`` (``quantum=``) is also modelled as the one-thread
pipeline of :mod:`~gradcomm.compressed.pipeline`: K pieces cost max(codec, wire) +
(codec + wire)/K + K·((p−1)·α + :data:`PIECE_S`), taken (:func:`gather_pieces`) only
below :data:`PIECE_GAIN` of the one-shot codec + wire; ``compressed/auto.py`` still
compares the routes one-shot (the pipeline only decides how allgather runs).

α, β and the copy speed come from a profile if there is one, else the defaults
:data:`ALPHA`, :data:`BETA`, :data:`COPY_S` (hand-set, not measured); e and g are the
default :data:`CODEC_COST` (in copies of one element; a profile's measured codec speeds
replace them); :data:`WIRE_ALPHA` is a default either way.

Example:
    >>> prof = Profile("threads", 4, alpha=1e-5, beta=1e-9, gamma={"float32": 5e-10})
    >>> round(prof.predict("recursive_doubling", 1024, 4) * 1e6, 2)
    23.07
    >>> prof.best(["ring", "recursive_doubling"], 1024, 4)
    'recursive_doubling'
    >>> Profile.from_json(prof.to_json()).digest() == prof.digest()
    True
    >>> t = route_times(4, 10**6, 10**6, 4, "int8", "rabenseifner", gathered=True)
    >>> min(t, key=t.get)
    'rabenseifner'
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .._dtypes import STORAGE
from ..errors import ConfigError

SCHEMA = 1
#: the pipeline chunk of ring and tree (their CHUNK_BYTES)
CHUNK_BYTES = 512 * 1024
#: algorithms the model has formulas for
MODELLED = ("ring", "tree", "recursive_doubling", "rabenseifner", "native")
#: environment variable naming the profile file ("none" for no profile)
PROFILE_ENV = "GRADCOMM_PROFILE"
_MAX_POINTS = 64
_MAX_CODECS = 64
_MAX_BYTES = 1 << 20          # a profile file larger than this is not one


def _interpolate(pts: list[list[float]], x: float) -> float:
    """Piecewise-linear through ``pts`` (sorted [x, y]); flat below, last slope above."""
    if len(pts) == 1 or x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))


def default_path(transport: str, ranks: int) -> str:
    """``$XDG_CACHE_HOME/gradcomm/profile-<transport>-<ranks>.json`` (~/.cache by default).

    Example:
        >>> default_path("mpi", 2).endswith("gradcomm/profile-mpi-2.json")
        True
    """
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "gradcomm", f"profile-{transport}-{ranks}.json")


def pipeline(transport: Any, segment_bytes: int) -> tuple[int, int]:
    """(message bytes c, receives posted w) of a pipelined dense collective whose
    segments hold ``segment_bytes`` on ``transport`` (None: :data:`CHUNK_BYTES`, 2).

    Example:
        >>> pipeline(None, 50 << 20)
        (524288, 2)
        >>> from gradcomm.comm import run_ranks
        >>> run_ranks(1, lambda t: pipeline(t, 50 << 20))[0]    # in-process: 512 KiB, 2
        (524288, 2)
    """
    if transport is None:
        return CHUNK_BYTES, 2
    c = max(1, int(transport.chunk_bytes(int(segment_bytes))))
    return c, 1 + max(1, int(type(transport).window_bytes) // c)


@dataclass
class Profile:
    """Measured costs of one transport at one rank count (seconds, bytes)."""

    transport: str
    ranks: int
    alpha: float
    beta: float
    gamma: dict[str, float]
    delta: float = 0.0
    native: list[list[float]] = field(default_factory=list)   # [[bytes, seconds], ...]
    overhead: float = 0.0      # one gradcomm.allreduce call outside the algorithm, no check
    check: float = 0.0         # the argument check
    copy: float = 0.0          # the input copy, per byte
    codecs: dict[str, dict[str, float]] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    #: α of each algorithm where measured (its software cost per step differs: the ring's
    #: pipeline bookkeeping, the tree's job list...); ``alpha`` for the others
    alpha_by_algorithm: dict[str, float] = field(default_factory=dict)
    #: the exchanges α and β were fitted to, [[bytes, seconds], ...]: where given, β for
    #: a message of m bytes is never below what they show around m (caches: a fitted line
    #: underestimates the time of messages that no longer fit in them)
    exchange: list[list[float]] = field(default_factory=list)

    def __post_init__(self) -> None:        # one canonical form: floats, sorted points
        for k in ("alpha", "beta", "delta", "overhead", "check", "copy"):
            setattr(self, k, float(getattr(self, k)))
        self.gamma = {k: float(v) for k, v in self.gamma.items()}
        self.alpha_by_algorithm = {k: float(v) for k, v in self.alpha_by_algorithm.items()}
        self.native = sorted([float(b), float(s)] for b, s in self.native)
        self.exchange = sorted([float(b), float(s)] for b, s in self.exchange)
        self.codecs = {k: {kk: float(vv) for kk, vv in v.items()}
                       for k, v in self.codecs.items()}

    # -- the model ---------------------------------------------------------------------
    def gamma_of(self, dtype: str) -> float:
        """γ of ``dtype`` (float32's if it was not measured)."""
        g = self.gamma.get(dtype)
        return self.gamma.get("float32", 0.0) if g is None else g

    def predict(self, algorithm: str, nbytes: int, p: int, dtype: str = "float32", *,
                transport: Any = None) -> float:
        """Modelled seconds of the algorithm itself (see the module table); ``inf`` for
        ``native`` without measurements. ``transport``: whose pipeline ring and tree
        use (message size and receive window; None: 512 KiB, double buffering)."""
        n = float(nbytes)
        if p <= 1 or nbytes <= 0:
            return 0.0
        a = self.alpha_by_algorithm.get(algorithm, self.alpha)
        g, dl, bt = self.gamma_of(dtype), self.delta, self.beta_at
        q = 1 << (p.bit_length() - 1)
        k = q.bit_length() - 1
        fold = 2 * (a + n * bt(n)) + n * g + dl if p != q else 0.0
        if algorithm == "ring":
            c, w = pipeline(transport, math.ceil(n / p))
            m = max(1, math.ceil(n / p / c))
            rounds = math.ceil(m / (w - 1))
            return (2 * (p - 1) * rounds * a + 2 * (p - 1) / p * n * bt(min(n / p, c))
                    + (p - 1) / p * n * g + (p - 1) * m * dl)
        if algorithm == "recursive_doubling":
            return k * (a + n * bt(n) + n * g + dl) + fold
        if algorithm == "rabenseifner":
            return (2 * k * a + 2 * (q - 1) / q * n * bt(n / 2) + (q - 1) / q * n * g + k * dl
                    + fold)
        if algorithm == "tree":
            d = (p - 1).bit_length()
            c, _ = pipeline(transport, nbytes)
            m = max(1, math.ceil(n / c))
            return (2 * d * m * a + 2 * d * n * bt(min(n, c)) + d * n * g + d * m * dl)
        if algorithm == "native":
            return _interpolate(self.native, n) if self.native else math.inf
        raise ConfigError(f"no cost model for algorithm {algorithm!r}; known: "
                          f"{', '.join(MODELLED)}")

    def beta_at(self, m: float) -> float:
        """β for messages of ``m`` bytes: the fitted β, or more where the measured
        exchanges around ``m`` took longer per byte (above the smallest one's time)."""
        pts = self.exchange
        if len(pts) < 2 or m <= pts[0][0]:
            return self.beta
        return max(self.beta, (_interpolate(pts, m) - pts[0][1]) / m)

    def call_time(self, algorithm: str, nbytes: int, p: int, dtype: str = "float32",
                  check: bool = True, *, transport: Any = None) -> float:
        """Modelled seconds of a whole ``gradcomm.allreduce`` call (fixed overhead, the
        check if any, the input copy, the algorithm)."""
        return (self.overhead + (self.check if check and p > 1 else 0.0) + self.copy * nbytes
                + self.predict(algorithm, nbytes, p, dtype, transport=transport))

    def best(self, candidates: Iterable[str], nbytes: int, p: int,
             dtype: str = "float32", *, transport: Any = None) -> str:
        """The candidate with the lowest modelled time (the first listed on a tie)."""
        out, low = None, math.inf
        for name in candidates:
            t = self.predict(name, nbytes, p, dtype, transport=transport)
            if out is None or t < low:
                out, low = name, t
        if out is None:
            raise ConfigError("no candidate algorithm to choose from")
        return out

    # -- files -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = SCHEMA
        return d

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): equal profiles give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def digest(self) -> int:
        """A 62-bit fingerprint of :meth:`to_json` (never 0, which stands for "none")."""
        h = int.from_bytes(hashlib.sha256(self.to_json().encode()).digest()[:8], "little")
        return (h >> 2) or 1

    @classmethod
    def from_dict(cls, d: Any, where: str = "profile") -> Profile:
        """Validate and build; ConfigError naming what is wrong."""
        def bad(what: str) -> ConfigError:
            return ConfigError(f"{where}: not a gradcomm profile ({what})")

        if not isinstance(d, dict):
            raise bad("not a JSON object")
        if d.get("schema") != SCHEMA:
            raise bad(f"schema {d.get('schema')!r}, expected {SCHEMA}")

        def num(key: str, value: Any = None) -> float:
            v = d.get(key) if value is None else value
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise bad(f"{key} must be a finite number >= 0, got {v!r}")
            return float(v)

        transport, ranks = d.get("transport"), d.get("ranks")
        if not isinstance(transport, str) or not transport or len(transport) > 64:
            raise bad(f"transport {transport!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= 1 << 24:
            raise bad(f"ranks {ranks!r}")
        gamma = d.get("gamma")
        if not isinstance(gamma, dict) or not gamma or any(k not in STORAGE for k in gamma):
            raise bad(f"gamma must map dtypes ({', '.join(STORAGE)}) to s/byte")
        def points(key: str) -> list[list[float]]:
            raw = d.get(key, [])
            if not isinstance(raw, list) or len(raw) > _MAX_POINTS:
                raise bad(f"{key} must be a list of at most {_MAX_POINTS} [bytes, seconds]")
            pts = []
            for pt in raw:
                if not isinstance(pt, list) or len(pt) != 2:
                    raise bad(f"{key} point {pt!r}")
                pts.append([num(f"{key} bytes", pt[0]), num(f"{key} seconds", pt[1])])
            pts.sort()
            if any(x1 <= x0 for (x0, _), (x1, _) in zip(pts, pts[1:])):
                raise bad(f"{key} sizes must differ")
            return pts

        pts, exchange = points("native"), points("exchange")
        codecs = d.get("codecs", {})
        if not isinstance(codecs, dict) or len(codecs) > _MAX_CODECS or not all(
                isinstance(k, str) and isinstance(v, dict) for k, v in codecs.items()):
            raise bad("codecs must map codec specs to {'encode': s/B, 'decode': s/B}")
        info = d.get("info", {})
        if not isinstance(info, dict):
            raise bad("info must be an object")
        per_alg = d.get("alpha_by_algorithm", {})
        if not isinstance(per_alg, dict) or any(k not in MODELLED for k in per_alg):
            raise bad(f"alpha_by_algorithm must map algorithms ({', '.join(MODELLED)}) to s")
        return cls(transport, ranks, num("alpha"), num("beta"),
                   {k: num(f"gamma[{k}]", v) for k, v in gamma.items()},
                   num("delta", d.get("delta", 0.0)), pts,
                   num("overhead", d.get("overhead", 0.0)), num("check", d.get("check", 0.0)),
                   num("copy", d.get("copy", 0.0)),
                   {k: {kk: num(f"codecs[{k}].{kk}", vv) for kk, vv in v.items()}
                    for k, v in codecs.items()}, info,
                   {k: num(f"alpha_by_algorithm[{k}]", v) for k, v in per_alg.items()},
                   exchange)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = "profile") -> Profile:
        if len(text) > _MAX_BYTES:
            raise ConfigError(f"{where}: not a gradcomm profile (over {_MAX_BYTES} bytes)")
        try:
            d = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{where}: not a gradcomm profile (invalid JSON: {exc})") from None
        return cls.from_dict(d, where)

    def save(self, path: str) -> str:
        """Write the profile (JSON) to ``path``, creating its directory; returns ``path``."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: str) -> Profile:
        """Read and validate a profile file (ConfigError if it is not one)."""
        try:
            with open(path, "rb") as f:
                text = f.read(_MAX_BYTES + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc}") from None
        return cls.from_json(text, path)


# -- compressed routes --------------------------------------------------------------------
# Route-model **defaults**: hand-set constants, not measurements of this machine. They
# steer a compressed ``algorithm="auto"``'s route choice wherever no calibrated profile
# says otherwise (a profile's α, β, copy speed and codec speeds replace ALPHA, BETA, COPY_S
# and CODEC_COST; WIRE_ALPHA is always this default). ``python -m gradcomm.bench
# --calibrate`` prints which of them its profile replaces and which stay defaults.
#: default (encode, decode) cost per element, in float32 element copies, of each codec's
#: kernels (rough figures read off ``python -m gradcomm.bench --codecs``; not re-measured
#: per machine)
CODEC_COST: dict[str, tuple[float, float]] = {
    "none": (0.5, 0.5), "fp16": (0.6, 0.6), "bf16": (0.6, 0.6), "int8": (2.4, 1.3),
    "qsgd": (1.7, 0.75), "terngrad": (1.5, 0.8), "onebit": (1.2, 0.65),
    "topk": (2.6, 0.75), "randomk": (2.1, 2.1)}
#: default cost of a codec with no entry above (copies per element)
DEFAULT_COST = (2.0, 1.0)
#: default seconds per compressed message without a profile (transport, framing, parsing)
ALPHA = 60e-6
#: default cost of a compressed message beyond a profile's α (framing, parsing, Python);
#: not calibrated: added to the profile's α
WIRE_ALPHA = 40e-6
#: default seconds per byte sent without a profile (between shared memory and 10 Gbit/s)
BETA = 0.5e-9
#: default seconds per byte of a memory copy without a profile
COPY_S = 0.1e-9
#: target bytes of one compressed message of the per-hop ring and tree (the default of
#: :func:`route_times`' ``chunk_bytes``)
COMPRESSED_CHUNK_BYTES = 2 << 20
#: default cost of one piece of the pipelined gathered route beyond its messages' α
#: (Python, the frame, the tests that progress the transport); not calibrated
PIECE_S = 100e-6
#: the pipelined gathered route's smallest piece, in elements, and most pieces
MIN_PIECE, MAX_PIECES = 1 << 16, 64
#: the pipeline is taken only when modelled at most this fraction of the one-shot time
PIECE_GAIN = 0.9


def gather_pieces(p: int, n: int, quantum: int, alpha: float, coding: float,
                  wire: float) -> tuple[int, float]:
    """(pieces, seconds) of the gathered route cut into pipelined pieces (one thread:
    the codec's ``coding`` seconds overlap the ``wire``'s; each piece pays (p − 1)
    messages' ``alpha`` and :data:`PIECE_S`): the fewest modelled seconds among 2, 4, ...
    :data:`MAX_PIECES` pieces of at least :data:`MIN_PIECE` elements (multiples of
    ``quantum``), or (1, coding + wire) when none is below :data:`PIECE_GAIN` of that.

    Example:
        >>> gather_pieces(2, 25 * 10**6, 2048, 1e-4, 0.056, 0.026)[0]
        16
        >>> gather_pieces(2, 25 * 10**6, 0, 1e-4, 0.056, 0.026)[0]
        1
    """
    best = (1, coding + wire)
    k = 2
    while quantum > 0 and k <= MAX_PIECES and n // k >= max(MIN_PIECE, quantum):
        s = max(coding, wire) + (coding + wire) / k + k * ((p - 1) * alpha + PIECE_S)
        if s < best[1] and s <= PIECE_GAIN * (coding + wire):
            best = (k, s)
        k *= 2
    return best


def route_times(p: int, n: int, c: int, itemsize: int, codec: str, per_hop: str,
                profile: Any = None, *, gathered: bool, sparse: bool = False,
                chunk_bytes: int = COMPRESSED_CHUNK_BYTES, quantum: int = 0,
                pieces: dict[str, int] | None = None) -> dict[str, float]:
    """Modelled seconds of each candidate route of a compressed allreduce (the module
    docstring's second table) through codec ``codec`` (its name): the per-hop route
    ``per_hop``, and for ``gathered`` codecs (not summable) also ``allgather``, or
    ``sparse_allgather`` for ``sparse`` ones. ``profile``: a :class:`Profile` or None
    (the defaults). ``quantum``: the codec's ``piece_quantum``; with one, allgather is
    modelled pipelined where that pays (:func:`gather_pieces`) and ``pieces`` (if given)
    receives its number of pieces under "allgather"."""
    a, b, copy = ALPHA, BETA, COPY_S
    if profile is not None:
        a, b, copy = profile.alpha + WIRE_ALPHA, profile.beta, profile.copy or COPY_S
    e, g = (x * copy * itemsize for x in CODEC_COST.get(codec, DEFAULT_COST))
    measured = profile.codecs if profile is not None else {}
    for spec in sorted(measured):                 # s per float32 byte, measured
        if spec == codec or spec.startswith(codec + ":"):
            e = measured[spec].get("encode", e / itemsize) * itemsize
            g = measured[spec].get("decode", g / itemsize) * itemsize
            break
    q = 1 << (p.bit_length() - 1)
    k = q.bit_length() - 1
    fold = 0 if p == q else 1
    m = max(1, -(-c // p // chunk_bytes))
    logp = (p - 1).bit_length()
    # (messages, bytes, encoded elements, decoded elements)
    shapes = {
        "ring": (2 * (p - 1) * m, 2 * (p - 1) / p * c, n, (2 * p - 1) / p * n),
        "rabenseifner": (2 * k + 2 * fold, 2 * (q - 1) / q * c + fold * c, n + fold * n,
                         (2 * q - 1) / q * n + fold * 2 * n),
        "recursive_doubling": (k + 2 * fold, k * c + fold * c, (k + 1 + fold) * n,
                               (2 * k + 1 + 2 * fold) * n),
        "tree": (2 * logp * m, 2 * logp * c, n, 2 * n),
    }
    gather_msgs = logp if p * c < 64 * 1024 else p - 1
    out = {per_hop: shapes[per_hop] if per_hop in shapes else shapes["ring"]}
    extra = {}
    if gathered:
        if sparse:
            out["sparse_allgather"] = (gather_msgs + 1, (p - 1) * c, n, 0.0)
            extra["sparse_allgather"] = copy * itemsize * n      # the zero fill
        else:
            out["allgather"] = (gather_msgs, (p - 1) * c, n, p * n)
    times = {name: a * msgs + b * nbytes + e * enc + g * dec + extra.get(name, 0.0)
             for name, (msgs, nbytes, enc, dec) in out.items()}
    if "allgather" in times:
        msgs, nbytes, enc, dec = out["allgather"]
        k, times["allgather"] = gather_pieces(p, n, quantum, a, e * enc + g * dec,
                                              a * msgs + b * nbytes)
        if pieces is not None:
            pieces["allgather"] = k
    return times


class _NoLink:
    """A profile's codec and copy speeds with free messages and bytes."""

    def __init__(self, prof: Profile) -> None:
        self.alpha, self.beta = -WIRE_ALPHA, 0.0
        self.copy, self.codecs = prof.copy, prof.codecs


def link_bound(profile: Profile, p: int, n: int, c: int, itemsize: int, codec: str, *,
               chunk_bytes: int = COMPRESSED_CHUNK_BYTES) -> bool:
    """Whether ``profile`` models a compressed ring's wire time (``c`` payload bytes of
    ``n`` elements) at more than twice its codec time (then keeping the link busy pays
    for a worker thread: :mod:`~gradcomm.compressed.ring`).

    Example:
        >>> slow = Profile("mpi", 2, alpha=1e-5, beta=1e-6, gamma={"float32": 1e-10})
        >>> link_bound(slow, 2, 10**6, 2 * 10**6, 4, "fp16")
        True
    """
    coding = route_times(p, n, c, itemsize, codec, "ring", _NoLink(profile),
                         gathered=False, chunk_bytes=chunk_bytes)["ring"]
    return profile.beta * 2 * (p - 1) / p * c > 2 * coding
