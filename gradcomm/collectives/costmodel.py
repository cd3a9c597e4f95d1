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
r = p − q, k = log2 q, d = ceil(log2 p); ring and tree move chunks of c = 512 KiB, m of
them per segment):

================== =========================================================================
ring               2(p−1)·m·α + 2(p−1)/p·n·β + (p−1)/p·n·γ + (p−1)·m·δ,  m = ceil(n/p / c)
recursive_doubling k·(α + nβ + nγ + δ) + F,  F = [r > 0]·(2(α + nβ) + nγ + δ) (the fold)
rabenseifner       2k·α + 2(q−1)/q·n·β + (q−1)/q·n·γ + k·δ + F
tree               2d·m·α + 2d·n·β + d·n·γ + d·m·δ,  m = ceil(n / c)
native             measured: interpolated linearly between the calibrated sizes
================== =========================================================================

β in each term is :meth:`Profile.beta_at` the size of that algorithm's messages (n/p and
at most c for ring, n for recursive doubling, n/2 for Rabenseifner, at most c for tree):
the fitted β, or more where the calibrated exchanges of that size took longer per byte.

Example:
    >>> prof = Profile("threads", 4, alpha=1e-5, beta=1e-9, gamma={"float32": 5e-10})
    >>> round(prof.predict("recursive_doubling", 1024, 4) * 1e6, 2)
    23.07
    >>> prof.best(["ring", "recursive_doubling"], 1024, 4)
    'recursive_doubling'
    >>> Profile.from_json(prof.to_json()).digest() == prof.digest()
    True
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

    def predict(self, algorithm: str, nbytes: int, p: int, dtype: str = "float32") -> float:
        """Modelled seconds of the algorithm itself (see the module table); ``inf`` for
        ``native`` without measurements."""
        n = float(nbytes)
        if p <= 1 or nbytes <= 0:
            return 0.0
        a = self.alpha_by_algorithm.get(algorithm, self.alpha)
        g, dl, bt = self.gamma_of(dtype), self.delta, self.beta_at
        q = 1 << (p.bit_length() - 1)
        k = q.bit_length() - 1
        fold = 2 * (a + n * bt(n)) + n * g + dl if p != q else 0.0
        if algorithm == "ring":
            m = max(1, math.ceil(n / p / CHUNK_BYTES))
            return (2 * (p - 1) * m * a + 2 * (p - 1) / p * n * bt(min(n / p, CHUNK_BYTES))
                    + (p - 1) / p * n * g + (p - 1) * m * dl)
        if algorithm == "recursive_doubling":
            return k * (a + n * bt(n) + n * g + dl) + fold
        if algorithm == "rabenseifner":
            return (2 * k * a + 2 * (q - 1) / q * n * bt(n / 2) + (q - 1) / q * n * g + k * dl
                    + fold)
        if algorithm == "tree":
            d = (p - 1).bit_length()
            m = max(1, math.ceil(n / CHUNK_BYTES))
            return (2 * d * m * a + 2 * d * n * bt(min(n, CHUNK_BYTES)) + d * n * g
                    + d * m * dl)
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
                  check: bool = True) -> float:
        """Modelled seconds of a whole ``gradcomm.allreduce`` call (fixed overhead, the
        check if any, the input copy, the algorithm)."""
        return (self.overhead + (self.check if check and p > 1 else 0.0) + self.copy * nbytes
                + self.predict(algorithm, nbytes, p, dtype))

    def best(self, candidates: Iterable[str], nbytes: int, p: int,
             dtype: str = "float32") -> str:
        """The candidate with the lowest modelled time (the first listed on a tie)."""
        out, low = None, math.inf
        for name in candidates:
            t = self.predict(name, nbytes, p, dtype)
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
