"""The lab's network: one namespace per backend behind a router namespace, built and torn down.

    root ns (gateway, load client, this process)
      pgx0 10.200.100.1 --veth-- uplink 10.200.100.2 [pgx-rtr] b<i> 10.200.<101+i>.1
                                                                 | veth
                           [pgx-b<i>] eth0 10.200.<101+i>.2: engine :8000, agent :50051

Every fault goes in `pgx-rtr`, on the one backend's router-side interface `b<i>`:
traffic towards the backend leaves the router through `b<i>` (FORWARD -o b<i>), traffic from
it enters through `b<i>` (FORWARD -i b<i>). So a fault hits exactly one node, in the
direction asked, and the root namespace is touched only by the uplink veth, one route per
backend and the 10.200.0.0/16 blackhole guard (so that a route gone with a deleted veth
fails locally instead of leaving through the default route). All links run at MTU 9000 so
that the path-MTU fault can narrow one hop to 1500.

Ownership: everything created is named `pgx*`; a state file under /run records whether the
guard route was ours and which root-namespace processes were started, so `cleanup()` - run
first by every lab and by `python -m chaos.cleanup` - removes exactly what a lab left
behind. A lock file held for the lab's life stops a second lab (or its cleanup) from
tearing down a live one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PREFIX = "pgx"
RTR = f"{PREFIX}-rtr"
ROOT_LINK = f"{PREFIX}0"
UPLINK_ROOT_IP = "10.200.100.1"
UPLINK_RTR_IP = "10.200.100.2"
GUARD = "10.200.0.0/16"
MTU = 9000
STATE_DIR = Path("/run/pulsegate-chaos")
STATE_FILE = STATE_DIR / "state.json"
LOCK_FILE = STATE_DIR / "lock"
ENGINE_PORT = 8000
AGENT_PORT = 50051


class LabError(RuntimeError):
    """The lab cannot be built here (not root, no `ip netns`, a command failed)."""


def sh(*args: str, check: bool = True, timeout: float = 15.0) -> subprocess.CompletedProcess[str]:
    """Run one command; raise LabError with its stderr when `check` and it fails."""
    p = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise LabError(f"{' '.join(args)}: {p.stderr.strip() or p.stdout.strip()}")
    return p


def in_ns(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh("ip", "netns", "exec", ns, *args, check=check)


def backend_ns(i: int) -> str:
    return f"{PREFIX}-b{i}"


def backend_ip(i: int) -> str:
    return f"10.200.{101 + i}.2"


def router_ip(i: int) -> str:
    return f"10.200.{101 + i}.1"


def fault_chain(i: int) -> str:
    """The router's FORWARD sub-chain holding backend i's network fault rules."""
    return f"F{i}"


# ---------------------------------------------------------------------------------------------
# Preconditions


def why_unavailable() -> str | None:
    """Why the lab cannot run on this machine, or None when it can."""
    if os.geteuid() != 0:
        return "the chaos lab needs root (network namespaces, iptables)"
    if sh("ip", "netns", "list", check=False).returncode != 0:
        return "`ip netns` is not available"
    for tool in ("iptables", "nft"):
        if sh("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"{tool} is not installed (apt-get install -y iptables nftables)"
    return None


def ensure_tools() -> None:
    """Install iptables/nftables with apt when they are missing (a fresh Debian machine)."""
    missing = [
        t for t in ("iptables", "nft") if sh("sh", "-c", f"command -v {t}", check=False).returncode
    ]
    if not missing or os.geteuid() != 0:
        return
    if sh("sh", "-c", "command -v apt-get", check=False).returncode != 0:
        return
    env = "DEBIAN_FRONTEND=noninteractive"
    r = sh("sh", "-c", f"{env} apt-get install -y -qq iptables nftables", check=False, timeout=300)
    if r.returncode != 0:
        sh("apt-get", "update", "-qq", check=False, timeout=300)
        sh("sh", "-c", f"{env} apt-get install -y -qq iptables nftables", check=False, timeout=300)


# ---------------------------------------------------------------------------------------------
# State file and lock


def _read_state() -> dict[str, Any]:
    try:
        return json.loads(STATE_FILE.read_text())  # type: ignore[no-any-return]
    except (OSError, ValueError):
        return {}


# The lab's threads (a scenario starts and stops processes from `asyncio.to_thread`) change
# the state file one at a time: two writers of one `state.tmp` lost one's rename (seen once,
# "No such file or directory: state.tmp -> state.json", in the replicas scenario).
_STATE_LOCK = threading.Lock()


def _write_state(state: dict[str, Any]) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = STATE_FILE.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(state))
    tmp.replace(STATE_FILE)


def record_pid(pid: int, what: str) -> None:
    """Remember a root-namespace process so a later cleanup can stop it."""
    with _STATE_LOCK:
        state = _read_state()
        state.setdefault("pids", {})[str(pid)] = what
        _write_state(state)


def forget_pid(pid: int) -> None:
    with _STATE_LOCK:
        state = _read_state()
        if str(pid) in state.get("pids", {}):
            del state["pids"][str(pid)]
            _write_state(state)


class Lock:
    """An exclusive flock on LOCK_FILE: one lab per machine."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def acquire(self, wait: float = 0.0) -> bool:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self._fd = fd
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.5)

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                os.close(self._fd)
            self._fd = None


# ---------------------------------------------------------------------------------------------
# Cleanup: everything named pgx*, the guard if ours, recorded root-namespace processes


def _our_namespaces() -> list[str]:
    out = sh("ip", "netns", "list", check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{PREFIX}-")]


def _pid_is_ours(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"pulsegate" in cmd or b"chaos" in cmd


def cleanup(verbose: bool = False) -> list[str]:
    """Remove every namespace, veth, route and process a lab left behind; return what was done.

    Safe to run at any time a lab is not running: it only touches `pgx*` names, the processes
    inside those namespaces, the root-namespace PIDs recorded in the state file (checked to
    still be pulsegate or chaos processes), and the guard route when the state says a lab
    added it.
    """
    done: list[str] = []
    state = _read_state()
    for pid_s, what in state.get("pids", {}).items():
        pid = int(pid_s)
        if _pid_is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
                done.append(f"killed {what} (pid {pid})")
    for ns in _our_namespaces():
        pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
        for p in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(p), signal.SIGCONT)
                os.kill(int(p), signal.SIGKILL)
        if pids:
            done.append(f"killed {len(pids)} process(es) in {ns}")
        sh("ip", "netns", "del", ns, check=False)
        done.append(f"deleted netns {ns}")
    if sh("ip", "link", "show", ROOT_LINK, check=False).returncode == 0:
        sh("ip", "link", "del", ROOT_LINK, check=False)
        done.append(f"deleted link {ROOT_LINK}")
    if state.get("guard_added"):
        sh("ip", "route", "del", "blackhole", GUARD, check=False)
        done.append(f"removed guard route blackhole {GUARD}")
    with contextlib.suppress(FileNotFoundError):
        STATE_FILE.unlink()
    if verbose:
        for d in done:
            print(f"cleanup: {d}")
    return done


# ---------------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class Node:
    """One backend's place in the lab."""

    index: int
    ns: str
    ip: str
    iface: str  # the router-side interface facing this backend

    @property
    def engine_url(self) -> str:
        return f"http://{self.ip}:{ENGINE_PORT}"

    @property
    def agent_addr(self) -> str:
        return f"{self.ip}:{AGENT_PORT}"


def build(n: int) -> list[Node]:
    """Create the router and `n` backend namespaces; return the nodes. Call cleanup() first."""
    state = _read_state()
    guard_present = "blackhole" in sh("ip", "route", "show", GUARD, check=False).stdout
    if not guard_present:
        sh("ip", "route", "replace", "blackhole", GUARD)
        state["guard_added"] = True
    _write_state(state)
    sh("ip", "netns", "add", RTR)
    cmds = [
        f"link add {ROOT_LINK} mtu {MTU} type veth peer name uplink mtu {MTU} netns {RTR}",
        f"addr add {UPLINK_ROOT_IP}/30 dev {ROOT_LINK}",
        f"link set dev {ROOT_LINK} up",
    ]
    _batch(None, cmds)
    _batch(
        RTR,
        ["link set dev lo up", f"addr add {UPLINK_RTR_IP}/30 dev uplink", "link set dev uplink up"],
    )
    in_ns(RTR, "sysctl", "-qw", "net.ipv4.ip_forward=1")
    # Sub-chains for each backend's faults, jumped to from FORWARD; lifting a fault = flush.
    rules = ["*filter", ":INPUT ACCEPT [0:0]", ":FORWARD ACCEPT [0:0]", ":OUTPUT ACCEPT [0:0]"]
    rules += [f":{fault_chain(i)} - [0:0]" for i in range(n)]
    rules += [":FOUT - [0:0]", "-A OUTPUT -j FOUT"]
    rules += [f"-A FORWARD -o b{i} -j {fault_chain(i)}" for i in range(n)]
    rules += [f"-A FORWARD -i b{i} -j {fault_chain(i)}" for i in range(n)]
    rules.append("COMMIT")
    p = subprocess.run(
        ["ip", "netns", "exec", RTR, "iptables-restore"],
        input="\n".join(rules) + "\n",
        capture_output=True,
        text=True,
        timeout=15,
    )
    if p.returncode != 0:
        raise LabError(f"iptables-restore in {RTR}: {p.stderr.strip()}")
    nodes = []
    for i in range(n):
        ns = backend_ns(i)
        sh("ip", "netns", "add", ns)
        _batch(
            RTR,
            [
                f"link add b{i} mtu {MTU} type veth peer name eth0 mtu {MTU} netns {ns}",
                f"addr add {router_ip(i)}/30 dev b{i}",
                f"link set dev b{i} up",
            ],
        )
        _batch(
            ns,
            [
                "link set dev lo up",
                f"addr add {backend_ip(i)}/30 dev eth0",
                "link set dev eth0 up",
                f"route add default via {router_ip(i)}",
            ],
        )
        sh("ip", "route", "replace", f"{router_ip(i).rsplit('.', 1)[0]}.0/30", "via",
           UPLINK_RTR_IP, "dev", ROOT_LINK)  # fmt: skip
        nodes.append(Node(i, ns, backend_ip(i), f"b{i}"))
    return nodes


def _batch(ns: str | None, cmds: list[str]) -> None:
    args = ["ip"] + (["-n", ns] if ns else []) + ["-batch", "-"]
    p = subprocess.run(args, input="\n".join(cmds) + "\n", capture_output=True, text=True)
    if p.returncode != 0:
        raise LabError(f"ip -batch ({ns or 'root'}): {p.stderr.strip()}")


def iptables(ns: str, *args: str) -> None:
    in_ns(ns, "iptables", "-w", *args)
