"""One kept backend takes a reloaded config (same name, same url: the same engine), keeping
what is known: its state, since, signals, evidence, backoff counters, probation progress,
suspicion and learned `auto` limit. Which backends are kept is `reload`'s business.

How: each part that holds config has a `reconfigure` that replaces only what it derives from
config, in place. The state never moves, so nothing can be left behind - building new parts
and copying the state over would have to name every field of six objects (and of the objects
they share) and stay in step with them.

    part        takes                           applies
    Standing    the BackendConfig, the score    verdict rebuilt at once (weight, zone, region,
                weights, max_inflight (its      max_inflight; a learned `auto` limit is kept);
                AutoLimit)                      score weights from the next evaluation
    Evaluation  the health and probes sections  from the next evaluation (eject_below, streak
                                                lengths, ...); a shorter interval brings the
                                                next one forward to now + interval
    Signals     ewma_alpha                      from the next sample (values, baselines kept)
    Backoff     ejection_base, ejection_max     from the next ejection (`until` kept)
    Probation   duration, ramp_step             now: one under way follows the new ramp from
                                                its own start

`BackendHealth.reconfigure` itself swaps its config, its two sections (its rules read them on
each call) and its models (`models`). Nothing here moves time: `now` only bounds the next
evaluation. A reload with the same config changes no verdict.
"""

from __future__ import annotations

from typing import Protocol

from pulsegate.config import BackendConfig, HealthConfig, ProbesConfig
from pulsegate.health.backoff import Backoff
from pulsegate.health.evaluation import Evaluation
from pulsegate.health.probation import Probation
from pulsegate.health.signals import Signals
from pulsegate.health.standing import Standing


class Tunable(Protocol):
    """The public parts of a backend's health that config tunes (`BackendHealth` is one)."""

    config: BackendConfig
    signals: Signals
    backoff: Backoff
    probation: Probation


def models(config: BackendConfig, serving: frozenset[str]) -> frozenset[str]:
    """A kept backend's models: the config's when it lists any, else those it serves now (found
    at runtime in its /v1/models, which a reload must not forget)."""
    return frozenset(config.models) or serving


def retune(
    b: Tunable,
    health: HealthConfig,
    probes: ProbesConfig,
    standing: Standing,
    evaluation: Evaluation,
    now: float,
) -> None:
    """Hand `b`'s new config (already in `b.config`) and the new sections to each of its parts;
    the verdict is rebuilt last, from the new config."""
    b.signals.reconfigure(health.ewma_alpha)
    b.backoff.reconfigure(health.ejection_base, health.ejection_max)
    b.probation.reconfigure(health.probation.duration, health.probation.ramp_step)
    evaluation.reconfigure(health, probes, now)
    standing.reconfigure(b.config, health.weights)
