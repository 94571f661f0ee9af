"""Hot reload of the fleet: a new backend list and new `health`/`probes` sections, taken
without losing what is known. A backend's identity is its `name`:

- added (a name not there before): a fresh `BackendHealth`, cold, as at start;
- removed (a name gone): out of the fleet at once; a late observation for it (a request in
  flight when the config changed) is ignored (`Fleet.observe`);
- restarted (same name, another `url`): another engine, so its history restarts (fresh, cold);
- kept (same name and url): keeps what is known and takes the new config from now on
  (`BackendHealth.reconfigure`, `retune`).

The fleet's own bookkeeping (peer groups, routable cache, panic, `version`) is redone by
`Fleet.reconfigure` from the list `rebuild` returns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health.backend import BackendHealth


@dataclass(frozen=True, slots=True)
class Reconfigured:
    """What a reload did, by backend name: `added`, `restarted` and `kept` in the new config's
    order, `removed` in the old one's."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    restarted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()


def classify(urls: Mapping[str, str], backends: Sequence[BackendConfig]) -> Reconfigured:
    """Sort a new backend list against the current one (`urls`: name -> url, in config order).

    Raises ValueError when the new list repeats a name."""
    added: list[str] = []
    restarted: list[str] = []
    kept: list[str] = []
    seen: set[str] = set()
    for c in backends:
        if c.name in seen:
            raise ValueError("backend names must be unique")
        seen.add(c.name)
        url = urls.get(c.name)
        if url is None:
            added.append(c.name)
        elif url != c.url:
            restarted.append(c.name)
        else:
            kept.append(c.name)
    removed = tuple(n for n in urls if n not in seen)
    return Reconfigured(tuple(added), removed, tuple(restarted), tuple(kept))


def rebuild(
    current: Mapping[str, BackendHealth],
    backends: Sequence[BackendConfig],
    health: HealthConfig,
    probes: ProbesConfig,
    now: float,
    fresh: Callable[[BackendConfig], BackendHealth],
) -> tuple[Reconfigured, tuple[BackendHealth, ...]]:
    """What a reload did, and the backends' health in the new config's order: the kept ones
    reconfigured in place, `fresh(config)` for the added and restarted ones.

    Raises ValueError for a repeated name, before anything is changed."""
    plan = classify({name: b.config.url for name, b in current.items()}, backends)
    kept = frozenset(plan.kept)
    order: list[BackendHealth] = []
    for c in backends:
        if c.name in kept:
            b = current[c.name]
            b.reconfigure(c, health, probes, now)
        else:
            b = fresh(c)
        order.append(b)
    return plan, tuple(order)
