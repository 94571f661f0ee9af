"""Verdicts -> Envoy `ClusterLoadAssignment`s: what pulsegate pushes as Envoy's EDS server. Pure.

One EDS cluster per model (`cluster_name`): Envoy cannot read `model` from the body, so the
route picks the cluster (docs/epp.md, "EDS mode"). Every backend that serves the model is
listed, routable or not, so Envoy's `/clusters` shows pulsegate's verdict for each:

    verdict                                      health_status   load_balancing_weight
    routable (ready, probation, degraded, or     HEALTHY         weight x 100, at least 1
      ejected but let in by pulsegate's panic)
    drained by an operator                       DRAINING        1
    anything else (ejected, cold, warming,       UNHEALTHY       1
      weight 0)

Degraded is HEALTHY with its lower weight, not Envoy's DEGRADED: Envoy sends to a DEGRADED
host only when too few are HEALTHY (a standby), where pulsegate's degraded means "keep it,
send it less". The probation ramp is the weight stepping up. Envoy needs integer weights
of 1 or more: a hundredth of a verdict weight is finer than the score separates backends,
and coarser steps mean fewer pushes for score jitter. Envoy's own panic threshold must be 0
in the cluster (`deploy/envoy/envoy-eds.yaml`): the panic decision is pulsegate's, carried
by the HEALTHY flags.

`max_inflight` is not carried: EDS has no per-host request limit (Envoy's circuit breakers
are per cluster; `per_host_thresholds` knows only `max_connections`, static config).

A `Plan` (cluster -> hosts) is plain tuples, so "did anything change" is `==`, and
`Published` moves its version only when it did.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from envoy.config.core.v3 import address_pb2, health_check_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from google.protobuf import wrappers_pb2

from pulsegate.health.fleet import Fleet
from pulsegate.health.verdict import State, Verdict

TYPE_URL = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
CLUSTER_PREFIX = "pulsegate_"
WEIGHT_SCALE = 100
_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")

HEALTHY = health_check_pb2.HEALTHY
UNHEALTHY = health_check_pb2.UNHEALTHY
DRAINING = health_check_pb2.DRAINING


def cluster_name(model: str) -> str:
    """The EDS cluster of `model`: `pulsegate_<model>`, with the characters Envoy's stat
    names would mangle (`/`, `:` ...) made `_` (`org/m:q4` -> `pulsegate_org_m_q4`)."""
    return CLUSTER_PREFIX + _UNSAFE.sub("_", model)


def envoy_weight(weight: float) -> int:
    """A verdict weight as Envoy's integer `load_balancing_weight` (x100, at least 1)."""
    return max(1, round(weight * WEIGHT_SCALE))


@dataclass(frozen=True, slots=True)
class Host:
    """One endpoint as Envoy will hold it."""

    endpoint: str  # host:port, as `Endpoints` writes it
    health: int  # envoy.config.core.v3.HealthStatus
    weight: int
    name: str  # the backend's pulsegate name (the endpoint's `hostname` in Envoy)


Plan = Mapping[str, tuple[Host, ...]]


def host_of(v: Verdict, endpoint: str, routable: Verdict | None) -> Host:
    """Backend `v` as an Envoy host; `routable` is its verdict among the model's routable
    ones (a panic verdict differs from the plain one), None when it is not routable."""
    if routable is not None:
        return Host(endpoint, HEALTHY, envoy_weight(routable.weight), v.name)
    health = DRAINING if v.state is State.DRAINED else UNHEALTHY
    return Host(endpoint, health, 1, v.name)


def hosts(
    members: Sequence[Verdict], routable: Iterable[Verdict], endpoint: Callable[[str], str]
) -> tuple[Host, ...]:
    """The hosts of one model's cluster: `members` (every backend serving it, config order),
    `routable` (the fleet's routable verdicts for it), `endpoint` (name -> host:port)."""
    ok = {v.name: v for v in routable}
    return tuple(host_of(v, endpoint(v.name), ok.get(v.name)) for v in members)


def plan_of(fleet: Fleet, endpoint: Callable[[str], str]) -> dict[str, tuple[Host, ...]]:
    """Every model's cluster from the fleet's verdicts now (a few µs a backend)."""
    every = fleet.verdicts()
    out: dict[str, tuple[Host, ...]] = {}
    for model in sorted(fleet.models()):
        members = [v for v in every if model in fleet.backend_models(v.name)]
        out[cluster_name(model)] = hosts(members, fleet.routable(model), endpoint)
    return out


def to_proto(cluster: str, hs: Sequence[Host]) -> endpoint_pb2.ClusterLoadAssignment:
    """One cluster's `ClusterLoadAssignment` (one locality, priority 0)."""
    lb = []
    for h in hs:
        host, port = h.endpoint.rsplit(":", 1)
        addr = address_pb2.Address(
            socket_address=address_pb2.SocketAddress(address=host.strip("[]"), port_value=int(port))
        )
        lb.append(
            endpoint_components_pb2.LbEndpoint(
                # The name as `hostname` (shown in /clusters); `endpoint_name` would be a
                # reference to `named_endpoints`, in place of the address.
                endpoint=endpoint_components_pb2.Endpoint(address=addr, hostname=h.name),
                health_status=h.health,
                load_balancing_weight=wrappers_pb2.UInt32Value(value=h.weight),
            )
        )
    locality = endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=lb)
    return endpoint_pb2.ClusterLoadAssignment(cluster_name=cluster, endpoints=[locality])


class Published:
    """The plan in force and its version: `offer` moves the version only on a change, so
    Envoy is sent nothing when a verdict moved but its host did not (a score change below
    a hundredth of a weight)."""

    __slots__ = ("plan", "version")

    def __init__(self) -> None:
        self.plan: Plan = {}
        self.version = 0

    def offer(self, plan: Plan) -> bool:
        """Take `plan`; True when it differs from the one in force (the version moved)."""
        if plan == self.plan:
            return False
        self.plan = dict(plan)
        self.version += 1
        return True

    def resources(self, names: Iterable[str] | None) -> list[endpoint_pb2.ClusterLoadAssignment]:
        """The assignments for the clusters `names` (None: every cluster of the plan). A
        name the plan lacks gets an empty assignment: Envoy ends its cluster's warm-up with
        no host (503 at once) instead of waiting out its `initial_fetch_timeout`."""
        wanted = sorted(self.plan) if names is None else names
        return [to_proto(n, self.plan.get(n, ())) for n in wanted]
