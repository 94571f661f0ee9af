"""Probers (I/O): they talk to backends and emit observations for the health core.

- `scheduler.Prober`: one asyncio task per backend and probe kind, cadence by state
  (`cadence`: the delays and the pause, on the `Clock` it is given; `waits`: clock-timed
  sleeps).
- `readiness`: ``/health`` + ``/v1/models`` (R27).
- `micro`: one-token micro-inference (R4) and the 4-8 KB synthetic canary (R19, R20).
- `scrape`: the engine's Prometheus page -> `EngineFacts` (R11), parsed by `engine_metrics`.
- `http`: the probe-only session, one bounded request, transport errors named once.
- `payload`: request bodies, including the canary's realistic prompt.
- `heartbeat`: the agent's gRPC heartbeat stream (R1-R3): `heartbeat_pings` keeps the
  pings' deadlines and confirmation pings, `heartbeat_micro` the micro-inference inside it.
"""

from pulsegate.probers.cadence import Kind
from pulsegate.probers.http import PROBE_HEADER, new_probe_session
from pulsegate.probers.scheduler import Prober

__all__ = ["PROBE_HEADER", "Kind", "Prober", "new_probe_session"]
