"""Why a stream was cut, as a value: each kind says what the health core is told."""

from __future__ import annotations

from pulsegate.proxy.cuts import MALFORMED, NO_DONE, SHUTTING_DOWN, Cut, CutKind, Evidence, failed


def test_each_cut_kind_maps_to_its_evidence() -> None:
    """A stall is suspect, a broken stream a failure, ejection and shutdown no evidence."""
    assert Cut(CutKind.STALLED, "stalled: x").evidence is Evidence.SUSPECT
    assert Cut(CutKind.EJECTED, "backend ejected (canary): x").evidence is Evidence.NONE
    assert SHUTTING_DOWN.evidence is Evidence.NONE
    for cut in (failed("reset"), NO_DONE, MALFORMED):
        assert cut.evidence is Evidence.FAILURE
    assert {k for k in CutKind} == {
        CutKind.STALLED, CutKind.EJECTED, CutKind.SHUTDOWN,
        CutKind.FAILED, CutKind.NO_DONE, CutKind.MALFORMED,
    }  # fmt: skip


def test_a_cut_reads_as_the_words_clients_and_logs_see() -> None:
    """str() is the text that follows "stream from NAME" in the client's error event."""
    assert str(failed("connection reset")) == "failed: connection reset"
    assert str(NO_DONE) == "ended without [DONE]"
    assert str(SHUTTING_DOWN) == "the gateway is shutting down"
    assert str(MALFORMED) == "sent a malformed event"
