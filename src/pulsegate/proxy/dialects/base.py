"""What every stream dialect shares: the state of what the client was sent, the one Protocol
the relay drives, and the small pieces of framing arithmetic. Pure: no I/O, no clock.

A dialect is made once per stream (`dialects.for_api`), so the relay picks the framing once
and never asks "which API is this?" per event.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson


@dataclass(slots=True)
class StreamState:
    """What the client has been sent so far on this stream."""

    id: Any = None
    created: Any = None
    model: Any = None
    text: dict[int, list[str]] = field(default_factory=dict)
    # Tokens sent: one per content event while relaying (a lower bound: engines may merge
    # tokens into one event), set to the exact count when a resume target can tokenize.
    tokens: int = 0
    finished: bool = False  # the generation's end was sent (finish_reason, stop_reason...)
    done: bool = False  # the terminal event (`[DONE]`, `response.completed`, ...) sent
    tool_call: bool = False
    # Tokens sent before the current upstream took over (for usage arithmetic).
    tokens_before: int = 0

    def sent_text(self, index: int = 0) -> str:
        return "".join(self.text.get(index, ()))


@dataclass(frozen=True, slots=True)
class Continuation:
    """The request continuing a broken stream: its body, and its path where that is not
    the client's (a Messages stream goes on through vLLM's chat endpoint)."""

    body: bytes
    path: str | None = None


class Dialect(Protocol):
    """One API's stream framing, as the relay needs it to continue a broken stream.

    `track` sees each event of the first upstream (forwarded byte for byte); `rewrite` makes
    each event of a continuation look like the first stream's (None: drop it); `refusal` says
    why the stream must not be continued; `body` is the continuation request in the stream's
    own API; `continuation` the request (body, and path when another API continues better)
    for a target of resume kind `resume` (`Target.resume`: `vllm`), whose events `rewrite`
    is then given (on another path: that API's events, `[DONE]` excepted, which the relay
    answers with `finish`); `finish` the events that close a stream whose generation was
    over when it broke; `error` the terminal error event(s) in the API's own shape."""

    @property
    def state(self) -> StreamState: ...

    def track(self, obj: dict[str, Any]) -> None: ...

    def rewrite(self, obj: dict[str, Any]) -> bytes | None: ...

    def refusal(self, doc: dict[str, Any]) -> str | None: ...

    def remaining(self, doc: dict[str, Any]) -> int | None: ...

    def body(self, doc: dict[str, Any]) -> bytes: ...

    def continuation(self, doc: dict[str, Any], resume: str) -> Continuation: ...

    def ended(self) -> bool: ...

    def finish(self) -> bytes: ...

    def error(self, message: str) -> bytes: ...


def sse_event(name: str, obj: dict[str, Any]) -> bytes:
    """One named SSE event (`event: NAME` + one data line), as vLLM frames typed streams."""
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def merged_counts(before: int, prompt: Any, completion: Any) -> tuple[int, int]:
    """(prompt, completion) tokens of the whole stream from a continuation's own counts: the
    continuation counted the `before` tokens already sent as prompt, so they move back.
    Worked example: 20 tokens sent, then the continuation says prompt 35 (15 + 20 replayed)
    and completion 60: the stream used prompt 15, completion 80."""
    p = max(0, prompt - before) if isinstance(prompt, int) else 0
    c = (completion if isinstance(completion, int) else 0) + before
    return p, c


def remaining_of(doc: dict[str, Any], state: StreamState, *keys: str) -> int | None:
    """The token budget left after what was sent: the first of `keys` that is an int."""
    for key in keys:
        v = doc.get(key)
        if isinstance(v, int) and not isinstance(v, bool):
            return v - state.tokens
    return None
