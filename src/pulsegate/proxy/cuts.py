"""Why a stream from a backend ended before `[DONE]`: a small value, not a string to parse.

The kind decides what the health core is told (`evidence`) and the text is what the client's
error event and the log say ("stream from b1 stalled: no token for 1000ms; ...").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class CutKind(enum.Enum):
    STALLED = "stalled"  # our watchdog: no token for the stall limit
    EJECTED = "ejected"  # the backend was ejected while the stream idled
    SHUTDOWN = "shutdown"  # the gateway's grace period ran out
    FAILED = "failed"  # the connection failed (reset, broken framing)
    NO_DONE = "no_done"  # the body ended without `[DONE]`
    MALFORMED = "malformed"  # an event that is not a JSON object


class Evidence(enum.Enum):
    """What a cut of this kind tells the health core about the backend."""

    SUSPECT = "suspect"  # a quiet stream: slow or sick, not proof (R17, R21)
    FAILURE = "failure"  # a broken stream: a request failure
    NONE = "none"  # not the backend's doing (ours, or already judged)


_EVIDENCE = {
    CutKind.STALLED: Evidence.SUSPECT,
    CutKind.EJECTED: Evidence.NONE,
    CutKind.SHUTDOWN: Evidence.NONE,
    CutKind.FAILED: Evidence.FAILURE,
    CutKind.NO_DONE: Evidence.FAILURE,
    CutKind.MALFORMED: Evidence.FAILURE,
}


@dataclass(frozen=True, slots=True)
class Cut:
    kind: CutKind
    text: str

    @property
    def evidence(self) -> Evidence:
        return _EVIDENCE[self.kind]

    def __str__(self) -> str:
        return self.text


SHUTTING_DOWN = Cut(CutKind.SHUTDOWN, "the gateway is shutting down")
NO_DONE = Cut(CutKind.NO_DONE, "ended without [DONE]")
MALFORMED = Cut(CutKind.MALFORMED, "sent a malformed event")


def failed(detail: str) -> Cut:
    return Cut(CutKind.FAILED, f"failed: {detail}")
