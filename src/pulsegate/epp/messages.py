"""ext_proc messages to and from the picker's values. No I/O: protobuf in, protobuf out.

What Envoy sends (`ProcessingRequest`) and what the EPP reads of it:

    request_headers    :path, :method, x-session-id; `metadata_context.filter_metadata`
                       ["envoy.lb.subset_hint"]["x-gateway-destination-endpoint-subset"]
    request_body       the whole body (processing mode BUFFERED: one message)
    response_headers   :status, x-gateway-destination-endpoint-served (or the same key in
                       `metadata_context` under `envoy.lb`), x-envoy-attempt-count, retry-after

The request headers must be sent (SEND) even though the pick needs the body: with SKIP,
Envoy's router has chosen a host (the override-host policy's fallback) before the body
reaches the picker, and the pick is ignored (verified with Envoy 1.40).

What the EPP answers (`ProcessingResponse`):

    a pick      the phase's `CommonResponse` sets header x-gateway-destination-endpoint
                and `dynamic_metadata` {"envoy.lb": {"x-gateway-destination-endpoint": v}}
                with the same value (the protocol forbids them to differ)
    a refusal   `immediate_response`: the status, OpenAI's error JSON, Retry-After
    otherwise   an empty response of the phase asked (carry on unchanged)

Header values: Envoy sends `raw_value` (bytes) and reads it back; `value` is the older form.
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from pulsegate.epp.picker import Pick, Refusal

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
ATTEMPT_COUNT = "x-envoy-attempt-count"

ProcessingRequest = pb.ProcessingRequest
ProcessingResponse = pb.ProcessingResponse


Headers = dict[str, str]


def headers_of(headers: pb.HttpHeaders) -> Headers:
    """The header map as a dict, read once (a protobuf repeated field is slow to search:
    ~4 us a lookup); the first value of a repeated name wins."""
    out: Headers = {}
    for h in headers.headers.headers:
        if h.key not in out:
            out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else str(h.value)
    return out


def path_of(headers: Headers) -> str:
    """`:path` without its query string."""
    return headers.get(":path", "/").split("?", 1)[0]


def subset_hint(req: pb.ProcessingRequest) -> tuple[str, ...] | None:
    """The endpoints Envoy allows for this request, or None when it sent no hint."""
    fm = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in fm:
        return None
    fields = fm[SUBSET_NAMESPACE].fields
    if SUBSET not in fields:
        return None
    v = fields[SUBSET]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return tuple(x.string_value for x in v.list_value.values if x.HasField("string_value"))
    if kind == "string_value":  # `ip:port,ip:port` written as one string
        return tuple(e for e in v.string_value.split(",") if e.strip())
    return ()


def served_endpoint(req: pb.ProcessingRequest, headers: Headers) -> str | None:
    """The endpoint that answered: `envoy.lb` metadata first (the protocol's place), else
    the response header of the same name (what `deploy/envoy/envoy.yaml` adds)."""
    fm = req.metadata_context.filter_metadata
    if LB_NAMESPACE in fm:
        v = fm[LB_NAMESPACE].fields.get(SERVED)
        if v is not None and v.string_value:
            return str(v.string_value)
    return headers.get(SERVED)


def number(headers: Headers, name: str) -> int | None:
    """Header `name` as a non-negative integer (`:status`, the attempt count), or None."""
    raw = headers.get(name)
    return int(raw) if raw is not None and raw.isdigit() else None


def _set(key: str, value: str) -> base_pb2.HeaderValueOption:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def route(pick: Pick, phase: str) -> pb.ProcessingResponse:
    """The answer carrying `pick`, in `phase` ("request_headers" for a request without a
    body, else "request_body")."""
    value = pick.value
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(set_headers=[_set(DESTINATION, value)])
    )
    meta = struct_pb2.Struct()
    meta.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = value
    if phase == "request_headers":
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta
        )
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=meta
    )


def refuse(refusal: Refusal) -> pb.ProcessingResponse:
    headers = [_set("content-type", "application/json")]
    headers.extend(_set(k, v) for k, v in refusal.headers)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status),
            headers=pb.HeaderMutation(set_headers=headers),
            body=refusal.body,
            details=f"pulsegate_{refusal.code}",
        )
    )


def models_list(models: Sequence[str]) -> bytes:
    """`GET /v1/models`, answered by the EPP itself: the models the fleet serves."""
    data = [{"id": m, "object": "model", "owned_by": "pulsegate"} for m in sorted(models)]
    return orjson.dumps({"object": "list", "data": data})


def immediate(status: int, body: bytes) -> pb.ProcessingResponse:
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=status),
            headers=pb.HeaderMutation(set_headers=[_set("content-type", "application/json")]),
            body=body,
        )
    )


# The empty answer of each phase, built once (read-only: never mutated after this).
_CARRY_ON = {
    "request_headers": pb.ProcessingResponse(request_headers=pb.HeadersResponse()),
    "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()),
    "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()),
    "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()),
    "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()),
    "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()),
}


def carry_on(phase: str) -> pb.ProcessingResponse:
    """An empty answer to `phase`: Envoy carries on unchanged (an unknown phase: the
    request-headers one, which Envoy rejects as out of order rather than misreads)."""
    return _CARRY_ON.get(phase) or _CARRY_ON["request_headers"]
