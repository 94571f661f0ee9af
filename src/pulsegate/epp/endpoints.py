"""Backend names and their `ip:port` endpoints, both ways. Pure.

The Endpoint Picker Protocol names a backend by the address Envoy connects to (`ip:port`,
the form Envoy's override-host policy matches against the cluster's hosts); pulsegate names
it by its configured `name`. A backend's endpoint is its `url`'s host and port, so the
pulsegate config and the Envoy cluster list the same addresses (`deploy/envoy/envoy.yaml`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from urllib.parse import urlsplit

from pulsegate.config import BackendConfig

_DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint_of(url: str) -> str:
    """`host:port` of `url` (the scheme's port when none is given; an IPv6 literal keeps its
    brackets, as Envoy writes it)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}"


class Endpoints:
    """name -> endpoint and endpoint -> name for the configured backends."""

    __slots__ = ("_by_endpoint", "_by_name")

    def __init__(self, backends: Iterable[BackendConfig]) -> None:
        self._by_name: dict[str, str] = {}
        self._by_endpoint: dict[str, str] = {}
        for b in backends:
            ep = endpoint_of(b.url)
            self._by_name[b.name] = ep
            self._by_endpoint.setdefault(ep, b.name)  # two names on one address: the first

    def endpoint(self, name: str) -> str:
        return self._by_name[name]

    def name(self, endpoint: str) -> str | None:
        """The backend at `endpoint`, or None when no configured backend is there."""
        return self._by_endpoint.get(endpoint.strip())

    def names(self) -> Sequence[str]:
        return tuple(self._by_name)

    def outside(self, subset: Iterable[str]) -> list[str]:
        """The backends whose endpoint is not in `subset` (Envoy's subset hint)."""
        allowed = {e.strip() for e in subset}
        return [n for n, ep in self._by_name.items() if ep not in allowed]
