"""ext_proc messages to and from the picker, and the servicer's answers, without a server."""

from __future__ import annotations

import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from pick_support import URLS, Setup, verdict

from pulsegate.epp import messages as m
from pulsegate.epp.picker import Pick, Refusal
from pulsegate.epp.service import PickerService, _Exchange
from pulsegate.health.observations import Observation, Outcome, RequestResult

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def _headers(**extra: str) -> pb.HttpHeaders:
    hs = {":method": "POST", ":path": "/v1/chat/completions?x=1", **extra}
    return pb.HttpHeaders(
        headers={"headers": [{"key": k, "raw_value": v.encode()} for k, v in hs.items()]}
    )


class Reports:
    def __init__(self) -> None:
        self.got: list[tuple[str, Observation]] = []

    def report(self, name: str, obs: Observation) -> None:
        self.got.append((name, obs))


def _service(s: Setup) -> tuple[PickerService, Reports]:
    reports = Reports()
    svc = PickerService(s.picker, s.verdicts, reports, s.endpoints, s.load, lambda: 5.0)
    return svc, reports


def test_headers_are_read_from_raw_value_or_value() -> None:
    """raw_value (Envoy's) or value (older); :path loses its query string."""
    raw = _headers()
    raw.headers.headers.add(key="x-old", value="v")
    raw.headers.headers.add(key="x-old", value="second")
    h = m.headers_of(raw)
    assert h[":method"] == "POST"
    assert h["x-old"] == "v"  # the first of a repeated name
    assert "x-none" not in h
    assert m.path_of(h) == "/v1/chat/completions"
    assert m.number({":status": "503"}, ":status") == 503
    assert m.number({":status": "5x"}, ":status") is None


def test_subset_hint_as_list_or_string() -> None:
    """The subset under envoy.lb.subset_hint, a list or one comma string; absent is None."""
    req = pb.ProcessingRequest()
    assert m.subset_hint(req) is None
    ns = req.metadata_context.filter_metadata[m.SUBSET_NAMESPACE]
    ns.fields[m.SUBSET].list_value.values.add(string_value="1.1.1.1:80")
    assert m.subset_hint(req) == ("1.1.1.1:80",)
    ns.fields[m.SUBSET].string_value = "1.1.1.1:80,2.2.2.2:80"
    assert m.subset_hint(req) == ("1.1.1.1:80", "2.2.2.2:80")


def test_route_sets_header_and_metadata_to_the_same_value() -> None:
    """The pick in the header and in envoy.lb dynamic metadata, identical (the protocol)."""
    pick = Pick(("a", "b"), ("10.0.0.1:8000", "10.0.0.2:8000"), "m", False)
    resp = m.route(pick, "request_body")
    (opt,) = resp.request_body.response.header_mutation.set_headers
    assert (opt.header.key, opt.header.raw_value) == (m.DESTINATION, pick.value.encode())
    meta = resp.dynamic_metadata.fields[m.LB_NAMESPACE].struct_value
    assert meta.fields[m.DESTINATION].string_value == "10.0.0.1:8000,10.0.0.2:8000"
    assert m.route(pick, "request_headers").HasField("request_headers")


def test_refusal_is_an_immediate_openai_error() -> None:
    """A refusal: immediate response with its status, JSON body and Retry-After."""
    r = Refusal(429, "busy", "overloaded", (("retry-after", "1"),))
    ir = m.refuse(r).immediate_response
    assert ir.status.code == 429
    assert orjson.loads(ir.body)["error"] == {
        "message": "busy",
        "type": "rate_limit_error",
        "code": "overloaded",
    }
    keys = {o.header.key: o.header.raw_value for o in ir.headers.set_headers}
    assert keys == {"content-type": b"application/json", "retry-after": b"1"}


def test_served_endpoint_from_metadata_then_header() -> None:
    """`envoy.lb` metadata wins; else the response header of the same name."""
    req = pb.ProcessingRequest(response_headers=_headers(**{m.SERVED: "10.0.0.2:8000"}))
    rh = m.headers_of(req.response_headers)
    assert m.served_endpoint(req, rh) == "10.0.0.2:8000"
    req.metadata_context.filter_metadata[m.LB_NAMESPACE].fields[
        m.SERVED
    ].string_value = "10.0.0.3:8000"
    assert m.served_endpoint(req, rh) == "10.0.0.3:8000"


def test_service_exchange_picks_then_reports() -> None:
    """Headers -> carry on; body -> the pick; response headers -> outcomes, slot moved."""
    s = Setup([verdict(n) for n in URLS])
    svc, reports = _service(s)
    ex = _Exchange()
    first = svc.answer(pb.ProcessingRequest(request_headers=_headers()), ex)
    assert first.HasField("request_headers") and not first.request_headers.HasField("response")
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    picked = svc.answer(body, ex)
    value = picked.request_body.response.header_mutation.set_headers[0].header.raw_value
    names = [s.endpoints.name(e) for e in value.decode().split(",")]
    assert sum(s.load.values()) == 1 and s.load[names[0]] == 1  # type: ignore[index]
    served = s.endpoints.endpoint(names[1])  # type: ignore[arg-type]
    rh = _headers(**{":status": "200", m.SERVED: served, m.ATTEMPT_COUNT: "2"})
    done = svc.answer(pb.ProcessingRequest(response_headers=rh), ex)
    assert done.HasField("response_headers")
    assert reports.got == [
        (names[0], RequestResult(Outcome.HTTP_5XX, None, None)),
        (names[1], RequestResult(Outcome.OK, None, 200)),
    ]
    assert s.load[names[1]] == 1  # type: ignore[index]
    assert ex.flight is not None
    ex.flight.close()
    assert sum(s.load.values()) == 0


def test_service_refuses_and_lists_models() -> None:
    """Unknown model: immediate 404; GET /v1/models without a body: the fleet's models."""
    s = Setup([verdict(n) for n in URLS])
    svc, _ = _service(s)
    ex = _Exchange()
    svc.answer(pb.ProcessingRequest(request_headers=_headers()), ex)
    bad = orjson.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    resp = svc.answer(
        pb.ProcessingRequest(request_body=pb.HttpBody(body=bad, end_of_stream=True)), ex
    )
    assert resp.immediate_response.status.code == 404
    assert ex.flight is None and sum(s.load.values()) == 0
    get = pb.HttpHeaders(
        headers={"headers": [
            {"key": ":method", "raw_value": b"GET"},
            {"key": ":path", "raw_value": b"/v1/models"},
        ]},
        end_of_stream=True,
    )  # fmt: skip
    listed = svc.answer(pb.ProcessingRequest(request_headers=get), _Exchange())
    assert orjson.loads(listed.immediate_response.body)["data"][0]["id"] == "m"


def test_struct_import_is_protobufs() -> None:
    """The metadata value is a google.protobuf.Struct (what Envoy's untyped metadata is)."""
    resp = m.route(Pick(("a",), ("1.2.3.4:5",), "m", False), "request_body")
    assert isinstance(resp.dynamic_metadata, struct_pb2.Struct)


def test_body_without_headers_is_refused() -> None:
    """A body with no request headers before it (headers SKIPped in Envoy's config): 500
    naming the misconfiguration, never a pick Envoy would ignore."""
    s = Setup([verdict(n) for n in URLS])
    svc, _ = _service(s)
    bare = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
    resp = svc.answer(bare, _Exchange())
    assert resp.immediate_response.status.code == 500
    assert orjson.loads(resp.immediate_response.body)["error"]["code"] == "epp_misconfigured"
