"""The fault catalogue: each fault made for real on one backend, and lifted again.

Network faults are netfilter rules or link changes in the router namespace on the backend's
interface `b<i>` (see netlab): `-o b<i>` is the gateway -> backend direction ("to"),
`-i b<i>` is backend -> gateway ("from"). Recipes from ../shared/notes/fault-injection.md
(netem does not exist on this kernel: loss is `-m statistic`, size is `-m length`, delay is an
NFQUEUE delay line). Process faults signal the engine or agent process; engine faults use the
simulator's `/sim/fault`. `Lab.repair()` undoes any of them, so a failed lift still leaves a
clean fleet for the next scenario.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from chaos import netlab
from chaos.lab import Lab

HOLD_S = 10.0
# Hard failures are held longer so the 5 s x 3 polling baseline can be seen detecting them.
HARD_HOLD_S = 17.0
DELAY_MS, JITTER_MS = 60, 20  # per direction: RTT 120 +- 40 ms across the router
LOSS = 0.25
BIG_BYTES = 1000
LATE_S = 1.5  # issue 21: one backend's first token 1.5 s late
# A warm fleet before the faults judged against it. Late first token: the hedge counts a
# backend's TTFT p95 once it has 20 first tokens, and the row's "healthy fleet p99" comes
# from the warm-up's second half (6 s, ~150 streams). Slow: the rule compares with the
# peers' smoothed probe latency, which takes ~30 s to come down from its start-up values
# (docs/slow-node.md: 10.2 s to `degraded` after a 5 s warm-up, 4.2-4.7 s after 30 s).
LATE_PRE_S = 12.0
SLOW_PRE_S = 30.0
# Answers of 100 tokens (0.5-1 s) for the stall: the streams the node carries when it stalls
# (mid-way, their own rhythm known) and those it starts before it is avoided (stalled after
# their 4th token, judged by the backend's rhythm): about 10 per run instead of 1-2.
STALL_TOKENS = 100
# `retry.hedge` is off by default; the late-first-token row is about what it does.
HEDGE_ON: dict[str, Any] = {"retry": {"hedge": {"enabled": True}}}


@dataclass(frozen=True)
class Fault:
    key: str
    kind: str  # network | process | engine
    title: str
    inject: Callable[[Lab, str], None]
    lift: Callable[[Lab, str], None]
    hold: float = HOLD_S
    # Requests the gateway sent just before detection can reach the backend this much later.
    in_flight_slack: float = 0.1
    # What /health says during the fault (the network faults leave it green for small GETs).
    notes: str = ""
    tags: frozenset[str] = field(default_factory=frozenset)
    # Seconds of load before the fault, when longer than the lab's usual 2 s (`Settings.pre`).
    pre: float = 0.0
    # Gateway config merged over the lab's, in every mode (the modes must stay comparable).
    gateway: dict[str, Any] = field(default_factory=dict)
    # Tokens per client request (the load's usual 16 answer in 80-160 ms: too short for a
    # stall to find more than one or two streams on the node mid-way).
    max_tokens: int = 16
    # What of `serve`'s proxy the fault is about, which Envoy + picker (`envoy-epp`) lacks
    # (docs/epp.md, "What this mode cannot do"): not run in that mode, its table says so.
    needs_serve: str = ""


# -- network ----------------------------------------------------------------------------------


def _rule(*spec: str) -> Callable[[Lab, str], None]:
    def inject(lab: Lab, name: str) -> None:
        node = lab.node(name)
        args = [a.replace("IF", node.iface) for a in spec]
        netlab.iptables(netlab.RTR, "-A", netlab.fault_chain(node.index), *args)

    return inject


def _flush(lab: Lab, name: str) -> None:
    netlab.iptables(netlab.RTR, "-F", netlab.fault_chain(lab.node(name).index))


def _pmtu_inject(lab: Lab, name: str) -> None:
    # One hop narrowed to 1500 while both ends keep MTU 9000 (their MSS says 8960), and the
    # router's "fragmentation needed" ICMP dropped: large segments vanish, small ones pass.
    netlab.iptables(netlab.RTR, "-A", "FOUT", "-p", "icmp", "--icmp-type",
                    "fragmentation-needed", "-j", "DROP")  # fmt: skip
    netlab.sh("ip", "-n", netlab.RTR, "link", "set", "dev", lab.node(name).iface, "mtu", "1500")


def _pmtu_lift(lab: Lab, name: str) -> None:
    netlab.sh("ip", "-n", netlab.RTR, "link", "set", "dev", lab.node(name).iface,
              "mtu", str(netlab.MTU))  # fmt: skip
    netlab.iptables(netlab.RTR, "-F", "FOUT")


def _delay_inject(lab: Lab, name: str) -> None:
    node = lab.node(name)
    queue = 10 + node.index
    lab.start_helper(
        ["-m", "chaos.nfq_delay", "--queue", str(queue), "--delay-ms", str(DELAY_MS),
         "--jitter-ms", str(JITTER_MS), "--seed", str(node.index)],
        b"nfq_delay ready",
    )  # fmt: skip
    netlab.iptables(netlab.RTR, "-A", netlab.fault_chain(node.index), "-j", "NFQUEUE",
                    "--queue-num", str(queue), "--queue-bypass")  # fmt: skip


def _delay_lift(lab: Lab, name: str) -> None:
    _flush(lab, name)
    for h in lab.helpers:  # SIGTERM: the delay line releases what it holds, then exits
        h.terminate()
        h.wait(5)
    lab.helpers.clear()


def _link(state: str) -> Callable[[Lab, str], None]:
    def act(lab: Lab, name: str) -> None:
        netlab.sh("ip", "-n", netlab.RTR, "link", "set", "dev", lab.node(name).iface, state)

    return act


# -- process ----------------------------------------------------------------------------------


def _signal(which: str, sig: int) -> Callable[[Lab, str], None]:
    def act(lab: Lab, name: str) -> None:
        procs = lab.engines if which == "engine" else lab.agents
        procs[name].signal(sig)

    return act


def _restart(which: str) -> Callable[[Lab, str], None]:
    def act(lab: Lab, name: str) -> None:
        if which == "engine":
            lab.restart_engine(name)
        else:
            lab.restart_agent(name)

    return act


# -- engine -----------------------------------------------------------------------------------


def _sim(mode: str, **params: object) -> Callable[[Lab, str], None]:
    def act(lab: Lab, name: str) -> None:
        lab.engines[name].fault(mode, **params)

    return act


_NONE = _sim("none")


FAULTS: tuple[Fault, ...] = (
    # network
    Fault("loss_to", "network", "25% random loss, gateway -> node",
          _rule("-o", "IF", "-m", "statistic", "--mode", "random", "--probability", str(LOSS),
                "-j", "DROP"), _flush, tags=frozenset({"loss", "ci"})),
    Fault("loss_from", "network", "25% random loss, node -> gateway",
          _rule("-i", "IF", "-m", "statistic", "--mode", "random", "--probability", str(LOSS),
                "-j", "DROP"), _flush, tags=frozenset({"loss"})),
    Fault("big_drop", "network", f"IP packets > {BIG_BYTES} B dropped (both ways)",
          _rule("-m", "length", "--length", f"{BIG_BYTES + 1}:65535", "-j", "DROP"), _flush,
          notes="/health (a small GET) stays green", tags=frozenset({"ci"})),
    Fault("pmtu", "network", "path-MTU blackhole (1500 hop, ICMP frag-needed dropped)",
          _pmtu_inject, _pmtu_lift, notes="/health stays green"),
    Fault("delay", "network", f"delay {DELAY_MS}+-{JITTER_MS} ms each way",
          _delay_inject, _delay_lift, in_flight_slack=0.1 + 2 * (DELAY_MS + JITTER_MS) / 1e3),
    Fault("syn_drop", "network", "TCP SYNs to the node dropped",
          _rule("-o", "IF", "-p", "tcp", "--syn", "-j", "DROP"), _flush,
          notes="established connections keep working"),
    Fault("link_down", "network", "router link to the node down", _link("down"), _link("up"),
          hold=HARD_HOLD_S, tags=frozenset({"hard"})),
    # process
    Fault("engine_kill", "process", "engine SIGKILL (restarted at lift)",
          _signal("engine", signal.SIGKILL), _restart("engine"), hold=HARD_HOLD_S,
          tags=frozenset({"hard"})),
    Fault("engine_stop", "process", "engine SIGSTOP (SIGCONT at lift)",
          _signal("engine", signal.SIGSTOP), _signal("engine", signal.SIGCONT),
          hold=HARD_HOLD_S, tags=frozenset({"hard"})),
    Fault("agent_kill", "process", "agent SIGKILL (restarted at lift)",
          _signal("agent", signal.SIGKILL), _restart("agent"), tags=frozenset({"ci"})),
    Fault("agent_stop", "process", "agent SIGSTOP (SIGCONT at lift)",
          _signal("agent", signal.SIGSTOP), _signal("agent", signal.SIGCONT)),
    # engine (simulated)
    Fault("error", "engine", "engine answers 500 to half the requests",
          _sim("error", rate=0.5), _NONE, tags=frozenset({"subhealthy"})),
    Fault("hang", "engine", "engine hangs (every endpoint, /health too)", _sim("hang"), _NONE,
          hold=HARD_HOLD_S, tags=frozenset({"hard"})),
    Fault("cuda_hang", "engine", "CUDA hang: inference hangs, /health green",
          _sim("cuda_hang"), _NONE),
    Fault("oom", "engine", "OOM: VRAM 0 free, inference 500", _sim("oom"), _NONE),
    Fault("slow", "engine", "engine 5x slower (TTFT and ITL)", _sim("slow", factor=5.0), _NONE,
          tags=frozenset({"subhealthy"}), pre=SLOW_PRE_S),
    Fault("late_first", "engine", f"first token {LATE_S:g} s late, then on time (retry.hedge on)",
          _sim("late_first", seconds=LATE_S), _NONE, tags=frozenset({"subhealthy"}),
          pre=LATE_PRE_S, gateway=HEDGE_ON, needs_serve="hedging"),
    Fault("stall", "engine", f"streams stall after 4 tokens ({STALL_TOKENS}-token answers)",
          _sim("stall", after_tokens=4), _NONE, tags=frozenset({"midstream"}),
          max_tokens=STALL_TOKENS, needs_serve="mid-stream resume"),
    Fault("warming", "engine", "engine restarts warming (/health 503, inference 503)",
          _sim("warming", seconds=HOLD_S), _NONE),
    # gray GPU faults (docs/gpu-faults.md): only the sim's DCGM gauges change, which the agent
    # (`--gpu engine`: the engine's /metrics) reads; /health and inference stay fine
    Fault("xid", "engine", "GPU Xid 79 (fallen off the bus), all else green",
          _sim("xid", code=79), _NONE, tags=frozenset({"gpu"})),
    Fault("ecc", "engine", "GPU double-bit ECC error and a row remap pending",
          _sim("ecc"), _NONE, tags=frozenset({"gpu"})),
    Fault("throttle", "engine", "GPU clocks throttled (thermal), all else green",
          _sim("throttle", reason="thermal"), _NONE, tags=frozenset({"gpu"})),
)  # fmt: skip

BY_KEY = {f.key: f for f in FAULTS}
QUICK = ("engine_kill", "loss_to", "big_drop", "cuda_hang", "stall")
