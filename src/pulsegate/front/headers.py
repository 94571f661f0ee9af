"""The `x-ratelimit-*` headers OpenAI clients read, as the front door writes them. Pure.

Per limit: `x-ratelimit-limit-*` (the key's limit), `-remaining-*` (whole units left in the
bucket) and `-reset-*` (the time until the bucket is full again, as OpenAI writes durations:
"20ms", "1.5s", "6m0s"). Each value is formatted once per change of its whole units
(`Shown`), not once per request; `front/door.py` puts them together.
"""

from __future__ import annotations

import math


class Shown:
    """One bucket's `remaining` and `reset` header values as last formatted: a value is
    formatted again only when its whole units change (a format is ~0.2-0.3 us, and a busy
    key's values repeat: a bucket its refill keeps near full shows the same ones)."""

    __slots__ = ("ms", "remaining", "remaining_s", "reset_s")

    def __init__(self) -> None:
        self.remaining = -1
        self.ms = -1
        self.remaining_s = self.reset_s = ""

    def show(self, level: float, capacity: float, rate: float) -> None:
        remaining = int(level) if level > 0 else 0
        if remaining != self.remaining:
            self.remaining = remaining
            self.remaining_s = str(remaining)
        x = (capacity - level) * 1000.0 / rate
        ms = int(x)
        if ms < x:
            ms += 1
        if ms != self.ms:
            self.ms = ms
            self.reset_s = duration_ms(ms)


def duration(s: float) -> str:
    """Seconds as OpenAI writes them in `x-ratelimit-reset-*` ("20ms", "1.5s", "6m0s"),
    rounded up to whole milliseconds."""
    return duration_ms(math.ceil(s * 1000.0))


def duration_ms(ms: int) -> str:
    """Whole milliseconds as OpenAI writes durations (integer arithmetic: `round(x, 3)`
    costs ~4x more)."""
    if ms < 1000:
        return f"{ms}ms" if ms > 0 else "0s"
    m, ms = divmod(ms, 60_000)
    # An int over 1000 prints with at most 3 decimals (the shortest repr of n / 1000).
    sec = f"{ms // 1000}" if ms % 1000 == 0 else f"{ms / 1000}"
    return f"{m}m{sec}s" if m else f"{sec}s"


__all__ = ["Shown", "duration", "duration_ms"]
