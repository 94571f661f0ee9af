"""The front door as the forwarder calls it: identify, admit, settle, headers and metrics."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from typing import Any

import orjson

from pulsegate.config import Config, parse_config
from pulsegate.front.door import BYTES_PER_TOKEN, FrontDoor, front_door
from pulsegate.front.headers import duration
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.request import CHAT, Limits, ProxyRequest, Rejection, parse

KEY = "pg-door-test-key"
OTHER = "pg-door-other-key"


def config(**entry: Any) -> Config:
    keys = [
        {"name": "team-a", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), **entry},
        {"name": "team-b", "sha256": hashlib.sha256(OTHER.encode()).hexdigest()},
    ]
    return parse_config(
        {"backends": [{"name": "a", "url": "http://127.0.0.1:9001"}], "auth": {"keys": keys}}
    )


def door(cfg: Config) -> tuple[FrontDoor, ProxyMetrics]:
    m = ProxyMetrics(Registry())
    d = front_door(cfg, m, 0.0)
    assert d is not None
    return d, m


def request(model: str = "demo-7b", content: str = "hi") -> ProxyRequest:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": content}]})
    r = parse(CHAT, body, None, Limits(1 << 20, 5.0, 0.1, 300.0, 0, ()))
    assert isinstance(r, ProxyRequest)
    return r


def call(
    d: FrontDoor, headers: dict[str, str], req: ProxyRequest, now: float, status: int = 200
) -> tuple[Exchange, Rejection | None]:
    """identify + admit + settle, as Forwarder.handle does."""
    ex = Exchange(now, 0.0, CHAT, "chat")
    refused = d.identify(headers, ex)
    if refused is None:
        refused = d.admit(req, ex, now)
    ex.status = refused.status if refused else status
    if ex.ticket is not None:
        d.settle(ex, now)
    return ex, refused


def bearer(key: str = KEY) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def test_no_auth_no_door() -> None:
    """Without `auth:` there is no door at all: nothing runs per request."""
    cfg = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:9001"}]})
    assert front_door(cfg, ProxyMetrics(Registry()), 0.0) is None


def test_missing_and_unknown_keys_are_401_naming_no_key() -> None:
    """No key or an unknown one: 401 invalid_api_key, the key in no message; counted as '-'."""
    d, m = door(config())
    _, r1 = call(d, {}, request(), 0.0)
    ex, r2 = call(d, bearer("pg-wrong"), request(), 0.0)
    assert r1 is not None and r2 is not None
    assert (r1.status, r1.code, r2.status, r2.code) == (
        401,
        "invalid_api_key",
        401,
        "invalid_api_key",
    )
    assert "pg-wrong" not in r2.message and ex.key is None
    assert m.key_rejections.get(("-", "missing_key")) == 1
    assert m.key_rejections.get(("-", "unknown_key")) == 1


def test_a_known_key_names_the_exchange() -> None:
    """Bearer or x-api-key: the exchange carries the key's name, and the request is counted."""
    d, m = door(config())
    ex, refused = call(d, bearer(), request(), 0.0)
    assert refused is None and ex.key == "team-a"
    ex, refused = call(d, {"x-api-key": OTHER}, request(), 0.0)
    assert refused is None and ex.key == "team-b"
    assert m.key_requests.get(("team-a", "200")) == 1


def test_model_allow_list() -> None:
    """A model outside the key's globs: 403 model_not_allowed; inside: admitted."""
    d, m = door(config(models=["llama-*"]))
    _, refused = call(d, bearer(), request("demo-7b"), 0.0)
    assert refused is not None and (refused.status, refused.code) == (403, "model_not_allowed")
    assert call(d, bearer(), request("llama-3-8b"), 0.0)[1] is None
    assert m.key_rejections.get(("team-a", "model_not_allowed")) == 1
    assert m.key_requests.get(("team-a", "403")) == 1


def test_rpm_refusal_has_retry_after_and_openai_headers() -> None:
    """rpm 2: the third within the second is 429 rate_limited with Retry-After and x-ratelimit-*."""
    d, m = door(config(rpm=2))
    ex, _ = call(d, bearer(), request(), 0.0)
    assert ex.reply_headers == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "1",
        "x-ratelimit-reset-requests": "30s",
    }
    call(d, bearer(), request(), 0.0)
    _, refused = call(d, bearer(), request(), 1.0)
    assert refused is not None and (refused.status, refused.code) == (429, "rate_limited")
    assert refused.headers is not None
    assert refused.headers["retry-after"] == "29"  # 1 of 2 back every 30 s, 1 s gone
    assert 28_999 <= int(refused.headers["retry-after-ms"]) <= 29_001
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert "2 requests per minute" in refused.message
    assert m.key_rejections.get(("team-a", "rpm")) == 1
    # Another key is not affected.
    assert call(d, bearer(OTHER), request(), 1.0)[1] is None


def test_tokens_estimated_from_the_body_then_corrected_by_usage() -> None:
    """tpm: the admission takes body/4; settle puts the answer's usage in its place."""
    d, m = door(config(tpm=10_000))
    req = request(content="x" * 4000)
    estimate = len(req.body) // BYTES_PER_TOKEN
    ex = Exchange(0.0, 0.0, CHAT, "chat")
    assert d.identify(bearer(), ex) is None and d.admit(req, ex, 0.0) is None
    assert ex.reply_headers is not None
    assert ex.reply_headers["x-ratelimit-remaining-tokens"] == str(10_000 - estimate)
    ex.tokens_in, ex.tokens_out, ex.status = 1000, 500, 200
    d.settle(ex, 0.0)
    ex2, _ = call(d, bearer(), request(content=""), 0.0)
    assert ex2.reply_headers is not None
    left = 10_000 - 1500 - len(request(content="").body) // BYTES_PER_TOKEN
    assert ex2.reply_headers["x-ratelimit-remaining-tokens"] == str(left)
    assert m.key_tokens.get(("team-a", "prompt")) == 1000
    assert m.key_tokens.get(("team-a", "completion")) == 500


def test_concurrency_released_at_settle() -> None:
    """concurrency 1: a second in flight is 429; after the first settles it is admitted."""
    d, _ = door(config(concurrency=1))
    first = Exchange(0.0, 0.0, CHAT, "chat")
    assert d.identify(bearer(), first) is None and d.admit(request(), first, 0.0) is None
    _, refused = call(d, bearer(), request(), 0.0)
    assert refused is not None and refused.code == "rate_limited"
    assert "1 requests at once" in refused.message
    first.status = 200
    d.settle(first, 0.1)
    assert call(d, bearer(), request(), 0.1)[1] is None


def test_a_reload_keeps_the_minute_of_unchanged_keys() -> None:
    """front_door(old=...): team-a's rpm unchanged keeps its count; a changed rpm starts full."""
    m = ProxyMetrics(Registry())
    d1 = front_door(config(rpm=1), m, 0.0)
    assert d1 is not None
    assert call(d1, bearer(), request(), 0.0)[1] is None
    d2 = front_door(config(rpm=1), m, 1.0, d1)
    assert d2 is not None and d2.store is d1.store
    _, refused = call(d2, bearer(), request(), 1.0)
    assert refused is not None and refused.code == "rate_limited"
    d3 = front_door(config(rpm=5), m, 2.0, d2)
    assert d3 is not None
    assert call(d3, bearer(), request(), 2.0)[1] is None


def test_workers_each_enforce_their_share() -> None:
    """gateway.workers 4: each worker process enforces ceil(rpm / 4)."""
    cfg = config(rpm=8)
    cfg = parse_config(
        {
            "backends": [{"name": "a", "url": "http://127.0.0.1:9001"}],
            "gateway": {"workers": 4},
            "auth": {
                "keys": [{"name": k.name, "sha256": k.sha256, "rpm": k.rpm} for k in cfg.auth.keys]
            },  # type: ignore[union-attr]
        }
    )
    d, _ = door(cfg)
    assert call(d, bearer(), request(), 0.0)[1] is None
    assert call(d, bearer(), request(), 0.0)[1] is None
    _, refused = call(d, bearer(), request(), 0.0)
    assert refused is not None and refused.headers is not None
    assert refused.headers["x-ratelimit-limit-requests"] == "2"


def test_durations_as_openai_writes_them() -> None:
    """reset headers: 20ms, 1.5s, 6m0s."""
    assert [duration(s) for s in (0.0, 0.0201, 1.5, 59.0, 360.0, 61.25)] == [
        "0s", "21ms", "1.5s", "59s", "6m0s", "1m1.25s"
    ]  # fmt: skip


def test_a_gateway_without_redis_never_loads_redis_py() -> None:
    """redis-py is about a tenth of a second of a gateway's start: the serving modules (one
    process or a primary and its workers) load it only where `cluster.redis` names a Redis
    (`front_door`, `HealthService`)."""
    code = (
        "import sys, pulsegate.server, pulsegate.cluster.primary, pulsegate.cluster.worker\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'redis'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
