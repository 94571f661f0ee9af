"""What the dashboard and `pulsegate status` need beyond `/admin/backends` and `/admin/events`.

- `GET /admin/summary` (admin-guarded): gateway totals and rates - requests/s, the error rate
  clients saw, the failure rate of backend attempts that retries hid, retries, stream resumes,
  per-backend share of traffic, panic. Rates are differences between counter samples taken
  when someone asks (at most one sample per 0.5 s, kept 30 s, rate over ~5 s): nothing runs
  while nobody watches, and the first call after a quiet spell answers `null` rates rather
  than a made-up number.
- `pulsegate_model_backends{model,state}`: how many backends serving each model are in each
  state, so an alert rule can say "every backend of model M is down" without a join.

Wire it with `register(app, gw, admin.guard)` before the catch-all route.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from pulsegate.health.verdict import State
from pulsegate.observe.metrics import Gauge
from pulsegate.observe.view import GatewayView

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Guard = Callable[[Handler], Handler]

SAMPLE_EVERY_S = 0.5  # at most this often a new counter sample is kept
KEEP_S = 30.0  # samples older than this are dropped
RATE_WINDOW_S = 5.0  # rates are taken over about this many seconds
MIN_WINDOW_S = 0.8  # a shorter window gives no rate (null) rather than a noisy one


@dataclass(frozen=True, slots=True)
class Sample:
    """The gateway's counters at one moment (monotonic seconds)."""

    t: float
    requests: int  # client requests routed (completed or failed), not attempts
    settled: float  # attempts that ended the request: 2xx/3xx, or a 4xx passed through
    attempts: dict[str, float]  # by backend
    failures: dict[str, float]  # attempts that failed, by backend
    retries: float
    resumes: float


def is_failure(code: str) -> bool:
    """An attempt's `code` label counts as a backend failure: 5xx or a transport outcome."""
    return code[:1] not in ("2", "3", "4")


def take_sample(gw: GatewayView, now: float) -> Sample:
    m = gw.proxy_metrics
    attempts: dict[str, float] = dict.fromkeys(gw.names(), 0.0)
    failures: dict[str, float] = dict.fromkeys(gw.names(), 0.0)
    settled = 0.0
    for (backend, _model, code), n in m.requests.values.items():
        attempts[backend] = attempts.get(backend, 0.0) + n
        if is_failure(code):
            failures[backend] = failures.get(backend, 0.0) + n
        else:
            settled += n
    return Sample(
        t=now,
        requests=m.request_seconds.count(),
        settled=settled,
        attempts=attempts,
        failures=failures,
        retries=sum(m.retries.values.values()),
        resumes=m.resumes.get(),
    )


class RateWindow:
    """A short history of samples; rates are the difference to the one ~5 s back."""

    def __init__(self) -> None:
        self.samples: collections.deque[Sample] = collections.deque()

    def add(self, s: Sample) -> None:
        if not self.samples or s.t - self.samples[-1].t >= SAMPLE_EVERY_S:
            self.samples.append(s)
        while self.samples and s.t - self.samples[0].t > KEEP_S:
            self.samples.popleft()

    def base(self, now: float) -> Sample | None:
        """The newest sample at least RATE_WINDOW_S old, else the oldest if old enough."""
        chosen: Sample | None = None
        for s in self.samples:
            if now - s.t >= RATE_WINDOW_S:
                chosen = s
            else:
                break
        if chosen is None and self.samples and now - self.samples[0].t >= MIN_WINDOW_S:
            chosen = self.samples[0]
        return chosen


def _ratio(num: float, den: float) -> float | None:
    return None if den <= 0 else round(min(1.0, max(0.0, num / den)), 4)


def summary(
    gw: GatewayView, window: RateWindow, now: float, token_required: bool, started: float = 0.0
) -> dict[str, Any]:
    """Totals, rates (None when no window yet) and per-backend traffic shares."""
    cur = take_sample(gw, now)
    base = window.base(now)
    window.add(cur)
    states: dict[str, int] = {}
    for name in gw.names():
        st = str(gw.health.fleet.snapshot(name)["state"])
        states[st] = states.get(st, 0) + 1
    doc: dict[str, Any] = {
        "ts": round(gw.health.clock.wall(), 3),
        # When this gateway process started serving: a page left open across a restart sees
        # it change and starts its event list over (event ids restart at 1).
        "started": started,
        # When the config in force was loaded (start or last reload), and reloads so far.
        "config_loaded_at": round(gw.health.config_loaded_at, 3),
        "config_reloads": {r: int(gw.health.metrics.reloads.get((r,))) for r in ("ok", "refused")},
        # The gateway's monotonic clock: `since` and `ejected_until` in /admin/backends are on it.
        "monotonic": round(now, 3),
        "window_s": None,
        "requests_total": cur.requests,
        "requests_per_s": None,
        "error_rate": None,
        "attempts_total": sum(cur.attempts.values()),
        "attempts_per_s": None,
        "attempt_failure_rate": None,
        "retries_total": cur.retries,
        "retries_per_s": None,
        "retries_by_reason": {k[0]: v for k, v in gw.proxy_metrics.retries.values.items()},
        "resumes_total": cur.resumes,
        "resumes_per_s": None,
        "ejections_total": sum(gw.health.metrics.ejections.values.values()),
        "inflight": sum(gw.inflight.values()),
        "panic": bool(gw.health.fleet.panic),
        "panic_models": sorted(gw.health.fleet.panic_models),
        "states": states,
        "admin_token_required": token_required,
        "thresholds": {
            "eject_below": gw.config.health.eject_below,
            "rejoin_above": gw.config.health.rejoin_above,
        },
        "backends": {
            name: {"attempts_per_s": None, "share": None, "failure_rate": None}
            for name in gw.names()
        },
    }
    if base is None:
        return doc
    dt = now - base.t
    d_req = cur.requests - base.requests
    d_att = {n: cur.attempts.get(n, 0.0) - base.attempts.get(n, 0.0) for n in cur.attempts}
    d_fail = {n: cur.failures.get(n, 0.0) - base.failures.get(n, 0.0) for n in cur.failures}
    total_att = sum(d_att.values())
    # A routed request that did not end on a 2xx/3xx or a passed-through 4xx failed for the
    # client: every retry hid was a failed attempt but not a failed request.
    d_failed_req = max(0.0, d_req - (cur.settled - base.settled))
    doc.update(
        window_s=round(dt, 3),
        requests_per_s=round(d_req / dt, 3),
        error_rate=_ratio(d_failed_req, d_req),
        attempts_per_s=round(total_att / dt, 3),
        attempt_failure_rate=_ratio(sum(d_fail.values()), total_att),
        retries_per_s=round((cur.retries - base.retries) / dt, 3),
        resumes_per_s=round((cur.resumes - base.resumes) / dt, 3),
    )
    for name, row in doc["backends"].items():
        att = d_att.get(name, 0.0)
        row["attempts_per_s"] = round(att / dt, 3)
        row["share"] = _ratio(att, total_att)
        row["failure_rate"] = _ratio(d_fail.get(name, 0.0), att)
    return doc


def model_backends(gw: GatewayView) -> Iterable[tuple[tuple[str, ...], float]]:
    """(model, state) -> number of backends serving the model in that state; zeros included."""
    counts: dict[tuple[str, str], int] = {}
    for name in gw.names():
        state = str(gw.health.fleet.snapshot(name)["state"])
        for model in gw.health.fleet.backend_models(name):
            for st in State:
                counts.setdefault((model, st.value), 0)
            counts[(model, state)] = counts.get((model, state), 0) + 1
    for (model, state), n in sorted(counts.items()):
        yield (model, state), float(n)


def register(app: web.Application, gw: GatewayView, guard: Guard) -> None:
    """Add `GET /admin/summary` (guarded) and the per-model backend-state gauge."""
    window = RateWindow()
    token_required = gw.config.gateway.admin_token_env is not None
    c = gw.health.clock
    started = round(c.wall(), 3)

    async def get_summary(request: web.Request) -> web.StreamResponse:
        doc = summary(gw, window, c.now(), token_required, started)
        return web.Response(body=orjson.dumps(doc), content_type="application/json")

    app.router.add_get("/admin/summary", guard(get_summary))
    gw.registry.add(
        Gauge(
            "pulsegate_model_backends",
            "Backends serving each model, by state",
            ("model", "state"),
            lambda: model_backends(gw),
        )
    )
