"""The front door through a real gateway: official clients, a reload, secrets kept in.

Real processes on loopback: a simulated engine behind a `Wiretap` (every byte the gateway
sent towards the backend is kept) and `pulsegate serve` with `auth.keys_file`. Clients are
the official `openai` and `anthropic` SDKs (no retries, so a 429 is seen, not waited out).
"""

from __future__ import annotations

import hashlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
import yaml

from support import Gateway, Sim, fast_probes, wait_until

from .wiretap import Wiretap

MODEL = "demo-7b"
KEY_A = "pg-e2e-team-a-0f9c2d7e4b1a"  # via key_env
KEY_B = "pg-e2e-team-b-5d3e8a1c9f70"  # other models only
KEY_L = "pg-e2e-limited-7a2b9c4d1e6f"  # rpm 2
KEY_C = "pg-e2e-team-c-3c1d5e7f9a0b"  # added by a reload
KEYS = (KEY_A, KEY_B, KEY_L, KEY_C)
ENV = {"PG_E2E_KEY_A": KEY_A}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def keys_doc(limited_rpm: int = 2, *, a: bool = True, c: bool = False) -> dict[str, Any]:
    keys: list[dict[str, Any]] = []
    if a:
        keys.append({"name": "team-a", "key_env": "PG_E2E_KEY_A", "models": ["demo-*"],
                     "rpm": 1000, "tpm": 1_000_000})  # fmt: skip
    keys.append({"name": "team-b", "sha256": sha(KEY_B), "models": ["other-*"]})
    keys.append({"name": "limited", "sha256": sha(KEY_L), "rpm": limited_rpm})
    if c:
        keys.append({"name": "team-c", "sha256": sha(KEY_C)})
    return {"keys": keys}


def write_keys(tmp: Path, doc: dict[str, Any] | str) -> None:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    part = tmp / "keys.yaml.tmp"
    part.write_text(text)
    part.replace(tmp / "keys.yaml")


def gateway_config(tap: Wiretap, workers: int = 1) -> dict[str, Any]:
    return {
        "gateway": {"workers": workers},
        "backends": [{"name": "sim", "url": tap.url, "models": [MODEL]}],
        "probes": fast_probes(),
        "auth": {"keys_file": "keys.yaml"},
    }


class Setup:
    def __init__(self, tmp: Path, workers: int = 1) -> None:
        self.tmp = tmp
        self.sim = Sim(tmp, "sim")
        self.tap = Wiretap((self.sim.host, self.sim.port))
        write_keys(tmp, keys_doc())
        self.gw = Gateway(tmp, gateway_config(self.tap, workers), ENV)

    def close(self) -> None:
        self.gw.stop()
        self.tap.close()
        self.sim.stop()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    s = Setup(tmp_path_factory.mktemp("door"))
    try:
        s.gw.wait_all_ready()
        yield s
    finally:
        s.close()


@pytest.fixture
def fresh(tmp_path: Path) -> Iterator[Setup]:
    s = Setup(tmp_path)
    try:
        s.gw.wait_all_ready()
        yield s
    finally:
        s.close()


def client(gw: Gateway, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=20)


def chat(gw: Gateway, key: str, model: str = MODEL) -> Any:
    return client(gw, key).chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )


def status(gw: Gateway, key: str) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(
        f"{gw.url}/v1/chat/completions", json=body, headers=headers, timeout=20
    ).status_code


def test_no_key_or_a_wrong_key_is_401(env: Setup) -> None:
    """No key: 401 in OpenAI's shape; the openai client with a wrong key: AuthenticationError."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{env.gw.url}/v1/chat/completions", json=body, timeout=20)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as e:
        chat(env.gw, "pg-not-a-key")
    assert e.value.code == "invalid_api_key"
    assert "pg-not-a-key" not in e.value.response.text


def test_the_model_list_needs_a_key_and_shows_what_it_may_use(env: Setup) -> None:
    """`GET /v1/models` with `auth`: 401 without a key; a key sees only the models its
    allow-list matches (team-b may use other-* only: an empty list)."""
    assert httpx.get(f"{env.gw.url}/v1/models", timeout=20).status_code == 401
    c = openai.OpenAI(base_url=f"{env.gw.url}/v1", api_key=KEY_A, max_retries=0)
    assert [m.id for m in c.models.list()] == [MODEL]
    c = openai.OpenAI(base_url=f"{env.gw.url}/v1", api_key=KEY_B, max_retries=0)
    assert [m.id for m in c.models.list()] == []


def test_a_key_gets_its_answer_with_rate_headers(env: Setup) -> None:
    """A known key: the answer, with OpenAI's x-ratelimit-* headers for its limits."""
    raw = chat(env.gw, KEY_A)
    assert raw.parse().choices[0].message.content
    h = raw.headers
    assert h["x-ratelimit-limit-requests"] == "1000"
    assert 0 < int(h["x-ratelimit-remaining-requests"]) < 1000
    assert h["x-ratelimit-limit-tokens"] == "1000000"
    assert int(h["x-ratelimit-remaining-tokens"]) < 1_000_000
    assert h["x-ratelimit-reset-requests"].endswith("ms")


def test_a_model_outside_the_allow_list_is_403(env: Setup) -> None:
    """team-b may only use other-*: PermissionDeniedError, model_not_allowed."""
    with pytest.raises(openai.PermissionDeniedError) as e:
        chat(env.gw, KEY_B)
    assert e.value.code == "model_not_allowed"


def test_over_the_limit_is_429_with_retry_after(env: Setup) -> None:
    """rpm 2: the third request is RateLimitError with Retry-After and remaining 0."""
    chat(env.gw, KEY_L)
    chat(env.gw, KEY_L)
    with pytest.raises(openai.RateLimitError) as e:
        chat(env.gw, KEY_L)
    assert e.value.code == "rate_limited"
    h = e.value.response.headers
    assert 1 <= int(h["retry-after"]) <= 30
    assert 0 < int(h["retry-after-ms"]) <= 30_000  # what the openai client reads first
    assert h["x-ratelimit-remaining-requests"] == "0"
    assert h["x-ratelimit-limit-requests"] == "2"


def test_the_anthropic_client_s_x_api_key(env: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """The anthropic client sending only `x-api-key`: admitted with a key, 401 with a wrong one."""
    for var in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(var, raising=False)  # no Authorization header besides

    def post(key: str) -> Any:
        c = anthropic.Anthropic(
            base_url=env.gw.url, default_headers={"x-api-key": key}, max_retries=0
        )
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        return c.post("/v1/chat/completions", body=body, cast_to=object)

    assert post(KEY_A)["choices"]
    with pytest.raises(anthropic.AuthenticationError):
        post("pg-wrong")


def test_a_stream_counts_its_tokens_per_key(env: Setup) -> None:
    """A streamed answer with usage: prompt and completion tokens counted under the key's name."""
    stream = client(env.gw, KEY_A).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    assert sum(1 for _ in stream) > 1

    def counted() -> bool:
        text = httpx.get(f"{env.gw.url}/metrics", timeout=5).text
        return 'pulsegate_key_tokens_total{key="team-a",kind="completion"}' in text

    wait_until(counted, what="team-a's tokens in /metrics")


def test_zz_no_key_leaks_anywhere(env: Setup) -> None:
    """No client key in /admin/*, /metrics, what the backend received, or the gateway's output."""
    gw = env.gw
    metrics = httpx.get(f"{gw.url}/metrics", timeout=5).text
    assert 'pulsegate_key_requests_total{key="team-a",code="200"}' in metrics
    assert 'pulsegate_key_rejections_total{key="-",reason="unknown_key"}' in metrics
    assert 'pulsegate_key_rejections_total{key="limited",reason="rpm"}' in metrics
    seen = [metrics]
    for path in ("/admin/backends", "/admin/events", "/admin/summary"):
        seen.append(httpx.get(f"{gw.url}{path}", timeout=5).text)
    sent = env.tap.sent()
    assert b"/v1/chat/completions" in sent  # the tap did see the client requests
    # This backend has no api_key_env: the gateway sends it no credential header at all.
    assert b"x-api-key" not in sent.lower() and b"authorization" not in sent.lower()
    seen.append(sent.decode("latin-1"))
    gw.signal(signal.SIGTERM)
    gw.popen.wait(timeout=15)
    assert gw.popen.stdout is not None
    seen.append(gw.popen.stdout.read().decode("utf-8", "replace"))
    seen.append(gw.log_path.read_text())
    for text in seen:
        for key in KEYS:
            assert key not in text
            assert sha(key) not in text


def test_a_reload_rereads_keys_and_keeps_unchanged_minutes(fresh: Setup) -> None:
    """SIGHUP with a changed keys file: a new key works, a removed one is 401, an unchanged
    key's used-up minute stays used up; a changed limit starts afresh."""
    gw = fresh.gw
    assert status(gw, KEY_L) == 200 and status(gw, KEY_L) == 200
    assert status(gw, KEY_L) == 429
    assert status(gw, KEY_C) == 401
    write_keys(fresh.tmp, keys_doc(a=False, c=True))
    gw.signal(signal.SIGHUP)
    wait_until(lambda: status(gw, KEY_C) == 200, what="team-c admitted after the reload")
    assert status(gw, KEY_A) == 401
    assert status(gw, KEY_L) == 429  # limited's entry is unchanged: its minute carries over
    write_keys(fresh.tmp, keys_doc(limited_rpm=3, a=False, c=True))
    gw.signal(signal.SIGHUP)
    wait_until(lambda: status(gw, KEY_L) == 200, what="limited admitted under rpm 3")


def test_a_broken_keys_file_keeps_the_old_keys(fresh: Setup) -> None:
    """A broken keys file (bad YAML, then duplicate names): the reload is refused naming
    auth.keys_file, and the keys in force stay in force."""
    gw = fresh.gw
    write_keys(fresh.tmp, "keys: [name: x\n")
    gw.signal(signal.SIGHUP)

    def refused() -> bool:
        return any(e["backend"] == "config" and e["to"] == "refused" for e in gw.events())

    wait_until(refused, what="the SIGHUP reload refused")
    assert status(gw, KEY_A) == 200
    doc = keys_doc()
    doc["keys"].append({"name": "team-b", "sha256": sha(KEY_C)})
    write_keys(fresh.tmp, doc)
    r = gw.reload()
    assert r.status_code == 400
    assert "auth.keys_file: keys.yaml: keys[3].name: duplicate of" in " ".join(r.json()["errors"])
    assert status(gw, KEY_A) == 200 and status(gw, KEY_C) == 401
    for key in KEYS:
        assert key not in r.text and sha(key) not in r.text


def test_workers_enforce_their_share_and_sum_key_metrics(tmp_path: Path) -> None:
    """gateway.workers 2: keys work in every worker, rpm 2 is 1 per worker (at most 2 of 6
    admitted), and the primary's /metrics sums the per-key counts."""
    s = Setup(tmp_path, workers=2)
    pids: list[int] = []
    try:
        pids = [
            w["pid"] for w in httpx.get(f"{s.gw.url}/admin/workers", timeout=5).json()["workers"]
        ]
        s.gw.wait_all_ready()
        fresh_conn = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=20)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        codes = []
        for _ in range(6):
            r = fresh_conn.post(f"{s.gw.url}/v1/chat/completions", json=body,
                                headers={"authorization": f"Bearer {KEY_L}"})  # fmt: skip
            codes.append(r.status_code)
        assert set(codes) <= {200, 429} and 1 <= codes.count(200) <= 2
        assert fresh_conn.post(f"{s.gw.url}/v1/chat/completions", json=body).status_code == 401

        def summed() -> bool:
            text = httpx.get(f"{s.gw.url}/metrics", timeout=5).text
            want = f'pulsegate_key_requests_total{{key="limited",code="429"}} {codes.count(429)}'
            return want in text

        wait_until(summed, what="the workers' key counts summed in /metrics")
    finally:
        s.close()
        for pid in pids:
            wait_until(lambda p=pid: not Path(f"/proc/{p}").exists() or
                       Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                       timeout=15, what=f"worker {pid} gone")  # fmt: skip
