"""The balanced router over verdicts, with a claim on limited backends (a worker's row)."""

from __future__ import annotations

import random
from collections.abc import Sequence

from pulsegate.balancer import Balancer
from pulsegate.config import RoutingConfig
from pulsegate.health.verdict import State, Verdict
from pulsegate.proxy.route import BalancedRouter


class _Verdicts:
    def __init__(self, verdicts: Sequence[Verdict]) -> None:
        self._v = tuple(verdicts)

    def routable(self, model: str) -> tuple[Verdict, ...]:
        return self._v

    def serves(self, model: str) -> bool:
        return True

    def models(self) -> set[str]:
        return {"m"}

    def backend_models(self, name: str) -> frozenset[str]:
        return frozenset({"m"})

    def usual_ttft(self, name: str, now: float) -> float | None:
        return None


def _v(name: str, cap: int = 0) -> Verdict:
    return Verdict(name, State.READY, 100.0, 1.0, "", "", max_inflight=cap)


def test_a_backend_at_its_limit_is_saturated_and_not_picked() -> None:
    """In-flight at max_inflight: never picked, and `saturated` says so (the queue waits)."""
    load = {"a": 2, "b": 0}
    r = BalancedRouter(
        _Verdicts([_v("a", 2), _v("b")]), Balancer(RoutingConfig(), random.Random(1)), load
    )
    assert all(r.pick("m", (), None).name == "b" for _ in range(20))  # type: ignore[union-attr]
    assert r.saturated("m", ()) and not r.saturated("m", ("a",))
    assert r.pick("m", ("b",), None) is None


def test_a_lost_claim_skips_to_the_next_backend() -> None:
    """Another process took the last slot between the read and the claim: pick again."""
    claims: list[str] = []

    def claim(name: str, cap: int) -> bool:
        claims.append(name)
        return name != "a"

    verdicts = _Verdicts([_v("a", 1), _v("b", 1)])
    r = BalancedRouter(verdicts, Balancer(RoutingConfig(), random.Random(2)), {}, claim=claim)
    for _ in range(10):
        v = r.pick("m", (), None)
        assert v is not None and v.name == "b"
    assert "a" in claims
    r2 = BalancedRouter(
        verdicts, Balancer(RoutingConfig(), random.Random(2)), {}, claim=lambda n, c: False
    )
    assert r2.pick("m", (), None) is None
