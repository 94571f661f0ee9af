"""Admin endpoints: read the fleet's verdicts and events; drain, undrain or eject a backend.

Guarded by a bearer token when `gateway.admin_token_env` names a set environment variable.
The token is compared in constant time, as bytes, and never echoed, logged or shown.

With no token configured, reads (GET) stay open, and changes (every other method under
/admin) are taken only when the gateway listens on loopback and the request cannot have
come from a web page: any page a user opens can POST to a loopback port, and a DNS-rebound
name reaches it too. A browser sends such a request without a CORS preflight only with a
form content type (or none), and always with its page's `Origin` on a POST, so:

    check                                   refused (403) when
    --------------------------------------  -------------------------------------------
    gateway.host                            not loopback (set gateway.admin_token_env)
    Host header                             not a loopback name or address (rebinding)
    Origin header, if sent                  not this gateway's own http://host:port
    Content-Type                            x-www-form-urlencoded, multipart/form-data,
                                            text/plain (sendable cross-site, no preflight)

Behind a multi-process gateway the worker that took the connection makes the Host and
Origin checks (`browser_refusal`): the primary sees only what the worker relays over its
private Unix socket.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from pulsegate.observe.view import GatewayView
from pulsegate.proxy.errors import error_response

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# The content types a cross-site <form> or no-cors fetch may send without a preflight
# (Fetch standard, "CORS-safelisted request-header").
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data", "text/plain"})


def is_loopback(host: str) -> bool:
    """`host` (a name or address, IPv6 with or without brackets) reaches only this machine:
    127.0.0.0/8, ::1 or `localhost`."""
    h = host.strip().strip("[]").rstrip(".").lower()
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def _host_name(hostport: str) -> str:
    """The name part of a Host header: `[::1]:8080` -> `::1`, `localhost:80` -> `localhost`."""
    if hostport.startswith("["):
        return hostport[1 : hostport.find("]")] if "]" in hostport else hostport
    return hostport.rsplit(":", 1)[0] if hostport.count(":") == 1 else hostport


def _via_unix_socket(request: web.Request) -> bool:
    """The request came over a Unix socket: a worker's relay to the primary (0700 dir)."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    return sock is not None and sock.family == socket.AF_UNIX


def _as_bytes(s: str) -> bytes | None:
    """A header or environment value as the bytes that arrived: aiohttp and os.environ decode
    non-UTF-8 bytes with surrogateescape. None: not representable (never equal to a token)."""
    try:
        return s.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return None


def _refused(message: str, code: str) -> web.Response:
    return error_response(403, message, code)


def form_refusal(request: web.Request) -> web.Response | None:
    """A 403 when the request's content type is one a web page can send cross-site."""
    ctype = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if ctype in FORM_TYPES:
        return _refused(
            f"admin change refused: content-type {ctype} can be sent by any web page; "
            "send application/json or no body (or set gateway.admin_token_env)",
            "form_content_refused",
        )
    return None


def browser_refusal(request: web.Request) -> web.Response | None:
    """A 403 when a change without a token may come from a web page: a Host that is not a
    loopback name (DNS rebinding), an Origin other than the gateway's own, a form body."""
    host = request.headers.get("host")
    if host is not None and not is_loopback(_host_name(host)):
        return _refused(
            "admin change refused: the Host header is not a loopback name or address "
            "(with no admin token, changes are taken only at localhost, 127.0.0.1 or [::1])",
            "host_not_loopback",
        )
    origin = request.headers.get("origin")
    if origin is not None and (host is None or origin.lower() != f"http://{host}".lower()):
        return _refused(
            "admin change refused: cross-origin request (the Origin header is not this "
            "gateway's own http://host:port); set gateway.admin_token_env to allow other "
            "clients",
            "cross_origin_refused",
        )
    return form_refusal(request)


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

    def _tokenless_refusal(self, request: web.Request) -> web.Response | None:
        """Why a change with no token configured is refused, or None (see the module doc)."""
        host = self.gw.config.gateway.host
        if not is_loopback(host):
            return _refused(
                f"admin changes are refused: the gateway listens on {host or '0.0.0.0'}, "
                "beyond loopback, with no admin token; set gateway.admin_token_env",
                "admin_token_required",
            )
        if _via_unix_socket(request):
            return form_refusal(request)  # the relaying worker checked Host and Origin
        return browser_refusal(request)

    def guard(self, handler: Handler) -> Handler:
        async def guarded(request: web.Request) -> web.StreamResponse:
            token = self._token()
            if token is not None:
                auth = request.headers.get("authorization", "")
                given = _as_bytes(auth[7:] if auth[:7].lower() == "bearer " else "")
                want = _as_bytes(token)
                if not want or given is None or not hmac.compare_digest(given, want):
                    return error_response(401, "admin token required", "unauthorized")
            elif request.method not in READ_METHODS:
                refusal = self._tokenless_refusal(request)
                if refusal is not None:
                    return refusal
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

    async def cluster(self, request: web.Request) -> web.StreamResponse:
        """`GET /admin/cluster`: the replicas sharing this one's Redis (`replicas/`)."""
        replicas = self.gw.health.replicas
        if replicas is None:
            return _json({"replica_id": None, "alone": True, "redis": None, "replicas": []})
        return _json(replicas.view())

    async def action(self, request: web.Request) -> web.StreamResponse:
        gw = self.gw
        name = request.match_info["name"]
        verb = request.match_info["action"]
        if name not in gw.names():
            return error_response(404, f"no backend named '{name}'", "backend_not_found")
        if not gw.health.act(name, verb):
            return error_response(404, f"unknown action '{verb}'", "unknown_action")
        return _json(gw.backend_view(name))
