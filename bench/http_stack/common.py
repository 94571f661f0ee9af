"""Shared payloads and helpers for the HTTP-stack benchmark (bench only, not product code)."""

from __future__ import annotations

import asyncio
import os

import orjson

PATH = b"/v1/chat/completions"
PATH_STR = PATH.decode()

# ~200 B OpenAI-style chat request (the proxies parse it and forward it unchanged).
REQUEST = {
    "model": "llama-3-8b-instruct",
    "messages": [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Say hello in five words, please. Keep it short."},
    ],
    "max_tokens": 16,
    "temperature": 0.2,
    "stream": False,
}
REQUEST_BODY = orjson.dumps(REQUEST)
STREAM_REQUEST_BODY = orjson.dumps({**REQUEST, "stream": True})

# ~300 B non-streaming completion returned by the upstream.
COMPLETION_BODY = orjson.dumps(
    {
        "id": "chatcmpl-bench0000000000000000",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "llama-3-8b-instruct",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, nice to meet!"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 31, "completion_tokens": 7, "total_tokens": 38},
    }
)

SSE_CHUNK = (
    b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"llama-3-8b-instruct",'
    b'"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
SSE_DONE = b"data: [DONE]\n\n"
SSE_CHUNKS = 64

JSON_CT = b"application/json"
SSE_CT = b"text/event-stream"


def install_uvloop() -> None:
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def upstream_url() -> str:
    return f"http://127.0.0.1:{os.environ['BENCH_UPSTREAM_PORT']}{PATH_STR}"


def parse_request(body: bytes) -> tuple[str | None, bool]:
    """The only parsing the gateway does on the hot path: model + stream flag."""
    req = orjson.loads(body)
    return req.get("model"), bool(req.get("stream"))


def make_aiohttp_session():  # type: ignore[no-untyped-def]
    import aiohttp

    connector = aiohttp.TCPConnector(limit=256, keepalive_timeout=60, enable_cleanup_closed=False)
    return aiohttp.ClientSession(
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=60),
        auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept-Encoding"),
    )
