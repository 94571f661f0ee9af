"""The node agent (runs beside each inference engine) and its heartbeat wire format.

- `server`: `run_agent` / `Agent`, the grpc.aio server of the heartbeat stream (R1-R4).
- `engine`: the background snapshot of engine metrics, readiness and GPU figures (R27),
  and the local micro-inference.
- `gpu`: the ``--gpu`` sources (NVML, a DCGM exporter, the engine's own gauges, none).
- `wire`: the generated stubs (``make proto``) and the Pong <-> `EngineFacts` mapping.

Nothing is imported here, so `pulsegate` imports without the generated stubs.
"""
