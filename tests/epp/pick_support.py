"""Helpers of the endpoint picker's pure tests: a config, verdicts, a router over them."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pulsegate.balancer import Balancer
from pulsegate.config import Config, parse_config
from pulsegate.epp.endpoints import Endpoints
from pulsegate.epp.picker import Picker
from pulsegate.health.verdict import State, Verdict
from pulsegate.proxy.route import BalancedRouter

URLS = {"a": "http://10.0.0.1:8000", "b": "http://10.0.0.2:8000", "c": "http://10.0.0.3:8000"}


class FakeVerdicts:
    """The `Verdicts` port with verdicts set by the test (the health core is not under test)."""

    def __init__(self, verdicts: Sequence[Verdict], models: set[str] | None = None) -> None:
        self.verdicts = tuple(verdicts)
        self._models = models if models is not None else {"m"}

    def routable(self, model: str) -> tuple[Verdict, ...]:
        return self.verdicts if model in self._models else ()

    def serves(self, model: str) -> bool:
        return model in self._models

    def models(self) -> set[str]:
        return set(self._models)

    def backend_models(self, name: str) -> frozenset[str]:
        return frozenset(self._models)

    def usual_ttft(self, name: str, now: float) -> float | None:
        return None


def verdict(name: str, cap: int = 0, state: State = State.READY) -> Verdict:
    return Verdict(name, state, 100.0, 1.0, "", "", rtt_s=0.01, max_inflight=cap)


def config(**sections: object) -> Config:
    backends = [{"name": n, "url": u, "models": ["m"]} for n, u in URLS.items()]
    return parse_config({"backends": backends, **sections})


class Setup:
    def __init__(self, verdicts: Sequence[Verdict], **sections: object) -> None:
        self.config = config(**sections)
        self.verdicts = FakeVerdicts(verdicts)
        self.load: dict[str, int] = dict.fromkeys(URLS, 0)
        router = BalancedRouter(
            self.verdicts, Balancer(self.config.routing, random.Random(7)), self.load
        )
        self.endpoints = Endpoints(self.config.backends)
        self.picker = Picker(self.config, router, self.verdicts, self.endpoints)
