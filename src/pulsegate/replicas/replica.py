"""One gateway replica among others that name the same Redis (`cluster.redis`).

The driver around the pure parts: it renews this replica's lease (`membership`), listens on
the evidence channel and folds what peers saw (`fold`), publishes what this replica saw and
decided (`codec`), says which backends this replica probes (`owns`, rendezvous over the live
set) and gives each replica its part of every backend's `max_inflight` (`rendezvous.share`).

Alone - no Redis answer for a renewal, no live subscription, or this replica missing from
the live set - it does what a single gateway does: probes everything and enforces the full
limits. A renewal is due every 0.5 s and bounded at 0.2 s, so a Redis that dies, stops or is
cut off leaves every replica alone within 0.7 s; nothing on the request path waits for
Redis, so no client request fails because of it.

It attaches to a `HealthService` (`control/service.py`), so it works the same in one process
and in a multi-process gateway's primary.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Any

from pulsegate.clock import Clock
from pulsegate.health.events import Transition
from pulsegate.health.observations import Observation, ProbeResult
from pulsegate.observe.metrics import Gauge, Registry
from pulsegate.replicas import codec, membership
from pulsegate.replicas.delays import Delays
from pulsegate.replicas.fold import Folder, Health
from pulsegate.replicas.membership import Members
from pulsegate.replicas.rendezvous import owner, share
from pulsegate.replicas.store import RedisStore
from pulsegate.runtime import TaskSet

log = logging.getLogger("pulsegate.replicas")

OUTBOX_MAX = 1000  # messages waiting for the publisher; more are dropped (Redis is sick)
RECENT = 50  # peers' messages kept for GET /admin/cluster


def replica_id(configured: str) -> str:
    return f"{socket.gethostname()}-{os.getpid()}" if configured == "auto" else configured


class Replicas:
    def __init__(self, health: Health, clock: Clock, registry: Registry) -> None:
        cfg = health.config.cluster
        assert cfg.redis is not None, "Replicas needs cluster.redis"
        self.id = replica_id(cfg.replica_id)
        self._health = health
        self._clock = clock
        self.store = RedisStore(cfg.redis)
        self._renew = self.store.script(membership.RENEW_LUA)
        self._folder = Folder(health, clock.now)
        self.members = Members()
        self.alone = True
        self._renewed_at: float | None = None
        self._owners: dict[str, str] = {}  # backend -> owning replica (last known live set)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue(OUTBOX_MAX)
        self.delays = Delays()
        self.sent = 0
        self.received = 0
        self.dropped = 0
        self.recent: list[dict[str, Any]] = []
        self._limits_cfg: object = None  # the config whose limits the fleet holds
        self._fleet_limits: dict[str, int] = {}
        self._closed = False
        self._register(registry)
        health.on_transitions.append(self._transitions)
        health.on_change.append(self._changed)

    # -- the seams the health service calls -------------------------------------------------

    def owns(self, backend: str) -> bool:
        """Whether this replica runs `backend`'s micro-inference and canary now."""
        return self.alone or self._owners.get(backend, self.id) == self.id

    def observed(self, name: str, obs: Observation) -> None:
        """Every observation the health service takes: this replica's own probe results for
        the backends it owns are shared (never what it folded from a peer)."""
        if type(obs) is not ProbeResult or self._folder.folding:
            return
        if self._owners.get(name, self.id) != self.id:
            return  # alone, probing a backend a peer owns: the peer shares its own results
        m = codec.probe_message(self.id, name, obs, self._clock.wall())
        if m is not None:
            self._send(m)

    def _transitions(self, transitions: Sequence[Transition]) -> None:
        if self._folder.folding:
            return
        now = self._clock.wall()
        for t in transitions:
            m = codec.transition_message(self.id, t, now)
            if m is not None:
                self._send(m)

    def _changed(self) -> None:
        if self._health.config is not self._limits_cfg:  # a reload put the full limits back
            self._apply_limits()

    # -- drivers ----------------------------------------------------------------------------

    def start(self, tasks: TaskSet) -> None:
        self._apply_limits()
        tasks.spawn(self.store.listen(membership.CHANNEL, self._message), "replicas-listen")
        tasks.spawn(self._lease_loop(), "replicas-lease")
        tasks.spawn(self._publish_loop(), "replicas-publish")
        log.info("replica %s: redis %s", self.id, self.store.url)

    async def close(self) -> None:
        """Leave the set at once (peers take over this replica's probes now, not in 3 s)."""
        self._closed = True
        if self.store.ok:
            await self.store.call(
                lambda c: self._renew([membership.LEASES_KEY, membership.JOINED_KEY], [self.id, 0])
            )
        await self.store.close()

    async def _lease_loop(self) -> None:
        keys = [membership.LEASES_KEY, membership.JOINED_KEY]
        lease_ms = int(membership.LEASE_S * 1000)
        while not self._closed:
            started = self._clock.now()
            # Deaf (no subscription) is no member: peers must not count on this one's news.
            ttl = lease_ms if self.store.subscribed else 0
            reply = await self.store.call(functools.partial(self._renew_as, keys, ttl))
            if reply is not None:
                try:
                    self.members = Members.read(reply)
                    self._renewed_at = started
                except ValueError as e:
                    log.warning("replica %s: lease reply not understood: %s", self.id, e)
            self.refresh()
            left = membership.RENEW_S - (self._clock.now() - started)
            await asyncio.sleep(max(0.0, left))

    def _renew_as(self, keys: list[str], ttl: int, _client: object) -> Awaitable[Any]:
        return self._renew(keys, [self.id, ttl])

    async def _publish_loop(self) -> None:
        while True:
            data = [await self._outbox.get()]
            while not self._outbox.empty() and len(data) < 100:
                data.append(self._outbox.get_nowait())

            async def send(c: Any, data: list[bytes] = data) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                for d in data:
                    pipe.publish(membership.CHANNEL, d)
                return await pipe.execute()  # type: ignore[no-any-return]

            if await self.store.call(send) is None:
                self.dropped += len(data)
            else:
                self.sent += len(data)

    # -- the live set -----------------------------------------------------------------------

    def refresh(self) -> None:
        """Recompute alone/together, owners and limits after a renewal (or a failed one)."""
        now = self._clock.now()
        fresh = (
            self._renewed_at is not None
            and now - self._renewed_at < 2 * membership.RENEW_S + self.store.timeout
        )
        ids = self.members.ids
        alone = not (self.store.ok and self.store.subscribed and fresh and self.id in ids)
        owners = {n: owner(n, ids) or self.id for n in self._health.fleet.names()} if ids else {}
        if alone != self.alone:
            log.log(
                logging.WARNING if alone else logging.INFO, "replica %s: %s", self.id,
                "working alone: probing every backend, full limits" if alone
                else f"joined {len(ids)} replica(s): probes and limits shared",
            )  # fmt: skip
        gained = [n for n in owners if self._mine(n, alone, owners) and not self.owns(n)]
        self.alone, self._owners = alone, owners
        self._apply_limits()
        prober = getattr(self._health, "prober", None)
        for n in gained:  # its first probe now, not at the end of a slow pause
            if prober is not None:
                prober.poke(n)

    def _mine(self, name: str, alone: bool, owners: dict[str, str]) -> bool:
        return alone or owners.get(name, self.id) == self.id

    def _apply_limits(self) -> None:
        cfg = self._health.config
        if cfg is not self._limits_cfg:  # the fleet holds this config's own limits
            self._limits_cfg = cfg
            self._fleet_limits = {b.name: b.max_inflight for b in cfg.backends}
        ids = () if self.alone else self.members.ids
        want = {
            b.name: share(b.max_inflight, b.name, ids, self.id)
            if b.max_inflight > 0 and ids
            else b.max_inflight
            for b in cfg.backends
        }
        if want == self._fleet_limits:
            return
        backends = tuple(replace(b, max_inflight=want[b.name]) for b in cfg.backends)
        self._health.fleet.reconfigure(backends, cfg.health, cfg.probes, self._clock.now())
        self._fleet_limits = want
        for f in self._health.on_change:
            f()

    # -- the channel --------------------------------------------------------------------------

    def _send(self, m: codec.Message) -> None:
        if not self.store.ok:
            self.dropped += 1
            return
        try:
            self._outbox.put_nowait(codec.encode(m))
        except asyncio.QueueFull:
            self.dropped += 1

    def _message(self, data: bytes) -> None:
        m = codec.decode(data)
        if m is None or m.replica == self.id:
            return
        delay = self._clock.wall() - m.sent
        folded = self._folder.fold(m)
        self.received += 1
        self.delays.add(delay)
        self.recent.append(
            {"replica": m.replica, "backend": m.backend, "message": m.kind, "at": m.sent,
             "delay_ms": round(delay * 1000, 3), "folded": folded, "fields": m.fields}
        )  # fmt: skip
        del self.recent[:-RECENT]

    # -- visible ------------------------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        """`GET /admin/cluster`: no secret (the URL without its password)."""
        cfg, here = self._health.config, self._fleet_limits
        return {
            "replica_id": self.id,
            "alone": self.alone,
            "redis": {"url": self.store.url, "up": self.store.ok,
                      "subscribed": self.store.subscribed, "last_error": self.store.last_error},
            "replicas": [
                {"id": m.replica, "lease_age_s": round(m.lease_age_s, 3),
                 "age_s": round(m.age_s, 3), "self": m.replica == self.id}
                for m in self.members.members
            ],
            "probes": {n: (self.id if self.alone else o) for n, o in sorted(self._owners.items())},
            "max_inflight": {
                b.name: {"fleet": b.max_inflight, "here": here.get(b.name, b.max_inflight)}
                for b in cfg.backends if b.max_inflight > 0
            },
            "propagation": self.delays.summary_ms(),
            "messages": {"sent": self.sent, "received": self.received, "dropped": self.dropped},
            "recent": list(reversed(self.recent)),
        }  # fmt: skip

    def _register(self, registry: Registry) -> None:
        def replicas() -> list[tuple[tuple[str, ...], float]]:
            return [((), 1.0 if self.alone else float(len(self.members.ids)))]

        def up() -> list[tuple[tuple[str, ...], float]]:
            return [((), 1.0 if self.store.ok else 0.0)]

        registry.add(
            Gauge(
                "pulsegate_cluster_replicas",
                "Live gateway replicas this one counts (1: alone)",
                (),
                replicas,
            )
        )
        registry.add(
            Gauge(
                "pulsegate_cluster_redis_up",
                "Whether the shared Redis answers (1) or not (0)",
                (),
                up,
            )
        )
