"""OpenTelemetry traces: a span per client request and one per upstream attempt, over OTLP/HTTP.

`observability.otlp_endpoint: URL` turns it on (default off: no `Tracer`, no thread, the
attempt opener's hook is None). Each request becomes a SERVER span named like the GenAI
semantic conventions' `{gen_ai.operation.name} {gen_ai.request.model}` (`chat demo-7b`),
the child of the client's W3C `traceparent` when it sent one; each upstream attempt (first
try, retry, stream resume) a CLIENT child span of the same name, whose id goes to the
backend in the attempt's own `traceparent` header, so an engine that traces (vLLM's
`--otlp-traces-endpoint`) joins the same trace. What each span carries: `spans.py`.

Why spans are built after the request, not along the way: propagation needs only ids, so
the request path draws random ids (the request's at its first attempt, one per attempt),
notes the backend's verdict at that moment and formats the header (5-12 us of CPU per
attempt on the 2-core test box); `Tracer.record` appends the finished `Exchange` to a
bounded queue. The exporter thread
turns exchanges into spans with their explicit start and end times, encodes them
(`otlp.py`) and POSTs a batch of at most EXPORT_BATCH every EXPORT_S, so span building,
encoding and the network never run on the event loop, and a slow or absent collector costs
the proxy nothing but spans: past MAX_QUEUED waiting exchanges a new one is dropped, as
are the exchanges of a batch the collector did not take, and both are counted
(`pulsegate_traces_dropped_total`).

A client's `traceparent` with the sampled flag off is honoured: propagated (flag off),
not exported. An invalid one is ignored (a new trace starts), as the W3C spec says;
`tracestate` is not passed on.
"""

from __future__ import annotations

import collections
import logging
import os
import random
import re
import socket
import threading
from collections.abc import Mapping

from pulsegate import __version__
from pulsegate.config import ObservabilityConfig
from pulsegate.observe import spans
from pulsegate.observe.metrics import Counter
from pulsegate.observe.otlp import Collector, CollectorError, Encoder
from pulsegate.observe.spans import AttemptIds, TraceIds
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.ports import Verdicts
from pulsegate.proxy.targets import Target

log = logging.getLogger("pulsegate.traces")

# A batch every second (the SDK's BatchSpanProcessor waits 5 s), at most 512 exchanges
# (~1,000 spans, ~400 KB); at most 8,192 exchanges wait (8 s at 1,000 requests/s with the
# collector down). The collector gets 5 s to answer a batch.
EXPORT_S = 1.0
EXPORT_BATCH = 512
MAX_QUEUED = 8192
EXPORT_TIMEOUT_S = 5.0
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")


def parse_traceparent(value: str | None) -> tuple[int, int, int] | None:
    """(trace id, parent span id, flags) of a W3C `traceparent`, or None when it is absent
    or invalid (then the request starts a new trace)."""
    if not value:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace, span, flags, rest = m.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    trace_id, span_id = int(trace, 16), int(span, 16)
    if not trace_id or not span_id:
        return None
    return trace_id, span_id, int(flags, 16)


class Tracer:
    """The request path's side (`headers`, `record`) and the exporter thread."""

    def __init__(
        self,
        cfg: ObservabilityConfig,
        verdicts: Verdicts,
        dropped: Counter,
        *,
        export_s: float = EXPORT_S,
    ) -> None:
        assert cfg.otlp_endpoint is not None
        self.endpoint = cfg.otlp_endpoint
        self.verdicts = verdicts
        self.dropped = dropped
        self.export_s = export_s
        resource = (
            ("service.name", cfg.service_name),
            ("service.version", __version__),
            # One per process: with `gateway.workers` each worker is its own instance.
            ("service.instance.id", f"{socket.gethostname()}-{os.getpid()}"),
            ("telemetry.sdk.name", "pulsegate"),
            ("telemetry.sdk.language", "python"),
            ("telemetry.sdk.version", __version__),
        )
        self._encoder = Encoder(resource, "pulsegate", __version__)
        self._collector = Collector(cfg.otlp_endpoint, EXPORT_TIMEOUT_S)
        self._rng = random.Random()  # the request path's ids
        self._thread_rng = random.Random()  # the exporter thread's
        self._queue: collections.deque[Exchange] = collections.deque()
        # Exchanges of batches the collector did not take, appended by the thread and
        # counted on the loop (deque appends and pops are atomic; the registry has no lock).
        self._lost: collections.deque[int] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="otlp-export", daemon=True)
        self._failing = False

    def start(self) -> None:
        self._thread.start()

    # -- the request path ------------------------------------------------------------------

    def ids(self, ex: Exchange) -> TraceIds:
        t = ex.trace
        if isinstance(t, TraceIds):
            return t
        parent = parse_traceparent(ex.traceparent)
        bits = self._rng.getrandbits
        if parent is None:
            t = TraceIds(bits(128) or 1, bits(64) or 1, 0, True)
        else:
            t = TraceIds(parent[0], bits(64) or 1, parent[1], bool(parent[2] & 1))
        ex.trace = t
        return t

    def headers(self, ex: Exchange, target: Target) -> Mapping[str, str]:
        """`AttemptOpener.trace`: the `traceparent` of the exchange's last attempt."""
        t = self.ids(ex)
        span_id = self._rng.getrandbits(64) or 1
        verdict = None
        if ex.model is not None:
            name = target.name
            for v in self.verdicts.routable(ex.model):  # a cached tuple
                if v.name == name:
                    verdict = v
                    break
        t.attempts[len(ex.attempts) - 1] = AttemptIds(span_id, verdict, target.url)
        flags = "01" if t.sampled else "00"
        return {"traceparent": f"00-{t.trace_id:032x}-{span_id:016x}-{flags}"}

    def record(self, ex: Exchange) -> None:
        while self._lost:
            self.dropped.inc(amount=self._lost.popleft())
        if not self.ids(ex).sampled:
            return
        q = self._queue
        if len(q) >= MAX_QUEUED:
            self.dropped.inc()
            return
        q.append(ex)
        if len(q) == EXPORT_BATCH:
            self._wake.set()  # a full batch goes at once

    # -- the exporter thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.wait(self.export_s)
            self._wake.clear()
            stopping = self._stopping
            while self._queue:
                self._export_batch()
                if not stopping and len(self._queue) < EXPORT_BATCH:
                    break
            if stopping:
                return

    def _export_batch(self) -> None:
        q = self._queue
        batch = [q.popleft() for _ in range(min(len(q), EXPORT_BATCH))]
        enc, rng = self._encoder, self._thread_rng
        body = enc.request(s for ex in batch for s in spans.spans(ex, self.ids(ex), enc, rng))
        try:
            self._collector.send(body)
        except CollectorError as e:
            self._lost.append(len(batch))
            if not self._failing:
                log.warning(
                    "the OTLP collector at %s did not take %d trace(s): %s",
                    self.endpoint,
                    len(batch),
                    e,
                )
            self._failing = True
            return
        if self._failing:
            log.info("the OTLP collector at %s takes traces again", self.endpoint)
            self._failing = False

    def close(self, timeout: float = EXPORT_TIMEOUT_S + 1.0) -> None:
        """Export what is queued (within about `timeout` seconds), then stop. Blocking:
        call it from a thread (`asyncio.to_thread`)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._collector.close()


__all__ = ["EXPORT_S", "MAX_QUEUED", "Tracer", "parse_traceparent"]
