"""Dialects normalised at the edge: what any backend sends, clients get the OpenAI way."""

from __future__ import annotations

import orjson

from pulsegate.proxy.attempt import normalize_error


def test_backend_errors_are_normalised_to_openai_shape() -> None:
    """FastAPI `detail`, plain text and 422 become OpenAI errors; OpenAI ones pass as is."""
    ok = b'{"error": {"message": "m", "type": "t", "code": "c"}}'
    assert normalize_error(400, ok) == (400, ok)
    status, body = normalize_error(422, b'{"detail": [{"loc": ["body"], "msg": "bad"}]}')
    err = orjson.loads(body)["error"]
    assert status == 400 and "bad" in err["message"] and err["code"] == "invalid_request"
    status, body = normalize_error(404, b"Not Found")
    assert status == 404 and orjson.loads(body)["error"]["message"] == "Not Found"
