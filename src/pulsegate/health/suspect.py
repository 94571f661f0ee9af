"""Suspect: client requests on a backend waiting for their first byte far beyond its usual
time to first token (`FirstByteOverdue`) - evidence the gateway has before any probe fires.

Overdue alone is not proof (one huge prompt is slow too), so it never ejects by itself: a
suspect backend's weight is multiplied by 0.05 at once and it is probed fast. Overdue reported
twice plus one failing micro-inference or canary ejects (cause stalled). A successful request
whose first byte came sooner than the overdue ones (`cleared_by`), or a micro/canary probe,
clears suspicion; so does an ejection. A success that was itself late does not: a backend
whose first tokens all come 1.5 s late still answers every request, and each answer cleared
the suspicion its late requests had raised (the hedge's reports, `proxy/hedge.py`).
"""

from __future__ import annotations

from pulsegate.health.observations import FirstByteOverdue

SUSPECT_FACTOR = 0.05  # weight multiplier while first bytes are overdue
OVERDUE_REPEATS = 2  # overdue reports that, with one failing probe, eject (cause stalled)


class Suspicion:
    """Whether a backend is suspect, and the overdue reports that made it so."""

    __slots__ = ("active", "bar_s", "reports", "words")

    def __init__(self) -> None:
        self.active = False
        self.reports = 0  # overdue reports since it became suspect
        self.words = ""  # the last report, in words
        self.bar_s = 0.0  # the shortest wait reported overdue: a success sooner clears

    @property
    def stalled(self) -> bool:
        """Overdue reported often enough that one failing probe is proof of a stall."""
        return self.active and self.reports >= OVERDUE_REPEATS

    def report(self, o: FirstByteOverdue) -> bool:
        """Count one report of overdue requests; True when it made the backend suspect."""
        self.reports += 1
        self.words = (
            f"first byte overdue on {o.count} request{'s' if o.count != 1 else ''} "
            f"(oldest {o.oldest_s:.1f}s)"
        )
        was = self.active
        self.bar_s = o.oldest_s if not was else min(self.bar_s, o.oldest_s)
        self.active = True
        return not was

    def cleared_by(self, ttft_s: float | None) -> bool:
        """Whether a successful request with this first-byte time clears the suspicion: it
        is active, and the first byte came sooner than the overdue ones (unknown: yes)."""
        return self.active and (ttft_s is None or ttft_s < self.bar_s)

    def clear(self) -> bool:
        """No longer suspect (a success, or an ejection); True when it was."""
        was = self.active
        self.active = False
        self.reports = 0
        return was
