"""New connections as evidence (`health.connects`): the pure rule with time passed in, and
what a backend does with it on a fake clock (no sleeping)."""

from __future__ import annotations

from pulsegate.health.connects import WINDOW_S, ConnectWatch
from pulsegate.health.machine import Event
from pulsegate.health.observations import ConnectResult
from pulsegate.health.rules import Fire
from pulsegate.health.verdict import State

from .harness import Harness, health_with

MADE = ConnectResult(True)
TIMED_OUT = ConnectResult(False, "connect timed out after 250ms")


# -- the rule ---------------------------------------------------------------------------------


def test_three_failures_in_a_row_are_hard_evidence() -> None:
    """The third failure with none made between fires cause connect, the count in words."""
    w = ConnectWatch(3)
    assert w.observe(TIMED_OUT, 3, 10.0) is None
    assert w.observe(TIMED_OUT, 3, 10.5) is None
    assert not w.hard(10.6)
    fire = w.observe(TIMED_OUT, 3, 11.0)
    assert fire == Fire(
        "connect",
        "3 new connections failed in a row in 1.0s, none made "
        "(last: connect timed out after 250ms)",
    )
    assert fire.event is None  # hard evidence: the state decides what it fires
    assert w.hard(11.0)


def test_a_connection_made_clears_the_count() -> None:
    """One fresh connect made in between starts the count afresh and clears the evidence."""
    w = ConnectWatch(3)
    w.observe(TIMED_OUT, 3, 0.0)
    w.observe(TIMED_OUT, 3, 0.5)
    assert w.observe(MADE, 3, 0.6) is None and w.failures == 0
    assert w.observe(TIMED_OUT, 3, 1.0) is None
    assert w.observe(TIMED_OUT, 3, 1.5) is None
    assert w.observe(TIMED_OUT, 3, 2.0) is not None
    w.observe(MADE, 3, 2.1)
    assert not w.hard(2.1) and w.reason == ""


def test_failures_further_apart_than_the_window_do_not_add_up() -> None:
    """A failure more than WINDOW_S after the previous one starts a new count."""
    w = ConnectWatch(3)
    w.observe(TIMED_OUT, 3, 0.0)
    w.observe(TIMED_OUT, 3, WINDOW_S)
    assert w.observe(TIMED_OUT, 3, 2 * WINDOW_S + 0.1) is None
    assert w.failures == 1


def test_the_evidence_lapses_without_a_new_failure() -> None:
    """Hard only while the latest failure is within WINDOW_S (an ejected backend with the
    connect probe off sees no new connection: probation's first ones judge it again)."""
    w = ConnectWatch(2)
    w.observe(TIMED_OUT, 2, 0.0)
    w.observe(TIMED_OUT, 2, 0.1)
    assert w.hard(0.1 + WINDOW_S)
    assert not w.hard(0.2 + WINDOW_S) and w.failures == 0


def test_limit_zero_is_off() -> None:
    """`health.connect_failures: 0`: failures are counted, nothing fires."""
    w = ConnectWatch(0)
    for i in range(10):
        assert w.observe(TIMED_OUT, 0, i * 0.1) is None
    assert not w.hard(1.0)


def test_gate_blocks_ready_and_rejoin_only_while_hard() -> None:
    """While the evidence stands no ready and no rejoin; other moves pass; cleared, all pass."""
    w = ConnectWatch(1)
    rejoin = Fire("rejoin", "...", Event.REJOIN_OK)
    ready = Fire("ready", "...", Event.READY_SEEN)
    score = Fire("score", "...", Event.SCORE_LOW)
    w.observe(TIMED_OUT, 1, 0.0)
    assert w.gate(rejoin, 0.1) is None and w.gate(ready, 0.1) is None
    assert w.gate(score, 0.1) is score and w.gate(None, 0.1) is None
    w.observe(MADE, 1, 0.2)
    assert w.gate(rejoin, 0.3) is rejoin and w.gate(ready, 0.3) is ready


# -- in the backend ---------------------------------------------------------------------------


def test_connect_failures_eject_a_ready_backend_whose_requests_still_work(
    ready3: Harness,
) -> None:
    """Pooled requests keep succeeding between the failed connects: still ejected, cause
    connect, on the third failure."""
    h = ready3
    for _ in range(2):
        assert h.obs("a", TIMED_OUT) == []
        h.run(0.5, h.healthy_traffic())
    t = h.obs("a", TIMED_OUT)
    assert [(x.to_state, x.cause) for x in t] == [(State.EJECTED, "connect")]
    assert "3 new connections failed in a row" in t[0].reason
    assert h.snap("a")["connect_failures"] == 3
    assert not h.fleet.backend("a").dead  # pooled connections work: panic may still use it


def test_no_rejoin_while_new_connections_fail(ready3: Harness) -> None:
    """Ejected for connect: healthy probes for a minute do not bring it back while the connect
    probe keeps failing; the first connection made lets the usual rejoin run."""
    h = ready3
    h.feed("a", TIMED_OUT, 3)
    assert h.state("a") is State.EJECTED

    def failing(h: Harness) -> None:
        h.healthy_traffic()(h)
        if round(h.now * 10) % 5 == 0:
            h.obs("a", TIMED_OUT)

    h.run(60.0, failing)
    assert h.state("a") is State.EJECTED

    def made(h: Harness) -> None:
        h.healthy_traffic()(h)
        h.obs("a", MADE)

    h.run(30.0, made)
    assert h.state("a") in (State.PROBATION, State.READY)


def test_on_probation_one_streak_fails_it(ready3: Harness) -> None:
    """On probation the connect evidence fails the probation (ejected again)."""
    h = ready3
    h.feed("a", TIMED_OUT, 3)
    h.run(30.0, lambda h: (h.obs("a", MADE), h.healthy_traffic()(h)))
    assert h.state("a") is State.PROBATION
    t = h.feed("a", TIMED_OUT, 3)
    assert [(x.from_state, x.to_state, x.cause) for x in t] == [
        (State.PROBATION, State.EJECTED, "connect")
    ]


def test_cold_backend_does_not_turn_ready_while_connects_fail(make: type[Harness]) -> None:
    """Readiness and a micro-inference passing (over pooled connections) do not make a
    backend ready while its new connections fail."""
    h = make(health=health_with(connect_failures=2))
    h.feed("a", TIMED_OUT, 2)
    h.make_ready("a")
    assert h.state("a") is State.COLD
    h.obs("a", MADE)
    h.make_ready("a")
    assert h.state("a") is State.READY


def test_config_zero_turns_the_rule_off(make: type[Harness]) -> None:
    """`health.connect_failures: 0`: any number of failed connects ejects nothing."""
    h = make(health=health_with(connect_failures=0))
    h.make_ready()
    h.run(5.0, h.healthy_traffic())
    assert h.feed("a", TIMED_OUT, 20) == []
    assert h.state("a") is State.READY
