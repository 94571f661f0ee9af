"""Bad input gets a clear OpenAI-shaped error and never hurts the gateway."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from support import Gateway, Sim, backend_entry, fast_probes


@pytest.fixture
def gw(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> Gateway:
    sim = start_sim("a")
    g = start_gateway(
        {
            "backends": [backend_entry(sim)],
            "gateway": {"max_body_bytes": 4096},
            "probes": fast_probes(),
        }
    )
    g.wait_all_ready()
    return g


def _post(gw: Gateway, body: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(
        gw.url + path, content=body, headers={"content-type": "application/json"}, timeout=10
    )


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_request"),
        (b'{"messages": [{"role": "user", "content": "x"}]}', 400, "missing_model"),
        (b'{"model": "demo-7b"}', 400, "missing_messages"),
        (b'{"model": "demo-7b", "messages": []}', 400, "missing_messages"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404,
         "model_not_found"),
        (b"\xff\xfe\x00garbage", 400, "invalid_json"),
    ],
)  # fmt: skip
def test_bad_requests_get_openai_errors(gw: Gateway, body: bytes, status: int, code: str) -> None:
    """Each malformed request gets its status and an OpenAI error body with a code."""
    r = _post(gw, body)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["code"] == code and err["message"] and err["type"]


def test_completions_requires_prompt(gw: Gateway) -> None:
    """/v1/completions without a prompt is a 400 naming the field."""
    r = _post(gw, b'{"model": "demo-7b"}', "/v1/completions")
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_oversize_body_is_413(gw: Gateway) -> None:
    """A body over gateway.max_body_bytes is refused with 413, declared or chunked."""
    big = b'{"model": "demo-7b", "prompt": "' + b"x" * 8000 + b'"}'
    r = _post(gw, big, "/v1/completions")
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold while reading
        yield big[:3000]
        yield big[3000:]

    r = httpx.post(gw.url + "/v1/completions", content=chunks(), timeout=10)
    assert r.status_code == 413


def test_openai_client_sees_typed_errors(gw: Gateway) -> None:
    """The openai SDK maps the gateway's errors to its own exception types."""
    c = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=10)
    with pytest.raises(openai.NotFoundError) as ei:
        c.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    assert "missing" in str(ei.value)


def test_no_healthy_backend_is_503_and_gateway_survives(gw: Gateway) -> None:
    """With every backend drained the gateway answers 503 with Retry-After, then recovers."""
    httpx.post(f"{gw.url}/admin/backends/a/drain", timeout=5).raise_for_status()
    body = b'{"model": "demo-7b", "messages": [{"role": "user", "content": "x"}]}'
    r = _post(gw, body)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_backend"
    assert r.headers["retry-after"]
    httpx.post(f"{gw.url}/admin/backends/a/undrain", timeout=5).raise_for_status()
    gw.wait_state("a", "ready", "probation")
    assert _post(gw, body).status_code == 200


def test_unknown_path_is_openai_404(gw: Gateway) -> None:
    """Unknown routes answer 404 in OpenAI's error shape."""
    r = httpx.get(gw.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
