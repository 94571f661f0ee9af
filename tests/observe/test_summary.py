"""GET /admin/summary's arithmetic and the per-model backend gauge, on an unstarted Gateway."""

from __future__ import annotations

from pulsegate.clock import ManualClock
from pulsegate.config import parse_config
from pulsegate.gateway import Gateway
from pulsegate.observe.dashboard import RateWindow, is_failure, model_backends, summary


def _gateway() -> Gateway:
    return Gateway(
        parse_config(
            {
                "backends": [
                    {"name": "a", "url": "http://127.0.0.1:9", "models": ["m"]},
                    {"name": "b", "url": "http://127.0.0.1:9", "models": ["m", "n"]},
                ]
            }
        ),
        ManualClock(),
    )


def _requests(gw: Gateway, n: int, backend: str, code: str) -> None:
    for _ in range(n):
        gw.proxy_metrics.requests.inc((backend, "m", code))


def test_failure_codes() -> None:
    """5xx and transport outcomes are failures; 2xx, 3xx and passed-through 4xx are not."""
    assert [is_failure(c) for c in ("200", "302", "404", "429")] == [False] * 4
    assert [is_failure(c) for c in ("500", "503", "timeout", "stream_broken")] == [True] * 4


def test_first_call_has_totals_but_no_rates() -> None:
    """Without an earlier sample every rate is null (unknown), never 0."""
    gw = _gateway()
    doc = summary(gw, RateWindow(), 100.0, token_required=False)
    assert doc["requests_total"] == 0
    assert doc["requests_per_s"] is None
    assert doc["error_rate"] is None
    assert doc["backends"]["a"] == {"attempts_per_s": None, "share": None, "failure_rate": None}
    assert doc["states"] == {"cold": 2}
    assert doc["panic"] is False
    assert doc["monotonic"] == 100.0
    assert doc["config_loaded_at"] == round(gw.health.clock.wall(), 3)  # loaded at start
    assert doc["config_reloads"] == {"ok": 0, "refused": 0}


def test_rates_shares_and_hidden_failures() -> None:
    """Retries hide backend failures: attempt failure rate > 0 while clients saw no error."""
    gw = _gateway()
    window = RateWindow()
    summary(gw, window, 100.0, token_required=True)
    # 10 client requests in 5 s: 8 straight to a, 2 failed on b (503) and retried on a.
    for _ in range(10):
        gw.proxy_metrics.request_seconds.observe(0.1)
    _requests(gw, 10, "a", "200")
    _requests(gw, 2, "b", "503")
    gw.proxy_metrics.retries.inc(("server_error",), 2)
    doc = summary(gw, window, 105.0, token_required=True)
    assert doc["window_s"] == 5.0
    assert doc["requests_per_s"] == 2.0
    assert doc["attempts_per_s"] == 2.4
    assert doc["error_rate"] == 0.0
    assert doc["attempt_failure_rate"] == round(2 / 12, 4)
    assert doc["retries_per_s"] == 0.4
    assert doc["retries_by_reason"] == {"server_error": 2}
    assert doc["backends"]["a"]["share"] == round(10 / 12, 4)
    assert doc["backends"]["b"]["failure_rate"] == 1.0
    assert doc["admin_token_required"] is True


def test_client_errors_counted_once_per_request() -> None:
    """A request whose every attempt failed is one client error, however many attempts."""
    gw = _gateway()
    window = RateWindow()
    summary(gw, window, 0.0, token_required=False)
    for _ in range(4):
        gw.proxy_metrics.request_seconds.observe(0.1)
    _requests(gw, 3, "a", "200")
    _requests(gw, 1, "a", "timeout")
    _requests(gw, 1, "b", "502")
    doc = summary(gw, window, 2.0, token_required=False)
    assert doc["error_rate"] == 0.25


def test_window_is_about_five_seconds() -> None:
    """Rates come from the newest sample at least 5 s old, not from the very first."""
    gw = _gateway()
    window = RateWindow()
    for t in range(0, 21):
        summary(gw, window, float(t), token_required=False)
    assert summary(gw, window, 21.0, token_required=False)["window_s"] == 5.0


def test_model_backends_counts_every_state() -> None:
    """Each model gets a row per state (zeros included), so 'none routable' is expressible."""
    gw = _gateway()
    rows = dict(model_backends(gw))
    assert rows[("m", "cold")] == 2.0
    assert rows[("n", "cold")] == 1.0
    assert rows[("m", "ready")] == 0.0
    assert {s for (_m, s) in rows} >= {"ready", "degraded", "probation", "ejected", "drained"}
