"""Emulated networks: each rank in its own Linux network namespace, links capped by tbf.

Linux and root only. ``Network(np, rate)`` creates, under a unique name prefix:

* ``np`` rank namespaces ``gradcomm-<id>-r<i>``, each with loopback and one interface
  ``gcnet0`` holding the address ``10.213.0.<i+1>/24``. The addresses exist only inside
  these namespaces: nothing is routed to or from the host or any outside network.
* 2 ranks (topology ``direct``): one veth pair, ``gcnet0`` in r0 <-> ``gcnet0`` in r1.
  More ranks (topology ``switch``): a namespace ``gradcomm-<id>-sw`` holding a bridge; each
  rank's ``gcnet0`` is a veth whose peer ``p<i>`` is a bridge port (a switch port).
* A ``tbf`` qdisc on BOTH ends of every veth: each rank's NIC is capped at ``rate`` per
  direction (full duplex), like a port on a switch of that speed. See :func:`tbf_params`
  for how burst and queue limit are sized.

Everything is removed on exit (``with`` block / ``down()``, atexit and SIGINT/SIGTERM/SIGHUP
handlers); ``python bench/netns.py --cleanup`` removes leftovers of crashed runs by prefix.

Command line::

    python bench/netns.py --rate 1gbit --np 2 --check                 # verify the cap
    python bench/netns.py --rate 1gbit --np 2 --launcher mpi -- python -m gradcomm.bench ...
    python bench/netns.py --rate 10gbit --np 2 --launcher gloo -- python bench/train.py ...
    python bench/netns.py --cleanup

``--launcher mpi`` runs ``mpirun`` (Open MPI 5) in MPMD form, one ``ip netns exec`` per rank,
with ``--mca pml ob1 --mca btl tcp,self`` (no shared memory, so nothing bypasses the link)
and ``btl_tcp_if_include 10.213.0.0/24``; MASTER_ADDR/MASTER_PORT/GLOO_SOCKET_IFNAME are
exported too, so an MPI job can open a gloo group over the same link. Open MPI 5's PMIx
reaches its ranks over TCP on 127.0.0.1 only, which a namespace cannot see:
:class:`LoopbackRelay` forwards 127.0.0.1:<pmix port> inside every rank namespace to the
host's loopback (loopback to loopback, nothing else). ``--launcher gloo`` starts the ranks itself with the
torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=10.213.0.1, MASTER_PORT)
and ``GLOO_SOCKET_IFNAME=gcnet0``.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

PREFIX = "gradcomm-"
IFNAME = "gcnet0"
SUBNET = "10.213.0"          # 10.213.0.0/24, created inside our namespaces only
CIDR = SUBNET + ".0/24"
IP = shutil.which("ip") or "/usr/sbin/ip"
TC = shutil.which("tc") or "/usr/sbin/tc"

_LIVE: list["Network"] = []  # networks that are up, for atexit / signal cleanup


# ---------------------------------------------------------------- rates and tbf sizing
_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9,
          "k": 10**3, "m": 10**6, "g": 10**9}


def parse_rate(text: str | int | float) -> int:
    """Bits per second from ``"1gbit"``, ``"100mbit"``, ``"10g"`` or a number.

    Example:
        >>> parse_rate("1gbit"), parse_rate("100mbit"), parse_rate(2.5e9)
        (1000000000, 100000000, 2500000000)
    """
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"rate must look like 1gbit, 100mbit or 10g; got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_rate(bps: float) -> str:
    """``1e9`` -> ``"1gbit"``; used in tc commands and messages."""
    for unit, f in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bps >= f and bps % f == 0:
            return f"{int(bps // f)}{unit}"
    return f"{int(bps)}bit"


def tbf_params(rate_bps: int) -> tuple[int, int]:
    """``(burst, limit)`` in bytes for a tbf at ``rate_bps``.

    burst (bucket size) = max(256 KiB, 2 ms of traffic):
      * at least one GSO/TSO super-packet (64 KiB) and then some: veth hands tbf 64 KiB
        segments, and a bucket smaller than a packet makes tbf split or drop it;
      * at least 2 ms at the rate: tbf refills the bucket from a timer; when the CPU wakes
        late (this kernel runs HZ=250, i.e. 4 ms ticks, and the box is busy) a smaller bucket
        overflows its refill, the link idles and measures BELOW the cap;
      * but not much more: a full bucket lets ``burst`` bytes pass at line speed, so a
        transfer of S bytes measures up to burst/S above the cap. At 1 Gbit/s burst is
        256 KiB (2 % of a 12.5 MB transfer); at 10 Gbit/s, 2.5 MB.
    limit (queue bytes) = max(8 MiB, 10 ms of traffic): TCP must never see a tail drop on
      the emulated link (a drop halves cwnd and the link measures below the cap); with the
      kernel's TCP small-queues budget (tcp_limit_output_bytes, 4 MiB here) a flow queues
      at most that much, so 8 MiB absorbs two flows per direction. Queueing delay when
      saturated: 8 MiB at 1 Gbit/s = 67 ms (like a deep-buffered switch); throughput, which
      is what these benchmarks measure, is unaffected.

    Example:
        >>> tbf_params(10**9)
        (262144, 8388608)
        >>> tbf_params(10 * 10**9)
        (2500000, 12500000)
    """
    per_ms = rate_bps / 8 / 1000
    burst = max(256 * 1024, int(2 * per_ms))
    limit = max(8 * 1024 * 1024, int(10 * per_ms))
    return burst, limit


# ---------------------------------------------------------------- shell helpers
def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    if not os.path.exists(IP) or not os.path.exists(TC):
        return "iproute2 (ip, tc) is not installed"
    if _run(IP, "netns", "list", check=False).returncode != 0:
        return "`ip netns` does not work here"
    return None


def list_namespaces(prefix: str = PREFIX) -> list[str]:
    """Our namespaces (by name prefix) that exist now."""
    out = _run(IP, "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.strip() and line.split()[0].startswith(prefix)]


def _kill_pids_in(ns: str) -> None:
    """Kill the processes still inside namespace ``ns`` (they are ours: we made it)."""
    pids = [int(p) for p in _run(IP, "netns", "pids", ns, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = []
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(_exists(p) for p in alive):
            time.sleep(0.05)
        pids = [p for p in alive if _exists(p)]


def _exists(pid: int) -> bool:
    """Running (a zombie counts as gone; we never reap here, so Popen keeps its status)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def cleanup(prefix: str = PREFIX) -> list[str]:
    """Remove every namespace whose name starts with ``prefix``, with the processes and
    links inside it; returns the namespaces removed. (Links are only ever created inside
    our namespaces, so deleting those removes every veth and bridge we made.)"""
    removed = []
    for ns in list_namespaces(prefix):
        _kill_pids_in(ns)
        _run(IP, "netns", "del", ns, check=False)
        removed.append(ns)
    return removed


# ---------------------------------------------------------------- the network
@dataclass
class Network:
    """``np`` ranks, each in its own namespace, every link capped at ``rate``.

    Use as a context manager; it always removes what it created.

    Example (needs root; skipped by doctest):
        >>> with Network(2, "1gbit") as net:          # doctest: +SKIP
        ...     subprocess.run(net.exec_prefix(0) + ["python", "-c", "print(1)"])
    """

    np: int
    rate: str | int = "1gbit"
    topology: str = "auto"          # "direct" (2 ranks only), "switch" or "auto"
    tag: str = field(default_factory=lambda: secrets.token_hex(3))
    rate_bps: int = field(init=False)
    created: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.np < 2:
            raise ValueError(f"np must be >= 2; got {self.np}")
        if self.np > 250:
            raise ValueError(f"np must be <= 250 (one /24); got {self.np}")
        self.rate_bps = parse_rate(self.rate)
        if self.topology == "auto":
            self.topology = "direct" if self.np == 2 else "switch"
        if self.topology not in ("direct", "switch"):
            raise ValueError(f"topology must be direct, switch or auto; got {self.topology!r}")
        if self.topology == "direct" and self.np != 2:
            raise ValueError(f"topology 'direct' joins exactly 2 ranks; got np={self.np}")
        if not re.fullmatch(r"[0-9a-z]{1,12}", self.tag):
            raise ValueError(f"tag must be 1-12 lowercase letters/digits; got {self.tag!r}")

    # names -------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return f"{PREFIX}{self.tag}-"

    def ns(self, rank: int) -> str:
        return f"{self.prefix}r{rank}"

    @property
    def switch_ns(self) -> str:
        return f"{self.prefix}sw"

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_prefix(self, rank: int) -> list[str]:
        """Command prefix that runs a program inside rank ``rank``'s namespace."""
        return [IP, "netns", "exec", self.ns(rank)]

    # lifecycle ---------------------------------------------------------
    def up(self) -> "Network":
        why = available()
        if why:
            raise RuntimeError(why)
        _install_handlers()
        _LIVE.append(self)
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _run(IP, "netns", "add", name)
        self.created.append(name)
        _run(IP, "-n", name, "link", "set", "lo", "up")

    def _tbf(self, ns: str, dev: str) -> None:
        burst, limit = tbf_params(self.rate_bps)
        _run(TC, "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
             "rate", fmt_rate(self.rate_bps), "burst", str(burst), "limit", str(limit))

    def _build(self) -> None:
        for r in range(self.np):
            self._add_ns(self.ns(r))
        if self.topology == "direct":
            a, b = self.ns(0), self.ns(1)
            # created directly inside the namespaces: nothing ever appears in the root ns
            _run(IP, "-n", a, "link", "add", IFNAME, "type", "veth",
                 "peer", "name", IFNAME, "netns", b)
            ends = [(a, IFNAME), (b, IFNAME)]
        else:
            sw = self.switch_ns
            self._add_ns(sw)
            _run(IP, "-n", sw, "link", "add", "br0", "type", "bridge")
            _run(IP, "-n", sw, "link", "set", "br0", "up")
            ends = []
            for r in range(self.np):
                port = f"p{r}"
                _run(IP, "-n", sw, "link", "add", port, "type", "veth",
                     "peer", "name", IFNAME, "netns", self.ns(r))
                _run(IP, "-n", sw, "link", "set", port, "master", "br0")
                _run(IP, "-n", sw, "link", "set", port, "up")
                ends += [(self.ns(r), IFNAME), (sw, port)]
        for r in range(self.np):
            _run(IP, "-n", self.ns(r), "addr", "add", f"{self.addr(r)}/24", "dev", IFNAME)
            _run(IP, "-n", self.ns(r), "link", "set", IFNAME, "up")
        for ns, dev in ends:
            self._tbf(ns, dev)

    def down(self) -> None:
        """Kill what runs inside our namespaces and delete them (idempotent)."""
        for ns in reversed(self.created):
            _kill_pids_in(ns)
            _run(IP, "netns", "del", ns, check=False)
        self.created.clear()
        if self in _LIVE:
            _LIVE.remove(self)

    def __enter__(self) -> "Network":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # introspection -----------------------------------------------------
    def qdiscs(self) -> str:
        """``tc qdisc show`` of every capped device, for logs."""
        out = []
        for ns in self.created:
            out.append(f"[{ns}] " + _run(TC, "-n", ns, "qdisc", "show").stdout.strip()
                       .replace("\n", f"\n[{ns}] "))
        return "\n".join(out)

    def describe(self) -> str:
        burst, limit = tbf_params(self.rate_bps)
        return (f"{self.np} ranks, {self.topology} topology, every NIC capped at "
                f"{fmt_rate(self.rate_bps)} per direction (tbf burst {burst} B, "
                f"limit {limit} B); namespaces {self.prefix}*")

    # launching ---------------------------------------------------------
    def rank_env(self, rank: int, port: int = 29500) -> dict[str, str]:
        """torchrun-style environment for rank ``rank`` (gloo over ``gcnet0``)."""
        return {"RANK": str(rank), "WORLD_SIZE": str(self.np), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(self.np), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                "MASTER_ADDR": self.addr(0), "MASTER_PORT": str(port),
                "GLOO_SOCKET_IFNAME": IFNAME, "TP_SOCKET_IFNAME": IFNAME,
                "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
                "GRADCOMM_NETNS": self.ns(rank), "GRADCOMM_NET_RATE": str(self.rate_bps),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def mpirun_argv(self, cmd: Sequence[str], mpirun: str | None = None,
                    extra: Sequence[str] = (), env: dict[str, str] | None = None) -> list[str]:
        """An Open MPI ``mpirun`` command, one MPMD block per rank, each wrapped in
        ``ip netns exec``; TCP only, on the emulated subnet only."""
        mpirun = mpirun or shutil.which("mpirun") or "mpirun"
        argv = [mpirun, "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
                "--mca", "btl_tcp_if_include", CIDR, "--bind-to", "none",
                "--oversubscribe"]
        env = os.environ if env is None else env
        for k in ("OMP_NUM_THREADS", "GRADCOMM_NET_RATE", "PYTHONPATH", "PATH"):
            if k in env:
                argv += ["-x", k]
        # so that an MPI job can also open a gloo group over the emulated link
        argv += ["-x", f"MASTER_ADDR={self.addr(0)}", "-x", f"MASTER_PORT={_free_port_hint()}",
                 "-x", f"GLOO_SOCKET_IFNAME={IFNAME}", "-x", "TORCH_CPP_LOG_LEVEL=ERROR"]
        argv += list(extra)
        for r in range(self.np):
            if r:
                argv.append(":")
            argv += ["-n", "1", "-x", f"GRADCOMM_NETNS={self.ns(r)}"] \
                + self.exec_prefix(r) + list(cmd)
        return argv

    def run(self, cmd: Sequence[str], launcher: str = "mpi", timeout: float | None = None,
            capture: bool = False, env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
        """Run ``cmd`` on every rank (``launcher`` "mpi" or "gloo"); returns the
        completed process(es); raises RuntimeError naming the failing rank."""
        cmd = _resolve(cmd)
        base = dict(os.environ)
        base.update(env or {})
        base.setdefault("OMP_NUM_THREADS", "1")
        base["GRADCOMM_NET_RATE"] = str(self.rate_bps)
        if launcher == "mpi":
            base.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            base.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            port = free_loopback_port()
            relay = LoopbackRelay([self.ns(r) for r in range(self.np)], port)
            try:
                argv = self.mpirun_argv(cmd, env=base,
                                        extra=["--pmixmca", "ptl_base_ipv4_port", str(port)])
                return _wait_all([_spawn(argv, base, capture)], timeout)
            finally:
                relay.close()
        elif launcher == "gloo":
            port = _free_port_hint()
            procs = [_spawn(self.exec_prefix(r) + list(cmd), {**base, **self.rank_env(r, port)},
                            capture) for r in range(self.np)]
        else:
            raise ValueError(f"launcher must be 'mpi' or 'gloo'; got {launcher!r}")
        return _wait_all(procs, timeout)


def _resolve(cmd: Sequence[str]) -> list[str]:
    cmd = list(cmd)
    if not cmd:
        raise ValueError("no command given (put it after --)")
    if cmd[0] in ("python", "python3"):
        cmd[0] = sys.executable
    elif not os.path.isabs(cmd[0]) and shutil.which(cmd[0]):
        cmd[0] = shutil.which(cmd[0]) or cmd[0]
    return cmd


def _free_port_hint() -> int:
    # namespaces are fresh, so any port is free there; vary it so TIME_WAIT never bites
    return 29500 + secrets.randbelow(20000)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the harness dies, even by SIGKILL."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _spawn(argv: list[str], env: dict[str, str], capture: bool) -> subprocess.Popen:
    out = subprocess.PIPE if capture else None
    return subprocess.Popen(argv, env=env, stdout=out, stderr=out, text=True,
                            start_new_session=True, preexec_fn=_die_with_parent)


def _wait_all(procs: list[subprocess.Popen], timeout: float | None) -> list[subprocess.CompletedProcess]:
    deadline = None if timeout is None else time.monotonic() + timeout
    results: list[subprocess.CompletedProcess | None] = [None] * len(procs)
    try:
        while any(r is None for r in results):
            for i, p in enumerate(procs):
                if results[i] is None and p.poll() is not None:
                    out, err = p.communicate()
                    results[i] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
                    if p.returncode != 0:  # one rank failed: the others would hang
                        raise RuntimeError(f"rank {i} exited with {p.returncode}: "
                                           f"{(err or '')[-2000:]}")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running after {timeout} s")
            time.sleep(0.02)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_group(p)
    return [r for r in results if r is not None]


def _kill_group(p: subprocess.Popen) -> None:
    """Stop child ``p`` and its process group (we started it with a new session)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


# ---------------------------------------------------------------- PMIx loopback relay
CLONE_NEWNET = 0x40000000


def socket_in_namespace(ns: str, family: int = socket.AF_INET) -> socket.socket:
    """A TCP socket that lives in namespace ``ns`` (a socket keeps the namespace it was
    created in). A helper thread enters ``ns`` with setns(2), so the caller never moves."""
    import ctypes
    import threading

    box: list = []

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            with open(f"/var/run/netns/{ns}") as f:
                if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {ns} failed")
            box.append(socket.socket(family, socket.SOCK_STREAM))
        except BaseException as e:   # reported in the caller
            box.append(e)
        # this thread ends here, still inside ns: nothing else runs on it

    th = threading.Thread(target=make, daemon=True)
    th.start()
    th.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


class LoopbackRelay:
    """Forwards ``127.0.0.1:port`` inside each rank namespace to ``127.0.0.1:port`` of
    this (root) namespace, for PMIx.

    Open MPI 5's PMIx talks to its ranks over TCP on 127.0.0.1 only (PMIx 4+ has no unix
    socket transport), and a fresh namespace has its own loopback: without this a rank in
    a namespace cannot reach mpirun. The relay only ever connects loopback to loopback;
    ranks' MPI data still goes over the capped veth (``btl_tcp_if_include``).
    """

    def __init__(self, namespaces: Sequence[str], port: int) -> None:
        import threading

        self.port = port
        self.listeners = []
        for ns in namespaces:
            s = socket_in_namespace(ns)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", port))
            s.listen(64)
            self.listeners.append(s)
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        for s in self.listeners:
            threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, lst: socket.socket) -> None:
        import threading

        while True:
            try:
                inner, _ = lst.accept()
                outer = socket.create_connection(("127.0.0.1", self.port), timeout=10)
                outer.settimeout(None)
            except OSError:
                return       # closed
            with self._lock:
                if self._closed:
                    inner.close()
                    outer.close()
                    return
                self._socks += [inner, outer]
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        buf = bytearray(1 << 16)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(memoryview(buf)[:n])
        except OSError:
            pass
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            socks, self._socks = self._socks, []
        for s in self.listeners + socks:
            try:
                s.close()
            except OSError:
                pass


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 here (namespaces are fresh: free there too), drawn
    below the kernel's ephemeral range: between this check and PMIx's own bind, an
    outgoing connection (gloo's, pip's) could take an ephemeral one, and the launch then
    fails with "The PMIx server's listener thread failed to start" (seen once in CI).
    Falls back to an ephemeral port if none below is free."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(64):
        port = 10000 + secrets.randbelow(max(1, low - 10000))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- cleanup on exit/signals
_HANDLERS_SET = False


def _down_all() -> None:
    for net in list(_LIVE):
        net.down()


def _on_signal(signum: int, frame: object) -> None:
    _down_all()
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    """Remove our namespaces on SIGINT/SIGTERM/SIGHUP (then behave as the default would)
    and at exit. Handlers someone else installed are left alone."""
    global _HANDLERS_SET
    if _HANDLERS_SET:
        return
    atexit.register(_down_all)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        try:
            if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(sig, _on_signal)
        except ValueError:   # not the main thread: atexit and try/finally still apply
            pass
    _HANDLERS_SET = True


# ---------------------------------------------------------------- measuring the cap
CHUNK = 1 << 20


def _sink(port: int, nbytes: int) -> None:
    """Accept one connection, read ``nbytes``, answer one byte (runs inside a ns)."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("ready", flush=True)
    srv.settimeout(60)
    conn, _ = srv.accept()
    conn.settimeout(120)
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        n = conn.recv_into(view, min(CHUNK, nbytes - got))
        if n == 0:
            raise ConnectionError(f"peer closed after {got} of {nbytes} bytes")
        got += n
    conn.sendall(b"k")
    conn.close()
    srv.close()


def _source(host: str, port: int, nbytes: int) -> None:
    """Connect, send ``nbytes``, wait for the answer; prints seconds (runs inside a ns)."""
    buf = memoryview(bytearray(os.urandom(1024)) * (CHUNK // 1024))
    deadline = time.monotonic() + 30
    while True:
        try:
            s = socket.create_connection((host, port), timeout=5)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    s.settimeout(120)
    t0 = time.perf_counter()
    left = nbytes
    while left:
        n = min(CHUNK, left)
        s.sendall(buf[:n])
        left -= n
    if s.recv(1) != b"k":
        raise ConnectionError("sink did not acknowledge")
    dt = time.perf_counter() - t0
    s.close()
    print(json.dumps({"bytes": nbytes, "seconds": dt}), flush=True)


def default_nbytes(rate_bps: int, seconds: float = 1.0) -> int:
    """Transfer size for a check: ``seconds`` at the rate, at least 4 MB and at least
    50 tbf bursts (so a full bucket skews the measurement by <= 2 %).

    Example:
        >>> default_nbytes(10**8) // 10**6, default_nbytes(10**9) // 10**6
        (13, 125)
    """
    burst, _ = tbf_params(rate_bps)
    return max(4 * 10**6, 50 * burst, int(rate_bps / 8 * seconds))


def measure_link(net: Network, src: int, dst: int, nbytes: int, port: int = 5201) -> float:
    """Bits per second of one TCP transfer of ``nbytes`` from rank src to rank dst."""
    here = os.path.abspath(__file__)
    sink = subprocess.Popen(net.exec_prefix(dst) + [sys.executable, here, "_sink", str(port),
                                                    str(nbytes)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise RuntimeError(f"sink failed: {sink.communicate()[1]}")
        out = subprocess.run(net.exec_prefix(src) + [sys.executable, here, "_source",
                                                     net.addr(dst), str(port), str(nbytes)],
                             capture_output=True, text=True, timeout=180)
        if out.returncode:
            raise RuntimeError(f"source failed: {out.stderr}")
        sink.wait(timeout=30)
        res = json.loads(out.stdout.strip().splitlines()[-1])
        return res["bytes"] * 8 / res["seconds"]
    finally:
        if sink.poll() is None:
            _kill_group(sink)


_MPI_CHECK = r"""
import json, sys, time, numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD; r, p = comm.Get_rank(), comm.Get_size()
n, reps = int(sys.argv[1]), int(sys.argv[2]); buf = np.ones(n, np.uint8)
res = []
for src in [s for s in range(p) for _ in range(reps)]:
    dst = (src + 1) % p
    comm.Barrier()
    if r == src:
        t0 = time.perf_counter(); comm.Send(buf, dst, 7); comm.Recv(buf[:1], dst, 8)
        res.append((src, dst, n * 8 / (time.perf_counter() - t0)))
    elif r == dst:
        comm.Recv(buf, src, 7); comm.Send(buf[:1], src, 8)
res = comm.gather(res, 0)
if r == 0: print("RESULT " + json.dumps([x for part in res for x in part]), flush=True)
"""

_GLOO_CHECK = r"""
import json, os, sys, time, datetime, torch, torch.distributed as dist
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
r, p = dist.get_rank(), dist.get_world_size()
n, reps = int(sys.argv[1]), int(sys.argv[2])
buf = torch.ones(n, dtype=torch.uint8); ack = torch.zeros(1, dtype=torch.uint8)
res = []
for src in [s for s in range(p) for _ in range(reps)]:
    dst = (src + 1) % p
    dist.barrier()
    if r == src:
        t0 = time.perf_counter(); dist.send(buf, dst); dist.recv(ack, dst)
        res.append((src, dst, n * 8 / (time.perf_counter() - t0)))
    elif r == dst:
        dist.recv(buf, src); dist.send(ack, src)
mine = torch.tensor(res, dtype=torch.float64).reshape(-1)    # reps rows on every rank
out = [torch.empty_like(mine) for _ in range(p)]
dist.all_gather(out, mine)
rows = [[int(a), int(b), v] for part in out for a, b, v in part.reshape(-1, 3).tolist()]
if r == 0: print("RESULT " + json.dumps(rows), flush=True)
from gradcomm.integrations.ddp.lifecycle import end_process_group
end_process_group()
"""


def check(net: Network, nbytes: int | None = None, vias: Sequence[str] = ("socket",),
          repeat: int = 3, tolerance: float = 0.10, verbose: bool = True) -> list[dict]:
    """Measure every link with a dense transfer of ``nbytes`` from rank i to i+1 (it crosses
    i's uplink and i+1's downlink) ``repeat`` times, over each of ``vias``: "socket" (plain
    Python TCP), "mpi" (MPI Send/Recv under mpirun with btl tcp), "gloo" (torch send/recv).

    One row per (via, link): the best of the repeats is compared with the cap, since the
    cap is an upper bound and a slower repeat means the CPU, not the link, was the limit
    (all repeats are kept in ``all_bps``). ``ok`` = within ``tolerance`` of the cap. The
    measured rate is TCP payload: with a 1500-byte MTU, 1448 of every 1514 bytes tbf
    counts are payload, so a link at its cap measures about 4.4 % below it.
    """
    nbytes = nbytes or default_nbytes(net.rate_bps)
    rows = []
    for via in vias:
        samples: dict[tuple[int, int], list[float]] = {}
        if via == "socket":
            for src in range(net.np):
                dst = (src + 1) % net.np
                samples[(src, dst)] = [measure_link(net, src, dst, nbytes)
                                       for _ in range(repeat)]
        elif via in ("mpi", "gloo"):
            code = _MPI_CHECK if via == "mpi" else _GLOO_CHECK
            (res,) = net.run([sys.executable, "-c", code, str(nbytes), str(repeat)],
                             launcher=via, timeout=600, capture=True)[:1]
            line = next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))
            for src, dst, bps in json.loads(line[7:]):
                samples.setdefault((src, dst), []).append(bps)
        else:
            raise ValueError(f"via must be socket, mpi or gloo; got {via!r}")
        for (src, dst), all_bps in samples.items():
            bps = max(all_bps)
            err = bps / net.rate_bps - 1
            row = {"via": via, "src": src, "dst": dst, "bytes": nbytes,
                   "cap_bps": net.rate_bps, "measured_bps": bps, "all_bps": all_bps,
                   "rel_err": err, "ok": abs(err) <= tolerance}
            rows.append(row)
            if verbose:
                spread = ", ".join(f"{b / 1e6:.0f}" for b in all_bps)
                print(f"  {via:6s} r{src} -> r{dst}: {nbytes / 1e6:7.1f} MB at "
                      f"{bps / 1e6:8.1f} Mbit/s (cap {net.rate_bps / 1e6:.0f}, {err:+.1%})  "
                      f"{'ok' if row['ok'] else 'OUT OF TOLERANCE'}   [runs: {spread}]",
                      flush=True)
    return rows


# ---------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_sink"]:
        _sink(int(argv[1]), int(argv[2]))
        return 0
    if argv[:1] == ["_source"]:
        _source(argv[1], int(argv[2]), int(argv[3]))
        return 0
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(prog="python bench/netns.py",
                                 description="Run ranks in network namespaces joined by "
                                             "rate-capped veth links (Linux, root).")
    ap.add_argument("--rate", default="1gbit", help="link rate per direction (1gbit, 10gbit, "
                                                    "100mbit, ...)")
    ap.add_argument("--np", type=int, default=2, help="number of ranks")
    ap.add_argument("--topology", default="auto", choices=["auto", "direct", "switch"])
    ap.add_argument("--launcher", default="mpi", choices=["mpi", "gloo"],
                    help="how the command after -- is started on every rank")
    ap.add_argument("--check", action="store_true",
                    help="measure every link and exit (non-zero if a link is off by > 10%%)")
    ap.add_argument("--via", default="socket,mpi,gloo",
                    help="for --check: socket, mpi and/or gloo transfers")
    ap.add_argument("--bytes", type=float, default=None,
                    help="for --check: transfer size (default: 1 s at the rate)")
    ap.add_argument("--repeat", type=int, default=3, help="for --check: runs per link")
    ap.add_argument("--json", default=None, help="for --check: write the rows here")
    ap.add_argument("--timeout", type=float, default=None, help="kill the ranks after this")
    ap.add_argument("--cleanup", action="store_true",
                    help=f"remove leftover namespaces named {PREFIX}* and exit")
    a = ap.parse_args(argv)
    if a.cleanup:
        removed = cleanup()
        print("removed: " + (", ".join(removed) if removed else "nothing"))
        return 0
    why = available()
    if why:
        print(f"netns: {why}", file=sys.stderr)
        return 2
    if not a.check and not cmd:
        ap.error("give --check, --cleanup or a command after --")
    with Network(a.np, a.rate, a.topology) as net:
        print(f"netns: {net.describe()}", flush=True)
        if a.check:
            rows = check(net, int(a.bytes) if a.bytes else None, a.via.split(","), a.repeat)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump({"network": net.describe(), "rows": rows}, f, indent=1)
            bad = [r for r in rows if not r["ok"]]
            print(f"netns: {len(rows) - len(bad)}/{len(rows)} links within 10% of the cap")
            return 1 if bad else 0
        try:
            net.run(cmd, launcher=a.launcher, timeout=a.timeout)
        except (RuntimeError, TimeoutError) as e:
            print(f"netns: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:      # namespaces are already gone (see _on_signal)
        print("netns: interrupted; removed what it created", file=sys.stderr)
        sys.exit(130)
