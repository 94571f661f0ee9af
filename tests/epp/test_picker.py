"""The picker's decision: endpoints best first, or a refusal in OpenAI's shape."""

from __future__ import annotations

import orjson
from pick_support import URLS, Setup, verdict

from pulsegate.epp.endpoints import Endpoints, endpoint_of
from pulsegate.epp.picker import Pick, Refusal
from pulsegate.health.verdict import State

CHAT = "/v1/chat/completions"


def _body(model: str = "m", **extra: object) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra})


def test_endpoint_of_urls() -> None:
    """A url's host:port; the scheme's port when none; IPv6 keeps its brackets."""
    assert endpoint_of("http://10.0.0.1:8000") == "10.0.0.1:8000"
    assert endpoint_of("http://10.0.0.1:8000/v1") == "10.0.0.1:8000"
    assert endpoint_of("https://10.0.0.1") == "10.0.0.1:443"
    assert endpoint_of("http://[fd00::1]:9000") == "[fd00::1]:9000"


def test_endpoints_both_ways(setup: Setup) -> None:
    """name -> endpoint -> name, an unknown endpoint is None, `outside` a subset's complement."""
    eps = Endpoints(setup.config.backends)
    assert eps.endpoint("b") == "10.0.0.2:8000"
    assert eps.name(" 10.0.0.2:8000") == "b"
    assert eps.name("10.9.9.9:1") is None
    assert eps.outside(["10.0.0.1:8000"]) == ["b", "c"]


def test_pick_lists_every_routable_backend_once(setup: Setup) -> None:
    """Three routable backends, max_attempts 3: all three, distinct, as endpoints."""
    got = setup.picker.pick(CHAT, _body(), None)
    assert isinstance(got, Pick)
    assert sorted(got.names) == ["a", "b", "c"]
    assert got.value == ",".join(URLS[n].removeprefix("http://") for n in got.names)
    assert got.model == "m" and not got.stream


def test_pick_is_as_long_as_max_attempts() -> None:
    """retry.max_attempts 2: two endpoints (Envoy's num_retries + 1)."""
    s = Setup([verdict(n) for n in URLS], retry={"max_attempts": 2})
    got = s.picker.pick(CHAT, _body(), None)
    assert isinstance(got, Pick) and len(got.names) == 2


def test_first_pick_goes_to_the_less_loaded() -> None:
    """The p2c load (in flight) decides the first endpoint, as in `serve`."""
    s = Setup([verdict("a"), verdict("b")])
    s.load.update({"a": 50, "b": 0})
    firsts = {s.picker.pick(CHAT, _body(), None).names[0] for _ in range(20)}  # type: ignore[union-attr]
    assert firsts == {"b"}


def test_session_key_pins_the_first_endpoint(setup: Setup) -> None:
    """The same x-session-id gets the same first endpoint (rendezvous affinity)."""
    firsts = {setup.picker.pick(CHAT, _body(), "user-42").names[0] for _ in range(20)}  # type: ignore[union-attr]
    assert len(firsts) == 1


def test_subset_hint_limits_the_pick(setup: Setup) -> None:
    """Only endpoints in Envoy's subset; an empty subset is a 503."""
    got = setup.picker.pick(CHAT, _body(), None, ("10.0.0.3:8000",))
    assert isinstance(got, Pick) and got.names == ("c",)
    none = setup.picker.pick(CHAT, _body(), None, ())
    assert isinstance(none, Refusal) and none.status == 503


def test_unknown_model_is_404(setup: Setup) -> None:
    """A model no backend serves: 404 model_not_found in OpenAI's shape."""
    got = setup.picker.pick(CHAT, _body("nope"), None)
    assert isinstance(got, Refusal) and got.status == 404
    assert orjson.loads(got.body)["error"]["code"] == "model_not_found"


def test_bad_request_is_the_parse_refusal(setup: Setup) -> None:
    """Not JSON, or no model: the proxy's own 400."""
    for body in (b"{", orjson.dumps({"messages": []})):
        got = setup.picker.pick(CHAT, body, None)
        assert isinstance(got, Refusal) and got.status == 400


def test_nothing_routable_is_503() -> None:
    """Every backend ejected: 503 no_healthy_backend with Retry-After."""
    s = Setup([verdict(n, state=State.EJECTED) for n in URLS])
    got = s.picker.pick(CHAT, _body(), None)
    assert isinstance(got, Refusal) and got.status == 503
    assert got.code == "no_healthy_backend" and ("retry-after", "1") in got.headers


def test_all_at_their_limit_is_429() -> None:
    """Every routable backend at max_inflight: 429 overloaded, Retry-After 1."""
    s = Setup([verdict(n, cap=1) for n in URLS])
    s.load.update(dict.fromkeys(URLS, 1))
    got = s.picker.pick(CHAT, _body(), None)
    assert isinstance(got, Refusal) and got.status == 429
    assert orjson.loads(got.body)["error"]["type"] == "rate_limit_error"


def test_stream_flag_is_read(setup: Setup) -> None:
    """`stream: true` is carried to the outcome report (time to first byte)."""
    got = setup.picker.pick(CHAT, _body(stream=True), None)
    assert isinstance(got, Pick) and got.stream
