"""The whole OpenAI surface end to end (issue #19): a real gateway, real sims, real clients.

Three full sims (`a`, `b`, `c`: every API, vLLM's default) serve `demo-7b`, a fourth (`gen`)
serves it with `apis: [chat]` only, and a fifth (`emb`) serves the embedding model
`embed-1` with `apis: [embeddings]`. What must hold is seen from outside: each answer's
status and `x-pulsegate-backend`, each sim's own count of the requests that reached it per
path (`/sim/stats` `api_requests`), `/admin/backends` and `/metrics`.

Probes run once at start and then every 20 s, passive ejection is off
(`consecutive_failures` 1000, `eject_below` 0) and errors do not weigh in the score: a
backend answering 500 stays in rotation at full weight, so every API's requests keep
meeting it and must be retried elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from support import Gateway, Sim, wait_until

SIM_ARGS = ("--ttft-ms", "5", "--itl-ms", "1")
SLOW_PROBES = {
    "readiness": {"interval": "20s", "interval_unstable": "20s"},
    "micro_inference": {"interval": "20s", "jitter": "0s"},
    "canary": {"interval": "20s"},
}
# path -> a good body for demo-7b (model added below)
BODIES: dict[str, dict[str, Any]] = {
    "/v1/rerank": {"query": "alpha bravo", "documents": ["red blue", "alpha bravo charlie"]},
    "/rerank": {"query": "alpha", "documents": ["alpha", "zulu"]},
    "/v2/rerank": {"query": "alpha", "documents": ["alpha", "zulu"], "top_n": 1},
    "/v1/score": {"text_1": "alpha", "text_2": ["alpha", "zulu"]},
    "/score": {"text_1": "alpha", "text_2": "bravo"},
    "/tokenize": {"prompt": "alpha bravo charlie"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/v1/embeddings": {"input": ["alpha bravo", "charlie"]},
}
POOLING = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/score", "/score")
TOKENIZER = ("/tokenize", "/detokenize")


class Fleet:
    def __init__(self, tmp: Path) -> None:
        self.sims: dict[str, Sim] = {}
        self.gw: Gateway | None = None
        try:
            for name in ("a", "b", "c", "gen"):
                self.sims[name] = Sim(tmp, name, *SIM_ARGS)
            self.sims["emb"] = Sim(tmp, "emb", *SIM_ARGS, model="embed-1")
            s = self.sims
            backends: list[dict[str, Any]] = [
                {"name": n, "url": s[n].url, "models": ["demo-7b"]} for n in ("a", "b", "c")
            ]
            backends.append(
                {"name": "gen", "url": s["gen"].url, "models": ["demo-7b"], "apis": ["chat"]}
            )
            backends.append(
                {"name": "emb", "url": s["emb"].url, "models": ["embed-1"], "apis": ["embeddings"]}
            )
            self.gw = Gateway(
                tmp,
                {
                    "backends": backends,
                    "probes": SLOW_PROBES,
                    "health": {
                        "consecutive_failures": 1000,
                        "eject_below": 0,
                        "weights": {"error_rate": 0},
                    },
                    "retry": {"per_try_timeout": "2s", "budget_min_per_s": 100},
                },
            )
            self.gw.wait_all_ready(timeout=20)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.gw is not None:
            self.gw.stop()
        for sim in self.sims.values():
            sim.stop()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(tmp_path_factory.mktemp("api-surface"))
    yield f
    f.stop()


def _gw(fleet: Fleet) -> Gateway:
    assert fleet.gw is not None
    return fleet.gw


def _counts(sim: Sim, path: str) -> dict[str, int]:
    return sim.stats()["api_requests"][path]  # type: ignore[no-any-return]


def test_embeddings_with_the_official_client(fleet: Fleet) -> None:
    """`embeddings.create` (base64 on the wire, the client's default) decodes to unit
    vectors, one per input, the same for the same text whichever backend answered."""
    client = openai.OpenAI(base_url=f"{_gw(fleet).url}/v1", api_key="unused", max_retries=0)
    first = client.embeddings.create(model="demo-7b", input=["alpha bravo", "charlie"])
    again = client.embeddings.create(model="demo-7b", input="alpha bravo", user="someone-else")
    assert [d.index for d in first.data] == [0, 1]
    vec = first.data[0].embedding
    assert len(vec) == 64 and math.isclose(sum(x * x for x in vec), 1.0, rel_tol=1e-4)
    assert again.data[0].embedding == pytest.approx(vec, abs=1e-6)
    assert first.usage.prompt_tokens == 3


def test_rerank_score_tokenize_detokenize_answer_in_vllm_framing(fleet: Fleet) -> None:
    """Each route answers vLLM's shape through the gateway, with the gateway's headers."""
    url = _gw(fleet).url
    with httpx.Client(timeout=10) as c:
        rr = c.post(f"{url}/v1/rerank", json={"model": "demo-7b", **BODIES["/v1/rerank"]})
        sc = c.post(f"{url}/score", json={"model": "demo-7b", **BODIES["/v1/score"]})
        tk = c.post(f"{url}/tokenize", json={"model": "demo-7b", **BODIES["/tokenize"]})
        dt = c.post(f"{url}/detokenize", json={"model": "demo-7b", "tokens": tk.json()["tokens"]})
    for r in (rr, sc, tk, dt):
        assert r.status_code == 200, r.text
        assert r.headers["x-pulsegate-backend"] in ("a", "b", "c")
    assert [x["index"] for x in rr.json()["results"]] == [1, 0]  # the shared words rank first
    assert sc.json()["data"][0]["score"] == 1.0
    assert tk.json()["count"] == 3
    assert dt.json()["prompt"] == " alpha bravo charlie"


def test_an_api_no_backend_of_the_model_serves_is_404_api_not_served(fleet: Fleet) -> None:
    """embed-1 is served only by `emb` (embeddings): its rerank is a 404 api_not_served,
    and its Anthropic messages a 404 in Anthropic's shape, through the anthropic client."""
    url = _gw(fleet).url
    r = httpx.post(f"{url}/v1/rerank", json={"model": "embed-1", **BODIES["/v1/rerank"]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "api_not_served"
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        client.messages.create(
            model="embed-1", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "not_found_error"
    assert "messages API" in body["error"]["message"]


def test_a_bad_messages_request_gets_anthropic_error_shape(fleet: Fleet) -> None:
    """A /v1/messages body without messages: a 400 `invalid_request_error` the anthropic
    client raises as BadRequestError; no backend saw it."""
    before = sum(s.stats()["client_requests_total"] for s in fleet.sims.values())
    client = anthropic.Anthropic(base_url=_gw(fleet).url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="demo-7b", max_tokens=5, messages=[])
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "'messages'" in body["error"]["message"]
    assert sum(s.stats()["client_requests_total"] for s in fleet.sims.values()) == before


def test_a_backend_4xx_on_messages_reaches_the_client_in_anthropic_shape(fleet: Fleet) -> None:
    """The sim refuses a numeric `content` with vLLM's OpenAI-shaped 400: the anthropic client
    gets it as Anthropic's `invalid_request_error` with the engine's message, not retried."""
    client = anthropic.Anthropic(base_url=_gw(fleet).url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="demo-7b",
            max_tokens=5,
            messages=[{"role": "user", "content": 5}],  # type: ignore[typeddict-item]
        )
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert "content" in body["error"]["message"]
    assert e.value.response.headers["x-pulsegate-backend"] in ("a", "b", "c")


def test_the_embeddings_only_backend_is_probed_with_embeddings_and_ready(fleet: Fleet) -> None:
    """`apis: [embeddings]`: its micro-inference and canary are embedding calls, it is
    ready, and embed-1's embeddings are served by it."""
    gw, emb = _gw(fleet), fleet.sims["emb"]
    assert gw.backends()["emb"]["state"] == "ready"
    stats = emb.stats()
    probes = stats["api_requests"]["/v1/embeddings"]["probe"]
    assert probes >= 2  # the first micro-inference and canary
    assert stats["probe_requests_total"] == probes  # no probe went to a generation endpoint
    r = httpx.post(f"{gw.url}/v1/embeddings", json={"model": "embed-1", "input": "alpha"})
    assert r.status_code == 200 and r.headers["x-pulsegate-backend"] == "emb"


def _call(c: httpx.Client, url: str, path: str, i: int) -> httpx.Response:
    return c.post(f"{url}{path}", json={"model": "demo-7b", **BODIES[path], "user": f"u{i}"})


def test_every_api_has_zero_client_errors_with_one_backend_failing(fleet: Fleet) -> None:
    """`a` answers 500 to everything: every request of every API still succeeds on `b` or
    `c`, some after a retry, and `a` did meet requests of each API (so each was retried)."""
    gw, a = _gw(fleet), fleet.sims["a"]
    a.fault("error", rate=1.0)
    try:
        paths = (*POOLING, *TOKENIZER)
        before = {p: _counts(a, p)["client"] for p in paths}
        bad: list[tuple[str, int, str]] = []
        retried = 0
        with httpx.Client(timeout=15) as c:
            for path in paths:
                for i in range(12):
                    r = _call(c, gw.url, path, i)
                    if r.status_code != 200:
                        bad.append((path, r.status_code, r.text[:200]))
                        continue
                    assert r.headers["x-pulsegate-backend"] in ("b", "c")
                    retried += r.headers["x-pulsegate-attempts"] != "1"
        oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        for i in range(12):
            got = oai.embeddings.create(model="demo-7b", input="alpha", user=f"s{i}")
            assert len(got.data) == 1
        assert bad == []
        met = {p: _counts(a, p)["client"] - before[p] for p in paths}
        assert retried >= len(paths) and all(n > 0 for n in met.values()), (met, retried)
    finally:
        a.fault("none")


def test_generation_apis_have_zero_client_errors_with_one_backend_failing(fleet: Fleet) -> None:
    """The same for the generation APIs, non-streamed, through the official clients: chat,
    completions, `responses.create` and the anthropic client's `messages.create`."""
    gw, a = _gw(fleet), fleet.sims["a"]
    oai = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
    ant = anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0)
    msgs: Any = [{"role": "user", "content": "hello"}]
    before = a.stats()["client_requests_total"]
    a.fault("error", rate=1.0)
    try:
        for i in range(9):
            chat = oai.chat.completions.create(
                model="demo-7b", messages=msgs, max_tokens=4, user=f"g{i}"
            )
            comp = oai.completions.create(model="demo-7b", prompt="hi", max_tokens=4, user=f"g{i}")
            resp = oai.responses.create(
                model="demo-7b", input="hello", max_output_tokens=4, user=f"g{i}"
            )
            mess = ant.messages.create(
                model="demo-7b", max_tokens=4, messages=msgs, metadata={"user_id": f"g{i}"}
            )
            assert chat.choices[0].message.content and comp.choices[0].text
            assert resp.output_text and mess.content
    finally:
        a.fault("none")
    assert a.stats()["client_requests_total"] > before  # `a` was met, and retried past


def test_requests_never_reach_a_backend_without_their_api(fleet: Fleet) -> None:
    """`gen` serves chat only: after every API's traffic it has seen chat and nothing else."""
    gw, gen = _gw(fleet), fleet.sims["gen"]
    with httpx.Client(timeout=15) as c:
        for path in (*POOLING, *TOKENIZER):
            for i in range(9):
                r = _call(c, gw.url, path, i)
                assert r.status_code == 200 and r.headers["x-pulsegate-backend"] != "gen"
        chat = {"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}]}
        served = {
            c.post(f"{gw.url}/v1/chat/completions", json={**chat, "user": f"c{i}"}).headers[
                "x-pulsegate-backend"
            ]
            for i in range(30)
        }
    counts = gen.stats()["api_requests"]
    assert all(counts[p]["client"] == 0 for p in (*POOLING, *TOKENIZER)), counts
    assert "gen" in served  # it is in rotation, for chat


def test_api_metric_counts_client_requests_by_api(fleet: Fleet) -> None:
    """`pulsegate_api_requests_total{api,code}` counts client requests per API."""
    gw = _gw(fleet)
    httpx.post(f"{gw.url}/tokenize", json={"model": "demo-7b", "prompt": "a b"})

    def line() -> str | None:
        text = httpx.get(f"{gw.url}/metrics").text
        for ln in text.splitlines():
            if ln.startswith('pulsegate_api_requests_total{api="tokenize",code="200"}'):
                return ln
        return None

    assert float(wait_until(line, timeout=5, what="the api metric").split()[-1]) >= 1
