"""The streams' rhythm: each backend's recent inter-token gaps and times to first token.

Two uses, both reading a high quantile of a recent distribution:
- the stall rule (`stall_limit`, `watchdog.py`): a stream is cut when no token has come for
  max(floor, k x the backend's recent inter-token p99 or the stream's own longest gap),
  capped by `streaming.stall_timeout`; at 5 ms between tokens a stall is 30 gaps old at
  150 ms, where the fixed 1 s made the client wait 672-1,033 ms (issue #21);
- the hedge (`hedge.py`): a first token later than k x the usual TTFT p95 is asked of a
  second backend.

`Quantiles` is a fixed-size histogram (log-spaced buckets, ~12% wide, 0.1 ms to ~100 s):
`add` is one `bisect` and one increment, no allocation (measured by `bench/rhythm.py`); every
`HALVE_EVERY` samples all counts are halved, so the distribution is that of the last ~1,000
samples or so, not of the process's life. A quantile is read back as its bucket's upper
bound (an over-estimate by at most one bucket: the safe side for a timeout), computed at
most once per `REREAD_EVERY` samples. Pure: no clock, no I/O; time is what is added.
"""

from __future__ import annotations

import bisect
import math

# Bucket upper bounds: 0.1 ms x 1.125^i up to ~100 s (118 buckets), plus one for anything
# longer. 12.5% wide: a p99 of 10 ms reads as at most 11.25 ms.
_LOW_S = 1e-4
_GROWTH = 1.125
_N = int(math.log(1e6) / math.log(_GROWTH)) + 1
BOUNDS: tuple[float, ...] = tuple(_LOW_S * _GROWTH**i for i in range(_N))
# Halve every count after this many samples: a sample's weight is 1/2 after 512 more, so
# the quantile follows a backend that changed speed within ~1,000 gaps (~5 s at 5 ms, 200
# tokens each from 25 streams).
HALVE_EVERY = 512
# A quantile is recomputed (a walk over the buckets, ~3 us) at most once per this many
# samples; between them the cached value is returned.
REREAD_EVERY = 32
# Fewer samples than this (after decay) and the quantile is not known: None. A p99 of
# gaps wants many (a stream gives hundreds); a p95 of first tokens fewer (one per stream).
MIN_SAMPLES = 64
MIN_TTFT_SAMPLES = 20


class Quantiles:
    """A recent distribution of durations (seconds): `add(x)`, `quantile(q)`."""

    __slots__ = ("_cached", "_cached_at", "_counts", "_halve_at", "_known", "_min", "_n")

    def __init__(self, min_samples: int = MIN_SAMPLES) -> None:
        self._min = min_samples
        self._counts = [0.0] * (_N + 1)
        self._n = 0  # samples ever added
        self._halve_at = HALVE_EVERY
        self._cached: dict[float, float] = {}
        self._cached_at = -REREAD_EVERY  # `_n` when the cache was filled: stale at start
        self._known = False  # enough samples, when the cache was filled

    @property
    def count(self) -> float:
        """Samples held, decayed (each halving halves them)."""
        return sum(self._counts)

    def add(self, x: float) -> None:
        """One sample: the hot path (one per stream chunk), a bisect and two increments."""
        self._counts[bisect.bisect_left(BOUNDS, x)] += 1.0
        self._n += 1
        if self._n >= self._halve_at:
            self._halve()

    def _halve(self) -> None:
        c = self._counts
        for i in range(len(c)):
            c[i] *= 0.5
        self._halve_at = self._n + HALVE_EVERY

    def quantile(self, q: float) -> float | None:
        """The `q` quantile (0-1) as a bucket's upper bound, or None with too few samples."""
        since = self._n - self._cached_at
        if since >= REREAD_EVERY or (since and not self._known):
            self._cached.clear()
            self._cached_at = self._n
            self._known = self.count >= self._min
        if not self._known:
            return None
        v = self._cached.get(q)
        if v is None:
            v = self._cached[q] = self._walk(q)
        return v

    def _walk(self, q: float) -> float:
        c = self._counts
        # Walk down from the top: the samples above the quantile are the few.
        above = (1.0 - q) * sum(c)
        seen = 0.0
        for i in range(len(c) - 1, -1, -1):
            seen += c[i]
            if seen > above:
                return BOUNDS[i] if i < _N else math.inf
        return BOUNDS[0]


class Rhythms:
    """Per backend: its streams' inter-token gaps (`itl`) and its times to first token
    (`ttft`). One per process, fed by the relays and the attempt opener."""

    __slots__ = ("_itl", "_ttft")

    def __init__(self) -> None:
        self._itl: dict[str, Quantiles] = {}
        self._ttft: dict[str, Quantiles] = {}

    def itl(self, name: str) -> Quantiles:
        """Backend `name`'s inter-token gaps (made on first use): a relay holds it for its
        stream's life, so the per-token path has no lookup."""
        q = self._itl.get(name)
        if q is None:
            q = self._itl[name] = Quantiles()
        return q

    def ttft(self, name: str) -> Quantiles:
        q = self._ttft.get(name)
        if q is None:
            q = self._ttft[name] = Quantiles(MIN_TTFT_SAMPLES)
        return q

    def first_token(self, name: str, seconds: float) -> None:
        """A stream on `name` had its first byte `seconds` after it was sent."""
        self.ttft(name).add(seconds)

    def usual_ttft(self, names: list[str], q: float) -> float | None:
        """The fleet's usual time to first token: the lower median over `names` of each
        backend's `q` quantile (those that know one). One slow backend in three, or in two,
        does not move it, where its own quantile would follow it (a backend 1.5 s late has a
        1.5 s p95, and a hedge judged by it would never fire)."""
        vals = sorted(v for n in names if (v := self.ttft(n).quantile(q)) is not None)
        return vals[(len(vals) - 1) // 2] if vals else None

    def forget(self, name: str) -> None:
        self._itl.pop(name, None)
        self._ttft.pop(name, None)


# -- the stall rule ---------------------------------------------------------------------------

# The stream's own longest gap counts once it has this many gaps: fewer say little.
MIN_OWN_GAPS = 8


def stall_limit(
    cap: float, floor: float, factor: float, backend_p99: float | None, own: float | None
) -> float:
    """Seconds of silence after which a stream that has begun is cut.

    max(floor, factor x the larger of the backend's recent inter-token p99 and the stream's
    own longest gap), at most `cap`; with neither known, `cap` (the fixed rule). The larger
    of the two: a stream slower than its backend's others (a longer context, a busier
    batch) is judged by its own pace, and one faster by its backend's tail.

    Worked example (the defaults, floor 150 ms, factor 4, cap 1 s): 5 ms between tokens,
    p99 9 ms and the stream's longest gap 30 ms: max(0.15, 4 x 0.030) = 150 ms. A steady
    200 ms stream: 4 x 0.2 = 800 ms, never reached. A 400 ms one: min(1 s, 1.6 s) = 1 s."""
    if backend_p99 is None and own is None:
        return cap
    base = max(x for x in (backend_p99, own) if x is not None)
    return min(cap, max(floor, factor * base))


__all__ = ["BOUNDS", "MIN_OWN_GAPS", "Quantiles", "Rhythms", "stall_limit"]
