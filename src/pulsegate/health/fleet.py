"""The fleet: every backend's health, the routable verdicts per model, and panic mode.

The only object the shells talk to. `observe` is on the request path (once per client request
attempt) and does no allocation on the OK path; `tick` runs evaluations, timers and probation
steps; `routable(model)` is cached and rebuilt only when `version` moved.

Panic (Envoy's panic threshold, per model): when more than `health.max_ejected_fraction` of a
model's in-service backends (ready, degraded, probation or ejected: cold, warming and drained
ones are not counted) are ejected, the detector is more likely wrong -
or the whole pool is sick - than the model unservable. The model's routable set then also
holds its ejected backends that are not dead (no failure streak at its limit, the engine not
saying "not ready", VRAM >= 5%), each flagged `panic=True` with its score-derived weight (at
least 1%), so the least bad get the most. Entering and leaving panic are recorded as
`PanicChange`s, collected with `take_panic_changes()`.

Hot reload (`reconfigure`, rules in `reload`): backends are matched by name; a new name or a
new url starts cold, a name gone leaves at once (its late observations are ignored), the rest
keep what is known under the new config.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Sequence

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health import reload, slowness
from pulsegate.health.backend import BackendHealth
from pulsegate.health.cadence import Cadence
from pulsegate.health.events import PanicChange, Transition
from pulsegate.health.observations import Observation
from pulsegate.health.reload import Reconfigured as Reconfigured  # re-exported: its result
from pulsegate.health.verdict import State, Verdict

_NO_VERDICTS: tuple[Verdict, ...] = ()
_NO_TRANSITIONS: tuple[Transition, ...] = ()
# Backends counted for the panic threshold: those that could carry traffic had they been
# healthy. Cold, warming and drained ones could not either way, so they do not dilute it.
_IN_SERVICE = frozenset({State.READY, State.DEGRADED, State.PROBATION, State.EJECTED})


class Fleet:
    """Health of every backend; verdicts for the balancer (R26)."""

    def __init__(
        self,
        backends: Sequence[BackendConfig],
        health: HealthConfig,
        probes: ProbesConfig,
        rng: random.Random,
        now: float,
    ) -> None:
        self._health = health
        self._rng = rng
        self._peers = slowness.FleetPeers()  # who each backend is compared with
        self._order: tuple[BackendHealth, ...] = tuple(
            self._fresh(b, health, probes, now) for b in backends
        )
        self._by_name = {b.name: b for b in self._order}
        if len(self._by_name) != len(self._order):
            raise ValueError("backend names must be unique")
        self._groups: dict[str, tuple[BackendHealth, ...]] = {}
        self._regroup()
        self.version = 0  # moves whenever any verdict or the panic set changes
        self._cache: dict[str | None, tuple[int, tuple[Verdict, ...]]] = {}
        self._panic: set[str] = set()
        self._panic_changes: list[PanicChange] = []
        self._now = now

    # -- feeding ------------------------------------------------------------------------------

    def observe(self, name: str, obs: Observation, now: float) -> Sequence[Transition]:
        """Fold one observation about backend `name` in; returns the transitions it caused.

        An unknown name gets none and changes nothing. (It raised KeyError before hot reload:
        now a request or probe in flight when `reconfigure` removed its backend still reports
        its outcome, and that is no caller bug.)"""
        b = self._by_name.get(name)
        if b is None:
            return _NO_TRANSITIONS
        if now > self._now:
            self._now = now
        v = b.version
        out = b.observe(obs, now)
        self._peers.moved()
        if b.version != v:
            self.version += 1
            if out:
                self._update_panic(now)
        return out

    def tick(self, now: float) -> list[Transition]:
        """Run evaluations, timers and probation steps due at `now` (call every ~100 ms; see
        `next_tick`)."""
        if now > self._now:
            self._now = now
        out: list[Transition] = []
        changed = False
        for b in self._order:
            v, state = b.version, b.state
            out.extend(b.tick(now))
            if b.version != v:
                changed = True
            if b.state is not state:
                self._peers.moved()  # a set of peers changed
        if changed:
            self.version += 1
        if out:
            self._update_panic(now)
        return out

    def next_tick(self, now: float) -> float:
        """The earliest time `tick` has something to do."""
        return min((b.next_due(now) for b in self._order), default=now + 1.0)

    def reconfigure(
        self,
        backends: Sequence[BackendConfig],
        health: HealthConfig,
        probes: ProbesConfig,
        now: float,
    ) -> Reconfigured:
        """Take a reloaded backend list and `health`/`probes` sections (`reload`): added and
        restarted (new url) backends start cold, removed ones leave at once, kept ones keep
        their state under the new config. routable() and panic reflect the new set at once.

        Raises ValueError for a repeated name, with nothing changed."""
        fresh = functools.partial(self._fresh, h=health, p=probes, now=now)
        plan, self._order = reload.rebuild(self._by_name, backends, health, probes, now, fresh)
        if now > self._now:
            self._now = now
        self._health = health
        self._by_name = {b.name: b for b in self._order}
        self._regroup()
        self._cache.clear()  # models gone must not linger in it
        self.version += 1
        self._update_panic(now)
        return plan

    # -- operator -----------------------------------------------------------------------------

    def drain(self, name: str, now: float) -> list[Transition]:
        """Take backend `name` out of rotation (idempotent)."""
        return self._admin(name, now, self._by_name[name].drain(now))

    def undrain(self, name: str, now: float) -> list[Transition]:
        """Return a drained backend (to cold; to ready at once if its engine is ready)."""
        return self._admin(name, now, self._by_name[name].undrain(now))

    def eject(self, name: str, now: float, reason: str = "admin") -> list[Transition]:
        """Eject backend `name` by hand; it returns through the usual rejoin and probation."""
        return self._admin(name, now, self._by_name[name].eject(now, reason))

    def _admin(self, name: str, now: float, out: Sequence[Transition]) -> list[Transition]:
        if now > self._now:
            self._now = now
        self._peers.moved()
        if out:
            self.version += 1
            self._update_panic(now)
        return list(out)

    def set_models(self, name: str, models: Iterable[str]) -> None:
        """Set the models backend `name` serves (discovered from its /v1/models). A name a
        reload removed is ignored: its last probe may answer after the reload."""
        b = self._by_name.get(name)
        if b is None:
            return
        new = frozenset(models)
        if new == b.models:
            return
        b.models = new
        self._regroup()
        self.version += 1
        self._update_panic(self._now)

    # -- reading ------------------------------------------------------------------------------

    def routable(self, model: str | None) -> tuple[Verdict, ...]:
        """Verdicts the balancer may pick from for `model` (None: every backend), with weight > 0.

        An unknown model gets nothing. Cached until `version` moves."""
        hit = self._cache.get(model)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        if model is None:
            group = self._order
            panic = self._over_threshold(group)[0]
        else:
            found = self._groups.get(model)
            if found is None:
                return _NO_VERDICTS  # not cached: client-chosen names must not grow memory
            group = found
            panic = model in self._panic
        verdicts = [b.verdict() for b in group if b.weight > 0.0]
        if panic:
            verdicts += [
                b.panic_verdict()
                for b in group
                if b.state is State.EJECTED and not b.dead and b.config.weight > 0.0
            ]
        result = tuple(verdicts)
        self._cache[model] = (self.version, result)
        return result

    def verdicts(self) -> tuple[Verdict, ...]:
        """Every backend's verdict, routable or not, in config order (dashboards)."""
        return tuple(b.verdict() for b in self._order)

    def models(self) -> set[str]:
        """Every model some backend serves."""
        return set(self._groups)

    def serves(self, model: str) -> bool:
        """Whether some backend serves `model` (no copy: called once per request)."""
        return model in self._groups

    def backend_models(self, name: str) -> frozenset[str]:
        """The models backend `name` serves."""
        return self._by_name[name].models

    def names(self) -> tuple[str, ...]:
        """Backend names in config order."""
        return tuple(self._by_name)

    def state(self, name: str) -> State:
        """Backend `name`'s current state."""
        return self._by_name[name].state

    def usual_ttft(self, name: str, now: float) -> float | None:
        """Backend `name`'s smoothed time to first token (None until it has one): how long a
        stream waiting for its first byte may wait before that is evidence against it."""
        return self._by_name[name].signals.ttft.value(now)

    def backend(self, name: str) -> BackendHealth:
        """The health object of backend `name` (tests, debugging)."""
        return self._by_name[name]

    def cadence(self, name: str, now: float | None = None) -> Cadence:
        """Whether backend `name` should be probed at the slow or the fast intervals (R14)."""
        return self._by_name[name].cadence(self._now if now is None else now)

    def unstable(self, name: str, now: float | None = None) -> bool:
        """True when backend `name` should be probed at the fast intervals."""
        return self.cadence(name, now) is Cadence.UNSTABLE

    @property
    def panic(self) -> bool:
        """Whether any model is in panic mode."""
        return bool(self._panic)

    @property
    def panic_models(self) -> frozenset[str]:
        """The models in panic mode."""
        return frozenset(self._panic)

    def take_panic_changes(self) -> list[PanicChange]:
        """Panic entries and exits since the last call (for the event log and alerts)."""
        out, self._panic_changes = self._panic_changes, []
        return out

    def snapshot(self, name: str, now: float | None = None) -> dict[str, object]:
        """Backend `name` for the admin API: state, score, weight, ramp, suspect, since,
        signals, ejections, last cause and reason, probation progress, cadence."""
        b = self._by_name[name]
        snap = b.snapshot(self._now if now is None else now)
        snap["panic"] = (
            b.state is State.EJECTED and not b.dead and any(m in self._panic for m in b.models)
        )
        snap["connect_failures"] = b.connects.failures  # new connections failed in a row
        return snap

    # -- internals ----------------------------------------------------------------------------

    def _fresh(
        self, c: BackendConfig, h: HealthConfig, p: ProbesConfig, now: float
    ) -> BackendHealth:
        """A new backend's health, cold, as at start."""
        b = BackendHealth(c, h, p, self._rng, now)
        b.peer_latency = functools.partial(self._peers.probe_latency, b)
        b.slow.peers = functools.partial(self._peers.of, b)
        return b

    def _regroup(self) -> None:
        groups: dict[str, list[BackendHealth]] = {}
        for b in self._order:
            for m in b.models:
                groups.setdefault(m, []).append(b)
        self._groups = {m: tuple(bs) for m, bs in sorted(groups.items())}
        self._peers.regroup(self._groups)

    def _over_threshold(self, group: Sequence[BackendHealth]) -> tuple[bool, int, int]:
        total = 0
        ejected = 0
        for b in group:
            if b.state in _IN_SERVICE:
                total += 1
                if b.state is State.EJECTED:
                    ejected += 1
        over = total > 0 and ejected / total > self._health.max_ejected_fraction
        return over, ejected, total

    def _update_panic(self, now: float) -> None:
        limit = self._health.max_ejected_fraction
        changed = False
        for model, group in self._groups.items():
            over, ejected, total = self._over_threshold(group)
            if over == (model in self._panic):
                continue
            changed = True
            if over:
                self._panic.add(model)
                reason = (
                    f"panic: {ejected}/{total} backends for {model} ejected (> {limit:.0%}); "
                    f"routing to the least-bad ejected ones that are not dead"
                )
            else:
                self._panic.discard(model)
                reason = f"panic over: {ejected}/{total} backends for {model} ejected"
            self._panic_changes.append(PanicChange(model, over, now, ejected, total, reason))
        for model in list(self._panic):
            if model not in self._groups:  # no backend serves it any more (models, reload)
                self._panic.discard(model)
                why = f"panic over: no backend serves {model}"
                self._panic_changes.append(PanicChange(model, False, now, 0, 0, why))
                changed = True
        if changed:
            self.version += 1
