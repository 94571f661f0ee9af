"""One request through Envoy: its pick, its in-flight slot, and what its answer tells. Pure.

The EPP sees a request twice: when Envoy asks where to send it (the pick), and when the
response headers come back (`x-gateway-destination-endpoint-served` and the status). Envoy
walks the pick's list in order on retries, so the served endpoint's place in the list says
which attempts went before it: every backend ahead of it was tried and failed (a 5xx, a
reset, a refused connection or the per-try timeout; Envoy does not say which, and all four
count the same against a backend's health). `x-envoy-attempt-count` says how many were
tried when no served endpoint is known (Envoy answered itself after the last failure).

    list a,b,c  served  status  attempts  reported
    ----------  ------  ------  --------  ---------------------------------------------
    a,b,c       a       200     1         a ok (time to first byte for a stream)
    a,b,c       b       200     2         a failed, b ok (no time: it holds a's wait)
    a,b,c       c       500     3         a failed, b failed, c http_5xx
    a,b,c       -       503     3         a, b, c failed (Envoy's own 503 after the last)
    a,b,c       -       503     -         nothing: no evidence against anyone

In flight: a request holds one slot of its first backend from the pick, moved to the one
that served it when they differ, released when Envoy closes the exchange (the end of the
response, or the client's leaving). The router reads these counts as `serve`'s do, for
`max_inflight` and the p2c load.
"""

from __future__ import annotations

from collections.abc import MutableMapping

from pulsegate.epp.picker import Pick
from pulsegate.health.observations import Outcome, RequestResult
from pulsegate.proxy.classify import classify_status

# An attempt Envoy moved past: failed, kind unknown (every failure kind weighs the same).
_SKIPPED = RequestResult(Outcome.HTTP_5XX, None, None)


class Flight:
    __slots__ = ("_load", "holding", "pick", "reported", "start")

    def __init__(self, pick: Pick, load: MutableMapping[str, int], now: float) -> None:
        self.pick = pick
        self.start = now
        self._load = load
        self.holding: str | None = pick.names[0]
        load[self.holding] = load.get(self.holding, 0) + 1
        self.reported = False

    def answered(
        self,
        served: str | None,
        status: int | None,
        retry_after: bool,
        attempts: int | None,
        now: float,
    ) -> list[tuple[str, RequestResult]]:
        """What the response phase says of each backend tried. `served`: the name of the
        backend that answered (None: unknown, or not one of ours). Once per flight."""
        if self.reported:
            return []
        self.reported = True
        names = self.pick.names
        if served is not None and served in names:
            k = names.index(served)
        elif status is not None and status >= 500 and attempts:
            k = min(attempts, len(names))
            return [(n, _SKIPPED) for n in names[:k]]
        else:
            return []
        out = [(n, _SKIPPED) for n in names[:k]]
        if status is not None:
            outcome = classify_status(status, retry_after)
            ttft = now - self.start if k == 0 and self.pick.stream and status < 400 else None
            out.append((served, RequestResult(outcome, ttft, status)))
        self._move(served)
        return out

    def _move(self, name: str) -> None:
        held = self.holding
        if held == name or held is None:
            return
        self._release()
        self.holding = name
        self._load[name] = self._load.get(name, 0) + 1

    def close(self) -> None:
        """The exchange is over: give the slot back (idempotent)."""
        self._release()
        self.holding = None

    def _release(self) -> None:
        held = self.holding
        if held is not None:
            n = self._load.get(held, 0)
            self._load[held] = n - 1 if n > 0 else 0
