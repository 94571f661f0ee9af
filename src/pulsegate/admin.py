"""Admin endpoints: read the fleet's verdicts and events; drain, undrain or eject a backend.

Guarded by a bearer token when `gateway.admin_token_env` names a set environment variable.
The token is compared in constant time and never echoed, logged or shown.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from pulsegate.observe.view import GatewayView
from pulsegate.proxy.errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(doc: object, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(doc, default=str), status=status, content_type="application/json"
    )


class Admin:
    def __init__(self, gw: GatewayView) -> None:
        self.gw = gw

    def _token(self) -> str | None:
        """The admin token in force (the config's `admin_token_env`, read per admin call so a
        reload that names another variable takes effect); None: no token configured."""
        env = self.gw.config.gateway.admin_token_env
        # Configured but unset (or empty) fails closed: every admin call is refused.
        return os.environ.get(env, "") if env else None

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self._token()
            if token is not None:
                auth = request.headers.get("authorization", "")
                given = auth[7:] if auth[:7].lower() == "bearer " else ""
                if not token or not hmac.compare_digest(given.encode(), token.encode()):
                    return error_response(401, "admin token required", "unauthorized")
            return await handler(request)

        return guarded

    async def backends(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        return _json(
            {
                "backends": [gw.backend_view(name) for name in gw.names()],
                "panic": gw.health.fleet.panic,
            }
        )

    async def events(self, request: web.Request) -> web.StreamResponse:
        try:
            since = int(request.query.get("since", "0"))
            limit = int(request.query.get("limit", "500"))
        except ValueError:
            return error_response(400, "'since' and 'limit' must be integers", "invalid_query")
        backend = request.query.get("backend")
        return _json({"events": self.gw.health.events.since(since, backend, limit)})

    async def action(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        name = request.match_info["name"]
        verb = request.match_info["action"]
        if name not in gw.names():
            return error_response(404, f"no backend named '{name}'", "backend_not_found")
        if not gw.health.act(name, verb):
            return error_response(404, f"unknown action '{verb}'", "unknown_action")
        return _json(gw.backend_view(name))
