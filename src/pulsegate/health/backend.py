"""One backend's health: signals + state machine + the rules that fire its events.

Rules (every number is a config key or a named constant in the unit named):

- Hard evidence ejects AT ONCE from ready/degraded: heartbeat misses reaching
  `probes.heartbeat.misses_to_dead` (cause heartbeat), `probes.canary.failures_to_isolate`
  canary failures in a row (canary), `probes.micro_inference.failures_to_eject` micro-inference
  failures in a row (micro_inference), `health.consecutive_failures` real requests failing in a
  row (consecutive_failures), first-byte-overdue evidence reported twice plus any failing
  probe (stalled, `suspect`), and a readiness probe refused: nothing listens on the engine's
  port (engine_down). One blip never ejects: apart from the refused port, every one of these
  needs a streak. On probation it fails at once (below); in any other state hard evidence
  ejects nothing (`machine.FAILURE_EVENTS`, applied by `_apply`).
- The score ejects only after `eject_after` evaluations in a row under `eject_below` (cause
  score), and only while it rests on at least two known dimensions: with the error rate as the
  only signal the renormalised score is the error sub-score, and R17 says error rate alone
  misjudges (`conditions.score_low`). Evaluations run in `tick` every `health.evaluate_interval`
  (`evaluation`).
- GPU faults in an agent's pong (`gpu_faults`): a fatal Xid (gpu_xid), double-bit ECC errors
  or a pending row remap (gpu_ecc) eject at once and block ready/rejoin while reported;
  hardware/thermal clock throttling degrades (gpu_throttle) and holds off recovery.
- Degraded (routable, down-weighted): score under `degrade_below`, VRAM more than 90% used or
  KV cache more than 95% full; back to ready with hysteresis (`conditions`).
- Free VRAM under 5% (R5): weight 0 at once (never picked), degraded at the next evaluation,
  and it blocks rejoining - but it is not by itself an ejection: engines such as vLLM reserve
  most of the GPU up front, so a low-memory gauge alone is weak evidence (R17). The failures
  an OOM causes eject through the streak rules.
- FirstByteOverdue: suspect at once (weight x 0.05, fast probing); cleared by a successful
  request or micro/canary probe (`suspect`).
- Ejected: out for the backoff (`backoff.Backoff`), still probed and scored. Leaves only when
  the backoff is over AND the score was above `rejoin_above` for `rejoin_after` evaluations in a
  row AND the hard evidence is clear: last heartbeat answered, last micro-inference and canary
  ok, the engine not saying "not ready", a micro-inference passed since the ejection, VRAM >= 5%
  free (`conditions.rejoin_blocker`, `evidence`). Then probation.
- Probation (`probation.Probation`): any failure (request, probe, heartbeat death, refused
  port, not ready, score under eject_below) ejects again with n + 1; passing (a micro-inference
  ran, latency back to normal) returns to ready with ramp 1.
- Cold/warming: the engine saying "not ready" -> warming; ready plus a micro-inference passed
  since any "not ready", with no hard evidence -> ready (`evidence`). Never routable (R25).
- Drained: operator only; undrain returns to cold, and readiness is re-checked at once.
- `max_inflight: auto`: the limit follows the engine's batch capacity (`auto_limit`).

Verdict numbers (score, weight, rtt) are refreshed at each evaluation and on discrete events
(state change, suspect, VRAM crossing 5%, ramp step), not on every request: the balancer's
in-flight counts carry the instant load, and the routable cache stays valid between.

`BackendHealth` folds each observation into the signals and the evidence, asks `rules` what
fires, and applies it (`_apply`: the one place a hard failure becomes an event); `evaluation`
runs the periodic judgement; `standing` holds the state and the verdict the balancer reads;
`retune` hands a reloaded config to each of them (`reconfigure`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health import conditions, connects, gpu_faults, retune, rules, slowness
from pulsegate.health.backoff import Backoff
from pulsegate.health.cadence import Cadence, cadence
from pulsegate.health.evaluation import Evaluation
from pulsegate.health.events import Transition
from pulsegate.health.evidence import Evidence
from pulsegate.health.machine import Event, failure_event, transition
from pulsegate.health.observations import (
    ConnectResult,
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
from pulsegate.health.rules import Fire
from pulsegate.health.signals import Signals
from pulsegate.health.standing import Standing
from pulsegate.health.verdict import State, Verdict

_NOTHING: tuple[Transition, ...] = ()


class BackendHealth:
    """Health of one backend. Feed it with `observe`, drive time with `tick`."""

    def __init__(
        self,
        config: BackendConfig,
        health: HealthConfig,
        probes: ProbesConfig,
        rng: random.Random,
        now: float,
    ) -> None:
        self.config, self.name = config, config.name
        self.models: frozenset[str] = frozenset(config.models)  # /v1/models: set by the fleet
        self._h, self._p = health, probes
        self.signals = Signals(health.ewma_alpha)
        self.backoff = Backoff(health.ejection_base, health.ejection_max, rng)
        self.probation = Probation(health.probation.duration, health.probation.ramp_step)
        self.evidence = Evidence()
        self.gpu = gpu_faults.GpuWatch()  # Xid / ECC / throttle evidence from the agent
        self.slow = slowness.SlowWatch(self.signals)  # 3x slower than its peers: degraded
        self.connects = connects.ConnectWatch(health.connect_failures)  # new ones failing
        self._st = Standing(config, health.weights, self.signals, self.probation, now)
        # Set by the fleet: the peers' median probe latency, for `rules.probation_end` (None).
        self.peer_latency: Callable[[float], float | None] = _no_peers
        self._evaluation = Evaluation(
            health, probes, self.signals, self.backoff, self.evidence, self.probation, now
        )

    # -- public reads -------------------------------------------------------------------------

    @property
    def state(self) -> State:
        """Where the backend is in the state machine (`machine`)."""
        return self._st.state

    @property
    def version(self) -> int:
        """Moves whenever the verdict, or whether panic may route here (`dead`), changes."""
        return self._st.version

    @property
    def score(self) -> float | None:
        """The 0-100 score as of the last evaluation or transition (None: nothing known)."""
        return self._st.weighing.score

    @property
    def ramp(self) -> float:
        """The probation ramp (1.0 outside probation)."""
        return self._st.ramp

    @property
    def suspect(self) -> bool:
        """First bytes overdue, not cleared since (`suspect`)."""
        return self._st.suspicion.active

    @property
    def weight(self) -> float:
        """Effective routing weight now (0 when not routable outside panic)."""
        return self._st.verdict.weight

    def verdict(self) -> Verdict:
        """The backend as the balancer sees it (outside panic)."""
        return self._st.verdict

    def panic_verdict(self) -> Verdict:
        """The verdict of an ejected-but-alive backend routed in panic mode (least-bad first)."""
        return self._st.panic_verdict()

    @property
    def dead(self) -> bool:
        """Never routed, even in panic: hard evidence present now (a failure streak at its
        limit), the engine saying it is not ready, or VRAM under 5% free."""
        return (
            self.evidence.not_ready
            or self.gpu.hard
            or not self._st.weighing.pickable
            or conditions.hard_evidence(self.signals, self._h, self._p) is not None
        )

    def cadence(self, now: float) -> Cadence:
        """Slow or fast probing (`cadence`)."""
        return cadence(self.state, self.suspect, self.signals, now)

    def next_due(self, now: float) -> float:
        """The next time `tick` has something to do (evaluation or probation ramp step)."""
        t = self._evaluation.next_at
        if self.state is State.PROBATION:
            t = min(t, self.probation.next_step_at(now))
        return t

    def snapshot(self, now: float) -> dict[str, object]:
        """State, numbers and signals for the admin API and the dashboard."""
        st = self._st
        v = st.verdict
        on_probation = st.state is State.PROBATION
        return {
            "state": st.state.value,
            "score": v.score,
            "score_known": self.score is not None,
            "weight": round(v.weight, 6),
            "ramp": st.ramp,
            "max_inflight": v.max_inflight,  # 0: no limit (or `auto`, unknown yet)
            "suspect": st.suspicion.active,
            "since": st.since,
            "signals": self.signals.snapshot(now),
            "ejections": self.backoff.total,
            "ejection_multiplier": self.backoff.n,
            "ejected_until": self.backoff.until if st.state is State.EJECTED else None,
            "last_cause": st.last_cause,
            "last_reason": st.last_reason,
            "probation_progress": round(self.probation.progress(now), 4) if on_probation else None,
            "cadence": self.cadence(now).value,
            "dead": self.dead,
        }

    # -- observations -------------------------------------------------------------------------

    def observe(self, obs: Observation, now: float) -> Sequence[Transition]:
        """Fold one observation in; returns the transitions it caused (usually none)."""
        if self._st.state is not State.EJECTED:
            return self._observe(obs, now)
        # An ejected backend's verdict does not change, but whether panic mode may route to it
        # (`dead`) does: move `version` so the fleet's routable cache is rebuilt.
        was = self.dead
        out = self._observe(obs, now)
        if self.dead is not was:
            self._st.touch()
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
                self._st.learn(obs, now)
                return _NOTHING
            case FirstByteOverdue():
                if obs.count > 0:
                    self.signals.last_failure_at = now
                    self._st.suspect(obs)
                return _NOTHING
            case ConnectResult():
                return self._apply(self.connects.observe(obs, self._h.connect_failures, now), now)
        raise TypeError(f"not an observation: {obs!r}")

    def _on_request(self, r: RequestResult, now: float) -> Sequence[Transition]:
        outcome = r.outcome
        if outcome is Outcome.OK:
            self.signals.record_request_ok(r.ttft_s, now)
            if self._st.suspicion.cleared_by(r.ttft_s):  # a late success clears nothing
                self._st.clear_suspect()
            return _NOTHING
        if not outcome.is_failure:
            return _NOTHING  # overloaded, client error, cancelled: not evidence of sickness
        self.signals.record_request_failure(outcome, r.status, now)
        return self._apply(rules.request_failure(self.state, self.signals, self._h), now)

    def _on_heartbeat(self, hb: Heartbeat, now: float) -> Sequence[Transition]:
        self.signals.record_heartbeat(hb, now)
        if hb.facts is not None:
            self._st.learn(hb.facts, now)
        if hb.rtt_s is not None:
            return self._apply(self.gpu.on_pong(self.state, hb.facts), now)
        return self._apply(rules.heartbeat_death(self.signals, self._p), now)

    def _on_probe(self, p: ProbeResult, now: float) -> Sequence[Transition]:
        self.signals.record_probe(p, now)
        if p.kind is ProbeKind.READINESS:
            return self._on_readiness(p, now)
        st = self._st
        micro = p.kind is ProbeKind.MICRO
        if micro:
            self.evidence.on_micro(p.ok)
        if p.ok:
            if micro and st.state is State.PROBATION:
                self.probation.micro_passed()
            st.clear_suspect()
            return self._apply(self._ready_seen(now), now)
        if st.state is State.COLD:
            # Never routable yet, so no transition; but the operator must see why it stays
            # out (vLLM that cannot run its model passes /health and fails its first
            # micro-inference: `cold` with an empty reason told nothing).
            st.last_reason = rules.probe_failure_words(p.kind, self.signals)
            return _NOTHING
        fire = rules.probe_failure(st.state, p.kind, self.signals, self._p, st.suspicion)
        return self._apply(fire, now)

    def _on_readiness(self, p: ProbeResult, now: float) -> Sequence[Transition]:
        ev = self.evidence
        if not p.ok:
            # Unreachable or timed out says nothing about loading: an error for the streak
            # rules (a hung engine is sick, not warming). Refused: out at once, before clients.
            if not p.refused:
                return _NOTHING
            ev.on_refused()
            fire = rules.engine_down(p)
            if self.state is State.COLD or self.state is State.WARMING:
                self._st.last_reason = fire.reason
            return self._apply(fire, now)
        if p.ready is False:
            ev.on_not_ready(p.reason)
            return self._apply(rules.not_ready(self.state, ev.ready_reason), now)
        if ev.on_ready():
            # A new engine process answers where the old one was gone: the failures counted
            # while nothing listened describe the outage, not this process. Without this a
            # restart after a long outage waited 30-40 s for the error rate to decay.
            self.signals.forget_outage()
        return self._apply(self._ready_seen(now), now)

    def _ready_seen(self, now: float) -> Fire | None:
        fire = rules.ready_seen(self.state, self.evidence, self.signals, self._h, self._p)
        return self.connects.gate(self.gpu.gate(fire), now)

    # -- time ---------------------------------------------------------------------------------

    def tick(self, now: float) -> list[Transition]:
        """Run what is due at `now`: an evaluation every evaluate_interval, probation steps."""
        was = self.dead if self.state is State.EJECTED else None
        out = self._tick(now)
        if was is not None and self.state is State.EJECTED and self.dead is not was:
            self._st.touch()  # stale VRAM gauge forgotten: see `observe`
        return out

    def _tick(self, now: float) -> list[Transition]:
        out: list[Transition] = []
        if self._evaluation.due(now):
            self._st.refresh(now, self.slow.weight_ratio(now))
            fire = self.slow.judge(self.state, self._evaluation.judge(self._st, now), now)
            out.extend(self._apply(self.connects.gate(self.gpu.gate(fire), now), now))
        if self.state is State.PROBATION:
            p = self.probation
            if not p.done(now):
                self._st.step_ramp(now)
            else:
                own = self.signals.latency_s(now)
                peers = self.peer_latency(now) if own is not None else None
                fire = rules.probation_end(p, self.signals.latency_ratio(now), own, peers)
                out.extend(self._apply(fire, now))
        return out

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
        ev, st = self.evidence, self.state  # cold, after the move
        fire = rules.not_ready(st, ev.ready_reason) if ev.not_ready else self._ready_seen(now)
        out.extend(self._apply(fire, now))
        return out

    def eject(self, now: float, reason: str = "admin") -> Sequence[Transition]:
        """Eject by hand; the backend comes back through the usual rejoin and probation."""
        if self.state is State.EJECTED:
            return _NOTHING
        words = "ejected by operator" if reason == "admin" else f"ejected by operator: {reason}"
        return (self._move(Event.ADMIN_EJECT, now, "admin", words),)

    def reconfigure(self, c: BackendConfig, h: HealthConfig, p: ProbesConfig, now: float) -> None:
        """Same engine, reloaded config: new numbers, same knowledge (`retune`, which see)."""
        self.config, self.models, self._h, self._p = c, retune.models(c, self.models), h, p
        retune.retune(self, h, p, self._st, self._evaluation, now)

    # -- internals ----------------------------------------------------------------------------

    def _apply(self, fire: Fire | None, now: float) -> Sequence[Transition]:
        """Make what a rule fired happen. Hard failure evidence (no event) fires what the state
        says (`machine.FAILURE_EVENTS`): an ejection, a failed probation, or nothing."""
        if fire is None:
            return _NOTHING
        event = failure_event(self.state) if fire.event is None else fire.event
        if event is None:
            return _NOTHING
        return (self._move(event, now, fire.cause, fire.reason),)

    def _move(self, event: Event, now: float, cause: str, reason: str) -> Transition:
        frm = self.state
        to = transition(frm, event)
        if to is State.EJECTED:
            reason = f"{reason}; out for at least {self.backoff.eject(now):.1f}s"
            # Time to first token of client requests is measured only while clients are sent:
            # after an ejection the last samples describe the sick spell, and would still weigh
            # the backend down for up to 30 s into probation. Probes keep their own latencies.
            self.signals.forget_ttft()
            self.evidence.on_eject()
            self._st.suspicion.clear()
        self._evaluation.moved(frm, to)
        return self._st.move(event, now, cause, reason)


def _no_peers(now: float) -> float | None:
    return None
