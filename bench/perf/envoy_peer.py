"""Envoy as a plain reverse proxy beside nginx in `make bench` (issue 23): its static config.

The same job as the bench's nginx, set up the same way so the two compare: one listener per
fleet (nginx's one `server` per port), a STATIC cluster of that fleet's engines on round
robin (nginx's default for an `upstream`), HTTP/1.1 to the engines on pooled keep-alive
connections (`proxy_http_version 1.1` + `keepalive`), responses streamed as they come
(`proxy_buffering off`), no retries (nginx's `proxy_next_upstream` does not apply to a
POST that was sent), no timeouts that a long token stream could hit. It is run with
`--concurrency 1`: one worker thread, like nginx's one worker process.

Left at Envoy's defaults on purpose: the `server`/`x-envoy-*` headers, the connection pool.
Off on purpose: the `x-request-id` Envoy would generate per request (a UUID nginx does not
make), the access log (nginx has `access_log off`).
"""

from __future__ import annotations

from typing import Any

_HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_UPSTREAM_HTTP = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
# nginx has no cap on requests or connections per upstream; Envoy's default circuit breaker
# is 1024 of each per cluster, enough for 64 streams, but a 503 from it would be a bench
# artefact, so it is set out of reach.
_NO_LIMIT = 1_000_000


def _address(port: int, host: str = "127.0.0.1") -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _listener(name: str, port: int) -> dict[str, Any]:
    route = {
        "match": {"prefix": "/"},
        # 0s: no whole-request timeout (Envoy's default is 15 s; a stream may run longer).
        "route": {"cluster": name, "timeout": "0s"},
    }
    hcm = {
        "@type": _HCM,
        "stat_prefix": name,
        "codec_type": "HTTP1",
        "generate_request_id": False,
        # 0s: off. Envoy's default (5 min) would not trigger here, but nginx has none either.
        "stream_idle_timeout": "0s",
        "route_config": {
            "name": name,
            "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [route]}],
        },
        "http_filters": [{"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}}],
    }
    return {
        "name": name,
        "address": _address(port),
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def _cluster(name: str, engines: list[tuple[str, int]]) -> dict[str, Any]:
    limits = {
        "max_connections": _NO_LIMIT,
        "max_pending_requests": _NO_LIMIT,
        "max_requests": _NO_LIMIT,
        "max_retries": 0,
    }
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "circuit_breakers": {"thresholds": [limits]},
        "typed_extension_protocol_options": {
            _UPSTREAM_HTTP: {
                "@type": f"type.googleapis.com/{_UPSTREAM_HTTP}",
                # HTTP/1.1 to the engines; connections are pooled and reused (keep-alive).
                "explicit_http_config": {"http_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _address(p, h)}} for h, p in engines]}
            ],
        },
    }


def config(fleets: dict[str, tuple[int, list[tuple[str, int]]]], admin_port: int) -> dict[str, Any]:
    """Envoy's bootstrap: for each fleet `name -> (listen port, [(host, port) of engines])`
    a listener on 127.0.0.1 and a cluster of those engines; the admin API on `admin_port`."""
    return {
        "admin": {"address": _address(admin_port)},
        "static_resources": {
            "listeners": [_listener(name, port) for name, (port, _) in fleets.items()],
            "clusters": [_cluster(name, engines) for name, (_, engines) in fleets.items()],
        },
    }
