"""Dialects normalised at the edge: what any backend sends, clients get the OpenAI way.

Run as a script, this file is also a stand-in hosted API that refuses the gateway's key:
every non-probe chat request gets a 401 whose body echoes the key, the way OpenAI's does
("Incorrect API key provided: sk-...").
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
from aiohttp import web

from pulsegate.proxy.attempt import normalize_error

FAKE_KEY = "sk-FAKE-0123456789abcdefLEAKME"
ECHO = orjson.dumps(
    {"error": {"message": f"Incorrect API key provided: {FAKE_KEY}", "code": "invalid_api_key"}}
)


def test_backend_errors_are_normalised_to_openai_shape() -> None:
    """FastAPI `detail`, plain text and 422 become OpenAI errors; OpenAI ones pass as is."""
    ok = b'{"error": {"message": "m", "type": "t", "code": "c"}}'
    assert normalize_error(400, ok) == (400, ok)
    status, body = normalize_error(422, b'{"detail": [{"loc": ["body"], "msg": "bad"}]}')
    err = orjson.loads(body)["error"]
    assert status == 400 and "bad" in err["message"] and err["code"] == "invalid_request"
    status, body = normalize_error(404, b"Not Found")
    assert status == 404 and orjson.loads(body)["error"]["message"] == "Not Found"


def test_backend_401_and_403_become_a_502_without_the_body() -> None:
    """A backend refusing the gateway's key is a 502 naming the backend, none of its body."""
    for status in (401, 403):
        for body in (ECHO, FAKE_KEY.encode(), b'{"detail": "' + FAKE_KEY.encode() + b'"}'):
            out, data = normalize_error(status, body, "hosted")
            err = orjson.loads(data)["error"]
            assert out == 502 and err["code"] == "upstream_auth_failed"
            assert "hosted" in err["message"] and FAKE_KEY not in data.decode()


def test_a_backend_echoing_the_key_in_a_401_never_shows_it_to_the_client(
    start_engine: Callable[..., object], start_gateway: Callable[..., object]
) -> None:
    """A stand-in answering 401 with the operator's key in its body: the client gets a 502
    in OpenAI's shape naming the backend, and the key nowhere in status, headers or body."""
    from support import Gateway, fast_probes

    engine = start_engine(Path(__file__))
    gw = start_gateway(
        {
            "backends": [
                {
                    "name": "hosted",
                    "url": engine.url,  # type: ignore[attr-defined]
                    "models": ["demo-7b"],
                    "api_key_env": "PG_FAKE_KEY",
                }
            ],
            "probes": fast_probes(),
        },
        env={"PG_FAKE_KEY": FAKE_KEY},
    )
    assert isinstance(gw, Gateway)
    gw.wait_all_ready()
    for stream in (False, True):
        body = {
            "model": "demo-7b",
            "messages": [{"role": "user", "content": "x"}],
            "stream": stream,
        }
        r = httpx.post(f"{gw.url}/v1/chat/completions", json=body, timeout=10)
        seen = r.text + "".join(f"{k}: {v}\n" for k, v in r.headers.items())
        assert FAKE_KEY not in seen and "sk-FAKE" not in seen
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["code"] == "upstream_auth_failed" and "hosted" in err["message"]
    # Not the backend's sickness: it stays ready (a 4xx never counts against it).
    assert gw.backends()["hosted"]["state"] == "ready"


# ---- the stand-in engine, when run as a script ------------------------------------------


async def _health(_: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _models(_: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "demo-7b", "object": "model"}]})


async def _chat(request: web.Request) -> web.Response:
    await request.read()
    if "x-pulsegate-probe" not in request.headers:
        return web.Response(status=401, body=ECHO, content_type="application/json")
    msg = {"role": "assistant", "content": "ok"}
    return web.json_response(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": msg, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    )


def main() -> None:
    from script_engines import serve

    app = web.Application()
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/chat/completions", _chat)
    serve(app, "key-echoing engine")


if __name__ == "__main__":
    main()
