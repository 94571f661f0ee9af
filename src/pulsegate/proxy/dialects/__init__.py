"""Stream dialects: one per API framing a streamed answer, each behind `base.Dialect`.

`for_api` makes the one for a stream, once, from its API label (`chat`, `completions`,
`responses`, `messages`); the relay drives it without looking at the API again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pulsegate.proxy.dialects.base import Dialect, StreamState
from pulsegate.proxy.dialects.chat import Chat
from pulsegate.proxy.dialects.messages import Messages
from pulsegate.proxy.dialects.responses import Responses

# The APIs whose streams are typed events (`event: TYPE`) rather than chat chunks + [DONE].
TYPED = frozenset({"responses", "messages"})


def for_api(
    api: str, path: str, doc: dict[str, Any], learn: Callable[[str], None] | None = None
) -> Dialect:
    """The dialect of a stream of `api` at `path` asked by `doc`; `learn` is told the
    response id of a Responses stream as soon as `response.created` passes."""
    if api == "responses":
        return Responses(learn)
    if api == "messages":
        return Messages()
    so = doc.get("stream_options")
    return Chat(path, isinstance(so, dict) and so.get("include_usage") is True)


__all__ = ["TYPED", "Chat", "Dialect", "Messages", "Responses", "StreamState", "for_api"]
