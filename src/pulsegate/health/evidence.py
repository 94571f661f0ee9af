"""What the probes have proved since the two moments that reset it: the engine's last "not
ready" answer and the backend's last ejection.

- Ready (cold or warming -> ready) needs the engine to say it is ready AND a micro-inference
  to have passed since it last said "not ready", with none failing since: a vLLM that cannot
  run its model passes /health and fails its first micro-inference.
- Rejoin (ejected -> probation) needs, besides the score and the streaks, the engine not
  saying "not ready" and a micro-inference passed since the ejection: the compute pipeline
  must have worked again, not just the port (R8).
- A refused readiness probe means nothing listens on the engine's port; the next "ready"
  answer then comes from a new process (`on_ready` returns True), whose failure counts start
  afresh.

Plain flags, updated by `BackendHealth` on each probe, readiness answer and ejection, and read
by the rules (`conditions.rejoin_blocker`).
"""

from __future__ import annotations


class Evidence:
    """One backend's readiness and rejoin evidence."""

    __slots__ = (
        "engine_gone",
        "micro_ok_since_eject",
        "micro_ok_since_not_ready",
        "ready",
        "ready_reason",
    )

    def __init__(self) -> None:
        self.ready: bool | None = None  # the engine's own last readiness answer (None: none yet)
        self.ready_reason = ""  # its words for the last "not ready"
        self.engine_gone = False  # a readiness probe was refused and none answered since
        self.micro_ok_since_not_ready = False  # and none failed since
        self.micro_ok_since_eject = False

    @property
    def not_ready(self) -> bool:
        """The engine's last answer was "not ready" (loading, reloading, model missing)."""
        return self.ready is False

    @property
    def ready_to_serve(self) -> bool:
        """The engine says ready and its last micro-inference, since any "not ready", passed."""
        return self.ready is True and self.micro_ok_since_not_ready

    def on_micro(self, ok: bool) -> None:
        """A micro-inference passed or failed."""
        if ok:
            self.micro_ok_since_not_ready = True
            self.micro_ok_since_eject = True
        else:
            self.micro_ok_since_not_ready = False

    def on_refused(self) -> None:
        """The readiness probe found nothing listening on the engine's port."""
        self.engine_gone = True

    def on_not_ready(self, reason: str) -> None:
        """The engine answered "not ready": a micro-inference must pass again after this."""
        self.ready = False
        self.ready_reason = reason or "loading"
        self.micro_ok_since_not_ready = False

    def on_ready(self) -> bool:
        """The engine answered "ready"; True when it had been gone (a new process answers)."""
        self.ready = True
        restarted = self.engine_gone
        self.engine_gone = False
        return restarted

    def on_eject(self) -> None:
        """The backend was ejected: rejoining needs a micro-inference from here on."""
        self.micro_ok_since_eject = False
