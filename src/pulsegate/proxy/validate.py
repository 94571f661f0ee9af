"""OpenAI's request fields checked at the edge: a wrong type or range is the client's fault.

Engines disagree on what a bad field deserves (vLLM: 400 in OpenAI's shape; transformers
serve: a plain-text 500, which the proxy must read as a sick engine). Checking the standard
fields here answers every client the same way and keeps a client's mistakes off the engine's
health. Only fields OpenAI defines are checked; unknown fields pass to the engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pulsegate.config import BackendConfig

_NUMBERS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
_COUNTS = ("max_tokens", "max_completion_tokens", "n")
# Stop strings are searched in every piece of text the gateway passes on (`stops.py`):
# 280k of them (3.9 MB) froze the gateway for 18.7 s before this bound. OpenAI allows 4;
# vLLM any number: 32 of up to 256 characters covers what code-completion clients send.
MAX_STOPS = 32
MAX_STOP_CHARS = 256


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def invalid_field(doc: dict[str, Any], chat: bool) -> str | None:
    """Why `doc` is not a valid OpenAI request (naming the field), or None."""
    for key, (lo, hi) in _NUMBERS.items():
        v = doc.get(key)
        if v is not None and (not _number(v) or not lo <= v <= hi):
            return f"'{key}' must be a number from {lo:g} to {hi:g}, got {v!r}"
    for key in _COUNTS:
        v = doc.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            return f"'{key}' must be an integer >= 1, got {v!r}"
    for key in ("stream", "logprobs"):
        v = doc.get(key)
        if v is not None and not isinstance(v, bool):
            return f"'{key}' must be true or false, got {v!r}"
    seed = doc.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        return f"'seed' must be an integer, got {seed!r}"
    stop = doc.get("stop")
    if not (stop is None or isinstance(stop, str)) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        return "'stop' must be a string or a list of strings"
    if isinstance(stop, list) and len(stop) > MAX_STOPS:
        return f"'stop' may hold at most {MAX_STOPS} strings, got {len(stop)}"
    if stop and any(len(s) > MAX_STOP_CHARS for s in ([stop] if isinstance(stop, str) else stop)):
        return f"each 'stop' string may be at most {MAX_STOP_CHARS} characters"
    if chat:
        for i, m in enumerate(doc["messages"]):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                return f"'messages[{i}]' must be an object with a string 'role'"
            content = m.get("content")
            if content is not None and not isinstance(content, str | list):
                return f"'messages[{i}].content' must be a string or a list of parts"
    return None


def fewer_choices(
    doc: dict[str, Any], model: str, backends: Iterable[BackendConfig]
) -> tuple[Sequence[str], str | None]:
    """For `n > 1`: the backends for `model` that answer fewer than `n` choices (`max_n`),
    to be left out of routing, and why the request must be refused when that is every one.

    transformers serve ignores `n` and answers one choice: such a backend must never get
    the request, and when no backend can give `n` choices the client gets a 400, never one
    choice silently. An `n` of 1 or none costs nothing here."""
    n = doc.get("n")
    if not isinstance(n, int) or n <= 1:
        return (), None
    serving = [b for b in backends if not b.models or model in b.models]
    unable = [b.name for b in serving if 0 < b.max_n < n]
    if serving and len(unable) == len(serving):
        most = max(b.max_n for b in serving)
        return unable, f"'n' must be at most {most} for model '{model}', got {n}"
    return unable, None
