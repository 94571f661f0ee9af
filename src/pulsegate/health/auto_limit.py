"""A backend's in-flight limit: the configured `max_inflight`, or with `auto` the engine's
batch capacity, so the gateway never sends more than the engine runs at once and queues the
rest.

With `auto` the capacity is taken as reported (a capacity gauge) or learned: requests running
while others wait in the engine's own queue is a full batch (vLLM does not export
max_num_seqs). A smaller full batch later (KV cache pressure) keeps the larger. Until known
the limit is 0, no limit: never a made-up number.
"""

from __future__ import annotations

from pulsegate.config import MAX_INFLIGHT_AUTO
from pulsegate.health.observations import EngineFacts


class AutoLimit:
    """The most concurrent requests the gateway may send one backend (0: no limit)."""

    __slots__ = ("auto", "value")

    def __init__(self, configured: int) -> None:
        self.auto = configured == MAX_INFLIGHT_AUTO
        self.value = 0 if self.auto else configured

    def reconfigure(self, configured: int) -> None:
        """A reloaded `max_inflight`: a number applies at once; `auto` keeps what it learned
        (and starts from 0, unknown, when it was a number before)."""
        was_auto = self.auto
        self.auto = configured == MAX_INFLIGHT_AUTO
        if not self.auto:
            self.value = configured
        elif not was_auto:
            self.value = 0

    def learn(self, facts: EngineFacts) -> bool:
        """Fold in one set of engine gauges (`auto` only); True when the limit changed."""
        if not self.auto:
            return False
        if facts.capacity is not None and facts.capacity >= 1:
            limit = int(facts.capacity)
        elif facts.queue_waiting and facts.running and facts.running > self.value:
            limit = int(facts.running)
        else:
            return False
        if limit == self.value:
            return False
        self.value = limit
        return True
