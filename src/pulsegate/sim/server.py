"""The simulated engine's HTTP shell: routes, the per-request flow, start and stop.

Request flow for ``POST /v1/{chat/,}completions`` (each step may be a fault's hang point):

1. arrival: counted in /sim/stats before anything can swallow it; a blackhole hangs here
   without reading the body;
2. body parsed (400/404 like vLLM); injected errors, OOM, warming and resets decided;
3. streaming responses send their headers now, as vLLM does before its queue;
4. FIFO wait for one of ``max_batch`` slots; prefix-cache lookup;
5. tokens: the first after TTFT (x0.3 on a prefix hit), then one per ITL, both x the `slow`
   factor; stall/reset/hang faults are checked before every token.

This is the only sim module that reads clocks (``loop.time()`` and ``time.time()``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import orjson
from aiohttp import web

from pulsegate.sim import faults as F
from pulsegate.sim import hostile
from pulsegate.sim.apis import PoolingApis
from pulsegate.sim.engine import Engine, Seq
from pulsegate.sim.metrics import EngineReading, render
from pulsegate.sim.protocol import (
    Framer,
    GenRequest,
    RequestError,
    parse_chat,
    parse_completion,
)
from pulsegate.sim.sink import TokenSink, abort_connection, error_response, json_response
from pulsegate.sim.text import TokenGen
from pulsegate.sim.typed import TypedApis

# A typed API's sink for one request (`typed.py`); None: the chat/completions one.
SinkFactory = Callable[[GenRequest, int], TokenSink]

log = logging.getLogger(__name__)

PREFIX_HIT_TTFT = 0.3  # a cached prefix skips ~70 % of prefill
PROBE_HEADER = "x-pulsegate-probe"
MAX_MODEL_LEN = 8192
# A zero-delay stream never awaits; yield to the loop every 256 tokens so one long request
# cannot starve the others (~50 us of work per yield).
_YIELD_EVERY = 256


@dataclass(frozen=True, slots=True)
class SimOptions:
    host: str = "127.0.0.1"
    port: int = 0
    name: str = "sim"
    model: str = "demo-7b"
    ttft_ms: float = 30.0
    itl_ms: float = 10.0
    max_batch: int = 32
    seed: int = 0
    gpu_total_mb: float = 81920.0


class _Closing(Exception):
    """The server is shutting down: hung requests give up with 503."""


class _Reset(Exception):
    """The `reset` fault fired: the connection has been aborted."""


_FAILURES: dict[F.Action, tuple[int, str, str]] = {
    F.Action.FAIL_ERROR: (500, "simulated engine failure (fault 'error')", "InternalServerError"),
    F.Action.FAIL_OOM: (
        500,
        "CUDA out of memory. Tried to allocate 2.00 GiB (simulated fault 'oom')",
        "InternalServerError",
    ),
    F.Action.FAIL_WARMING: (503, "engine is warming up (fault 'warming')", "ServiceUnavailable"),
}


class Sim:
    """One simulated engine: its state and its aiohttp handlers."""

    def __init__(self, opts: SimOptions) -> None:
        self.opts = opts
        self.engine = Engine(name=opts.name, max_batch=opts.max_batch)
        self.faults = F.FaultState()
        self.typed = TypedApis(opts.model)  # /v1/responses and /v1/messages (`typed.py`)
        self._rng = random.Random(opts.seed)  # `error` rate draws, reproducible per seed
        self._ttft_s = max(0.0, opts.ttft_ms) / 1000.0
        self._itl_s = max(0.0, opts.itl_ms) / 1000.0
        self._closing = False
        self._now: Callable[[], float] = time.monotonic  # replaced by loop.time on startup
        # /v1/embeddings, rerank, score, /tokenize, /detokenize (`apis.py`)
        self.pooling = PoolingApis(
            engine=self.engine,
            faults=self.faults,
            gate=self._gate,
            closing=_Closing,
            rng=self._rng,
            now=lambda: self._now(),
            ttft_s=self._ttft_s,
            model=opts.model,
            probe_header=PROBE_HEADER,
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        for path, handler in self.pooling.routes():
            app.router.add_post(path, handler)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/sim/fault", self.get_fault)
        app.router.add_post("/sim/fault", self.post_fault)
        app.router.add_get("/sim/stats", self.stats)
        app.router.add_get("/sim/requests", self.requests)
        app.on_startup.append(self._on_startup)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self._now = asyncio.get_running_loop().time

    def close(self) -> None:
        """Release every hung request (they answer 503) so shutdown does not wait on them."""
        self._closing = True
        self.faults.wake()

    async def _engine_gate(self) -> web.Response | None:
        """Hang /health, /metrics, /v1/models under `hang`; a 503 if we shut down meanwhile."""
        try:
            await self._gate(F.engine_endpoint)
        except _Closing:
            return error_response(503, "engine is shutting down", "ServiceUnavailable")
        return None

    async def _gate(self, decide: Callable[[F.Fault], F.Action]) -> F.Action:
        """Ask ``decide`` about the current fault until it says something other than HANG."""
        while True:
            if self._closing:
                raise _Closing
            action = decide(self.faults.current(self._now()))
            if action is not F.Action.HANG:
                return action
            await self.faults.wait_change()

    # ---- engine endpoints ----

    async def health(self, request: web.Request) -> web.Response:
        self.engine.scrapes["health"] += 1
        if (closed := await self._engine_gate()) is not None:
            return closed
        if self.faults.current(self._now()).mode is F.Mode.WARMING:
            return web.Response(status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        if (closed := await self._engine_gate()) is not None:
            return closed
        data: list[dict[str, Any]] = []
        if self.faults.current(self._now()).mode is not F.Mode.WARMING:
            m = self.opts.model
            data.append(
                {
                    "id": m,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "pulsegate-sim",
                    "root": m,
                    "parent": None,
                    "max_model_len": MAX_MODEL_LEN,
                }
            )
        return json_response({"object": "list", "data": data})

    async def metrics(self, request: web.Request) -> web.Response:
        self.engine.scrapes["metrics"] += 1
        if (closed := await self._engine_gate()) is not None:
            return closed
        e = self.engine
        fault = self.faults.current(self._now())
        gpu = F.gpu_reading(
            fault,
            total_mb=self.opts.gpu_total_mb,
            running=e.running,
            max_batch=e.max_batch,
            kv_tokens=e.kv_tokens,
        )
        reading = EngineReading(
            model=self.opts.model,
            max_batch=e.max_batch,
            running=e.running,
            waiting=e.waiting,
            prefix_queries=e.prefix_cache.queries,
            prefix_hits=e.prefix_cache.hits,
            request_success=e.request_success_total,
            prompt_tokens=e.prompt_tokens_total,
            generation_tokens=e.generation_tokens_total,
        )
        return web.Response(text=render(reading, gpu), content_type="text/plain", charset="utf-8")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, parse_completion)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, self.typed.parse_responses, self.typed.sink)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._infer(request, self.typed.parse_messages, self.typed.sink)

    # ---- the inference flow ----

    async def _infer(
        self,
        request: web.Request,
        parse: Callable[[bytes], GenRequest],
        sink: SinkFactory | None = None,
    ) -> web.StreamResponse:
        probe = PROBE_HEADER in request.headers
        tp = request.headers.get("traceparent")
        self.engine.arrive(request.path, probe=probe, wall=time.time(), traceparent=tp)
        try:
            return await self._serve(request, parse, sink)
        except _Closing:
            return error_response(503, "engine is shutting down", "ServiceUnavailable")
        except (_Reset, ConnectionResetError):
            # The connection is gone; aiohttp cancels this handler on connection_lost, and
            # whatever we return is never written.
            return web.Response(status=500)
        finally:
            self.engine.depart()

    async def _serve(
        self,
        request: web.Request,
        parse: Callable[[bytes], GenRequest],
        make_sink: SinkFactory | None = None,
    ) -> web.StreamResponse:
        length = request.content_length
        await self._gate(lambda f: F.on_arrival(f, length))
        try:
            req = parse(await request.read())
        except RequestError as e:
            return error_response(e.status, e.message, e.err_type)
        if req.model is not None and req.model != self.opts.model:
            return error_response(404, f"The model `{req.model}` does not exist.", "NotFoundError")

        stream = req.stream
        action = await self._gate(lambda f: F.on_admit(f, stream=stream, draw=self._rng.random()))
        if action is F.Action.RESET:
            abort_connection(request)
            raise _Reset
        if action is F.Action.HOSTILE:
            fault = self.faults.current(self._now())
            framer = Framer(req.kind, self.opts.model, int(time.time()))
            await hostile.serve(request, hostile.plan(fault, req, framer, self.opts.seed))
            raise _Reset  # the connection is closed: nothing more is written on it
        if action in _FAILURES:
            return error_response(*_FAILURES[action])

        created = int(time.time())
        if make_sink is not None:
            sink = make_sink(req, created)
        else:
            sink = TokenSink(Framer(req.kind, self.opts.model, created, req.prompt_ids))
        if stream:
            await sink.start(request)
        try:
            return await self._run(request, req, sink)
        except _Closing:
            if not stream:
                raise
            abort_connection(request)  # headers are out: a dying engine just drops the stream
            raise _Reset from None

    async def _run(
        self, request: web.Request, req: GenRequest, sink: TokenSink
    ) -> web.StreamResponse:
        """Queue for a slot, decode, finish the response; the slot is freed on every path."""
        seq = Seq(prompt_tokens=req.prompt_tokens)
        await self.engine.admit(seq)
        ok = False
        try:
            hit = self.engine.prefix_cache.lookup(req.rendered)
            await self._decode(request, req, seq, PREFIX_HIT_TTFT if hit else 1.0, sink)
            resp = await sink.finish(req, seq.generated)
            ok = True
            return resp
        finally:
            self.engine.release(seq, ok=ok)

    async def _decode(
        self, request: web.Request, req: GenRequest, seq: Seq, ttft_mult: float, sink: TokenSink
    ) -> None:
        """Produce ``req.max_tokens`` tokens into ``sink`` on the TTFT/ITL schedule.

        Deadlines are absolute (``due``) so per-token overhead does not add up: 500 tokens at
        10 ms take 5 s, not 5 s + 500 x loop latency.
        """
        gen = TokenGen(req.context, self.opts.seed if req.seed is None else req.seed, req.keys)
        n, stream = req.max_tokens, req.stream
        now = self._now()
        fault = self.faults.current(now)
        due = now + self._ttft_s * ttft_mult * F.slowdown(fault) + F.first_token_delay(fault)
        if fault.mode is F.Mode.NONE and due <= now and self._itl_s == 0 and n <= _YIELD_EVERY:
            # Zero-delay fleet (benchmarks): nothing can wait or fail, so skip the per-token
            # fault checks and clock reads; ~3x less CPU per 16-token request.
            for i in range(n):
                sink.token(gen.next(), i == n - 1)
            seq.generated = n
            return
        for i in range(n):
            action = F.on_token(fault, i, stream=stream)
            if action is F.Action.HANG:
                await sink.flush()
                action = await self._gate(partial(F.on_token, index=i, stream=stream))
                now = self._now()
                due = max(due, now)
            if action is F.Action.RESET:
                await sink.flush()
                abort_connection(request)
                raise _Reset
            if due > now:
                if i > 0:  # the role chunk waits for the first token, as vLLM sends it
                    await sink.flush()
                await asyncio.sleep(due - now)
            elif i % _YIELD_EVERY == _YIELD_EVERY - 1:
                await sink.flush()
                await asyncio.sleep(0)
            seq.generated += 1
            sink.token(gen.next(), i == n - 1)
            now = self._now()
            fault = self.faults.current(now)
            due += self._itl_s * F.slowdown(fault)

    # ---- control endpoints (never affected by faults) ----

    async def get_fault(self, request: web.Request) -> web.Response:
        return json_response(self.faults.describe(self._now()))

    async def post_fault(self, request: web.Request) -> web.Response:
        try:
            fault = F.parse_fault(orjson.loads(await request.read()))
        except orjson.JSONDecodeError as e:
            return error_response(400, f"Invalid JSON body: {e}", "BadRequestError")
        except F.FaultError as e:
            return error_response(400, str(e), "BadRequestError")
        self.faults.set(fault, self._now())
        log.info(
            "%s",
            orjson.dumps(
                {
                    "event": "sim_fault",
                    "sim": self.opts.name,
                    "mode": fault.mode.value,
                    **fault.params(),
                }
            ).decode(),
        )
        return json_response(self.faults.describe(self._now()))

    async def stats(self, request: web.Request) -> web.Response:
        return json_response({**self.engine.stats(), "api_requests": self.pooling.counts})

    async def requests(self, request: web.Request) -> web.Response:
        since = _since(request.query.get("since"))
        if isinstance(since, web.Response):
            return since
        return json_response(
            {"name": self.opts.name, "requests": self.engine.recent_arrivals(since)}
        )


def _since(raw: str | None) -> float | web.Response | None:
    """`/sim/requests?since=`: wall seconds, or a 400 naming the bad value."""
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return error_response(
            400, f"'since' must be a number (wall seconds), got {raw!r}", "BadRequestError"
        )


@dataclass(slots=True)
class RunningSim:
    """A sim serving in this process (``start_sim``); ``close()`` stops it."""

    sim: Sim
    runner: web.AppRunner
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def close(self) -> None:
        self.sim.close()
        await self.runner.cleanup()


async def start_sim(opts: SimOptions) -> RunningSim:
    """Start serving ``opts`` on the running loop; returns once the socket listens."""
    sim = Sim(opts)
    # handler_cancellation: a client that hangs up cancels its handler, so requests hung by
    # a fault never outlive their connection. shutdown_timeout: 0.5 s for in-flight streams.
    runner = web.AppRunner(
        sim.app(), access_log=None, handler_cancellation=True, shutdown_timeout=0.5
    )
    await runner.setup()
    site = web.TCPSite(runner, opts.host, opts.port)
    await site.start()
    port = int(runner.addresses[0][1])
    return RunningSim(sim=sim, runner=runner, host=opts.host, port=port)


def run_sim(opts: SimOptions) -> int:
    """Serve until SIGINT or SIGTERM; print the listening line for launchers. Returns 0."""

    async def main() -> None:
        running = await start_sim(opts)
        print(f"sim {opts.name} listening on {running.url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await running.close()

    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None
    try:
        import uvloop

        loop_factory = uvloop.new_event_loop
    except ImportError:  # uvloop is optional (absent on Windows): asyncio's loop works too
        pass
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(main())
    return 0
