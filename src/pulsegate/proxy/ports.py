"""The two seams between the proxy and whatever judges the backends.

The proxy reads verdicts (`Verdicts`, and a `Router` that picks among them) and reports
outcomes (`Outcomes`); it never sees the health core itself. One process: the health
service's `Fleet` is the verdicts and the service takes the outcomes. A proxy worker
(`cluster/`): a `FleetMirror` of the primary's verdicts, outcomes sent over its channel. A
baseline mode (`gateway.mode`): the baseline is all three.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pulsegate.health.observations import Observation
from pulsegate.health.verdict import Verdict


class Verdicts(Protocol):
    """What the proxy reads about the backends."""

    def routable(self, model: str) -> tuple[Verdict, ...]:
        """The verdicts of the backends that may take a request for `model` now."""
        ...

    def serves(self, model: str) -> bool: ...

    def models(self) -> set[str]: ...

    def backend_models(self, name: str) -> frozenset[str]: ...

    def usual_ttft(self, name: str, now: float) -> float | None:
        """The backend's usual time to first token, for the first-byte watch."""
        ...


class Router(Protocol):
    """Picks one backend for one attempt."""

    def pick(self, model: str, tried: Sequence[str], session_key: str | None) -> Verdict | None:
        """A backend for `model` not in `tried`, or None: nothing routable has room."""
        ...

    def saturated(self, model: str, tried: Sequence[str]) -> bool:
        """Some routable backend for `model`, not in `tried`, is at its concurrency limit."""
        ...


class Outcomes(Protocol):
    """Where the proxy reports what it saw of a backend."""

    def report(self, name: str, obs: Observation) -> None: ...
