"""Ask a running picker what it would answer, as Envoy asks: one ext_proc exchange.

For the tests, the benchmark and an operator's check ("is this backend still in the
pick?"). The exchange is a real one (request headers, then the buffered body), so it holds
an in-flight slot for the few milliseconds it lasts and its answer is what Envoy would get.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from pulsegate.epp.messages import DESTINATION


@dataclass(frozen=True, slots=True)
class Answer:
    endpoints: tuple[str, ...]  # the pick, best first; empty for an immediate answer
    status: int | None = None  # the immediate answer's status (a refusal)


def ask(
    target: str,
    model: str,
    path: str = "/v1/chat/completions",
    session: str | None = None,
    timeout: float = 5.0,
) -> Answer:
    """The picker at `target` (`host:port`)'s answer for a one-message chat request."""
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    headers = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    if session is not None:
        headers.append(("x-session-id", session))
    hs = pb.HttpHeaders()
    for k, v in headers:
        hs.headers.headers.add(key=k, raw_value=v.encode())
    msgs = [
        pb.ProcessingRequest(request_headers=hs),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
    ]
    with grpc.insecure_channel(target) as ch:
        answers = list(pb_grpc.ExternalProcessorStub(ch).Process(iter(msgs), timeout=timeout))
    for a in answers:
        if a.HasField("immediate_response"):
            return Answer((), int(a.immediate_response.status.code))
    for opt in answers[-1].request_body.response.header_mutation.set_headers:
        if opt.header.key == DESTINATION:
            return Answer(tuple(opt.header.raw_value.decode().split(",")))
    return Answer(())
