"""The engine's scheduler state: batch slots with a FIFO queue, the prefix cache, counters.

No sockets and no clock: wall times are passed in. Admission uses asyncio futures only so
that a request can wait for a slot; everything else is plain bookkeeping read by
``/metrics`` and ``/sim/stats``.

Slots: at most ``max_batch`` sequences run at once (vLLM's max_num_seqs). A finished
sequence hands its slot straight to the oldest waiter, so the queue is strictly FIFO and a
newcomer can never overtake someone already waiting.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any

ARRIVALS_KEPT = 2000  # /sim/requests ring: ~20 s of a 100 rps test, enough to audit ejection


@dataclass(slots=True, eq=False)
class Seq:
    """One admitted or waiting request. ``generated`` is bumped by the token loop."""

    prompt_tokens: int
    generated: int = 0


class PrefixCache:
    """LRU of recent prompt-prefix hashes, standing in for vLLM's automatic prefix caching.

    Keyed on the first ``prefix_chars`` characters of the rendered prompt: a shared system
    prompt (the usual case) hits, a fresh conversation misses. 1024 entries x 256 chars keeps
    the model cheap while still letting session affinity show a measurable TTFT win.
    """

    def __init__(self, capacity: int = 1024, prefix_chars: int = 256) -> None:
        self._capacity = capacity
        self._prefix_chars = prefix_chars
        self._seen: OrderedDict[int, None] = OrderedDict()
        self.queries = 0
        self.hits = 0

    def lookup(self, rendered_prompt: str) -> bool:
        """Count a query; True on a hit. The prefix is remembered either way (LRU)."""
        key = hash(rendered_prompt[: self._prefix_chars])  # per-process salt is fine here
        self.queries += 1
        if key in self._seen:
            self._seen.move_to_end(key)
            self.hits += 1
            return True
        self._seen[key] = None
        if len(self._seen) > self._capacity:
            self._seen.popitem(last=False)
        return False


class Engine:
    """Slots, queue and counters of one simulated engine."""

    def __init__(self, *, name: str, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.name = name
        self.max_batch = max_batch
        self.prefix_cache = PrefixCache()
        self._running: set[Seq] = set()
        self._waiting: deque[tuple[Seq, asyncio.Future[None]]] = deque()
        # arrivals (every inference request, counted before any fault can swallow it)
        self.requests_total = 0
        self.client_requests_total = 0
        self.probe_requests_total = 0
        self.last_client_request_wall: float | None = None
        # GETs of /health and /metrics: what watching this engine costs it (an agent's
        # refresh reads each once)
        self.scrapes = {"health": 0, "metrics": 0}
        # (wall, path, the W3C `traceparent` header if any: the gateway's trace propagation)
        self.arrivals: deque[tuple[float, str, str | None]] = deque(maxlen=ARRIVALS_KEPT)
        self.inflight = 0  # accepted and not yet answered, hung ones included
        # outcomes
        self.request_success_total = 0
        self.prompt_tokens_total = 0
        self._finished_tokens = 0  # tokens of sequences no longer running

    # ---- arrivals ----

    def arrive(
        self, path: str, *, probe: bool, wall: float, traceparent: str | None = None
    ) -> None:
        """Count an inference request as it arrives (before its body is read)."""
        self.requests_total += 1
        self.inflight += 1
        if probe:
            self.probe_requests_total += 1
        else:
            self.client_requests_total += 1
            self.last_client_request_wall = wall
            self.arrivals.append((wall, path, traceparent))

    def depart(self) -> None:
        """The request is answered, failed or abandoned."""
        self.inflight -= 1

    # ---- slots ----

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def try_admit(self, seq: Seq) -> bool:
        """Take a free slot now if nobody is queued ahead; the fast path, no future made."""
        if len(self._running) < self.max_batch and not self._waiting:
            self._running.add(seq)
            self.prompt_tokens_total += seq.prompt_tokens
            return True
        return False

    async def admit(self, seq: Seq) -> None:
        """Wait in FIFO order for a slot. Cancellation while waiting gives nothing away."""
        if self.try_admit(seq):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (seq, fut)
        self._waiting.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(seq)  # the slot was handed over just as we were cancelled
            else:
                try:
                    self._waiting.remove(entry)
                except ValueError:
                    pass  # release() already skipped past our cancelled future
            raise

    def release(self, seq: Seq, *, ok: bool = False) -> None:
        """Free ``seq``'s slot, handing it to the oldest waiter; count the outcome."""
        if seq not in self._running:
            return
        self._running.discard(seq)
        self._finished_tokens += seq.generated
        if ok:
            self.request_success_total += 1
        while self._waiting:
            nxt, fut = self._waiting.popleft()
            if not fut.done():
                self._running.add(nxt)
                self.prompt_tokens_total += nxt.prompt_tokens
                fut.set_result(None)
                return

    # ---- readings ----

    @property
    def kv_tokens(self) -> int:
        """Tokens held in KV cache: prompt plus generated of every running sequence."""
        return sum(s.prompt_tokens + s.generated for s in self._running)

    @property
    def generation_tokens_total(self) -> int:
        return self._finished_tokens + sum(s.generated for s in self._running)

    def stats(self) -> dict[str, Any]:
        """What ``GET /sim/stats`` returns."""
        return {
            "name": self.name,
            "requests_total": self.requests_total,
            "client_requests_total": self.client_requests_total,
            "probe_requests_total": self.probe_requests_total,
            "inflight": self.inflight,
            "running": self.running,
            "waiting": self.waiting,
            "last_client_request_wall": self.last_client_request_wall,
            "scrapes": self.scrapes,
        }

    def recent_arrivals(self, since: float | None = None) -> list[dict[str, Any]]:
        """Client arrivals kept in the ring, oldest first, optionally only after ``since``."""
        return [
            {"t": t, "path": p} if tp is None else {"t": t, "path": p, "traceparent": tp}
            for t, p, tp in self.arrivals
            if since is None or t > since
        ]
