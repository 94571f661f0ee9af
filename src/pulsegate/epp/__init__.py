"""`pulsegate epp`: the health brain and the balancer as a Gateway API Inference Extension
endpoint picker (EPP), with Envoy as the data plane.

Envoy's ext_proc filter asks, per request, which backend to send it to; pulsegate answers
with the backends in the order it would try them (`x-gateway-destination-endpoint`, and
the same value in `envoy.lb` dynamic metadata), and reads back which one served and how
(`x-gateway-destination-endpoint-served`, the status). Envoy carries the tokens; pulsegate
never sees them in this mode, so it cannot resume a broken stream (`pulsegate serve` can).

- `endpoints.py`: a backend's `ip:port` from its url, both ways (pure)
- `picker.py`: a request in, a `Pick` (endpoints best first) or a `Refusal` out (pure)
- `flight.py`: one request's pick, its in-flight slot and the outcomes it reports (pure)
- `messages.py`: ext_proc protobuf messages to and from those values (no I/O)
- `service.py`: the grpc.aio `ExternalProcessor` servicer (the shell)
- `run.py`: the process: config, health service, gRPC server, signals
- `ask.py`: ask a running picker what it would answer, as Envoy asks (tests, bench, ops)
- `envoy.py`: the Envoy binary, the shipped config aimed at a fleet, the child process
- `demo.py`: `pulsegate demo --data-plane envoy`
"""
