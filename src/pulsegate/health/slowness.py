"""A slow node is degraded: its latency against its peers' on the same model, as a pure rule.

The score compares a backend with its OWN baseline, and the balancer's weights shift traffic
away from a slow node, but neither says "this node is 5x slower than the others": a node
that turned slow a minute after start, or whose baseline was learned slow, kept state
`ready`. This rule (issue #21, item 4) compares it with its peers:

- the reading (`read`): the backend's latest probe sample (micro-inference or canary,
  whichever came last) over the median of its peers' smoothed latency for the same probe (the
  peers: the other backends, ready or degraded, serving one of its models), floored at 10 ms
  so loopback noise is no ratio. Where no probe is known on both sides, the smoothed time to
  first token of real (streamed) traffic, the same way. Probes, not TTFT: they come at a
  steady rate to every backend, while the balancer sends a slow node little or no traffic, so
  its TTFT average is starved (measured: stuck at 2.6x for a 4x node). The latest sample, not
  the average: with the default probes (canary every 2 s, alpha 0.2) the average took ~12 s to
  pass 3x; the rule below asks for two slow samples in a row, and the newest probe of either
  kind supersedes an outlier. None (no evidence) where nothing is known on both sides;
- slow (`SlowWatch.judge`): the ratio at or over `SLOW_RATIO` (3x) at every evaluation for
  `SLOW_WINDOW_S` (2 s) in a row, over at least `SLOW_SAMPLES` (2) distinct probe samples
  (for TTFT, evaluations), so one outlier that stays the latest sample for a while never
  degrades. A ready backend then fires DEGRADE with cause ``slow`` (the reason gives the
  numbers), whatever else the evaluation found, short of an ejection. (It was 3 s without the
  sample count: detection took 4.8-6.1 s in the chaos lab, over the issue's 5 s.)
- cleared: back within `CLEAR_RATIO` (1.5x) of its peers for `SLOW_WINDOW_S` in a row, or
  nothing known (hysteresis: from 1.5x to 3x it stays slow). Until then a degraded backend
  does not recover; after, the usual degraded-to-ready conditions apply at the next
  evaluation.

Time is passed in; `SlowWatch` is the one per-backend memory. The fleet sees every backend, so
it hands each watch a way to find its peers (`FleetPeers.of`, a `Peers`): one `Latencies` per
model set and instant, sorted once and shared by every backend it holds, so a backend's
peers' median is a bisect. (Gathered per backend, the peers made a fleet's evaluations
O(n²): at 1,000 backends each 100 ms tick took 70 ms.)
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pulsegate.health.machine import Event
from pulsegate.health.rules import Fire
from pulsegate.health.signals import LATENCY_FLOOR_S, LatencyTracker, Signals
from pulsegate.health.verdict import State

SLOW_RATIO = 3.0  # this many times the peers' median, sustained: slow
CLEAR_RATIO = 1.5  # back within this: no longer slow
SLOW_WINDOW_S = 2.0  # how long the ratio must stay at or over SLOW_RATIO
SLOW_SAMPLES = 2  # ... and in how many probe samples (one outlier never degrades)
# The weight counts a peer ratio over this slack only: peers are other machines, and a spread
# of 1.5x between healthy ones is no reason to shift traffic.
PEER_SLACK = 1.5
_SERVING = frozenset({State.READY, State.DEGRADED})
_WHAT = {"micro": "micro-inference", "canary": "canary", "ttft": "smoothed TTFT"}


class Member(Protocol):
    """What the rule reads of one backend of the fleet (`BackendHealth` is one)."""

    @property
    def name(self) -> str: ...
    @property
    def models(self) -> frozenset[str]: ...
    @property
    def state(self) -> State: ...
    @property
    def signals(self) -> Signals: ...


@dataclass(frozen=True, slots=True)
class Reading:
    """One comparison: `source` ('micro', 'canary' or 'ttft'), the backend's own smoothed
    latency, the peers' median and how many peers, and own / max(median, 10 ms)."""

    source: str
    own_s: float
    peers_s: float
    peers: int
    ratio: float
    at: float | None = None  # when the probe sample was taken (None: a smoothed TTFT)

    def words(self) -> str:
        """'TTFT 251 ms is 5.0x its 2 peers' median (50 ms)'."""
        what = _WHAT.get(self.source, self.source)
        n = "peer's" if self.peers == 1 else f"{self.peers} peers'"
        return (
            f"{what} {self.own_s * 1e3:.0f} ms is {self.ratio:.1f}x its {n} median "
            f"({self.peers_s * 1e3:.0f} ms)"
        )


def compare(
    source: str, own: float | None, peers: Sequence[float], at: float | None = None
) -> Reading | None:
    """`own` (a sample taken `at`, or a smoothed value) against the median of `peers`; None
    when either side is unknown."""
    if own is None or not peers:
        return None
    med = statistics.median(peers)
    return Reading(source, own, med, len(peers), own / max(med, LATENCY_FLOOR_S), at)


def _reading(
    source: str, own: float | None, peers: tuple[float, int] | None, at: float | None = None
) -> Reading | None:
    """`compare` with the peers' median and count already known."""
    if own is None or peers is None:
        return None
    med, n = peers
    return Reading(source, own, med, n, own / max(med, LATENCY_FLOOR_S), at)


def _micro(s: Signals) -> LatencyTracker:
    return s.micro


def _canary(s: Signals) -> LatencyTracker:
    return s.canary


def _ttft(s: Signals) -> LatencyTracker:
    return s.ttft


_SOURCES: dict[str, Callable[[Signals], LatencyTracker]] = {
    "micro": _micro,
    "canary": _canary,
    "ttft": _ttft,
}


class Latencies:
    """The smoothed latencies of a set of backends (`members`, by name) at one instant,
    sorted per source on first use: the median of the set less one value is then a bisect."""

    __slots__ = ("_members", "_sorted", "names", "now")

    def __init__(self, members: Mapping[str, Signals], now: float) -> None:
        self._members = members
        self.names = members.keys()
        self.now = now
        self._sorted: dict[str, list[float]] = {}

    def median(self, source: str, less: float | None = None) -> tuple[float, int] | None:
        """The median of `source`'s known values and their count, with one value equal to
        `less` left out (the asking backend's own); None when no value is left."""
        values = self._sorted.get(source)
        if values is None:
            of, now = _SOURCES[source], self.now
            found = (of(s).value(now) for s in self._members.values())
            values = self._sorted[source] = sorted(v for v in found if v is not None)
        n = skip = len(values)  # `skip`: the index left out (none: past the end)
        if less is not None:
            i = bisect.bisect_left(values, less)
            if i < n and values[i] == less:
                skip, n = i, n - 1
        if n == 0:
            return None
        mid = n // 2  # the n values left, indexed past `skip`
        upper = values[mid if mid < skip else mid + 1]
        if n % 2:
            return upper, n
        lower = values[mid - 1 if mid - 1 < skip else mid]
        return (lower + upper) / 2, n  # as `statistics.median` does


class Peers:
    """What one backend compares itself with: `latencies` of a set that holds the backend
    itself when `member` is True (its own value is then left out of each median)."""

    __slots__ = ("latencies", "member")

    def __init__(self, latencies: Latencies, member: bool = False) -> None:
        self.latencies = latencies
        self.member = member

    @classmethod
    def among(cls, signals: Sequence[Signals], now: float) -> Peers:
        """Peers given as a list of their signals (the backend not among them)."""
        return cls(Latencies({str(i): s for i, s in enumerate(signals)}, now))

    def median(self, source: str, own: float | None) -> tuple[float, int] | None:
        """The peers' median of `source` and how many peers have one; `own` is the asking
        backend's smoothed value of it, left out where it is one of the set."""
        return self.latencies.median(source, own if self.member else None)


def _smoothed(name: str, own: LatencyTracker, peers: Peers, now: float) -> Reading | None:
    v = own.value(now)
    return _reading(name, v, peers.median(name, v))


def _latest(own: Signals, peers: Peers, now: float) -> Reading | None:
    """The backend's latest probe sample (micro-inference or canary, whichever came last)
    against the peers' smoothed latency of the same probe."""
    kinds = [("micro", _micro), ("canary", _canary)]
    kinds.sort(key=lambda k: k[1](own).ewma.at or -1.0, reverse=True)
    for name, of in kinds:
        t = of(own)
        v = t.value(now)
        if v is None:  # none, or stale
            continue
        r = _reading(name, t.last, peers.median(name, v), t.ewma.at)
        if r is not None:
            return r
    return None


def read(own: Signals, peers: Peers, now: float) -> Reading | None:
    """The latest probe sample against the peers' smoothed latency of the same probe; else
    the smoothed TTFT against theirs; None if nothing is known on both sides."""
    r = _latest(own, peers, now)
    if r is not None:
        return r
    return _smoothed("ttft", own.ttft, peers, now)


def smoothed(own: Signals, peers: Peers, now: float) -> Reading | None:
    """The backend's smoothed micro-inference latency against its peers' (else canary, else
    TTFT): the steady comparison the routing weight reads (`peer_ratio`), where `read` takes
    the latest sample for the state's quick verdict."""
    for name in ("micro", "canary", "ttft"):
        r = _smoothed(name, _SOURCES[name](own), peers, now)
        if r is not None:
            return r
    return None


def peer_ratio(reading: Reading | None) -> float | None:
    """The ratio the routing weight counts: the peer ratio past `PEER_SLACK`, or None.

    Worked example: a backend whose first token comes 1.5 s late among peers at 30 ms is 50x
    their median; the weight counts 50 / 1.5 = 33x (`score.routing_weight`: 1.2 / 33 = 0.036,
    about 1.8% of the traffic among three). A node 5x slower: 3.3x, weight 0.36. At 1.5x or
    less: nothing (None)."""
    if reading is None or reading.ratio <= PEER_SLACK:
        return None
    return reading.ratio / PEER_SLACK


def serving(members: Sequence[Member]) -> dict[str, Signals]:
    """The signals of the backends of `members` that serve traffic (ready or degraded), by
    name: the set a model's backends compare themselves with."""
    return {m.name: m.signals for m in members if m.state in _SERVING}


class FleetPeers:
    """Who each backend of a fleet compares itself with: the backends serving one of its
    models (the fleet's `groups`). Their latencies are gathered once per model set and
    instant and shared by every backend of the set, until the fleet says something `moved`
    (an observation, a change of state) or time moves."""

    __slots__ = ("_groups", "_latencies", "_moves")

    def __init__(self) -> None:
        self._groups: Mapping[str, Sequence[Member]] = {}
        # Per model set: the `_moves` the latencies were gathered at, and the latencies.
        self._latencies: dict[frozenset[str], tuple[int, Latencies]] = {}
        self._moves = 0

    def regroup(self, groups: Mapping[str, Sequence[Member]]) -> None:
        """The fleet's model groups changed (a reload, models discovered)."""
        self._groups = groups
        self._latencies.clear()

    def moved(self) -> None:
        """Something was observed or changed state: gather the latencies again."""
        self._moves += 1

    def of(self, b: Member, now: float) -> Peers:
        """`b`'s peers at `now`: the other backends serving traffic for one of its models."""
        key = b.models
        found = self._latencies.get(key)
        if found is None or found[0] != self._moves or found[1].now != now:
            members = [p for m in sorted(key) for p in self._groups.get(m, ())]
            found = self._latencies[key] = (self._moves, Latencies(serving(members), now))
        latencies = found[1]
        return Peers(latencies, b.name in latencies.names)

    def probe_latency(self, b: Member, now: float) -> float | None:
        """The median smoothed probe latency of `b`'s peers serving traffic (ready or
        degraded) for any model `b` serves; None without one. Asked at the end of a
        probation, not per request."""
        peers = serving([p for m in b.models for p in self._groups.get(m, ())])
        peers.pop(b.name, None)
        found = (s.latency_s(now) for s in peers.values())
        values = [v for v in found if v is not None]
        return statistics.median(values) if values else None


def _no_peers(now: float) -> Peers:
    return Peers(Latencies({}, now))


class SlowWatch:
    """One backend's slowness against its peers: when the current spell at or over 3x (or,
    once slow, within 1.5x) began, and whether it is judged slow."""

    __slots__ = (
        "_own",
        "_prev",
        "_sample",
        "_samples",
        "_within",
        "last",
        "peers",
        "since",
        "slow",
    )

    def __init__(self, own: Signals) -> None:
        self._own = own
        # Set by the fleet: the backend's peers at an instant (`FleetPeers.of`).
        self.peers: Callable[[float], Peers] = _no_peers
        self.since: float | None = None  # start of the current spell at or over SLOW_RATIO
        self._samples = 0  # distinct probe samples in that spell (evaluations, for TTFT)
        self._sample: float | None = None  # the last one's time
        self._within: float | None = None  # slow: start of the current spell within 1.5x
        self.slow = False
        self.last: Reading | None = None
        self._prev: float | None = None  # the previous evaluation

    def weight_ratio(self, now: float) -> float | None:
        """`peer_ratio` of the smoothed comparison with the peers now."""
        return peer_ratio(smoothed(self._own, self.peers(now), now))

    def update(self, reading: Reading | None, now: float) -> bool:
        """Fold one evaluation's reading in; whether the backend is slow now."""
        self.last = reading
        # Evaluations come every `evaluate_interval`, a tick late or early: the window is met
        # within half the gap since the previous one (2 s is two 1 s evaluations, not three).
        window = SLOW_WINDOW_S - (0.0 if self._prev is None else 0.5 * max(0.0, now - self._prev))
        self._prev = now
        if reading is None:  # nothing known: no evidence either way
            self.since = self._within = None
            self.slow = False
        elif reading.ratio >= SLOW_RATIO:
            self._within = None
            if self.since is None:
                self.since, self._samples, self._sample = now, 0, None
            if reading.at is None or reading.at != self._sample:
                self._samples += 1
                self._sample = reading.at
            if now - self.since >= window and self._samples >= SLOW_SAMPLES:
                self.slow = True
        elif reading.ratio <= CLEAR_RATIO:
            self.since = None
            if self.slow:
                if self._within is None:
                    self._within = now
                if now - self._within >= window:
                    self.slow = False
                    self._within = None
        else:  # between: both spells are broken; a slow backend stays slow (hysteresis)
            self.since = self._within = None
        return self.slow

    def judge(self, state: State, fire: Fire | None, now: float) -> Fire | None:
        """One evaluation: what fires, given what the other rules fired (`fire`). Slow and
        ready: DEGRADE with cause slow, unless another rule ejects. Slow and degraded: no
        recovery. Otherwise `fire` unchanged."""
        if not self.update(read(self._own, self.peers(now), now), now):
            return fire
        if fire is not None and fire.event is Event.RECOVER:
            return None
        if state is State.READY and (fire is None or fire.event is Event.DEGRADE):
            r, since = self.last, self.since
            why = f"slow: {r.words()}" if r is not None else "slow"
            if since is not None:
                why += f" for {now - since:.1f}s"
            return Fire("slow", why, Event.DEGRADE)
        return fire
