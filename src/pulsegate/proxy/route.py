"""The pulsegate router: the balancer over the verdicts, with the in-flight load.

`claim`, when given, reserves a slot of a backend with a concurrency limit before the pick
is final (a proxy worker's shared-memory row: two workers never both take the last slot);
a backend whose last slot another process took meanwhile is skipped.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from pulsegate.balancer import Balancer
from pulsegate.health.verdict import Verdict
from pulsegate.proxy.ports import Verdicts


class BalancedRouter:
    __slots__ = ("_balancer", "_claim", "_load", "_verdicts")

    def __init__(
        self,
        verdicts: Verdicts,
        balancer: Balancer,
        load: Mapping[str, int],
        claim: Callable[[str, int], bool] | None = None,
    ) -> None:
        self._verdicts = verdicts
        self._balancer = balancer
        self._load = load
        self._claim = claim

    def pick(self, model: str, tried: Sequence[str], session_key: str | None) -> Verdict | None:
        routable = self._verdicts.routable(model)
        verdict = self._balancer.pick(routable, self._load, tried, session_key)
        claim = self._claim
        if claim is None:
            return verdict
        while verdict is not None and verdict.max_inflight > 0:
            if claim(verdict.name, verdict.max_inflight):
                return verdict
            tried = [*tried, verdict.name]
            verdict = self._balancer.pick(routable, self._load, tried, session_key)
        return verdict

    def saturated(self, model: str, tried: Sequence[str]) -> bool:
        load = self._load
        for v in self._verdicts.routable(model):
            cap = v.max_inflight
            if cap > 0 and v.name not in tried and load.get(v.name, 0) >= cap:
                return True
        return False
