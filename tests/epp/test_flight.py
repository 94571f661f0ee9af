"""One request's slot and outcomes, from the served endpoint's place in the pick."""

from __future__ import annotations

from pulsegate.epp.flight import Flight
from pulsegate.epp.picker import Pick
from pulsegate.health.observations import Outcome

PICK = Pick(("a", "b", "c"), ("1:1", "2:2", "3:3"), "m", stream=True)


def _outcomes(flight: Flight, *args: object) -> list[tuple[str, Outcome, float | None]]:
    return [(n, r.outcome, r.ttft_s) for n, r in flight.answered(*args)]  # type: ignore[arg-type]


def test_first_served_ok_with_ttft() -> None:
    """Served by the first: one ok, with the time since the pick (a stream)."""
    load: dict[str, int] = {}
    f = Flight(PICK, load, now=10.0)
    assert load == {"a": 1}
    assert _outcomes(f, "a", 200, False, 1, 10.25) == [("a", Outcome.OK, 0.25)]


def test_served_by_the_second_blames_the_first() -> None:
    """Served by b: a failed (Envoy moved past it), b ok without a time; the slot moves."""
    load: dict[str, int] = {}
    f = Flight(PICK, load, now=0.0)
    got = _outcomes(f, "b", 200, False, 2, 1.0)
    assert got == [("a", Outcome.HTTP_5XX, None), ("b", Outcome.OK, None)]
    assert load == {"a": 0, "b": 1}
    f.close()
    f.close()
    assert load == {"a": 0, "b": 0}


def test_last_one_failing_too() -> None:
    """Served by c with a 500: a and b failed before, c's 500 is http_5xx."""
    f = Flight(PICK, {}, now=0.0)
    got = _outcomes(f, "c", 500, False, 3, 1.0)
    assert [o for _, o, _ in got] == [Outcome.HTTP_5XX] * 3


def test_envoys_own_503_blames_the_attempts() -> None:
    """No served endpoint, Envoy's 503 after 2 attempts: the first two failed."""
    f = Flight(PICK, {}, now=0.0)
    assert [n for n, _, _ in _outcomes(f, None, 503, False, 2, 1.0)] == ["a", "b"]


def test_no_evidence_no_report() -> None:
    """No served endpoint and no attempt count: nobody is blamed; once only."""
    f = Flight(PICK, {}, now=0.0)
    assert _outcomes(f, None, 503, False, None, 1.0) == []
    f2 = Flight(PICK, {}, now=0.0)
    assert len(_outcomes(f2, "a", 200, False, 1, 1.0)) == 1
    assert _outcomes(f2, "a", 200, False, 1, 1.0) == []


def test_overloaded_is_not_a_failure() -> None:
    """A 429 from the backend: overloaded, which does not count against its health."""
    f = Flight(PICK, {}, now=0.0)
    ((name, outcome, ttft),) = _outcomes(f, "a", 429, True, 1, 1.0)
    assert (name, outcome, ttft) == ("a", Outcome.OVERLOADED, None)
    assert not outcome.is_failure
