"""The event log: every state change as one JSON line, kept in a ring for `/admin/events`.

Events that an operator must hear about (ejection, recovery, panic) also go to the alert
sink. Recording never blocks and never raises: observability must not break routing.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import orjson

from pulsegate import clock

log = logging.getLogger("pulsegate.events")

# Which transitions page someone: (to_state) -> alert kind.
_ALERT_ON = {
    "ejected": "ejected",
    "ready": "recovered",
    "panic": "panic",
    "panic_over": "panic",
    "capacity_low": "capacity",
    "capacity_ok": "capacity",
}
# A degradation pages only when its cause is a sustained condition of the node itself (a
# node 3x slower than its peers, a throttling GPU), not a score dip a busy fleet shows daily.
_ALERT_DEGRADED = frozenset({"slow", "gpu_throttle"})


class EventLog:
    def __init__(
        self,
        capacity: int = 2000,
        alert: Callable[[dict[str, Any]], None] | None = None,
        wall: Callable[[], float] = clock.wall,
    ) -> None:
        self.events: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._seq = itertools.count(1)
        self._alert = alert
        self._wall = wall  # the gateway clock's wall time (`pulsegate.clock`)

    def record(
        self,
        backend: str,
        from_state: str,
        to_state: str,
        reason: str,
        signals: Mapping[str, Any] | None = None,
        cause: str = "",
    ) -> dict[str, Any]:
        ev: dict[str, Any] = {
            "id": next(self._seq),
            "ts": round(self._wall(), 3),
            "kind": cause if cause in ("panic", "min_ready") else "transition",
            "cause": cause,
            "backend": backend,
            "from": from_state,
            "to": to_state,
            "reason": reason,
            "signals": dict(signals) if signals else {},
        }
        self.events.append(ev)
        try:
            log.info(orjson.dumps(ev, default=str).decode())
        except Exception:  # never let logging break routing
            log.exception("event log failed")
        alert_kind = _ALERT_ON.get(to_state)
        if to_state == "degraded" and cause in _ALERT_DEGRADED:
            alert_kind = "degraded"
        # "ready" is a recovery only when coming back from ejection/probation, not at startup.
        if alert_kind == "recovered" and from_state not in ("probation", "ejected"):
            alert_kind = None
        if alert_kind and self._alert is not None:
            self._alert(_alert_payload(alert_kind, ev))
        return ev

    def since(self, after_id: int = 0, backend: str | None = None, limit: int = 500) -> list[Any]:
        out = [
            e
            for e in self.events
            if e["id"] > after_id and (backend is None or e["backend"] == backend)
        ]
        return out[-limit:]


def _alert_payload(kind: str, ev: dict[str, Any]) -> dict[str, Any]:
    name = ev["backend"]
    if kind == "ejected":
        text = f"node {name} ejected: {ev['reason']}"
    elif kind == "recovered":
        text = f"node {name} recovered"
    elif kind == "degraded":
        text = f"node {name} degraded ({ev['cause']}): {ev['reason']}"
    elif kind == "capacity":
        text = ev["reason"]
    else:
        text = f"panic mode {'entered' if ev['to'] == 'panic' else 'over'}: {ev['reason']}"
    return {"alert": kind, "text": text, "event": ev}
