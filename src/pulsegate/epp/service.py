"""The ext_proc servicer: one gRPC stream per HTTP request through Envoy. The shell.

Every message is answered at once and synchronously from the picker and the verdicts in
memory: nothing on this path waits for I/O, so an answer costs the parse and the pick
(tens of microseconds), well inside Envoy's `message_timeout`. The stream's end (Envoy
closes it when the HTTP exchange ends, or the client leaves) gives back the request's
in-flight slot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, MutableMapping

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from pulsegate.epp import messages as m
from pulsegate.epp.endpoints import Endpoints
from pulsegate.epp.flight import Flight
from pulsegate.epp.picker import SESSION_HEADER, Picker, Refusal
from pulsegate.proxy.ports import Outcomes, Verdicts

MODELS_PATH = "/v1/models"
_NO_BODY = Refusal(400, "an inference request needs a JSON body", "invalid_request")
# A body without request headers: Envoy's config skips them (request_header_mode must be
# SEND: with SKIP the router has already chosen a host when the body reaches the picker).
_NO_PATH = Refusal(500, "the data plane sent no request headers to the picker", "epp_misconfigured")


class _Exchange:
    """What one stream has seen so far."""

    __slots__ = ("body", "flight", "headers", "subset")

    def __init__(self) -> None:
        self.headers: m.Headers | None = None
        self.subset: tuple[str, ...] | None = None
        self.body = b""
        self.flight: Flight | None = None


class PickerService(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self,
        picker: Picker,
        verdicts: Verdicts,
        outcomes: Outcomes,
        endpoints: Endpoints,
        load: MutableMapping[str, int],
        now: Callable[[], float],
    ) -> None:
        self._picker = picker
        self._verdicts = verdicts
        self._outcomes = outcomes
        self._endpoints = endpoints
        self._load = load
        self._now = now

    def reconfigure(self, picker: Picker, endpoints: Endpoints) -> None:
        """A reload: new exchanges pick with `picker`; outcomes map endpoints with
        `endpoints` (an exchange in flight keeps its own in-flight slot)."""
        self._picker = picker
        self._endpoints = endpoints

    async def Process(
        self, request_iterator: AsyncIterator[m.ProcessingRequest], context: object
    ) -> AsyncIterator[m.ProcessingResponse]:
        ex = _Exchange()
        try:
            async for req in request_iterator:
                yield self.answer(req, ex)
        finally:
            if ex.flight is not None:
                ex.flight.close()

    def answer(self, req: m.ProcessingRequest, ex: _Exchange) -> m.ProcessingResponse:
        phase = req.WhichOneof("request")
        if phase == "request_headers":
            ex.headers = m.headers_of(req.request_headers)
            ex.subset = m.subset_hint(req)
            if req.request_headers.end_of_stream:
                return self._bodiless(ex.headers)
            return m.carry_on(phase)
        if phase == "request_body":
            ex.body += req.request_body.body
            if not req.request_body.end_of_stream:
                return m.carry_on(phase)
            return self._pick(ex, phase)
        if phase == "response_headers":
            self._report(req, ex)
            return m.carry_on(phase)
        return m.carry_on(phase or "")  # trailers, a response body: not asked for, passed

    def _pick(self, ex: _Exchange, phase: str) -> m.ProcessingResponse:
        headers = ex.headers
        if headers is None:  # a body before headers: request headers must be sent (SEND)
            return m.refuse(_NO_PATH)
        got = self._picker.pick(m.path_of(headers), ex.body, headers.get(SESSION_HEADER), ex.subset)
        ex.body = b""
        if isinstance(got, Refusal):
            return m.refuse(got)
        ex.flight = Flight(got, self._load, self._now())
        return m.route(got, phase)

    def _bodiless(self, headers: m.Headers) -> m.ProcessingResponse:
        if m.path_of(headers) == MODELS_PATH and headers.get(":method") == "GET":
            return m.immediate(200, m.models_list(sorted(self._verdicts.models())))
        return m.refuse(_NO_BODY)

    def _report(self, req: m.ProcessingRequest, ex: _Exchange) -> None:
        flight = ex.flight
        if flight is None:
            return
        rh = m.headers_of(req.response_headers)
        endpoint = m.served_endpoint(req, rh)
        served = self._endpoints.name(endpoint) if endpoint else None
        results = flight.answered(
            served,
            m.number(rh, ":status"),
            "retry-after" in rh,
            m.number(rh, m.ATTEMPT_COUNT),
            self._now(),
        )
        for name, result in results:
            self._outcomes.report(name, result)
