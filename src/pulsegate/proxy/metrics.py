"""The proxy side's metrics, defined in one place.

These are the metrics the proxy path writes. In a multi-process gateway each proxy worker
counts them in its own registry and the primary sums them (`cluster/metrics.py` takes the
list from `ProxyMetrics.summed`, so a metric added here is summed with no other change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pulsegate.observe.metrics import Counter, Gauge, Histogram, Registry


class Level(Counter):
    """A gauge the proxy sets as things change (not read at scrape time), so that a primary
    sums it over its workers like the counters (a worker's last value counts until it is
    replaced; then it leaves the sum, `cluster/metrics.py`)."""

    def set(self, value: float, labels: tuple[str, ...] = ()) -> None:
        self.values[labels] = value

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.doc}"
        yield f"# TYPE {self.name} gauge"
        for line in super().render():
            if not line.startswith("#"):
                yield line


class ProxyMetrics:
    __slots__ = (
        "access_log_dropped",
        "api_requests",
        "client_connections",
        "client_connections_refused",
        "hedges",
        "key_rejections",
        "key_requests",
        "key_tokens",
        "queued",
        "request_seconds",
        "requests",
        "resumes",
        "retries",
        "traces_dropped",
        "ttft",
    )

    def __init__(self, r: Registry) -> None:
        # The client connection cap (`conn_guard.py`, `gateway.max_client_connections`).
        self.client_connections = Level(
            "pulsegate_client_connections", "Client connections open (refused ones left out)"
        )
        self.client_connections.set(0)
        r.add(self.client_connections)
        self.client_connections_refused: Counter = r.counter(
            "pulsegate_client_connections_refused_total",
            "Client connections answered 503 at once: gateway.max_client_connections open",
        )
        self.requests: Counter = r.counter(
            "pulsegate_requests_total",
            "Client request attempts by backend, model and status code",
            ("backend", "model", "code"),
        )
        # One per client request (not per attempt) by API and the status the client got:
        # the per-API view; `pulsegate_requests_total` keeps its labels (dashboards, alerts).
        self.api_requests: Counter = r.counter(
            "pulsegate_api_requests_total",
            "Client requests by API (chat, completions, responses, embeddings, messages, "
            "rerank, score, tokenize, detokenize) and the status the client got",
            ("api", "code"),
        )
        self.request_seconds: Histogram = r.histogram(
            "pulsegate_request_seconds", "Time from request to response headers or final error"
        )
        self.ttft: Histogram = r.histogram(
            "pulsegate_ttft_seconds", "Time to first byte from the serving backend"
        )
        self.retries: Counter = r.counter(
            "pulsegate_retries_total", "Retries on another backend, by reason", ("reason",)
        )
        self.resumes: Counter = r.counter(
            "pulsegate_stream_resumes_total", "Streams continued on another backend"
        )
        # Hedged first tokens (`hedge.py`): hedge_won, primary_won (the other cancelled at
        # once), hedge_failed, no_budget, no_backend.
        self.hedges: Counter = r.counter(
            "pulsegate_hedges_total",
            "Streams whose first token was late, by what the hedge on a second backend did",
            ("outcome",),
        )
        self.queued: Counter = r.counter(
            "pulsegate_queued_total", "Requests that waited for a backend with free capacity"
        )
        # The front door's (`auth:`, `front/door.py`): labelled by the key's name, never the key.
        self.key_requests: Counter = r.counter(
            "pulsegate_key_requests_total",
            "Requests by client key name and the status the client got",
            ("key", "code"),
        )
        self.key_tokens: Counter = r.counter(
            "pulsegate_key_tokens_total",
            "Tokens by client key name, from the answers' usage (prompt, completion)",
            ("key", "kind"),
        )
        # The access log's and the tracer's (`observe/access_log.py`, `observe/traces.py`).
        self.access_log_dropped: Counter = r.counter(
            "pulsegate_access_log_dropped_total",
            "Access log lines dropped: the disk did not keep up or a write failed",
        )
        self.traces_dropped: Counter = r.counter(
            "pulsegate_traces_dropped_total",
            "Requests not traced: the OTLP export queue was full",
        )
        self.key_rejections: Counter = r.counter(
            "pulsegate_key_rejections_total",
            "Requests the front door refused, by key name ('-': none or unknown) and reason",
            ("key", "reason"),
        )

    @property
    def summed(self) -> tuple[Counter | Histogram, ...]:
        """Every metric here: what a primary sums over its workers."""
        return (
            self.requests,
            self.request_seconds,
            self.ttft,
            self.retries,
            self.resumes,
            self.hedges,
            self.queued,
            self.api_requests,
            self.key_requests,
            self.key_tokens,
            self.key_rejections,
            self.access_log_dropped,
            self.traces_dropped,
            self.client_connections,
            self.client_connections_refused,
        )


def proxy_gauges(r: Registry, inflight: Mapping[str, int], queue_depth: Callable[[], int]) -> None:
    """The proxy side's gauges: in-flight requests per backend, requests waiting for
    capacity (read at scrape time from whatever holds them in this process)."""

    def infl() -> Iterable[tuple[tuple[str, ...], float]]:
        for name, n in inflight.items():
            yield (name,), float(n)

    def depth() -> Iterable[tuple[tuple[str, ...], float]]:
        yield (), float(queue_depth())

    r.add(Gauge("pulsegate_backend_inflight", "Requests in flight", ("backend",), infl))
    r.add(Gauge("pulsegate_queue_depth", "Requests waiting for capacity", (), depth))
