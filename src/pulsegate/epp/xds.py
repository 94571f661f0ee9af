"""pulsegate as Envoy's endpoint discovery (EDS) server: verdicts pushed, nothing per request.

Envoy keeps one gRPC stream (`envoy.service.endpoint.v3.EndpointDiscoveryService.
StreamEndpoints`, xDS v3, state of the world) and names the clusters it wants; pulsegate
answers each with a `ClusterLoadAssignment` (`assignment.py`) and pushes again whenever a
host's health or weight changes. Envoy's own load balancer picks per request in C++; no
request reaches Python.

    Envoy                                      pulsegate
    DiscoveryRequest  names=[c], nonce=""  ->                      (subscribe)
                                           <-  DiscoveryResponse   version=v7 nonce=1
    DiscoveryRequest  version=v7 nonce=1   ->                      (ACK: v7 applied)
                          ... a verdict moves ...
                                           <-  DiscoveryResponse   version=v8 nonce=2
    DiscoveryRequest  version=v7 nonce=2   ->                      (NACK: error_detail set)
                      error_detail=...

`Subscription` is the per-stream bookkeeping (pure): which clusters, what was sent, what
was applied. A request whose nonce is not the latest sent is stale: its names are taken
(each request carries the whole list) but it acknowledges nothing. A NACK is logged and
the rejected version is not sent again; the next change is. A new stream's first answer
waits until no backend is cold (`SETTLE_S` at most), so a restarted pulsegate does not
tell Envoy that everything is down.

`Publisher` watches the fleet: woken by the health service's `on_change` / `on_transitions`,
and every `POLL_S` for what the health tick moves without a transition (probation ramp
steps); it rebuilds the plan and, when a host changed, wakes every stream, at most once per
`MIN_INTERVAL_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

import grpc
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc
from google.protobuf import any_pb2

from pulsegate.epp.assignment import TYPE_URL, Plan, Published

log = logging.getLogger("pulsegate.epp.xds")

# Pushes are coalesced to one per 50 ms: a probe round that moves three verdicts is one
# push, and 20 pushes a second at most is nothing to Envoy.
MIN_INTERVAL_S = 0.05
# The health tick (control/service.py) runs every 100 ms; ramp steps come from it.
POLL_S = 0.1
# A pulsegate just started has judged nothing: every backend is cold, and answering Envoy
# then would mark them all UNHEALTHY (a restart would be an outage until the first probe
# round). The first answer on a stream waits until no backend is cold, at most this long;
# meanwhile Envoy keeps what it had (reconnecting), or waits at start-up (its
# `initial_fetch_timeout` is 5 s in envoy-eds.yaml).
SETTLE_S = 3.0


@dataclass
class Subscription:
    """One stream's state of the world. `names` None: no request yet; an empty tuple is a
    wildcard (every cluster)."""

    names: tuple[str, ...] | None = None
    sent_version: int = -1  # the plan version last sent (-1: none)
    nonce: int = 0  # the last nonce sent
    applied: str = ""  # the version Envoy last acknowledged
    rejected: int = -1  # a version Envoy refused: not sent again
    nacks: int = 0
    _resend: bool = field(default=False, repr=False)

    def request(self, version_info: str, names: Iterable[str], nonce: str, error: str) -> None:
        """Take one `DiscoveryRequest`'s fields."""
        names = tuple(sorted(names))
        if names != self.names:  # the first request too
            self._resend = True
            self.names = names
        if nonce != str(self.nonce) or not nonce:
            return  # the first request, or stale: it answers an earlier response
        if error:
            self.nacks += 1
            self.rejected = self.sent_version
        else:
            self.applied = version_info

    def due(self, version: int) -> bool:
        """Whether a response should go out now for plan `version`."""
        if self.names is None:
            return False
        if self._resend:
            return True
        return version != self.sent_version and version != self.rejected

    def sent(self, version: int) -> str:
        """Record a response for `version`; returns its nonce."""
        self._resend = False
        self.sent_version = version
        self.nonce += 1
        return str(self.nonce)

    @property
    def wanted(self) -> tuple[str, ...] | None:
        """The cluster names to send (None: every cluster)."""
        return self.names or None


def response(published: Published, sub: Subscription) -> discovery_pb2.DiscoveryResponse:
    """The response for `sub` now (and record it as sent)."""
    version = published.version
    resources = []
    for cla in published.resources(sub.wanted):
        a = any_pb2.Any()
        a.Pack(cla)
        resources.append(a)
    nonce = sub.sent(version)
    return discovery_pb2.DiscoveryResponse(
        version_info=str(version), resources=resources, type_url=TYPE_URL, nonce=nonce
    )


class Publisher:
    """The plan in force, rebuilt from `build` when poked or polled; streams wait on it."""

    def __init__(
        self,
        build: Callable[[], Plan],
        version: Callable[[], int],
        settled: Callable[[], bool],
        now: Callable[[], float],
    ) -> None:
        self._build = build
        self._version = version  # the fleet's version: a cheap "something moved"
        self._settled = settled  # no backend cold: the verdicts are worth sending
        self._now = now
        self._settle_by = now() + SETTLE_S
        self._seen = -1
        self.published = Published()
        self.published.offer(build())
        self._wake = asyncio.Event()
        self._streams: set[asyncio.Event] = set()
        self.pushes = 0

    def poke(self, *_: object) -> None:
        """Something may have changed (the health service's callbacks)."""
        self._wake.set()

    def watch(self) -> asyncio.Event:
        ev = asyncio.Event()
        ev.set()  # a new stream is answered from the plan in force
        self._streams.add(ev)
        return ev

    def settle_wait(self) -> float:
        """Seconds a stream's first answer should still wait (0: send)."""
        if self._settled():
            self._settle_by = 0.0  # once settled, always: a later cold backend is a verdict
        return max(0.0, self._settle_by - self._now())

    def unwatch(self, ev: asyncio.Event) -> None:
        self._streams.discard(ev)

    def refresh(self, force: bool = False) -> bool:
        """Rebuild the plan if the fleet moved (or `force`); True when a host changed."""
        v = self._version()
        if not force and v == self._seen:
            return False
        self._seen = v
        if not self.published.offer(self._build()):
            return False
        self.pushes += 1
        for ev in self._streams:
            ev.set()
        return True

    async def run(self) -> None:
        while True:
            poked = False
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
                poked = True
            except TimeoutError:
                pass
            self._wake.clear()
            # Poked: a reload may change endpoints without moving the fleet's version.
            if self.refresh(force=poked):
                await asyncio.sleep(MIN_INTERVAL_S)


class EdsService(eds_pb2_grpc.EndpointDiscoveryServiceServicer):  # type: ignore[misc]
    """`StreamEndpoints` over the publisher's plan. Delta and Fetch are not served."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher

    async def StreamEndpoints(
        self,
        requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[discovery_pb2.DiscoveryResponse]:
        sub = Subscription()
        wake = self.publisher.watch()
        peer = context.peer()
        reader = asyncio.ensure_future(self._read(requests, sub, wake, peer))
        try:
            while not reader.done():
                hold = self.publisher.settle_wait() if sub.sent_version < 0 else 0.0
                if hold > 0.0:  # woken by a request or a plan change, or the time is up
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), hold)
                    wake.clear()
                    if self.publisher.settle_wait() > 0.0:
                        continue
                else:
                    await wake.wait()
                    wake.clear()
                if reader.done():
                    break
                pub = self.publisher.published
                if sub.due(pub.version):
                    yield response(pub, sub)
        finally:
            self.publisher.unwatch(wake)
            reader.cancel()

    async def _read(
        self,
        requests: AsyncIterator[discovery_pb2.DiscoveryRequest],
        sub: Subscription,
        wake: asyncio.Event,
        peer: str,
    ) -> None:
        try:
            async for req in requests:
                if req.type_url and req.type_url != TYPE_URL:
                    log.warning("eds %s: type %s not served", peer, req.type_url)
                    continue
                error = req.error_detail.message if req.HasField("error_detail") else ""
                if error:
                    log.warning("eds %s refused version %s: %s", peer, sub.sent_version, error)
                sub.request(req.version_info, req.resource_names, req.response_nonce, error)
                wake.set()
        finally:
            wake.set()  # the stream ended: the writer stops
