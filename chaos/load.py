"""Steady client load: an open-loop asyncio client at a fixed rate, mixed streaming and not.

Open loop (requests leave on a fixed schedule, whether or not earlier ones were answered) is
what a fleet of users does: a slow backend cannot slow the offered load down and so hide its
own tail. Request i leaves at start + i / rate. Half the prompts are short (~200 bytes) and
half are long (3-5 KB, the size of a real chat context: several IP packets, so packet-size
faults hit client traffic as they hit the gateway's canary), and half the requests stream.
Every prompt starts with a unique tag so the engines' prefix cache cannot make faults look
faster than they are.

Who answered: `serve` names the backend in `x-pulsegate-backend`; Envoy (the `envoy-epp`
mode) names the engine's `ip:port` in `x-gateway-destination-endpoint-served`, mapped to
the backend's name by `endpoints`.

Each request becomes one `Result`. A request is an error when the client does not get a
complete, well-formed answer within `timeout`: a non-200 status, a transport error, a timeout,
a stream without `data: [DONE]`, or a stream carrying an error object.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import orjson

WORDS = (
    *("gpu", "kernel", "tensor", "cache", "token", "batch", "prompt", "stream", "engine"),
    *("node", "fleet", "route", "queue", "health", "probe", "canary", "packet", "window"),
    *("thread", "memory", "latency", "error", "vllm", "model", "layer", "head", "weight"),
)


@dataclass(slots=True)
class Result:
    t0: float  # wall time the request left
    t1: float  # wall time it ended (answer complete, error, or timeout)
    stream: bool
    big: bool  # a long prompt (several packets)
    status: int  # HTTP status, 0 when none arrived
    ok: bool
    error: str  # "" when ok; else timeout | connect | status | stream_cut | stream_error | ...
    backend: str  # x-pulsegate-backend (or Envoy's served endpoint): who answered in the end
    attempts: int
    ttft: float | None  # seconds to the first body chunk
    max_gap: float | None  # streams: the longest pause between two chunks

    @property
    def latency(self) -> float:
        return self.t1 - self.t0

    def row(self) -> dict[str, Any]:
        return asdict(self)


def _prompt(rng: random.Random, i: int, big: bool) -> str:
    n = rng.randint(450, 800) if big else rng.randint(20, 30)
    return f"[req {i}] " + " ".join(rng.choice(WORDS) for _ in range(n))


class Load:
    """`rate` requests per second to `url` until `stop()`; results in `results`."""

    def __init__(
        self,
        url: str,
        rate: float = 50.0,
        max_tokens: int = 16,
        timeout: float = 10.0,
        seed: int = 0,
        stream_share: float = 0.5,
        big_share: float = 0.5,
        endpoints: Mapping[str, str] | None = None,
    ) -> None:
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.rate = rate
        self.max_tokens = max_tokens
        self.timeout = timeout
        self.rng = random.Random(seed)
        self.stream_share = stream_share
        self.big_share = big_share
        self.endpoints = endpoints or {}
        self.results: list[Result] = []
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._runner: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.sent = 0

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=False),
            timeout=aiohttp.ClientTimeout(total=self.timeout),
        )
        self._runner = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        start = loop.time()
        i = 0
        while not self._stop.is_set():
            due = start + i / self.rate
            delay = due - loop.time()
            if delay > 0:
                try:
                    await asyncio.wait_for(self._stop.wait(), delay)
                    break
                except TimeoutError:
                    pass
            stream = self.rng.random() < self.stream_share
            big = self.rng.random() < self.big_share
            body = {
                "model": "demo-7b",
                "messages": [{"role": "user", "content": _prompt(self.rng, i, big)}],
                "max_tokens": self.max_tokens,
                "stream": stream,
            }
            t = loop.create_task(self._one(orjson.dumps(body), stream, big))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
            self.sent += 1
            i += 1

    async def stop(self, drain: float | None = None) -> list[Result]:
        """Stop sending; wait for requests in flight (at most `drain`, default the timeout)."""
        self._stop.set()
        if self._runner is not None:
            await self._runner
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=drain or self.timeout + 1)
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        return self.results

    async def _one(self, body: bytes, stream: bool, big: bool) -> None:
        assert self._session is not None
        t0 = time.time()
        status, backend, attempts = 0, "", 0
        ttft: float | None = None
        max_gap: float | None = None
        error = ""
        try:
            async with self._session.post(
                self.url, data=body, headers={"content-type": "application/json"}
            ) as r:
                status = r.status
                backend, attempts = _served(r.headers, self.endpoints)
                if status != 200:
                    await r.read()
                    error = "status"
                elif stream:
                    ttft, max_gap, error = await _read_stream(r, t0)
                else:
                    data = await r.read()
                    ttft = time.time() - t0
                    doc = orjson.loads(data)
                    if not doc.get("choices"):
                        error = "bad_body"
        except TimeoutError:
            error = "timeout"
        except aiohttp.ClientConnectorError:
            error = "connect"
        except (aiohttp.ClientError, OSError, orjson.JSONDecodeError) as e:
            error = f"transport:{type(e).__name__}"
        except asyncio.CancelledError:
            error = "cancelled"
            self.results.append(
                Result(t0, time.time(), stream, big, status, False, error, backend, attempts,
                       ttft, max_gap)
            )  # fmt: skip
            raise
        self.results.append(
            Result(t0, time.time(), stream, big, status, not error, error, backend, attempts,
                   ttft, max_gap)
        )  # fmt: skip


def _served(headers: Mapping[str, str], endpoints: Mapping[str, str]) -> tuple[str, int]:
    """The backend that answered and the attempts it took, from `serve`'s headers or Envoy's."""
    if "x-pulsegate-backend" in headers:
        return headers["x-pulsegate-backend"], int(headers.get("x-pulsegate-attempts") or 0)
    served = headers.get("x-gateway-destination-endpoint-served", "")
    return endpoints.get(served, served), int(headers.get("x-envoy-attempt-count") or 0)


async def _read_stream(r: aiohttp.ClientResponse, t0: float) -> tuple[float | None, float, str]:
    """Read an SSE stream: time to first chunk, longest pause between chunks, error kind."""
    ttft: float | None = None
    last = None
    max_gap = 0.0
    done = False
    buf = b""
    async for chunk in r.content.iter_any():
        now = time.time()
        if ttft is None:
            ttft = now - t0
        if last is not None:
            max_gap = max(max_gap, now - last)
        last = now
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    done = True
                elif payload.startswith(b"{") and b'"error"' in payload:
                    try:
                        if "error" in orjson.loads(payload):
                            return ttft, max_gap, "stream_error"
                    except orjson.JSONDecodeError:
                        return ttft, max_gap, "stream_bad"
    return ttft, max_gap, "" if done else "stream_cut"
