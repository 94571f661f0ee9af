"""The messages replicas send each other on the Redis channel: compact JSON, one per fact.

    {"v": 1, "r": "gw-a-123", "b": "node-1", "k": "probe", "t": 1764600000.123,
     "f": {"kind": "canary", "ok": false, "lat": 0.35, "reason": "timeout after 350ms"}}

`r` the sender's replica id, `b` the backend, `t` the sender's wall clock at publish (the
receiver measures the propagation delay from it), `k` the kind:

| k          | f                                   | the receiver                                  |
| ---------- | ----------------------------------- | --------------------------------------------- |
| `probe`    | a micro-inference or canary result  | folds it in as a `ProbeResult` observation    |
| `eject`    | cause, reason                       | ejects too, unless already ejected            |
| `drain`    | -                                   | drains too (an operator's action)             |
| `undrain`  | -                                   | undrains too                                  |
| `recovered`| cause                               | nothing: its own evidence brings it back; kept|
|            |                                     | for `GET /admin/cluster` (who saw what)       |

Pure: no I/O. A message that does not parse is None (a newer replica's kind, a stray
publisher): never an exception on the subscriber's loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from pulsegate.health.events import Transition
from pulsegate.health.observations import ProbeKind, ProbeResult
from pulsegate.health.verdict import State

VERSION = 1
KINDS = frozenset({"probe", "eject", "drain", "undrain", "recovered"})
_SHARED_PROBES = frozenset({ProbeKind.MICRO, ProbeKind.CANARY})


@dataclass(frozen=True, slots=True)
class Message:
    replica: str
    backend: str
    kind: str
    sent: float  # the sender's wall clock, seconds
    fields: dict[str, Any] = field(default_factory=dict)


def encode(m: Message) -> bytes:
    doc = {"v": VERSION, "r": m.replica, "b": m.backend, "k": m.kind, "t": m.sent}
    if m.fields:
        doc["f"] = m.fields
    return orjson.dumps(doc)


def decode(data: bytes | str) -> Message | None:
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(doc, dict) or doc.get("v") != VERSION or doc.get("k") not in KINDS:
        return None
    r, b, t, f = doc.get("r"), doc.get("b"), doc.get("t"), doc.get("f", {})
    if not (isinstance(r, str) and isinstance(b, str) and isinstance(f, dict)):
        return None
    if not isinstance(t, int | float) or isinstance(t, bool):
        return None
    return Message(r, b, doc["k"], float(t), f)


def probe_message(replica: str, backend: str, r: ProbeResult, sent: float) -> Message | None:
    """A micro-inference or canary result to share; None for the kinds every replica runs
    itself (readiness)."""
    if r.kind not in _SHARED_PROBES:
        return None
    f: dict[str, Any] = {"kind": r.kind.value, "ok": r.ok}
    if r.latency_s is not None:
        f["lat"] = round(r.latency_s, 6)
    if r.reason:
        f["reason"] = r.reason
    return Message(replica, backend, "probe", sent, f)


def probe_result(m: Message) -> ProbeResult | None:
    """The `ProbeResult` a `probe` message carries; None when malformed."""
    f = m.fields
    try:
        kind = ProbeKind(f.get("kind"))
    except ValueError:
        return None
    ok, lat, reason = f.get("ok"), f.get("lat"), f.get("reason", "")
    if kind not in _SHARED_PROBES or not isinstance(ok, bool) or not isinstance(reason, str):
        return None
    if lat is not None and (not isinstance(lat, int | float) or isinstance(lat, bool)):
        return None
    return ProbeResult(kind, ok, None if lat is None else float(lat), reason)


def transition_message(replica: str, t: Transition, sent: float) -> Message | None:
    """What to tell the others of one transition this replica decided; None for the moves
    each replica makes on its own (ready, degraded, probation...)."""
    if t.to_state is State.EJECTED:
        return Message(replica, t.backend, "eject", sent, {"cause": t.cause, "reason": t.reason})
    if t.cause in ("drain", "undrain"):
        return Message(replica, t.backend, t.cause, sent)
    if t.cause == "recovered":
        return Message(replica, t.backend, "recovered", sent, {"cause": t.cause})
    return None
