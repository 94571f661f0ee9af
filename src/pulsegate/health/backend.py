"""One backend's health: signals + state machine + the rules that fire its events.

Rules (every number is a config key or a named constant below):

- Hard evidence ejects AT ONCE from ready/degraded: heartbeat misses reaching
  `probes.heartbeat.misses_to_dead` (cause heartbeat), `probes.canary.failures_to_isolate`
  canary failures in a row (canary), `probes.micro_inference.failures_to_eject` micro-inference
  failures in a row (micro_inference), `health.consecutive_failures` real requests failing in a
  row (consecutive_failures), and first-byte-overdue evidence reported twice plus any failing
  probe (stalled). One blip never ejects: every one of these needs a streak.
- The score ejects only after `eject_after` evaluations in a row under `eject_below` (cause
  score), and only while it rests on at least two known dimensions: with the error rate as the
  only signal the renormalised score is the error sub-score, and R17 says error rate alone
  misjudges. Evaluations run in `tick` every `health.evaluate_interval`.
- Degraded (routable, down-weighted): score under `degrade_below`, VRAM more than 90% used or
  KV cache more than 95% full; back to ready with hysteresis (`conditions`).
- Free VRAM under 5% (R5): weight 0 at once (never picked), degraded at the next evaluation,
  and it blocks rejoining - but it is not by itself an ejection: engines such as vLLM reserve
  most of the GPU up front, so a low-memory gauge alone is weak evidence (R17). The failures
  an OOM causes eject through the streak rules.
- FirstByteOverdue: suspect at once (weight x 0.05, fast probing); cleared by a successful
  request or micro/canary probe.
- Ejected: out for the backoff (`ejection.Backoff`), still probed and scored. Leaves only when
  the backoff is over AND the score was above `rejoin_above` for `rejoin_after` evaluations in a
  row AND the hard evidence is clear: last heartbeat answered, last micro-inference and canary
  ok, the engine ready, at least one active probe succeeded since the ejection (a micro-
  inference, when micro probes are required), VRAM >= 5% free. Then probation.
- Probation (`probation.Probation`): any failure (request, probe, heartbeat death, not ready,
  score under eject_below) ejects again with n + 1; passing returns to ready with ramp 1.
- Cold/warming: the engine saying "not ready" -> warming; ready (plus a micro-inference when
  `require_micro_for_ready`) with no hard evidence -> ready. Never routable (R25).
- Drained: operator only; undrain returns to cold, and readiness is re-checked at once.

Verdict numbers (score, weight, rtt) are refreshed at each evaluation and on discrete events
(state change, suspect, VRAM crossing 5%, ramp step), not on every request: the balancer's
in-flight counts carry the instant load, and the routable cache stays valid between.
"""

from __future__ import annotations

import dataclasses
import enum
import random
from collections.abc import Callable, Sequence

from pulsegate.config import MAX_INFLIGHT_AUTO, BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health import conditions
from pulsegate.health.ejection import Backoff
from pulsegate.health.events import Transition
from pulsegate.health.machine import Event, transition
from pulsegate.health.observations import (
    EngineFacts,
    FirstByteOverdue,
    Heartbeat,
    Observation,
    Outcome,
    ProbeKind,
    ProbeResult,
    RequestResult,
)
from pulsegate.health.probation import Probation
from pulsegate.health.score import (
    GPU_FREE_MIN,
    ScoreInputs,
    known_dimensions,
    routing_weight,
    score,
)
from pulsegate.health.signals import Signals
from pulsegate.health.verdict import ROUTABLE, State, Verdict

SUSPECT_FACTOR = 0.05  # weight multiplier while first bytes are overdue
OVERDUE_REPEATS = 2  # overdue reports that, with one failing probe, eject (cause stalled)
UNSTABLE_HOLD_S = 30.0  # a failure keeps probing fast for this long
PANIC_WEIGHT_FLOOR = 0.01  # an ejected backend routed in panic gets at least this weight
MIN_DIMENSIONS_TO_EJECT = 2  # one signal alone (say, the error rate) never ejects via the score

_NOTHING: tuple[Transition, ...] = ()
_STABLE_STATES = frozenset({State.READY, State.DRAINED})


class Cadence(enum.Enum):
    """How often the probers should look at a backend (R14)."""

    STABLE = "stable"  # the slow intervals
    UNSTABLE = "unstable"  # fast: not ready, degraded, ejected, probation, suspect, failing


class BackendHealth:
    """Health of one backend. Feed it with `observe`, drive time with `tick`."""

    def __init__(
        self,
        config: BackendConfig,
        health: HealthConfig,
        probes: ProbesConfig,
        rng: random.Random,
        now: float,
        *,
        require_micro_for_ready: bool = False,
    ) -> None:
        self.config = config
        self.name = config.name
        self.models: frozenset[str] = frozenset(config.models)
        self._h = health
        self._p = probes
        self._require_micro = require_micro_for_ready
        self.signals = Signals(health.ewma_alpha)
        self.backoff = Backoff(health.ejection_base, health.ejection_max, rng)
        self.probation = Probation(
            health.probation.duration, health.probation.ramp_step, require_micro_for_ready
        )
        # The median smoothed probe latency of the peers in service for the same models, set
        # by the fleet: a probation judged slow against its own baseline passes when it is as
        # fast as they are (the slowdown is shared, not its own). None: no peer to compare.
        self.peer_latency: Callable[[float], float | None] = _no_peers
        self.state = State.COLD
        self.since = now
        self.last_cause = ""
        self.last_reason = ""
        # Numbers refreshed at evaluations and transitions.
        self.score: float | None = None
        self._inputs = ScoreInputs()
        self._base_weight = 1.0
        self._rtt_s: float | None = None
        self._prefix_hit: float | None = None
        self._pickable = True  # VRAM unknown or >= 5% free
        # `max_inflight: auto`: the engine's batch capacity, reported (capacity gauge) or
        # learned (requests running while others wait in its queue); 0 while unknown.
        self._auto_limit = 0
        self._engine_gone = False  # a readiness probe was refused and none answered since
        self.ramp = 1.0
        # Rule state.
        self._next_eval = now + health.evaluate_interval
        self._low_evals = 0
        self._good_evals = 0
        self.suspect = False
        self._overdue_reports = 0
        self._overdue_desc = ""
        self._ready: bool | None = None  # the engine's own last readiness answer
        self._ready_reason = ""
        self._micro_ok_since_not_ready = False
        self._probe_ok_since_eject = False
        self._micro_ok_since_eject = False
        # Verdict cache: `version` moves whenever the verdict would differ.
        self.version = 0
        self._verdict = self._build_verdict()

    # -- public reads -------------------------------------------------------------------------

    @property
    def weight(self) -> float:
        """Effective routing weight now (0 when not routable outside panic)."""
        return self._verdict.weight

    def verdict(self) -> Verdict:
        """The backend as the balancer sees it (outside panic)."""
        return self._verdict

    def panic_verdict(self) -> Verdict:
        """The verdict of an ejected-but-alive backend routed in panic mode (least-bad first)."""
        w = max(self._base_weight, PANIC_WEIGHT_FLOOR) * self.config.weight
        return dataclasses.replace(self._verdict, weight=w, panic=True)

    @property
    def dead(self) -> bool:
        """Never routed, even in panic: hard evidence present now (a failure streak at its
        limit), the engine saying it is not ready, or VRAM under 5% free."""
        return (
            self._ready is False
            or not self._pickable
            or conditions.hard_evidence(self.signals, self._h, self._p) is not None
        )

    def cadence(self, now: float) -> Cadence:
        """Stable (slow probing) only when ready or drained, not suspect, and without a failure or
        heartbeat miss in the last 30 s."""
        s = self.signals
        if (
            self.state in _STABLE_STATES
            and not self.suspect
            and s.heartbeat_misses == 0
            and (s.last_failure_at is None or now - s.last_failure_at >= UNSTABLE_HOLD_S)
        ):
            return Cadence.STABLE
        return Cadence.UNSTABLE

    def next_due(self, now: float) -> float:
        """The next time `tick` has something to do (evaluation or probation ramp step)."""
        t = self._next_eval
        if self.state is State.PROBATION:
            t = min(t, self.probation.next_step_at(now))
        return t

    def snapshot(self, now: float) -> dict[str, object]:
        """State, numbers and signals for the admin API and the dashboard."""
        ejected = self.state is State.EJECTED
        return {
            "state": self.state.value,
            "score": self._verdict.score,
            "score_known": self.score is not None,
            "weight": round(self._verdict.weight, 6),
            "ramp": self.ramp,
            "max_inflight": self._verdict.max_inflight,  # 0: no limit (or `auto`, unknown yet)
            "suspect": self.suspect,
            "since": self.since,
            "signals": self.signals.snapshot(now),
            "ejections": self.backoff.total,
            "ejection_multiplier": self.backoff.n,
            "ejected_until": self.backoff.until if ejected else None,
            "last_cause": self.last_cause,
            "last_reason": self.last_reason,
            "probation_progress": (
                round(self.probation.progress(now), 4) if self.state is State.PROBATION else None
            ),
            "cadence": self.cadence(now).value,
            "dead": self.dead,
        }

    # -- observations -------------------------------------------------------------------------

    def observe(self, obs: Observation, now: float) -> Sequence[Transition]:
        """Fold one observation in; returns the transitions it caused (usually none)."""
        if self.state is not State.EJECTED:
            return self._observe(obs, now)
        # An ejected backend's verdict does not change, but whether panic mode may route to it
        # (`dead`) does: move `version` so the fleet's routable cache is rebuilt.
        was = self.dead
        out = self._observe(obs, now)
        if self.dead is not was:
            self.version += 1
        return out

    def _observe(self, obs: Observation, now: float) -> Sequence[Transition]:
        match obs:
            case RequestResult():
                return self._on_request(obs, now)
            case Heartbeat():
                return self._on_heartbeat(obs, now)
            case ProbeResult():
                return self._on_probe(obs, now)
            case EngineFacts():
                self.signals.record_facts(obs, now)
                self._learn_capacity(obs)
                self._check_pickable(now)
                return _NOTHING
            case FirstByteOverdue():
                return self._on_overdue(obs, now)
        raise TypeError(f"not an observation: {obs!r}")

    def _on_request(self, r: RequestResult, now: float) -> Sequence[Transition]:
        outcome = r.outcome
        if outcome is Outcome.OK:
            self.signals.record_request_ok(r.ttft_s, now)
            if self.suspect:
                self._clear_suspect()
            return _NOTHING
        if not outcome.is_failure:
            return _NOTHING  # overloaded, client error, cancelled: not evidence of sickness
        s = self.signals
        s.record_request_failure(outcome, r.status, now)
        st = self.state
        if st is State.PROBATION:
            return self._eject(
                now,
                Event.PROBATION_FAILED,
                "request_failure",
                f"request failed during probation ({s.last_request_failure})",
            )
        if (st is State.READY or st is State.DEGRADED) and (
            s.request_failures >= self._h.consecutive_failures
        ):
            return self._eject(
                now,
                Event.HARD_FAILURE,
                "consecutive_failures",
                f"{s.request_failures} requests failed in a row (last: {s.last_request_failure})",
            )
        return _NOTHING

    def _on_heartbeat(self, hb: Heartbeat, now: float) -> Sequence[Transition]:
        s = self.signals
        s.record_heartbeat(hb, now)
        if hb.facts is not None:
            self._learn_capacity(hb.facts)
            self._check_pickable(now)
        if hb.rtt_s is not None or s.heartbeat_misses < self._p.heartbeat.misses_to_dead:
            return _NOTHING
        why = f"heartbeat missed {s.heartbeat_misses}x in a row ({s.last_heartbeat_miss})"
        if self.state is State.PROBATION:
            return self._eject(now, Event.PROBATION_FAILED, "heartbeat", why)
        if self.state is State.READY or self.state is State.DEGRADED:
            return self._eject(now, Event.HARD_FAILURE, "heartbeat", why)
        return _NOTHING

    def _on_probe(self, p: ProbeResult, now: float) -> Sequence[Transition]:
        self.signals.record_probe(p, now)
        if p.kind is ProbeKind.READINESS:
            return self._on_readiness(p, now)
        micro = p.kind is ProbeKind.MICRO
        if p.ok:
            self._probe_ok_since_eject = True
            if micro:
                self._micro_ok_since_not_ready = True
                self._micro_ok_since_eject = True
                if self.state is State.PROBATION:
                    self.probation.micro_ok += 1
            if self.suspect:
                self._clear_suspect()
            return self._maybe_ready(now)
        s = self.signals
        if micro:
            self._micro_ok_since_not_ready = False
            return self._probe_failed(
                now,
                "micro_inference",
                "micro-inference",
                s.micro_failures,
                self._p.micro_inference.failures_to_eject,
                s.last_micro_failure,
            )
        return self._probe_failed(
            now,
            "canary",
            "canary",
            s.canary_failures,
            self._p.canary.failures_to_isolate,
            s.last_canary_failure,
        )

    def _probe_failed(
        self, now: float, cause: str, label: str, streak: int, limit: int, why: str
    ) -> Sequence[Transition]:
        st = self.state
        if st is State.PROBATION:
            return self._eject(
                now, Event.PROBATION_FAILED, cause, f"{label} failed during probation: {why}"
            )
        if st is State.COLD:
            # Never routable yet, so no transition; but the operator must see why it stays
            # out (vLLM that cannot run its model passes /health and fails its first
            # micro-inference: `cold` with an empty reason told nothing).
            self.last_reason = f"{label} failed {streak}x: {why}"
            return _NOTHING
        if st is not State.READY and st is not State.DEGRADED:
            return _NOTHING
        if streak >= limit:
            return self._eject(now, Event.HARD_FAILURE, cause, f"{label} failed {streak}x: {why}")
        if self.suspect and self._overdue_reports >= OVERDUE_REPEATS:
            why = f"{self._overdue_desc}, and {label} failed: {why}"
            return self._eject(now, Event.HARD_FAILURE, "stalled", why)
        return _NOTHING

    def _on_readiness(self, p: ProbeResult, now: float) -> Sequence[Transition]:
        if not p.ok:
            # Unreachable or timed out says nothing about loading: it is counted as an
            # error and the streak rules judge it (a hung engine is sick, not warming).
            # A refused connection is different: nothing listens on the engine's port, so
            # every request sent there fails. Out at once, before clients find out.
            if p.refused:
                self._engine_gone = True
                why = f"engine refuses connections ({p.reason or 'connection refused'})"
                st = self.state
                if st is State.READY or st is State.DEGRADED:
                    return self._eject(now, Event.HARD_FAILURE, "engine_down", why)
                if st is State.PROBATION:
                    return self._eject(now, Event.PROBATION_FAILED, "engine_down", why)
                if st is State.COLD or st is State.WARMING:
                    self.last_reason = why
            return _NOTHING
        if p.ready is False:
            self._ready = False
            self._ready_reason = p.reason or "loading"
            self._micro_ok_since_not_ready = False
            st = self.state
            why = f"engine not ready: {self._ready_reason}"
            if st is State.COLD or st is State.READY or st is State.DEGRADED:
                return (self._move(Event.NOT_READY, now, "not_ready", why),)
            if st is State.PROBATION:
                return self._eject(now, Event.PROBATION_FAILED, "not_ready", why)
            return _NOTHING
        self._ready = True
        self._probe_ok_since_eject = True
        if self._engine_gone:
            # A new engine process answers where the old one was gone: the failures counted
            # while nothing listened describe the outage, not this process. Without this a
            # restart after a long outage waited 30-40 s for the error rate to decay.
            self._engine_gone = False
            self.signals.forget_outage()
        return self._maybe_ready(now)

    def _on_overdue(self, o: FirstByteOverdue, now: float) -> Sequence[Transition]:
        if o.count <= 0:
            return _NOTHING
        self._overdue_reports += 1
        self._overdue_desc = (
            f"first byte overdue on {o.count} request{'s' if o.count != 1 else ''} "
            f"(oldest {o.oldest_s:.1f}s)"
        )
        self.signals.last_failure_at = now
        if not self.suspect:
            self.suspect = True
            self._publish()
        return _NOTHING

    def _maybe_ready(self, now: float) -> Sequence[Transition]:
        if self.state is not State.COLD and self.state is not State.WARMING:
            return _NOTHING
        if not self._ready or conditions.hard_evidence(self.signals, self._h, self._p) is not None:
            return _NOTHING
        if self._require_micro and not self._micro_ok_since_not_ready:
            return _NOTHING
        why = "engine ready, micro-inference ok" if self._require_micro else "engine ready"
        return (self._move(Event.READY_SEEN, now, "ready", why),)

    # -- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Transition]:
        """Run what is due at `now`: an evaluation every evaluate_interval, probation steps."""
        was = self.dead if self.state is State.EJECTED else None
        out = self._tick(now)
        if was is not None and self.state is State.EJECTED and self.dead is not was:
            self.version += 1  # stale VRAM gauge forgotten: see `observe`
        return out

    def _tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        if now >= self._next_eval:
            interval = self._h.evaluate_interval
            nxt = self._next_eval + interval
            # Late ticks do not replay missed evaluations: no new evidence arrived for them.
            self._next_eval = nxt if nxt > now else now + interval
            out.extend(self._evaluate(now))
        if self.state is State.PROBATION:
            out.extend(self._probation_tick(now))
        return out

    def _evaluate(self, now: float) -> Sequence[Transition]:
        self._refresh(now)
        h = self._h
        st = self.state
        sc = self.score
        low = (
            sc is not None
            and sc < h.eject_below
            and known_dimensions(self._inputs, h.weights) >= MIN_DIMENSIONS_TO_EJECT
        )
        if st is State.READY or st is State.DEGRADED:
            self._low_evals = self._low_evals + 1 if low else 0
            if self._low_evals >= h.eject_after:
                return self._eject(
                    now,
                    Event.SCORE_LOW,
                    "score",
                    f"score {sc:.0f} < {h.eject_below:g} for {self._low_evals} evaluations "
                    f"({conditions.describe(self._inputs)})",
                )
            # Quiet (no failure since the last evaluation, not suspect): forgive ejections and
            # let latency baselines learn. Degraded counts too - an engine that reserves 92% of
            # VRAM up front would otherwise never learn (the 1.5x ceiling guards the baseline).
            last_failure = self.signals.last_failure_at
            if self.suspect or (
                last_failure is not None and now - last_failure <= h.evaluate_interval
            ):
                self.backoff.unhealthy()
            else:
                self.backoff.healthy(now)
                self.signals.learn(now)
            kv = self.signals.kv_cache_usage(now)
            why = conditions.degrade_reasons(sc, self._inputs, kv, h)
            if st is State.READY and why:
                return (self._move(Event.DEGRADE, now, "degraded", "; ".join(why)),)
            if st is State.DEGRADED and conditions.recovered(sc, self._inputs, kv, h):
                return (
                    self._move(
                        Event.RECOVER,
                        now,
                        "cleared",
                        f"degraded conditions cleared (score {sc:.0f})",
                    ),
                )
            return _NOTHING
        if st is State.EJECTED:
            good = sc is not None and sc > h.rejoin_above
            self._good_evals = self._good_evals + 1 if good else 0
            if self._good_evals >= h.rejoin_after and self.backoff.elapsed(now):
                blocker = conditions.rejoin_blocker(
                    self.signals,
                    now,
                    engine_ready=self._ready,
                    probe_ok_since_eject=self._probe_ok_since_eject,
                    micro_ok_since_eject=self._micro_ok_since_eject,
                    require_micro=self._require_micro,
                )
                if blocker is None:
                    return (
                        self._move(
                            Event.REJOIN_OK,
                            now,
                            "rejoin",
                            f"score above {h.rejoin_above:g} for {self._good_evals} evaluations "
                            f"after {now - self.since:.1f}s ejected; probation "
                            f"{self.probation.duration:g}s",
                        ),
                    )
            return _NOTHING
        if st is State.PROBATION:
            if low:
                return self._eject(
                    now,
                    Event.PROBATION_FAILED,
                    "score",
                    f"score {sc:.0f} < {h.eject_below:g} during probation",
                )
            return _NOTHING
        if st is State.COLD or st is State.WARMING:
            return self._maybe_ready(now)
        return _NOTHING

    def _probation_tick(self, now: float) -> Sequence[Transition]:
        p = self.probation
        if not p.done(now):
            r = p.ramp(now)
            if r != self.ramp:
                self.ramp = r
                self._publish()
            return _NOTHING
        ratio = self.signals.latency_ratio(now)
        own = self.signals.latency_s(now)
        peers = self.peer_latency(now) if own is not None else None
        shortfall = p.shortfall(ratio, own, peers)
        if shortfall is not None:
            return self._eject(now, Event.PROBATION_FAILED, "probation", shortfall)
        lat = "unknown" if ratio is None else f"{ratio:.2f}x baseline"
        if p.excused_by_peers(ratio, own, peers):
            assert own is not None and peers is not None
            lat += (
                f" but {own * 1000:.0f} ms against its peers' {peers * 1000:.0f} ms "
                "(the slowdown is shared)"
            )
        return (
            self._move(
                Event.PROBATION_PASSED,
                now,
                "recovered",
                f"recovered: {p.duration:g}s probation passed, {p.micro_ok} micro-inferences "
                f"ok, latency {lat}",
            ),
        )

    # -- operator -----------------------------------------------------------------------------

    def drain(self, now: float) -> Sequence[Transition]:
        """Take out of rotation by hand (idempotent)."""
        if self.state is State.DRAINED:
            return _NOTHING
        return (self._move(Event.DRAIN, now, "drain", "drained by operator"),)

    def undrain(self, now: float) -> Sequence[Transition]:
        """Return a drained backend: to cold, then ready at once if the engine is known ready."""
        if self.state is not State.DRAINED:
            return _NOTHING
        out = [self._move(Event.UNDRAIN, now, "undrain", "undrained by operator")]
        if self._ready is False:
            why = f"engine not ready: {self._ready_reason}"
            out.append(self._move(Event.NOT_READY, now, "not_ready", why))
        else:
            out.extend(self._maybe_ready(now))
        return out

    def eject(self, now: float, reason: str = "admin") -> Sequence[Transition]:
        """Eject by hand; the backend comes back through the usual rejoin and probation."""
        if self.state is State.EJECTED:
            return _NOTHING
        words = "ejected by operator" if reason == "admin" else f"ejected by operator: {reason}"
        return self._eject(now, Event.ADMIN_EJECT, "admin", words)

    def set_models(self, models: frozenset[str]) -> None:
        """Replace the model list (discovered from /v1/models)."""
        self.models = models

    # -- internals ----------------------------------------------------------------------------

    def _eject(self, now: float, event: Event, cause: str, reason: str) -> Sequence[Transition]:
        out = self.backoff.eject(now)
        # Time to first token of client requests is measured only while clients are sent:
        # after an ejection the last samples describe the sick spell, and would still weigh
        # the backend down for up to 30 s into probation. Probes keep their own latencies.
        self.signals.forget_ttft()
        self._probe_ok_since_eject = False
        self._micro_ok_since_eject = False
        self.suspect = False
        self._overdue_reports = 0
        return (self._move(event, now, cause, f"{reason}; out for at least {out:.1f}s"),)

    def _move(self, event: Event, now: float, cause: str, reason: str) -> Transition:
        frm = self.state
        to = transition(frm, event)
        self.state = to
        self.since = now
        self.last_cause = cause
        self.last_reason = reason
        both_routable = frm in (State.READY, State.DEGRADED) and to in (State.READY, State.DEGRADED)
        if not both_routable:
            self._low_evals = 0
            self._good_evals = 0
        if to is State.PROBATION:
            self.probation.start(now)
            self.ramp = self.probation.ramp(now)
            # Envoy: counters reset on un-eject, so one failure after return is one, not six.
            self.signals.reset_request_failures()
        else:
            self.ramp = 1.0
        self._refresh(now)
        return Transition(
            backend=self.name,
            from_state=frm,
            to_state=to,
            event=event,
            cause=cause,
            reason=reason,
            at=now,
            score=self.score,
            signals=self.signals.snapshot(now),
        )

    def _refresh(self, now: float) -> None:
        """Recompute score, weight and rtt from the signals, and publish the verdict."""
        s = self.signals
        inputs = s.score_inputs(now)
        self._inputs = inputs
        self.score = score(inputs, self._h.weights)
        self._base_weight = routing_weight(self.score, inputs.latency_ratio, inputs.error_rate)
        self._rtt_s = s.rtt_s(now)
        self._prefix_hit = s.prefix_cache_hit_rate(now)
        gf = inputs.gpu_free
        self._pickable = gf is None or gf >= GPU_FREE_MIN
        self._publish()

    def _learn_capacity(self, f: EngineFacts) -> None:
        """For `max_inflight: auto`: the most requests the engine runs at once. A reported
        capacity is taken as it is; otherwise the largest batch seen while requests waited
        in the engine's own queue (a full batch: vLLM does not export max_num_seqs)."""
        if self.config.max_inflight != MAX_INFLIGHT_AUTO:
            return
        if f.capacity is not None and f.capacity >= 1:
            limit = int(f.capacity)
        elif f.queue_waiting and f.running and f.running > self._auto_limit:
            limit = int(f.running)
        else:
            return
        if limit != self._auto_limit:
            self._auto_limit = limit
            self._publish()

    def _check_pickable(self, now: float) -> None:
        gf = self.signals.memory_free(now)
        pickable = gf is None or gf >= GPU_FREE_MIN
        if pickable != self._pickable:
            self._pickable = pickable
            self._publish()

    def _clear_suspect(self) -> None:
        self.suspect = False
        self._overdue_reports = 0
        self._publish()

    def _build_verdict(self) -> Verdict:
        w = 0.0
        aw = self.config.weight
        if self.state is State.PROBATION:
            aw *= self.ramp
        if self.suspect:
            aw *= SUSPECT_FACTOR
        if self.state in ROUTABLE and self._pickable:
            w = self._base_weight * aw
        c = self.config
        return Verdict(
            name=self.name,
            state=self.state,
            score=0.0 if self.score is None else round(self.score, 2),
            weight=w,
            zone=c.zone,
            region=c.region,
            rtt_s=self._rtt_s,
            gpu_free_ratio=self._inputs.gpu_free,
            prefix_cache_hit_rate=self._prefix_hit,
            max_inflight=self._auto_limit
            if c.max_inflight == MAX_INFLIGHT_AUTO
            else c.max_inflight,
            affinity_weight=aw,
        )

    def _publish(self) -> None:
        v = self._build_verdict()
        if v != self._verdict:
            self._verdict = v
            self.version += 1


def _no_peers(now: float) -> float | None:
    return None
