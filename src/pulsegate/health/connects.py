"""New connections as evidence: a node that takes no new connection while its old ones work.

TCP SYNs dropped on the way to a node, or a listener whose accept queue is full, leave every
established connection working: the heartbeat's HTTP/2 stream, the proxy's pooled keep-alive
connections and the probes' own pool stay green, and only a *new* connection hangs. Before
this rule the chaos lab's `syn_drop` was never detected, and each client request that needed
a new connection waited out the connect timeout first (p99 1,184 ms; issue #21, item 3).

The rule (`ConnectWatch`), over the fresh connects the gateway makes to one backend (the
proxy's pools, each new connection, and the connect probe, `probers/dial.py`, every
`probes.connect.interval`, so an idle fleet or warm pools still see what a new connection
sees):

- `health.connect_failures` (3) fresh connects failed (no connection within the connect
  timeout, refused, unreachable), each within `WINDOW_S` (5 s) of the one before and none
  made in between, is hard evidence with cause ``connect``: it ejects a ready or degraded
  backend at once and fails a probation (`machine.FAILURE_EVENTS`); 0 turns the rule off;
- while it stands the backend neither turns ready nor rejoins (`gate`);
- one fresh connect made clears it; so does `WINDOW_S` without a failure (with the connect
  probe off, an ejected backend gets no new connection to prove itself with: probation's
  first ones do, and fail it again if the node still drops them).

Why 3 in a row: one lost SYN fails one connect (the kernel retransmits it only after 1 s, past
the 250 ms connect timeout), so one is a blip; three with none made between is 1 in 10^6 at
1 % random loss. The probe runs every 0.5 s and half that after a failure, so three take
0.75 s once the first began: 0.75-1.3 s from the fault (measured: docs/connect-evidence.md).
"""

from __future__ import annotations

import errno

from pulsegate.health.machine import Event
from pulsegate.health.observations import ConnectResult
from pulsegate.health.rules import Fire

WINDOW_S = 5.0  # a failure older than this before the next one starts the count afresh
# A connect that failed for want of our own resources (file descriptors, local ports, memory)
# says nothing about the backend: the reporters leave these out.
OWN_ERRNOS = frozenset(
    {errno.EMFILE, errno.ENFILE, errno.EADDRNOTAVAIL, errno.ENOBUFS, errno.ENOMEM}
)
_BLOCKED = frozenset({Event.REJOIN_OK, Event.READY_SEEN})


class ConnectWatch:
    """One backend's fresh connects failing since the last one made."""

    __slots__ = ("failures", "first_at", "last_at", "limit", "reason")

    def __init__(self, limit: int) -> None:
        self.limit = limit  # `health.connect_failures`, as of the last observation
        self.failures = 0  # in a row, each within WINDOW_S of the one before
        self.first_at: float | None = None  # the first of them
        self.last_at: float | None = None  # the latest of them
        self.reason = ""  # the latest one's, in words

    def hard(self, now: float) -> bool:
        """The evidence stands at `now`: `limit` failures in a row, the latest within WINDOW_S."""
        if self.last_at is not None and now - self.last_at > WINDOW_S:
            self._forget()
        return 0 < self.limit <= self.failures

    def observe(self, r: ConnectResult, limit: int, now: float) -> Fire | None:
        """Fold one fresh connect in; hard evidence (cause connect) while `limit` failed in a
        row, else None."""
        self.limit = limit
        if r.ok:
            self._forget()
            return None
        if self.last_at is None or now - self.last_at > WINDOW_S:
            self.failures, self.first_at = 0, now
        self.failures += 1
        self.last_at = now
        self.reason = r.reason
        if not self.hard(now):
            return None
        spell = now - (self.first_at if self.first_at is not None else now)
        why = (
            f"{self.failures} new connections failed in a row in {spell:.1f}s, none made "
            f"(last: {self.reason or 'failed'})"
        )
        return Fire("connect", why)

    def gate(self, f: Fire | None, now: float) -> Fire | None:
        """`f` (another rule's move), or None when it would make the backend ready or let it
        rejoin while the evidence stands."""
        if f is not None and f.event in _BLOCKED and self.hard(now):
            return None
        return f

    def _forget(self) -> None:
        self.failures = 0
        self.first_at = self.last_at = None
        self.reason = ""
