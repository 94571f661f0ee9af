"""Stop strings the OpenAI way: generation ends *before* the stop string, which is not sent.

vLLM does this itself; transformers serve stops but leaves the stop string (and the rest of
the token that completed it) in the text. Cutting at the first occurrence is a no-op for an
engine that already strips, so it is applied whatever the backend. A stream holds back the
last `longest stop - 1` characters until the next piece shows they do not start a stop.
"""

from __future__ import annotations

from typing import Any

import orjson


def stop_strings(doc: dict[str, Any]) -> tuple[str, ...]:
    stop = doc.get("stop")
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, list):
        return tuple(s for s in stop if isinstance(s, str) and s)
    return ()


def _cut(text: str, stops: tuple[str, ...]) -> int:
    """Index of the earliest stop string in `text`, or -1."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else -1


def cut_answer(body: bytes, stops: tuple[str, ...]) -> bytes:
    """A non-streamed answer with each stopped choice's text cut before its stop string."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    changed = False
    for ch in doc.get("choices") or () if isinstance(doc, dict) else ():
        if ch.get("finish_reason") != "stop":
            continue
        holder, key = (ch["message"], "content") if "message" in ch else (ch, "text")
        text = holder.get(key)
        if isinstance(text, str) and (i := _cut(text, stops)) >= 0:
            holder[key] = text[:i]
            changed = True
    return orjson.dumps(doc) if changed else body


class StopFilter:
    """Choice 0 of a stream with its text cut before the first stop string."""

    __slots__ = ("hold", "pending", "stopped", "stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.hold = max(len(s) for s in stops) - 1
        self.pending = ""
        self.stopped = False

    def feed(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to send instead of `obj` (None: send nothing)."""
        choices = obj.get("choices")
        if not choices:
            return obj
        ch = choices[0]
        delta = ch.get("delta")
        holder, key = (delta, "content") if delta is not None else (ch, "text")
        piece = holder.get(key) or ""
        finish = ch.get("finish_reason")
        if self.stopped:
            if not finish:
                return None
            holder[key] = ""
            ch["finish_reason"] = "stop"
            return obj
        buf = self.pending + piece
        i = _cut(buf, self.stops)
        if i >= 0:
            emit, self.pending, self.stopped = buf[:i], "", True
        elif finish:
            emit, self.pending = buf, ""
        else:
            keep = max(0, len(buf) - self.hold)
            emit, self.pending = buf[:keep], buf[keep:]
        if not emit and not finish and not (delta and delta.get("role")):
            return None
        if key in holder or emit:
            holder[key] = emit
        return obj
