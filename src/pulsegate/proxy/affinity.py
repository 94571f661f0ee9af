"""Response-id affinity: a Responses request that names `previous_response_id` goes to the
backend that produced that response, the only one holding its state. Pure, no I/O.

An engine keeps stored responses in its own memory (vLLM: a dict per process, with
`VLLM_ENABLE_RESPONSES_API_STORE`), so another backend can only answer "not found", or
worse, when it happens to hold a different conversation under a colliding id. The gateway
learns `response id -> backend` from `response.created` of a stream and from the `id` of a
non-streamed answer, and remembers the most recent `CAPACITY` of them (LRU: ~120 bytes an
entry, ~1.2 MB at 10,000; an agent's chain of turns is recent by nature).

A request whose previous response is known is pinned to that backend (every other backend
is avoided, so it is never retried elsewhere); when that backend cannot be picked (ejected,
removed, or failing), the answer is 503 `previous_response_unavailable` in OpenAI's shape,
naming the response and that its state lives on one backend: never another backend's
confused answer. An id not remembered (another gateway process made it, or it was pushed
out) routes as any request does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import orjson

CAPACITY = 10_000


class ResponseAffinity:
    """The backend of each recent response id, at most `capacity` of them."""

    __slots__ = ("_homes", "capacity")

    def __init__(self, capacity: int = CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._homes: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    def learn(self, response_id: str, backend: str) -> None:
        homes = self._homes
        homes[response_id] = backend
        homes.move_to_end(response_id)
        if len(homes) > self.capacity:
            homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        """The backend that produced `response_id`, or None when it is not remembered."""
        backend = self._homes.get(response_id)
        if backend is not None:
            self._homes.move_to_end(response_id)
        return backend

    def learn_answer(self, body: bytes, backend: str) -> None:
        """Learn from a non-streamed Responses answer (its top-level `id`)."""
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        rid = doc.get("id") if isinstance(doc, dict) else None
        if isinstance(rid, str) and rid:
            self.learn(rid, backend)


def previous_id(doc: dict[str, Any]) -> str | None:
    prev = doc.get("previous_response_id")
    return prev if isinstance(prev, str) and prev else None


def pinned_avoid(home: str, names: Iterable[str]) -> list[str]:
    """Every backend but `home`: what a pinned request must never be sent to."""
    return [n for n in names if n != home]


def unavailable_message(response_id: str, home: str) -> str:
    return (
        f"previous_response_id '{response_id}' was produced by backend '{home}', which "
        "cannot serve it now; a stored response's state lives on that backend alone. "
        "Retry later, or send the whole conversation as input without previous_response_id"
    )
