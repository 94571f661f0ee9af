"""The gateway's HTTP surface: OpenAI endpoints, health, metrics, admin and dashboard.

Every proxied path (`proxy.request.API`: chat, completions, responses, embeddings, Anthropic
messages, rerank, score, tokenize, detokenize, with vLLM's aliases) goes through the same
`Forwarder.handle`; an error answer leaves in its API's shape (`errors.reshape`).
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol, cast

import orjson
from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from pulsegate.admin import READ_METHODS, Admin, browser_refusal
from pulsegate.config import Config
from pulsegate.observe.dashboard import register as register_dashboard
from pulsegate.observe.view import GatewayView
from pulsegate.proxy.client_out import AioIncoming, AioStream, Whole
from pulsegate.proxy.errors import error_response, reshape
from pulsegate.proxy.forward import Forwarder
from pulsegate.proxy.ports import Verdicts
from pulsegate.proxy.request import API, Rejection
from pulsegate.proxy.state import ProxyState

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyRoutes(Protocol):
    """What the OpenAI routes need: the current request handler (a reload replaces it; a
    request in flight keeps the one it started with), the verdicts /v1/models lists, and
    the proxy state (while it drains, every answer says `Connection: close`)."""

    forwarder: Forwarder
    proxy: ProxyState

    @property
    def verdicts(self) -> Verdicts: ...


def set_max_body(app: web.Application, cfg: Config) -> None:
    """A reload's `gateway.max_body_bytes`. aiohttp reads the limit from the application for
    every request it makes (`Application._client_max_size`, no public setter); the forwarder
    turns an oversize read into an OpenAI-shaped 413."""
    app._client_max_size = cfg.gateway.max_body_bytes + 1  # the extra byte: see build_app


def _gate_admin_changes(to_primary: Handler) -> Handler:
    """A worker's relay to the primary (admin, metrics, dashboard: every path but the OpenAI
    ones), refusing first a change without a token that may come from a web page
    (`admin.browser_refusal`): the relay passes on neither Host nor Origin, so only the
    worker can check them. A request with an Authorization header goes on: a page cannot
    send one cross-site without a preflight, and the primary checks the token."""

    async def relay(request: web.Request) -> web.StreamResponse:
        if request.method not in READ_METHODS and "authorization" not in request.headers:
            refusal = browser_refusal(request)
            if refusal is not None:
                return refusal
        return await to_primary(request)

    return relay


def build_app(
    config: Config,
    *,
    proxy: ProxyRoutes | None = None,
    view: GatewayView | None = None,
    to_primary: Handler | None = None,
    admin_extra: Sequence[tuple[str, str, Handler]] = (),
) -> web.Application:
    """The gateway's routes: the OpenAI endpoints of `proxy` (its forwarder, and the
    verdicts `/v1/models` lists), and the admin API, metrics and dashboard of `view`. A
    proxy worker of a multi-process gateway (cluster/) has no view but `to_primary`: every
    path other than the OpenAI endpoints and /healthz goes to the primary. A primary has
    no proxy. `admin_extra`: more (method, path, handler) admin routes, guarded like the
    others."""
    # client_max_size makes aiohttp refuse oversize bodies while reading; Forwarder turns
    # that into an OpenAI-shaped 413. The extra byte lets a body of exactly the limit pass.
    app = web.Application(client_max_size=config.gateway.max_body_bytes + 1)
    r = app.router
    if proxy is not None:
        side = proxy
        cache: list[tuple[tuple[str, ...], bytes]] = [((), b"")]

        state = side.proxy

        def proxied(path: str) -> Handler:
            api = API[path]

            async def handle(request: web.Request) -> web.StreamResponse:
                answer = await side.forwarder.handle(AioIncoming(request), path)
                if isinstance(answer, Whole):
                    resp: web.StreamResponse = answer.response()
                elif isinstance(answer, web.Response):
                    resp = reshape(answer, api)
                else:  # a stream, relayed already; its `Connection: close` said then
                    return cast(AioStream, answer).response
                if state.shutting_down:
                    resp.force_close()
                return resp

            return handle

        async def models(request: web.Request) -> web.StreamResponse:
            names = tuple(sorted(side.verdicts.models()))
            door = side.forwarder.door
            if door is not None:  # with `auth`: a key, and only the models it may use
                allowed = door.listing(request.headers)
                if isinstance(allowed, Rejection):
                    return error_response(allowed.status, allowed.message, allowed.code)
                data = [{"id": m, "object": "model", "owned_by": "pulsegate"} for m in names]
                doc = {"object": "list", "data": [d for d in data if allowed(str(d["id"]))]}
                return web.Response(body=orjson.dumps(doc), content_type="application/json")
            if cache[0][0] != names or not cache[0][1]:
                data = [{"id": m, "object": "model", "owned_by": "pulsegate"} for m in names]
                cache[0] = (names, orjson.dumps({"object": "list", "data": data}))
            return web.Response(body=cache[0][1], content_type="application/json")

        async def expect(request: web.Request) -> None:
            """`Expect: 100-continue` with a Content-Length past the limit: no 100, so the
            handler's 413 comes before the client uploads it (aiohttp's default handler
            sent 100 first, inviting a 100 MiB upload to be refused)."""
            cl = request.content_length
            if cl is None or cl <= side.forwarder.limits.max_body:
                await _default_expect_handler(request)

        for path in API:
            r.add_post(path, proxied(path), expect_handler=expect)
        r.add_get("/v1/models", models)

    async def healthz(request: web.Request) -> web.StreamResponse:
        return web.Response(text="ok")

    async def dashboard(request: web.Request) -> web.StreamResponse:
        try:
            html = (
                importlib.resources.files("pulsegate.observe")
                .joinpath("static/dashboard.html")
                .read_bytes()
            )
        except FileNotFoundError:
            return web.Response(text="dashboard not built", status=404)
        return web.Response(body=html, content_type="text/html")

    async def not_found(request: web.Request) -> web.StreamResponse:
        return error_response(404, f"no route for {request.method} {request.path}", "not_found")

    r.add_get("/healthz", healthz)
    if to_primary is not None:
        r.add_route("*", "/{tail:.*}", _gate_admin_changes(to_primary))
        return app
    if view is None:
        r.add_route("*", "/{tail:.*}", not_found)
        return app
    gw = view
    admin = Admin(gw)

    async def metrics(request: web.Request) -> web.StreamResponse:
        return web.Response(text=gw.registry.render(), content_type="text/plain", charset="utf-8")

    r.add_get("/metrics", metrics)
    r.add_get("/dashboard", dashboard)
    r.add_get("/admin/backends", admin.guard(admin.backends))
    r.add_get("/admin/events", admin.guard(admin.events))
    r.add_get("/admin/cluster", admin.guard(admin.cluster))
    r.add_post("/admin/backends/{name}/{action}", admin.guard(admin.action))
    register_dashboard(app, gw, admin.guard)  # GET /admin/summary, pulsegate_model_backends
    for method, path, handler in admin_extra:
        r.add_route(method, path, admin.guard(handler))
    r.add_route("*", "/{tail:.*}", not_found)
    return app
