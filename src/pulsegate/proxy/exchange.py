"""One client request as the outside world saw it, and the seams that read it.

The proxy path fills an `Exchange` in as it goes (who asked, for which model, which backends
were tried, the status, the client-seen time to first token, the tokens, the resumes) and,
when the request ends, hands it to the `Recorder`s: the access log, the tracer, the per-key
token accounting. Recording is off the request path: a recorder only appends to a buffer or
a queue, never waits on I/O. With no recorder and no `Door` the record is still filled (a
few attribute writes per request) and dropped.

`Door` is the front door (`auth:`): it names the caller from the request headers before the
body is read, then admits the parsed request against the caller's model allow-list and
limits, and is told when the request ends so it can correct the tokens it estimated.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from pulsegate.proxy.request import ProxyRequest, Rejection

# Status recorded for a request whose client went away before the answer was complete
# (nginx's convention).
CLIENT_CLOSED = 499


class Attempt:
    """One upstream request made for the exchange: a first try, a retry or a resume."""

    __slots__ = ("backend", "end", "outcome", "resume", "start", "status")

    def __init__(self, backend: str, start: float, resume: bool = False) -> None:
        self.backend = backend
        self.start = start  # clock seconds (monotonic)
        self.end = 0.0
        self.status: int | None = None  # the backend's HTTP status, None: no answer
        self.outcome = ""  # "ok", or the failure's outcome (`health.observations.Outcome`)
        self.resume = resume


class Exchange:
    """The record of one request, made at arrival. Plain classes, these two, made per
    request: mypyc compiles them to native ones (a dataclass's generated `__init__` stays an
    interpreted call there)."""

    __slots__ = (
        "api",
        "attempts",
        "backends",
        "charged",
        "end",
        "error",
        "hedges",
        "key",
        "model",
        "path",
        "reply_headers",
        "resumes",
        "start",
        "status",
        "stream",
        "ticket",
        "tokens_in",
        "tokens_out",
        "trace",
        "traceparent",
        "ttft",
        "wall",
    )

    def __init__(self, start: float, wall: float, path: str, api: str) -> None:
        self.start = start  # clock seconds (monotonic) at arrival
        self.wall = wall  # time.time() at arrival: the access log's and the trace's timestamps
        self.path = path
        self.api = api  # chat, completions, ...: the `api` label
        self.key: str | None = None  # the client key's name (never the key)
        self.model: str | None = None
        self.stream = False
        # The backends tried, in order, first attempts and resumes (the same list the proxy
        # path keeps to never try a backend twice).
        self.backends: list[str] = []
        self.attempts: list[Attempt] = []
        self.status = 0  # what the client got (a stream that ended in an error event: 200)
        self.error: str | None = None  # the error code the client got, in the body or stream
        self.ttft: float | None = None  # seconds from arrival to the first byte to the client
        self.tokens_in: int | None = None  # the answer's `usage`, when the backend sent one
        self.tokens_out: int | None = None
        self.resumes = 0
        self.hedges = 0
        self.end = 0.0
        # W3C trace context the client sent (`traceparent`), for the tracer.
        self.traceparent: str | None = None
        # Headers the door adds to the answer (`x-ratelimit-*`).
        self.reply_headers: Mapping[str, str] | None = None
        # Who the door identified (its own record of the caller), handed back to it at the
        # end, and what it charged at admission (the estimated tokens; -1: nothing taken).
        self.ticket: object = None
        self.charged = -1
        # The tracer's ids for this request (`observe/traces.py`), made at its first
        # upstream attempt so the backend gets a `traceparent`; None: not traced.
        self.trace: object = None

    def attempt(self, backend: str, now: float, resume: bool = False) -> Attempt:
        a = Attempt(backend, now, resume=resume)
        self.attempts.append(a)
        return a


class Recorder(Protocol):
    """Told of every exchange once it ended; must not block or raise."""

    def record(self, ex: Exchange) -> None: ...


class Door(Protocol):
    """The front door: who is asking, and may they."""

    def identify(self, headers: Mapping[str, str], ex: Exchange) -> Rejection | None:
        """Name the caller from the request's headers (sets `ex.key`), or refuse: 401."""
        ...

    def admit(self, req: ProxyRequest, ex: Exchange, now: float) -> Rejection | None:
        """May the caller send `req` now (model allow-list, limits)? Sets `ex.charged` and
        `ex.reply_headers` when admitted; a refusal is a 403 or 429 with its headers."""
        ...

    def settle(self, ex: Exchange, now: float) -> None:
        """The admitted exchange ended: release what `admit` took, correct the tokens."""
        ...

    def listing(self, headers: Mapping[str, str]) -> Rejection | Callable[[str], bool]:
        """`GET /v1/models`: the caller's model allow-list, or a 401."""
        ...


__all__ = ["CLIENT_CLOSED", "Attempt", "Door", "Exchange", "Recorder"]
