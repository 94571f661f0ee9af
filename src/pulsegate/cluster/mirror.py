"""A worker's copy of the health core's verdicts: the read side of `Fleet` the proxy uses.

The primary exports a `View` whenever the fleet's `version` moves (and at least every
second, for the usual time to first token, which drifts without moving the version) and
sends it to every worker; the worker's `FleetMirror` swaps it in whole. The proxy path then
reads plain dicts, as fast as from the fleet itself: `routable` returns the same tuples of
verdicts the fleet computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pulsegate.health.fleet import Fleet
from pulsegate.health.verdict import State, Verdict

_NONE: tuple[Verdict, ...] = ()


@dataclass(frozen=True, slots=True)
class View:
    """What the proxy needs from the health core, at one `version` of the fleet."""

    version: int = -1
    routable: dict[str, tuple[Verdict, ...]] = field(default_factory=dict)  # per model
    models: dict[str, frozenset[str]] = field(default_factory=dict)  # per backend
    states: dict[str, State] = field(default_factory=dict)
    ttft: dict[str, float] = field(default_factory=dict)  # usual TTFT per backend, seconds
    sent: float = 0.0  # monotonic time at export (CLOCK_MONOTONIC is one clock per host)


def export(fleet: Fleet, now: float) -> View:
    """The fleet's current verdicts as a `View`."""
    names = fleet.names()
    ttft: dict[str, float] = {}
    for n in names:
        t = fleet.usual_ttft(n, now)
        if t is not None:
            ttft[n] = t
    return View(
        version=fleet.version,
        routable={m: fleet.routable(m) for m in sorted(fleet.models())},
        models={n: fleet.backend_models(n) for n in names},
        states={n: fleet.state(n) for n in names},
        ttft=ttft,
        sent=now,
    )


class FleetMirror:
    """Answers the proxy's questions (`Fleet`'s read API) from the last `View` received."""

    __slots__ = ("_view", "version")

    def __init__(self) -> None:
        self._view = View()
        self.version = -1

    def apply(self, view: View) -> None:
        self._view = view
        self.version = view.version

    def routable(self, model: str | None) -> tuple[Verdict, ...]:
        """As `Fleet.routable`; for None, the union of every model's verdicts."""
        if model is None:
            seen: dict[str, Verdict] = {}
            for vs in self._view.routable.values():
                for v in vs:
                    seen.setdefault(v.name, v)
            return tuple(seen.values())
        return self._view.routable.get(model, _NONE)

    def serves(self, model: str) -> bool:
        return model in self._view.routable

    def models(self) -> set[str]:
        return set(self._view.routable)

    def backend_models(self, name: str) -> frozenset[str]:
        return self._view.models.get(name, frozenset())

    def names(self) -> tuple[str, ...]:
        return tuple(self._view.models)

    def state(self, name: str) -> State:
        return self._view.states[name]

    def usual_ttft(self, name: str, now: float) -> float | None:
        return self._view.ttft.get(name)
