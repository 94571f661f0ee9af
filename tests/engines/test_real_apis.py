"""The API surface against a real vLLM embedding model (issue #19): `make test-engines`.

The tiny Llama (`scripts/make_tiny_model.py`) served as an embedding model
(`--runner pooling --convert embed`): vLLM 0.32 then registers `/v1/embeddings`, `/v1/rerank`,
`/v1/score`, `/tokenize`, `/detokenize` and no generation route (its `/v1/completions` is a
404). The gateway names it `apis: [embeddings, rerank, score, tokenize]`: it must probe it
with embeddings and find it ready, serve the official client's `embeddings.create` and the
other pooling routes through it, and answer a chat request for it with its own 404
`api_not_served` rather than send it there.

This module starts its own engine (not the suite's shared pool) and stops it by PID.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from engine_kit import LOG_DIR, eng, real_probes

from support import Gateway, wait_until

MODEL = "tiny-embed"
HERE = LOG_DIR / "test_real_apis"


class EmbeddingEngine:
    def __init__(self) -> None:
        HERE.mkdir(parents=True, exist_ok=True)
        self.port = eng.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd, env, cwd = eng.vllm_command(self.port)
        cmd[cmd.index("--served-model-name") + 1] = MODEL
        cmd += ["--runner", "pooling", "--convert", "embed"]
        self.log = open(HERE / "vllm-embed.log", "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            ["nice", "-n", str(eng.ENGINE_NICE), *cmd],
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 180.0) -> None:
        def up() -> bool:
            assert self.popen.poll() is None, "vLLM exited: see build/engine-logs/test_real_apis"
            return httpx.get(f"{self.url}/health", timeout=1).status_code == 200

        wait_until(up, timeout=timeout, interval=0.5, what="vLLM embedding model healthy")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=5)
        self.log.close()


@pytest.fixture(scope="module")
def gateway() -> Iterator[Gateway]:
    engine = EmbeddingEngine()
    gw: Gateway | None = None
    try:
        engine.wait_healthy()
        backend: dict[str, Any] = {
            "name": "vllm-embed",
            "url": engine.url,
            "models": [MODEL],
            "apis": ["embeddings", "rerank", "score", "tokenize"],
        }
        gw = Gateway(HERE, {"backends": [backend], "probes": real_probes()})
        gw.wait_all_ready(timeout=60)
        yield gw
    finally:
        if gw is not None:
            gw.stop()
        engine.stop()


def test_the_embedding_model_is_ready_on_embedding_probes(gateway: Gateway) -> None:
    """vLLM has no generation route for it: only embedding probes can make it ready, and
    they keep passing (no micro-inference or canary failure counted)."""
    t0 = time.monotonic()
    assert gateway.wait_state("vllm-embed", "ready")["state"] == "ready"
    metrics = httpx.get(f"{gateway.url}/metrics", timeout=5).text
    failures = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("pulsegate_probe_failures_total") and 'backend="vllm-embed"' in ln
    ]
    assert all(ln.endswith(" 0") for ln in failures), failures
    assert time.monotonic() - t0 < 5


def test_official_client_embeddings_through_the_gateway(gateway: Gateway) -> None:
    """`embeddings.create` (base64 on the wire) returns vLLM's normalised vectors, one per
    input, the gateway's headers on the answer."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    raw = client.embeddings.with_raw_response.create(model=MODEL, input=["hello", "world"])
    got = raw.parse()
    assert raw.headers["x-pulsegate-backend"] == "vllm-embed"
    assert [d.index for d in got.data] == [0, 1]
    vec = got.data[0].embedding
    assert len(vec) == 128 and math.isclose(sum(x * x for x in vec), 1.0, rel_tol=1e-3)


def test_pooling_and_tokenizer_routes_reach_vllm(gateway: Gateway) -> None:
    """rerank, score, tokenize and detokenize answer in vLLM's own framing."""
    url = gateway.url
    with httpx.Client(timeout=30) as c:
        rr = c.post(
            f"{url}/v1/rerank", json={"model": MODEL, "query": "a", "documents": ["a", "b"]}
        )
        sc = c.post(f"{url}/v1/score", json={"model": MODEL, "text_1": "a", "text_2": ["a", "b"]})
        tk = c.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello"})
        dt = c.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tk.json()["tokens"]})
    for r in (rr, sc, tk, dt):
        assert r.status_code == 200, r.text
    assert len(rr.json()["results"]) == 2 and len(sc.json()["data"]) == 2
    assert tk.json()["count"] >= 5  # one token per character, plus any BOS
    assert "hello" in dt.json()["prompt"]


def test_chat_for_the_embedding_model_is_api_not_served(gateway: Gateway) -> None:
    """The gateway answers 404 `api_not_served` itself; vLLM would have said 404 too, as a
    route it does not have, which the client could not tell from a wrong URL."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == "api_not_served"
