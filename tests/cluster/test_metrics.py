"""The workers' proxy metrics summed into the primary's registry."""

from __future__ import annotations

from pulsegate.cluster.metrics import MetricsMerge, snapshot
from pulsegate.observe.metrics import Registry


def _registry() -> Registry:
    r = Registry()
    r.counter("pulsegate_requests_total", "x", ("backend", "model", "code"))
    r.histogram("pulsegate_request_seconds", "x")
    r.counter("pulsegate_ejections_total", "x", ("backend", "reason"))
    return r


def test_counters_and_histograms_add_up_and_survive_a_retired_worker() -> None:
    """Totals are the sum over workers; a replaced worker's counts stay in them."""
    workers = [_registry(), _registry()]
    for i, w in enumerate(workers):
        for _ in range(i + 1):
            w.metrics[0].inc(("a", "m", "200"))  # type: ignore[union-attr]
            w.metrics[1].observe(0.02)  # type: ignore[union-attr]
    primary = _registry()
    primary.metrics[2].inc(("a", "probe"))  # type: ignore[union-attr]
    merge = MetricsMerge(primary)
    merge.update(0, snapshot(workers[0]))
    merge.update(1, snapshot(workers[1]))
    text = primary.render()
    assert 'pulsegate_requests_total{backend="a",model="m",code="200"} 3' in text
    assert "pulsegate_request_seconds_count 3" in text
    assert 'pulsegate_ejections_total{backend="a",reason="probe"} 1' in text  # its own
    merge.retire(0)
    merge.update(0, snapshot(_registry()))  # the replacement starts from zero
    assert 'code="200"} 3' in primary.render()


def test_snapshot_holds_only_the_proxy_metrics() -> None:
    """Health-side metrics are the primary's: a worker never sends them."""
    assert set(snapshot(_registry())) == {"pulsegate_requests_total", "pulsegate_request_seconds"}
