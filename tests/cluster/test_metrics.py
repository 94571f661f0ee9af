"""The workers' proxy metrics summed into the primary's registry."""

from __future__ import annotations

from pulsegate.cluster.metrics import MetricsMerge, snapshot
from pulsegate.observe.metrics import Counter, Registry
from pulsegate.proxy.metrics import ProxyMetrics


def _side() -> tuple[Registry, ProxyMetrics, Counter]:
    """A process's registry: the proxy metrics and one health-side counter."""
    r = Registry()
    m = ProxyMetrics(r)
    ejections = r.counter("pulsegate_ejections_total", "x", ("backend", "reason"))
    return r, m, ejections


def test_counters_and_histograms_add_up_and_survive_a_retired_worker() -> None:
    """Totals are the sum over workers; a replaced worker's counts stay in them."""
    workers = [_side()[1], _side()[1]]
    for i, w in enumerate(workers):
        for _ in range(i + 1):
            w.requests.inc(("a", "m", "200"))
            w.request_seconds.observe(0.02)
    primary, pm, ejections = _side()
    ejections.inc(("a", "probe"))
    merge = MetricsMerge(pm)
    merge.update(0, snapshot(workers[0]))
    merge.update(1, snapshot(workers[1]))
    text = primary.render()
    assert 'pulsegate_requests_total{backend="a",model="m",code="200"} 3' in text
    assert "pulsegate_request_seconds_count 3" in text
    assert 'pulsegate_ejections_total{backend="a",reason="probe"} 1' in text  # its own
    merge.retire(0)
    merge.update(0, snapshot(_side()[1]))  # the replacement starts from zero
    assert 'code="200"} 3' in primary.render()


def test_snapshot_holds_only_the_proxy_metrics() -> None:
    """Health-side metrics are the primary's: a worker never sends them."""
    _, m, _ = _side()
    names = set(snapshot(m))
    assert names == {x.name for x in m.summed}
    assert {"pulsegate_requests_total", "pulsegate_request_seconds"} <= names
    assert "pulsegate_ejections_total" not in names


def test_a_gone_workers_levels_leave_the_sum() -> None:
    """Open client connections are a level: a killed worker's die with it, while its
    refused-connection count (a counter) stays in the total."""
    workers = [_side()[1], _side()[1]]
    for i, w in enumerate(workers):
        w.client_connections.set(10 * (i + 1))
        w.client_connections_refused.inc()
    primary, pm, _ = _side()
    merge = MetricsMerge(pm)
    merge.update(0, snapshot(workers[0]))
    merge.update(1, snapshot(workers[1]))
    assert "pulsegate_client_connections 30" in primary.render()
    merge.retire(1)
    text = primary.render()
    assert "pulsegate_client_connections 10" in text
    assert "pulsegate_client_connections_refused_total 2" in text
    merge.update(1, snapshot(_side()[1]))  # the replacement: no connection yet
    assert "pulsegate_client_connections 10" in primary.render()
