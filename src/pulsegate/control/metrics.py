"""The health side's metrics, defined in one place: probes, heartbeats, ejections, verdicts.

Counters and histograms are written by the health service as observations arrive; the
gauges read the fleet at scrape time. In a multi-process gateway these live in the primary
only (the proxy side's are in `proxy/metrics.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from pulsegate.clock import Clock
from pulsegate.health.fleet import Fleet
from pulsegate.health.observations import Heartbeat, Observation, ProbeResult
from pulsegate.health.verdict import ROUTABLE, State
from pulsegate.observe.metrics import Counter, Gauge, Histogram, Registry

Samples = Iterable[tuple[tuple[str, ...], float]]


class HealthMetrics:
    __slots__ = (
        "_clock",
        "_fleet",
        "ejections",
        "heartbeat_misses",
        "probe",
        "probe_failures",
        "reloads",
        "rtt",
    )

    def __init__(
        self,
        r: Registry,
        fleet: Fleet,
        clock: Clock,
        below_min: Callable[[], Samples],
    ) -> None:
        self._fleet = fleet
        self._clock = clock
        self.ejections: Counter = r.counter(
            "pulsegate_ejections_total", "Ejections by backend and reason", ("backend", "reason")
        )
        self.probe: Histogram = r.histogram(
            "pulsegate_probe_seconds", "Active probe latency", ("backend", "kind")
        )
        self.rtt: Histogram = r.histogram(
            "pulsegate_heartbeat_rtt_seconds", "Heartbeat round-trip time", ("backend",)
        )
        self.probe_failures: Counter = r.counter(
            "pulsegate_probe_failures_total",
            "Active probes that failed (no answer in time, refused, error status)",
            ("backend", "kind"),
        )
        self.heartbeat_misses: Counter = r.counter(
            "pulsegate_heartbeat_misses_total",
            "Heartbeats missed, by reason",
            ("backend", "reason"),
        )
        self.reloads: Counter = r.counter(
            "pulsegate_config_reloads_total",
            "Config reloads (SIGHUP, /admin/reload), by result: ok, refused",
            ("result",),
        )
        r.add(Gauge("pulsegate_backend_score", "Health score 0-100", ("backend",), self._scores))
        r.add(
            Gauge(
                "pulsegate_event_loop_tasks",
                "asyncio tasks alive in this process's event loop (the health process's with "
                "gateway.workers > 1): flat under steady load, or something leaks",
                (),
                _tasks,
            )
        )
        r.add(
            Gauge(
                "pulsegate_event_loop_stall_seconds_total",
                "Time this gateway's event loop stood still (ticks over 40 ms late); deadlines "
                "that passed meanwhile are not held against backends",
                (),
                self._stall_seconds,
                kind="counter",
            )
        )
        r.add(
            Gauge(
                "pulsegate_backend_state",
                "1 for the backend's current state",
                ("backend", "state"),
                self._states,
            )
        )
        r.add(Gauge("pulsegate_backend_weight", "Effective weight", ("backend",), self._weights))
        r.add(Gauge("pulsegate_panic", "1 while in panic mode", (), self._panic))
        r.add(
            Gauge(
                "pulsegate_model_ready",
                "Ready backends per model (routable: ready, degraded, probation)",
                ("model",),
                self._model_ready,
            )
        )
        r.add(
            Gauge(
                "pulsegate_model_below_min_ready",
                "1 while a model has fewer ready backends than routing.min_ready",
                ("model",),
                below_min,
            )
        )

    def observed(self, name: str, obs: Observation) -> None:
        """Count what an observation says about probes and heartbeats."""
        if type(obs) is ProbeResult:
            if obs.latency_s is not None:
                self.probe.observe(obs.latency_s, (name, obs.kind.value))
            if not obs.ok:
                self.probe_failures.inc((name, obs.kind.value))
        elif type(obs) is Heartbeat:
            if obs.rtt_s is not None:
                self.rtt.observe(obs.rtt_s, (name,))
            else:
                self.heartbeat_misses.inc((name, obs.reason or "late"))

    # -- gauges -------------------------------------------------------------------------------

    def _stall_seconds(self) -> Samples:
        yield (), self._clock.stall_total_s

    def _snapshots(self) -> Iterable[tuple[str, dict[str, object]]]:
        fleet = self._fleet
        for name in fleet.names():
            yield name, fleet.snapshot(name)

    def _scores(self) -> Samples:
        for name, s in self._snapshots():
            if s.get("score_known", True):  # an unknown score is absent, not 0
                yield (name,), float(s["score"])  # type: ignore[arg-type]

    def _weights(self) -> Samples:
        for name, s in self._snapshots():
            yield (name,), float(s["weight"])  # type: ignore[arg-type]

    def _states(self) -> Samples:
        for name, s in self._snapshots():
            for st in State:
                yield (name, st.value), 1.0 if s["state"] == st.value else 0.0

    def _panic(self) -> Samples:
        yield (), 1.0 if self._fleet.panic else 0.0

    def _model_ready(self) -> Samples:
        for m, n in sorted(ready_counts(self._fleet).items()):
            yield (m,), float(n)


def ready_counts(fleet: Fleet) -> dict[str, int]:
    """Routable backends per model."""
    counts = dict.fromkeys(fleet.models(), 0)
    for name in fleet.names():
        if fleet.state(name) in ROUTABLE:
            for m in fleet.backend_models(name):
                counts[m] = counts.get(m, 0) + 1
    return counts


def _tasks() -> list[tuple[tuple[str, ...], float]]:
    try:
        return [((), float(len(asyncio.all_tasks())))]
    except RuntimeError:  # no running loop (a scrape is always on it)
        return []
