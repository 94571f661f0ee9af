"""Simpler gateways, for the chaos lab to measure pulsegate against (`gateway.mode`).

- `round_robin`: no health at all; every backend of the model in turn (a plain L7 proxy).
- `polling`: the seeds' "traditional" probe: `GET /health` every `probes.readiness.interval`
  (5 s in the lab), 3 consecutive failures take a backend out, one success brings it back.
- `passive`: outlier ejection from real traffic only (Envoy's consecutive-5xx): after
  `health.consecutive_failures` failures in a row a backend is out for ejection_base x n,
  capped at ejection_max, then simply back.

Same proxy path, retries and retry budget as pulsegate; only the routing verdicts differ.
Pure: `now` is passed in; the polling driver lives in the gateway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pulsegate.config import BackendConfig, Config
from pulsegate.health.observations import Observation, RequestResult
from pulsegate.health.verdict import State, Verdict

POLL_FAILURES_TO_EJECT = 3


@dataclass(frozen=True, slots=True)
class BaselineEvent:
    backend: str
    from_state: str
    to_state: str
    cause: str
    reason: str


class Baseline:
    def __init__(self, mode: str, config: Config) -> None:
        self.mode = mode
        self._h = config.health
        self._backends = {b.name: b for b in config.backends}
        self._verdicts = {b.name: _verdict(b) for b in config.backends}
        self._out_until: dict[str, float] = {}  # passive: out until then
        self._out: set[str] = set()
        self._streak: dict[str, int] = dict.fromkeys(self._backends, 0)
        self._ejections: dict[str, int] = dict.fromkeys(self._backends, 0)
        self._rr: dict[str, int] = {}
        self._by_model: dict[str, tuple[str, ...]] = {}
        for b in config.backends:
            for m in b.models:
                self._by_model[m] = (*self._by_model.get(m, ()), b.name)

    def models(self) -> set[str]:
        return set(self._by_model)

    def state(self, name: str) -> str:
        return "ejected" if name in self._out else "ready"

    def pick(self, model: str, tried: Sequence[str]) -> Verdict | None:
        names = self._by_model.get(model, ())
        n = len(names)
        start = self._rr.get(model, 0)
        self._rr[model] = start + 1
        for i in range(n):
            name = names[(start + i) % n]
            if name not in self._out and name not in tried:
                return self._verdicts[name]
        return None

    def observe(self, name: str, obs: Observation, now: float) -> list[BaselineEvent]:
        """Passive mode: consecutive failures on real traffic eject for a backoff."""
        if self.mode != "passive" or type(obs) is not RequestResult:
            return []
        if not obs.outcome.is_failure:
            if obs.outcome.value == "ok":
                self._streak[name] = 0
            return []
        self._streak[name] += 1
        if self._streak[name] < self._h.consecutive_failures or name in self._out:
            return []
        self._ejections[name] += 1
        backoff = min(self._h.ejection_max, self._h.ejection_base * self._ejections[name])
        self._out.add(name)
        self._out_until[name] = now + backoff
        self._streak[name] = 0
        why = f"{self._h.consecutive_failures} consecutive failures; out for {backoff:.1f}s"
        return [BaselineEvent(name, "ready", "ejected", "consecutive_failures", why)]

    def tick(self, now: float) -> list[BaselineEvent]:
        out = []
        for name, until in list(self._out_until.items()):
            if now >= until:
                del self._out_until[name]
                self._out.discard(name)
                out.append(BaselineEvent(name, "ejected", "ready", "backoff", "backoff elapsed"))
        return out

    def poll(self, name: str, ok: bool, reason: str) -> list[BaselineEvent]:
        """Polling mode: one `/health` result."""
        if ok:
            self._streak[name] = 0
            if name in self._out:
                self._out.discard(name)
                return [BaselineEvent(name, "ejected", "ready", "health", "/health ok")]
            return []
        self._streak[name] += 1
        if self._streak[name] >= POLL_FAILURES_TO_EJECT and name not in self._out:
            self._out.add(name)
            why = f"/health failed {POLL_FAILURES_TO_EJECT}x: {reason}"
            return [BaselineEvent(name, "ready", "ejected", "health", why)]
        return []


def _verdict(b: BackendConfig) -> Verdict:
    return Verdict(b.name, State.READY, 100.0, b.weight, b.zone, b.region)
