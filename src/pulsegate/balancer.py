"""Pick one backend for one request from the health core's verdicts (R5, R15, R24-R26, R28, R29).

Pure: no I/O, no clock, randomness from the injected ``random.Random``. The balancer sees
verdicts only (R26); the health core decides state, score and effective weight.

Eligibility (hard rules; ``pick`` returns ``None`` when nothing passes)
    weight finite and > 0; state in ``ROUTABLE``, or ``panic`` is set and the state is
    ``EJECTED`` (panic never admits cold, warming or drained replicas: R25 and the operator win);
    ``gpu_free_ratio`` unknown or >= 5% (R5; NaN counts as < 5%); in-flight below
    ``max_inflight`` when that is > 0; name not in ``exclude`` (never the same backend twice for
    one request, R15).

Topology (R29)
    Eligible candidates fall in three tiers: the ``prefer_zone`` zone, then the region
    (``prefer_region``, else the region the ``prefer_zone`` backends report, learned the first
    time one appears among the candidates: set ``prefer_region`` to have it from the start), then
    anywhere. Only the best non-empty tier is considered, so traffic crosses a zone only when
    every local backend is ineligible (excluded, saturated at ``max_inflight``, sick). Panic
    candidates count like any other: the health core sets their share through their weight.
    One exception: a tier whose members are *all* in probation (a zone coming back) takes the
    mean of their ramps as its share, and the next tier the rest (the draw is the session
    key's hash when there is one). Without it a returning zone took all of its traffic at
    the first ramp step, untested (measured: 0/50, then 22/50, then 49/50 per second).

Weighted power of two choices (no session key)
    The first draw is proportional to weight. A challenger is drawn uniformly among the
    *other* eligible backends and kept with probability weight / max weight (so, when kept, it
    is a second distinct weighted draw); it replaces the first only with a load lower by more
    than LOAD_TOLERANCE (15%), so measurement noise does not decide::

        load = rtt x (1 + inflight / rel_weight)

    - ``rtt`` = ``max(rtt_s, 1 ms)``; the floor keeps sub-millisecond LAN jitter from
      counting. An unknown RTT is taken equal to the rival's, so a new backend never wins on a
      latency it has not shown (linkerd's starting-RTT idea, without a magic default).
    - ``rel_weight`` = weight / the tier's largest weight (1.0 for a full-weight backend). With
      equal weights the factor is linkerd's ``pending + 1``. Dividing in-flight by weight makes
      the fixed point inflight ∝ weight, so a probation backend at 15% carries ~15% of a peer's
      load; the ``+1`` is *not* divided by weight, so idle backends tie whatever their weight.
    - Near-ties on load (within LOAD_TOLERANCE) go to the lower ``1 - 0.05 x cache_hit -
      0.05 x gpu_free`` (the R24 tie-break: warm prefix cache, free VRAM), else to the draw.

    Shares. At equal load the first draw stands, so every backend gets exactly p = w / sum(w).
    A low-weight backend that is idle while the others are busy wins every challenge it makes,
    but it challenges with probability (1 - p) x rel / (n - 1) <= p, so its share is at most
    2p: it is never over-picked just for being idle. Equal weights: always a challenge, i.e.
    plain distinct-pair p2c. Measured (tests/test_balancer.py, seeded, weights 0.15/1/1,
    p = 6.98%): all idle 6.99%; the two full ones busy and it idle (a static snapshot, the
    worst case) 13.94% (bound 2p = 13.95%); closed loop at 20 in flight 7.2%, at 2 in flight
    9.4%. A 1% ramp next to four full backends (p = 0.25%): 0.24% idle, 0.42% loaded.

Session affinity (``session_key``, R28)
    Weighted rendezvous hashing within the chosen tier: score = -ln(u) / wq, lowest wins,
    with u from a 64-bit mix of blake2b(key) and the cached blake2b of the backend name. wq is
    the weight rounded to the nearest power of two (octave buckets with edges at 0.71, 1.41 x a
    power of two) so that score jitter of a healthy backend does not reshuffle sessions, while
    a probation ramp (1%, 2%, 4%, ... of a share) still matters. Bounded load (Mirrokni et
    al.): a backend takes the session only while inflight + 1 <=
    ceil((1 + epsilon) x (tier in-flight + 1) x wq / sum(wq)), i.e. (1 + epsilon) x the mean
    counting this request (weighted; the plain mean when weights are equal); else the next in
    hash order. A session moves only when its home leaves the tier/eligible set or overflows,
    or when backends change weight bucket. Measured: 300 sessions on 3 backends at ~33 in
    flight each stay home on 98.9% of picks; at ~10 each the 1.25 x mean bound is within
    Poisson noise and 6-10% of picks spill (raise ``affinity_epsilon`` for stickier sessions).
    An empty key counts as no key.

Cost (CPython 3.11, 100k picks on a busy shared core; ``PULSEGATE_BENCH=1 pytest -k bench``):
3 candidates 2.0 µs/pick (p2c, equal weights), 2.6 (mixed weights), 4.0-7 with a session key;
30 candidates 10-16 µs p2c, 30-43 µs with a session key (one 64-bit mix per candidate).
"""

from __future__ import annotations

import hashlib
import math
import random
from bisect import bisect_right
from collections.abc import Container, Mapping, Sequence
from itertools import accumulate

from pulsegate.config import RoutingConfig
from pulsegate.health.verdict import ROUTABLE, State, Verdict

__all__ = [
    "CACHE_BONUS",
    "MIN_GPU_FREE",
    "PANIC_ROUTABLE",
    "RTT_FLOOR_S",
    "VRAM_BONUS",
    "Balancer",
    "prefix_key",
]

# R5: never pick a node with less than 5% free VRAM.
MIN_GPU_FREE = 0.05
# RTTs below 1 ms are treated as 1 ms: sub-ms differences on one LAN are noise, not signal.
RTT_FLOOR_S = 0.001
# A challenger must beat the first draw's load by more than this share to replace it.
LOAD_TOLERANCE = 0.15
# R24 tie-break: a fully warm prefix cache and a fully free GPU each shave 5% off the load.
CACHE_BONUS = 0.05
VRAM_BONUS = 0.05
# States panic mode may route to: ejected-but-alive nodes. Never cold/warming (R25) or drained.
PANIC_ROUTABLE = ROUTABLE | frozenset({State.EJECTED})

_INF = math.inf
_MASK64 = (1 << 64) - 1
_TWO_POW_M53 = 2.0**-53
_SQRT_HALF = math.sqrt(0.5)
# Backend names are few (config-defined); the cap only guards against a caller inventing them.
_NAME_CACHE_MAX = 4096


def _digest64(text: str) -> int:
    data = text.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _octave(weight: float) -> float:
    """`weight` rounded to the nearest power of two (on a log scale); always > 0."""
    m, e = math.frexp(weight)  # weight = m * 2**e, 0.5 <= m < 1
    if m >= _SQRT_HALF:
        return math.ldexp(1.0, e if e < 1024 else 1023)  # 2**1024 would overflow
    return math.ldexp(0.5, e)


def prefix_key(body_text: str, k: int) -> str | None:
    """A stable affinity key for the first `k` characters of a request body (None if k <= 0 or
    the body is empty): requests sharing a prompt prefix land where that prefix is cached."""
    if k <= 0 or not body_text:
        return None
    data = body_text[:k].encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=8).hexdigest()


class Balancer:
    """Chooses a backend per request; see the module docstring for the rules and formulas.

    Holds only the routing settings, the rng, a cache of per-backend name hashes and the
    learned region of ``prefer_zone``; ``pick`` is otherwise a function of its arguments.
    """

    __slots__ = ("_epsilon", "_name_hash", "_region", "_rng", "_zone")

    def __init__(self, routing: RoutingConfig, rng: random.Random) -> None:
        self._rng = rng
        self._zone = routing.prefer_zone
        self._region = routing.prefer_region
        eps = routing.affinity_epsilon
        self._epsilon = eps if eps >= 0.0 else 0.0
        self._name_hash: dict[str, int] = {}

    def pick(
        self,
        candidates: Sequence[Verdict],
        inflight: Mapping[str, int],
        exclude: Container[str] = (),
        session_key: str | None = None,
    ) -> Verdict | None:
        """The backend for this request, or None when no candidate is eligible."""
        zone = self._zone
        region = self._region
        if zone and not region:
            region = self._learn_region(candidates)

        members, wmin, wmax = self._eligible(
            candidates, inflight, exclude, zone, region, session_key
        )
        if len(members) <= 1:
            return members[0] if members else None
        if session_key:  # "" is no key: it would pin every keyless request to one backend
            return self._affinity(members, inflight, session_key)
        return self._p2c(members, inflight, wmin, wmax)

    def _eligible(
        self,
        candidates: Sequence[Verdict],
        inflight: Mapping[str, int],
        exclude: Container[str],
        zone: str,
        region: str,
        session_key: str | None,
    ) -> tuple[list[Verdict], float, float]:
        """The eligible candidates of the best zone tier, with their min and max weight.

        Panic candidates (ejected but alive) are used only when no healthy candidate anywhere
        is eligible (all excluded, or at their max_inflight): a healthy remote backend is never
        passed over for a sick local one, and survivors at their limits spill to the least bad
        ejected ones rather than queue.

        A tier made only of backends in probation (a zone coming back) takes the mean of their
        ramps as its share, the next tier the rest (`_ramping_spill`): a returning zone is
        tried with a tenth of its traffic first, not all of it."""
        tiers: tuple[list[Verdict], list[Verdict], list[Verdict]] = ([], [], [])
        panicked: list[tuple[int, Verdict]] = []
        for v in candidates:
            w = v.weight
            if not 0.0 < w < _INF:
                continue
            state = v.state
            healthy = state in ROUTABLE
            if not healthy and not (v.panic and state in PANIC_ROUTABLE):
                continue
            g = v.gpu_free_ratio
            if g is not None and not g >= MIN_GPU_FREE:
                continue
            name = v.name
            if name in exclude:
                continue
            cap = v.max_inflight
            if cap > 0 and inflight.get(name, 0) >= cap:
                continue
            if zone and v.zone == zone:
                tier = 0
            elif region and v.region == region:
                tier = 1
            else:
                tier = 2
            if not healthy:
                panicked.append((tier, v))
                continue
            tiers[tier].append(v)
        best = 0 if tiers[0] else 1 if tiers[1] else 2
        members = tiers[best]
        if members and best < 2:
            members = self._ramping_spill(tiers, best, session_key)
        if panicked and not members:
            best_tier = min(t for t, _ in panicked)
            members = [v for t, v in panicked if t == best_tier]
        if not members:
            return members, 0.0, 0.0
        wmin = wmax = members[0].weight
        for v in members:
            w = v.weight
            if w > wmax:
                wmax = w
            elif w < wmin:
                wmin = w
        return members, wmin, wmax

    def _ramping_spill(
        self, tiers: tuple[list[Verdict], ...], best: int, session_key: str | None
    ) -> list[Verdict]:
        """Tier `best` (the best non-empty one), or the next non-empty tier when `best`'s
        members are all in probation and the draw falls past their mean ramp (cascading).
        The draw is the session key's hash when there is one, so a session does not flip
        between tiers from one request to the next."""
        u: float | None = None
        i = best
        while True:
            members = tiers[i]
            j = next((k for k in range(i + 1, len(tiers)) if tiers[k]), None)
            if j is None or any(v.ramp >= 1.0 for v in members):
                return members
            ramp = sum(v.ramp for v in members) / len(members)
            if u is None:
                u = (
                    (_digest64(session_key) >> 11) * _TWO_POW_M53
                    if session_key
                    else self._rng.random()
                )
            if u < ramp:
                return members
            i = j

    # -----------------------------------------------------------------------------------------

    def _learn_region(self, candidates: Sequence[Verdict]) -> str:
        """The region of the preferred zone's backends, remembered once seen (topology is static
        for a Balancer's life; a config reload builds a new one)."""
        zone = self._zone
        for v in candidates:
            if v.zone == zone and v.region:
                self._region = v.region
                return v.region
        return ""

    def _p2c(
        self, members: list[Verdict], inflight: Mapping[str, int], wmin: float, wmax: float
    ) -> Verdict:
        rng = self._rng
        n = len(members)
        # `int(random() * n)`, not `randrange(n)`: one C call where randrange is two
        # interpreted ones per draw (n is small: the bias, under 2**-50, is nil).
        if wmin == wmax:  # equal weights (the common case): plain distinct-pair p2c
            i = int(rng.random() * n)
            j = int(rng.random() * (n - 1))
        else:
            # Relative weights (<= 1) so a sum of huge weights cannot overflow to inf.
            cum = list(accumulate([v.weight / wmax for v in members]))
            i = bisect_right(cum, rng.random() * cum[-1])
            if i >= n:
                i = n - 1
            j = int(rng.random() * (n - 1))
            # Thinning: the challenger only challenges with probability weight / wmax, which caps
            # any backend's share at 2 x its weight share however idle it is.
            rel = members[j + (j >= i)].weight / wmax
            if rel < 1.0 and rng.random() >= rel:
                return members[i]
        a = members[i]
        b = members[j + (j >= i)]
        # Unknown RTT (0.0 from _rtt) is taken equal to the rival's: never better than shown.
        rtt_a = _rtt(a.rtt_s)
        rtt_b = _rtt(b.rtt_s)
        if not rtt_a:
            rtt_a = rtt_b or RTT_FLOOR_S
        if not rtt_b:
            rtt_b = rtt_a
        # The challenger must be clearly better (by more than LOAD_TOLERANCE): near-ties keep
        # the weighted first draw, so at equal load every backend gets its weight share, and
        # RTT noise (15 ms vs 17 ms) does not send all light, one-at-a-time traffic to one.
        la = _load(a, inflight.get(a.name, 0), rtt_a, wmax)
        lb = _load(b, inflight.get(b.name, 0), rtt_b, wmax)
        if lb * (1.0 + LOAD_TOLERANCE) < la:
            return b
        if la * (1.0 + LOAD_TOLERANCE) < lb:
            return a
        # A near-tie on load: the warmer prefix cache and freer VRAM win (R24), else the draw.
        return b if _warmth(b) < _warmth(a) else a

    def _affinity(self, members: list[Verdict], inflight: Mapping[str, int], key: str) -> Verdict:
        key_hash = _digest64(key)
        aw0 = members[0].affinity_weight
        equal = all(v.affinity_weight == aw0 for v in members)
        log = math.log
        names = self._name_hash
        scores: list[float] = []
        best = 0
        best_score = _INF
        total = 0
        wq_sum = 0.0 if not equal else float(len(members))
        for i, v in enumerate(members):
            bh = names.get(v.name)
            if bh is None:
                bh = self._backend_hash(v.name)
            # splitmix64's finaliser of key_hash ^ bh (bijective 64-bit mix), inlined: this loop is
            # the whole cost of an affinity pick.
            z = ((key_hash ^ bh) + 0x9E3779B97F4A7C15) & _MASK64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
            # u: uniform in (0, 1) from the top 53 bits of the mixed (key, backend) hash.
            u = (((z ^ (z >> 31)) >> 11) + 0.5) * _TWO_POW_M53
            if equal:  # same weight everywhere: ordering by u alone equals -ln(u) / w
                score = -u
            else:
                wq = _octave(v.affinity_weight)
                score = -log(u) / wq
                wq_sum += wq
            scores.append(score)
            if score < best_score:
                best, best_score = i, score
            n = inflight.get(v.name, 0)
            if n > 0:
                total += n

        budget = (1.0 + self._epsilon) * (total + 1) / wq_sum
        home = members[best]
        if _fits(home, equal, inflight, budget):
            return home
        # Home overflows: walk the rest in hash order (rare, so sorting here is fine).
        for i in sorted(range(len(members)), key=scores.__getitem__):
            v = members[i]
            if i != best and _fits(v, equal, inflight, budget):
                return v
        return home  # unreachable: the capacities sum to more than the in-flight total

    def _backend_hash(self, name: str) -> int:
        """blake2b of a backend name, computed once per name and cached."""
        names = self._name_hash
        if len(names) >= _NAME_CACHE_MAX:
            names.clear()
        h = names[name] = _digest64(name)
        return h


def _fits(v: Verdict, equal: bool, inflight: Mapping[str, int], budget: float) -> bool:
    """Bounded load: room for one more request within ceil((1 + eps) x weighted mean)."""
    wq = 1.0 if equal else _octave(v.affinity_weight)
    return inflight.get(v.name, 0) + 1 <= math.ceil(budget * wq)


def _rtt(rtt_s: float | None) -> float:
    """max(rtt_s, RTT_FLOOR_S), or 0.0 when unknown (None or NaN)."""
    if rtt_s is None or rtt_s != rtt_s:
        return 0.0
    return rtt_s if rtt_s > RTT_FLOOR_S else RTT_FLOOR_S


def _load(v: Verdict, n: int, rtt: float, wmax: float) -> float:
    rel = v.weight / wmax
    if n <= 0:
        pending = 1.0
    elif rel > 0.0:
        pending = 1.0 + n / rel
    else:  # weight underflowed relative to the largest: as good as unpickable
        return _INF
    return rtt * pending


def _warmth(v: Verdict) -> float:
    """1 minus the cache and VRAM bonus: lower is better (at most 10% below 1)."""
    factor = 1.0
    h = v.prefix_cache_hit_rate
    if h is not None and h > 0.0:
        factor -= CACHE_BONUS * (h if h < 1.0 else 1.0)
    g = v.gpu_free_ratio
    if g is not None and g > 0.0:
        factor -= VRAM_BONUS * (g if g < 1.0 else 1.0)
    return factor
