"""The proxy side's metrics, defined in one place.

These are the metrics the proxy path writes. In a multi-process gateway each proxy worker
counts them in its own registry and the primary sums them (`cluster/metrics.py` takes the
list from `ProxyMetrics.summed`, so a metric added here is summed with no other change).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from pulsegate.observe.metrics import Counter, Gauge, Histogram, Registry


class ProxyMetrics:
    __slots__ = ("queued", "request_seconds", "requests", "resumes", "retries", "ttft")

    def __init__(self, r: Registry) -> None:
        self.requests: Counter = r.counter(
            "pulsegate_requests_total",
            "Client request attempts by backend, model and status code",
            ("backend", "model", "code"),
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
        self.queued: Counter = r.counter(
            "pulsegate_queued_total", "Requests that waited for a backend with free capacity"
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
            self.queued,
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
