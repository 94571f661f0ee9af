"""`gateway.workers: N > 1`: one health process (the primary) and N proxy workers.

See docs/architecture.md ("Process model") for the picture. In short:

- `primary.py`: the health core, probers, events, alerts, admin actions and the metrics
  registry, once; starts, feeds and replaces the workers.
- `worker.py`: the proxy path on the shared SO_REUSEPORT port, routing on a mirror of the
  primary's verdicts, sending its outcomes back.
- `channel.py`: the framed messages between them over a socketpair.
- `mirror.py`: the exported verdicts (`View`) and the worker's read-only `FleetMirror`.
- `shared.py`: gateway-wide in-flight counts in shared memory (`max_inflight` holds across
  workers).
- `metrics.py`: the workers' proxy metrics summed into the primary's registry.

`workers: 1` uses none of this: `pulsegate serve` is the single process it always was.
"""
