"""Response-id affinity (`proxy/affinity.py`): bounded, most recent kept. Pure."""

from __future__ import annotations

import orjson
import pytest

from pulsegate.proxy.affinity import ResponseAffinity, pinned_avoid, previous_id


def test_the_most_recent_ids_are_kept_and_a_lookup_keeps_an_id_fresh() -> None:
    """Past capacity the least recently used id goes; `home` counts as a use."""
    aff = ResponseAffinity(capacity=2)
    aff.learn("r1", "a")
    aff.learn("r2", "b")
    assert aff.home("r1") == "a"  # r1 now fresher than r2
    aff.learn("r3", "c")
    assert (aff.home("r1"), aff.home("r2"), aff.home("r3")) == ("a", None, "c")
    assert len(aff) == 2
    with pytest.raises(ValueError, match="capacity"):
        ResponseAffinity(capacity=0)


def test_a_non_streamed_answer_teaches_its_id_and_junk_teaches_nothing() -> None:
    """The top-level `id` of a Responses answer is learned; non-JSON or id-less is ignored."""
    aff = ResponseAffinity()
    aff.learn_answer(orjson.dumps({"id": "resp_1", "object": "response"}), "b1")
    aff.learn_answer(b"<html>", "b2")
    aff.learn_answer(orjson.dumps({"object": "response"}), "b3")
    assert aff.home("resp_1") == "b1" and len(aff) == 1


def test_a_pinned_request_avoids_every_other_backend() -> None:
    """Only the home stays pickable; a missing or empty previous_response_id is none."""
    assert pinned_avoid("b", ["a", "b", "c"]) == ["a", "c"]
    assert previous_id({"previous_response_id": "resp_9"}) == "resp_9"
    assert previous_id({"previous_response_id": ""}) is None and previous_id({}) is None
