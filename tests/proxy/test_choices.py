"""`n > 1` goes only to backends that answer `n` choices (`max_n`), else an OpenAI 400.

transformers serve ignores `n` and answers one choice (docs/real-engines.md, finding 3):
the hf-like stand-in does the same, the vLLM-like one honours `n`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from script_engines import HF_LIKE, VLLM_LIKE, ScriptEngine

from pulsegate.config import ConfigError, parse_config
from support import Gateway, fast_probes

MSGS = [{"role": "user", "content": "x"}]


def _gateway(start_gateway: Callable[..., Gateway], *backends: dict[str, Any]) -> Gateway:
    gw = start_gateway({"backends": list(backends), "probes": fast_probes()})
    gw.wait_all_ready()
    return gw


def _chat(gw: Gateway, session: str | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "demo-7b", "messages": MSGS, "max_tokens": 3, **extra}
    headers = {"x-session-id": session} if session else {}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=10)


def test_n_goes_only_to_backends_that_honour_it(
    start_engine: Callable[..., ScriptEngine], start_gateway: Callable[..., Gateway]
) -> None:
    """`n: 2` is served by the backend that gives two choices, also for sessions homed on
    the one that gives one choice (where their `n: 1` requests go)."""
    hf, vl = start_engine(HF_LIKE), start_engine(VLLM_LIKE)
    gw = _gateway(
        start_gateway,
        {"name": "hf", "url": hf.url, "models": ["demo-7b"], "max_n": 1},
        {"name": "vl", "url": vl.url, "models": ["demo-7b"]},
    )
    homes = {}
    for i in range(12):
        homes[i] = _chat(gw, f"s{i}").headers["x-pulsegate-backend"]
        r = _chat(gw, f"s{i}", n=2)
        assert r.status_code == 200, r.text
        assert r.headers["x-pulsegate-backend"] == "vl"
        assert len(r.json()["choices"]) == 2
    assert "hf" in homes.values(), homes  # else the test proved nothing


def test_n_no_backend_honours_is_an_openai_400(
    start_engine: Callable[..., ScriptEngine], start_gateway: Callable[..., Gateway]
) -> None:
    """With only a one-choice engine, `n: 2` is refused in OpenAI's shape before any engine
    sees it; `n: 1` is served."""
    hf = start_engine(HF_LIKE)
    gw = _gateway(start_gateway, {"name": "hf", "url": hf.url, "models": ["demo-7b"], "max_n": 1})
    r = _chat(gw, n=2)
    assert r.status_code == 400
    err = r.json()["error"]
    assert "'n'" in err["message"] and "at most 1" in err["message"]
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'pulsegate_requests_total{backend="hf"' not in metrics  # no engine saw it
    assert _chat(gw, n=1).status_code == 200


def test_max_n_config() -> None:
    """`max_n` defaults to 0 (no limit); a negative or non-integer value is an error naming
    its key path."""
    a = {"name": "a", "url": "http://127.0.0.1:9001"}
    cfg = parse_config({"backends": [a, {**a, "name": "b", "max_n": 1}]})
    assert [b.max_n for b in cfg.backends] == [0, 1]
    for bad in (-1, "one"):
        with pytest.raises(ConfigError) as ei:
            parse_config({"backends": [{**a, "max_n": bad}]})
        assert "backends[0].max_n" in str(ei.value)
