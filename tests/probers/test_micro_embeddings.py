"""An embedding-only backend (`apis: [embeddings]`) gets real micro-inference and canary
probes, as embedding calls, against the sim's `/v1/embeddings`."""

from __future__ import annotations

import time

from probe_kit import SimControl, running_prober

from pulsegate.health.observations import ProbeKind
from pulsegate.probers.http import Reply
from pulsegate.probers.micro import _judge
from pulsegate.probers.payload import Api

M, C = ProbeKind.MICRO, ProbeKind.CANARY


async def test_embedding_backend_is_probed_on_embeddings(sim: SimControl) -> None:
    """Micro-inference and canary both pass, every probe went to /v1/embeddings."""
    before = await sim.stats()
    async with running_prober([sim.backend(apis=("embeddings",))]) as (_, rec):
        micro = await rec.wait_for(M, lambda r: True)
        canary = await rec.wait_for(C, lambda r: True)
        await rec.wait_for(M, lambda r: True, since=time.monotonic())
    assert (micro.ok, micro.reason) == (True, "")
    assert (canary.ok, canary.reason) == (True, "")
    after = await sim.stats()
    emb = after["api_requests"]["/v1/embeddings"]["probe"]
    emb -= before["api_requests"]["/v1/embeddings"]["probe"]
    assert emb >= 3
    assert after["probe_requests_total"] - before["probe_requests_total"] == emb


async def test_embedding_probe_fails_on_the_engine_error(sim: SimControl) -> None:
    """An OOM embedder's 500 fails the micro-inference with the engine's own message."""
    await sim.fault("oom")
    async with running_prober([sim.backend(apis=("embeddings",))]) as (_, rec):
        r = await rec.wait_for(M, lambda r: True)
    assert not r.ok and r.reason.startswith("HTTP 500: CUDA out of memory")


def test_an_embedding_answer_without_data_is_not_healthy() -> None:
    """2xx is not enough: the answer must hold a list of embeddings (`data`)."""
    good = Reply(200, 0.01, b'{"object": "list", "data": [{"embedding": [0.1]}]}')
    chat = Reply(200, 0.01, b'{"choices": []}')
    ok = _judge(M, good, Api.EMBEDDINGS)
    bad = _judge(M, chat, Api.EMBEDDINGS)
    assert ok is not None and ok.ok
    assert bad is not None and not bad.ok and bad.reason == "bad response: not embeddings"
