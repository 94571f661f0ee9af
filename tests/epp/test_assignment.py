"""EDS mode's pure parts: verdicts -> hosts -> ClusterLoadAssignment, plan versions, and the
per-stream xDS bookkeeping (subscribe, ACK, NACK, stale nonces)."""

from __future__ import annotations

from envoy.config.endpoint.v3 import endpoint_pb2

from health.harness import Harness
from pulsegate.epp.assignment import (
    DRAINING,
    HEALTHY,
    TYPE_URL,
    UNHEALTHY,
    Host,
    Published,
    cluster_name,
    envoy_weight,
    host_of,
    plan_of,
    to_proto,
)
from pulsegate.epp.xds import SETTLE_S, Publisher, Subscription, response
from pulsegate.health.verdict import State, Verdict


def _endpoint(name: str) -> str:
    return f"10.0.0.{ord(name[0]) - 96}:8000"


def _v(name: str, state: State = State.READY, weight: float = 1.0) -> Verdict:
    return Verdict(name, state, 90.0, weight)


def _hosts(h: Harness, model: str = "m") -> dict[str, tuple[int, int]]:
    return {x.name: (x.health, x.weight) for x in plan_of(h.fleet, _endpoint)[cluster_name(model)]}


def test_cluster_name_is_safe_for_envoy() -> None:
    """One cluster per model, `pulsegate_<model>`, with `/` and `:` made `_`."""
    assert cluster_name("demo-7b") == "pulsegate_demo-7b"
    assert cluster_name("meta-llama/Llama-3.1-8B:q4") == "pulsegate_meta-llama_Llama-3.1-8B_q4"


def test_weights_are_integers_of_at_least_one() -> None:
    """Envoy wants integer weights >= 1: x100, rounded, never 0."""
    assert envoy_weight(1.0) == 100
    assert envoy_weight(0.25) == 25
    assert envoy_weight(0.001) == 1
    assert envoy_weight(2.0) == 200


def test_verdict_to_host_table() -> None:
    """Routable (degraded and panic included) is HEALTHY with its weight; drained is
    DRAINING; anything else UNHEALTHY."""
    ep = "10.0.0.1:8000"
    assert host_of(_v("a"), ep, _v("a")) == Host(ep, HEALTHY, 100, "a")
    degraded = _v("a", State.DEGRADED, 0.3)
    assert host_of(degraded, ep, degraded) == Host(ep, HEALTHY, 30, "a")
    ejected = _v("a", State.EJECTED, 0.0)
    assert host_of(ejected, ep, None).health == UNHEALTHY
    # In panic the fleet lets an ejected backend back in: its routable verdict decides.
    assert host_of(ejected, ep, _v("a", State.EJECTED, 0.5)) == Host(ep, HEALTHY, 50, "a")
    assert host_of(_v("a", State.DRAINED, 0.0), ep, None).health == DRAINING
    for st in (State.COLD, State.WARMING, State.READY):
        assert host_of(_v("a", st), ep, None).health == UNHEALTHY


def test_plan_follows_the_fleet() -> None:
    """Cold: every host UNHEALTHY; ready: HEALTHY at 100; a drain is DRAINING, an ejection
    UNHEALTHY, and the others keep their weight."""
    h = Harness()
    assert set(_hosts(h).values()) == {(UNHEALTHY, 1)}
    h.make_ready()
    h.run(30.0, h.healthy_traffic())
    assert _hosts(h) == {n: (HEALTHY, 100) for n in "abc"}
    h.fleet.drain("a", h.now)
    h.fleet.eject("b", h.now)
    assert _hosts(h) == {"a": (DRAINING, 1), "b": (UNHEALTHY, 1), "c": (HEALTHY, 100)}


def test_probation_is_a_weight_stepping_up() -> None:
    """Back from an ejection, the host is HEALTHY with a small weight that climbs to 100."""
    h = Harness()
    h.make_ready()
    h.run(30.0, h.healthy_traffic())
    h.fleet.eject("a", h.now)
    weights: list[int] = []
    for _ in range(400):
        h.run(0.25, h.healthy_traffic())
        health, w = _hosts(h)["a"]
        if health == HEALTHY and (not weights or weights[-1] != w):
            weights.append(w)
    assert weights[0] < 10 and weights[-1] == 100
    assert weights == sorted(weights) and len(weights) > 10


def test_one_cluster_per_model_with_its_members() -> None:
    """A backend is listed in the cluster of each model it serves, and only there."""
    h = Harness(names=("a", "b"), models=("m", "n"))
    assert set(plan_of(h.fleet, _endpoint)) == {"pulsegate_m", "pulsegate_n"}
    h.fleet.set_models("b", ["n"])
    assert set(_hosts(h, "m")) == {"a"}
    assert set(_hosts(h, "n")) == {"a", "b"}


def test_proto_carries_address_health_weight_and_name() -> None:
    """Each host is an LbEndpoint with its socket address, health, weight and hostname."""
    cla = to_proto("pulsegate_m", [Host("10.0.0.1:8000", HEALTHY, 40, "a")])
    assert cla.cluster_name == "pulsegate_m"
    (lb,) = cla.endpoints[0].lb_endpoints
    assert lb.endpoint.address.socket_address.address == "10.0.0.1"
    assert lb.endpoint.address.socket_address.port_value == 8000
    assert lb.endpoint.hostname == "a"
    assert lb.health_status == HEALTHY
    assert lb.load_balancing_weight.value == 40
    v6 = to_proto("c", [Host("[::1]:9000", HEALTHY, 1, "x")]).endpoints[0].lb_endpoints[0]
    assert v6.endpoint.address.socket_address.address == "::1"


def test_version_moves_only_on_a_change() -> None:
    """The same plan offered twice is one version; a changed host is the next."""
    p = Published()
    plan = {"pulsegate_m": (Host("10.0.0.1:8000", HEALTHY, 100, "a"),)}
    assert p.offer(plan) and p.version == 1
    assert not p.offer(dict(plan)) and p.version == 1
    assert p.offer({"pulsegate_m": (Host("10.0.0.1:8000", UNHEALTHY, 1, "a"),)})
    assert p.version == 2


def test_resources_for_named_and_unknown_clusters() -> None:
    """Named clusters get theirs; an unknown name gets an empty assignment; no names: all."""
    p = Published()
    p.offer({"pulsegate_m": (Host("10.0.0.1:8000", HEALTHY, 100, "a"),), "pulsegate_n": ()})
    got = p.resources(["pulsegate_m", "pulsegate_x"])
    assert [c.cluster_name for c in got] == ["pulsegate_m", "pulsegate_x"]
    assert len(got[0].endpoints[0].lb_endpoints) == 1 and not got[1].endpoints[0].lb_endpoints
    assert [c.cluster_name for c in p.resources(None)] == ["pulsegate_m", "pulsegate_n"]


def test_subscribe_ack_and_push() -> None:
    """The first request is answered; its ACK needs nothing; a new version goes out."""
    s = Subscription()
    assert not s.due(1)  # no request yet
    s.request("", ["pulsegate_m"], "", "")
    assert s.due(1)
    nonce = s.sent(1)
    assert not s.due(1)
    s.request("1", ["pulsegate_m"], nonce, "")
    assert s.applied == "1" and not s.due(1)
    assert s.due(2)


def test_nack_is_not_resent_and_stale_nonces_ack_nothing() -> None:
    """A refused version is not sent again (the next one is); a stale nonce acknowledges
    nothing but its names count."""
    s = Subscription()
    s.request("", ["pulsegate_m"], "", "")
    s.request("1", ["pulsegate_m"], s.sent(1), "")
    nonce = s.sent(2)
    s.request("1", ["pulsegate_m"], nonce, "bad address")
    assert s.nacks == 1 and s.applied == "1"
    assert not s.due(2) and s.due(3)
    s.request("3", ["pulsegate_m"], "0", "")  # an old nonce
    assert s.applied == "1"
    s.request("1", ["pulsegate_m", "pulsegate_n"], "0", "")  # a new cluster, stale nonce
    assert s.due(2)  # same version, new names: answered


def test_response_message() -> None:
    """A DiscoveryResponse: the type, the plan's version, a fresh nonce, the assignments."""
    p = Published()
    p.offer({"pulsegate_m": (Host("10.0.0.1:8000", HEALTHY, 100, "a"),)})
    s = Subscription()
    s.request("", [], "", "")  # a wildcard
    r = response(p, s)
    assert (r.type_url, r.version_info, r.nonce) == (TYPE_URL, "1", "1")
    cla = endpoint_pb2.ClusterLoadAssignment()
    assert r.resources[0].Unpack(cla) and cla.cluster_name == "pulsegate_m"
    assert response(p, s).nonce == "2"


def test_publisher_pushes_changes_only_and_holds_a_cold_start() -> None:
    """A stream is woken only when a host changed; a new stream's first answer waits while a
    backend is cold, for SETTLE_S at most, and never again once settled."""
    now = [0.0]
    version = [0]
    cold = [True]
    host = [Host("10.0.0.1:8000", UNHEALTHY, 1, "a")]
    pub = Publisher(
        lambda: {"pulsegate_m": (host[0],)}, lambda: version[0], lambda: not cold[0],
        lambda: now[0],
    )  # fmt: skip
    assert pub.settle_wait() == SETTLE_S
    now[0] = 1.0
    assert pub.settle_wait() == SETTLE_S - 1.0
    ev = pub.watch()
    ev.clear()
    version[0] = 1  # something moved, no host changed
    assert not pub.refresh() and not ev.is_set()
    host[0] = Host("10.0.0.1:8000", HEALTHY, 100, "a")
    version[0] = 2
    assert pub.refresh() and ev.is_set() and pub.published.version == 2
    cold[0] = False
    assert pub.settle_wait() == 0.0
    cold[0] = True  # a backend added cold later is a verdict, not a start
    assert pub.settle_wait() == 0.0
