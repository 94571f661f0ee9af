"""The endpoint picker's decision: one request in, the backends to try out. Pure.

The request is parsed by the proxy's own parse (`proxy/request.py`: `model`, the session
key from `x-session-id`, `user` or the prompt's head, the backends that cannot serve its
API or its `n`), and the backends are chosen by the same `Router` over the same verdicts as
`pulsegate serve`: the first pick is the one `serve` would try first, each next one is the
pick with the earlier ones excluded, which is the order `serve` would retry in. Envoy walks
that list on retries (its override-host policy), so the list is as long as
`retry.max_attempts`.

Answers, as the Endpoint Picker Protocol asks (and `serve` answers the same cases):

    model no backend lists                 404 model_not_found
    a bad request (no model, bad JSON ...) 400 (`proxy/request.py`'s own refusal)
    subset hint empty or none eligible     503 no_healthy_backend
    nothing routable for the model         503 no_healthy_backend, Retry-After: 1
    every candidate at its max_inflight    429 overloaded, Retry-After: 1

`serve` would queue the request for `routing.queue_timeout` in the last case; an EPP must
answer within Envoy's `message_timeout`, so it refuses at once and the client retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pulsegate.config import Config
from pulsegate.epp.endpoints import Endpoints
from pulsegate.proxy.errors import error_body
from pulsegate.proxy.ports import Router, Verdicts
from pulsegate.proxy.request import Limits, Rejection, parse

SESSION_HEADER = "x-session-id"


@dataclass(frozen=True, slots=True)
class Pick:
    """The backends to try, best first, and what the outcome report needs of the request."""

    names: tuple[str, ...]
    endpoints: tuple[str, ...]
    model: str
    stream: bool

    @property
    def value(self) -> str:
        """The `x-gateway-destination-endpoint` value: `ip:port,ip:port,...`."""
        return ",".join(self.endpoints)


@dataclass(frozen=True, slots=True)
class Refusal:
    """An immediate answer in OpenAI's error shape; no backend sees the request."""

    status: int
    message: str
    code: str
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def body(self) -> bytes:
        return error_body(self.status, self.message, self.code)


class Picker:
    """`pick(path, body, session header, subset)` -> `Pick | Refusal`."""

    __slots__ = ("_endpoints", "_limits", "_router", "_verdicts", "depth")

    def __init__(
        self, config: Config, router: Router, verdicts: Verdicts, endpoints: Endpoints
    ) -> None:
        self._limits = Limits.of(config)
        self._router = router
        self._verdicts = verdicts
        self._endpoints = endpoints
        self.depth = max(1, config.retry.max_attempts)  # endpoints per answer

    def pick(
        self,
        path: str,
        body: bytes,
        session_header: str | None,
        subset: Sequence[str] | None = None,
    ) -> Pick | Refusal:
        """The backends for this request, or why none. `subset`: Envoy's subset hint (the
        endpoints allowed), None when it sent none."""
        req = parse(path, body, session_header, self._limits)
        if isinstance(req, Rejection):
            return Refusal(req.status, req.message, req.code, tuple((req.headers or {}).items()))
        model = req.model
        if not self._verdicts.serves(model):
            return Refusal(404, f"model '{model}' is not served by any backend", "model_not_found")
        avoid = list(req.avoid)
        if subset is not None:
            avoid.extend(self._endpoints.outside(subset))
        router = self._router
        names: list[str] = []
        skip = list(avoid)
        for _ in range(self.depth):
            v = router.pick(model, skip, req.session_key)
            if v is None:
                break
            names.append(v.name)
            skip.append(v.name)
        if not names:
            if router.saturated(model, avoid):
                return Refusal(
                    429,
                    f"every backend for model '{model}' is at its concurrency limit; retry shortly",
                    "overloaded",
                    (("retry-after", "1"),),
                )
            where = " in the subset Envoy allowed" if subset is not None else ""
            msg = f"no healthy backend for model '{model}'{where}"
            return Refusal(503, msg, "no_healthy_backend", (("retry-after", "1"),))
        eps = tuple(self._endpoints.endpoint(n) for n in names)
        return Pick(tuple(names), eps, model, req.stream)
