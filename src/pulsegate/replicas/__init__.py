"""Active-active gateway replicas sharing one truth through Redis (`cluster.redis`).

Not `pulsegate.cluster` (one gateway's primary and proxy workers): these are whole gateways,
each with its own health core, that share what they see.

- `replica.Replicas`: the driver one `HealthService` holds: lease, listen, publish, owns.
- `store`: the Redis shell (bounded calls, never raises, password never shown).
- `membership`: leases in a sorted set on the server's clock; the live set.
- `rendezvous`: who probes a backend; each replica's part of a `max_inflight` (pure).
- `codec`: the channel's messages (pure); `fold`: a peer's message into the health core.
- `delays`: the propagation delays measured here (pure).
"""

from pulsegate.replicas.replica import Replicas

__all__ = ["Replicas"]
