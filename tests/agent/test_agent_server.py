"""The agent as a process: pongs from a real engine's figures, micro-inference inside the
stream, the standard gRPC health service, unknown facts when there is no source, options
and shutdown. Every agent is a real `pulsegate agent` process, talked to with grpcio."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from engine_stub import engine_stub
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pulsegate.agent.wire import SERVICE_NAME, facts_from_pong, heartbeat_stub, pb
from support import Proc, Sim, wait_until

Stream = Any  # a grpc.aio StreamStreamCall


@asynccontextmanager
async def heartbeat(agent: Proc) -> AsyncIterator[tuple[grpc.aio.Channel, Stream]]:
    """A real grpcio channel and heartbeat call to `agent`, closed afterwards."""
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}")
    call = heartbeat_stub(channel).Stream()
    try:
        yield channel, call
    finally:
        call.cancel()
        await channel.close()


async def ping(call: Stream, seq: int, **kw: Any) -> None:
    await call.write(pb.Ping(seq=seq, send_ns=time.monotonic_ns(), **kw))


async def pong_where(
    call: Stream, pred: Callable[[Any], bool], *, within: float = 5.0, seq0: int = 1000
) -> Any:
    """Ping until a pong satisfies `pred` (the agent's snapshot refreshes in the
    background); fail after `within` seconds."""
    deadline = time.monotonic() + within
    seq = seq0
    last = None
    while time.monotonic() < deadline:
        seq += 1
        await ping(call, seq)
        last = await asyncio.wait_for(call.read(), timeout=2.0)
        if pred(last):
            return last
        await asyncio.sleep(0.05)  # poll interval, not a settle: the loop ends on the state
    raise AssertionError(f"no pong matched within {within}s; last: {last}")


async def health_status(channel: grpc.aio.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
    return int(reply.status)


async def test_pong_echoes_and_reports_the_engines_figures(
    start_sim: Callable[..., Sim], start_agent: Callable[..., Proc]
) -> None:
    """A pong echoes the ping's timestamp and carries the sim's vLLM and DCGM figures."""
    sim = start_sim("eng")
    agent = start_agent(sim.url)
    async with heartbeat(agent) as (_, call):
        sent = time.monotonic_ns()
        await call.write(pb.Ping(seq=7, send_ns=sent))
        pong = await asyncio.wait_for(call.read(), timeout=2.0)
        assert pong.seq == 7 and pong.echo_send_ns == sent
        assert 0 < pong.agent_processing_ns < 5_000_000
        assert pong.engine_ready and pong.engine_dialect == "vllm"
        assert pong.gpu_source == "engine"
        facts = facts_from_pong(pong)
        # The sim's idle 80 GiB card (see pulsegate.sim.gpu): 14336 MiB used, 34 C, 0 %.
        assert facts.gpu_total_mb == 81920 and facts.gpu_used_mb == 14336
        assert facts.gpu_free_ratio == pytest.approx(67584 / 81920)
        assert facts.gpu_temp_c == 34 and facts.gpu_util == 0
        assert facts.queue_waiting == 0 and facts.running == 0 and facts.kv_cache_usage == 0
        assert facts.capacity == 32
        assert facts.source == "agent:engine"


async def test_engine_not_ready_shows_in_pong_and_health_service(
    start_sim: Callable[..., Sim], start_agent: Callable[..., Proc]
) -> None:
    """A warming engine (GET /health 503) reads as not ready, in pongs and gRPC health."""
    sim = start_sim("warm")
    agent = start_agent(sim.url)
    async with heartbeat(agent) as (channel, call):
        assert await health_status(channel, "") == health_pb2.HealthCheckResponse.SERVING
        assert await health_status(channel, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
        assert await health_status(channel, "engine") == health_pb2.HealthCheckResponse.SERVING
        await asyncio.to_thread(sim.fault, "warming", seconds=30)
        pong = await pong_where(call, lambda p: p.HasField("engine_ready") and not p.engine_ready)
        assert "503" in pong.engine_status and not pong.engine_unreachable
        assert await health_status(channel, "engine") == health_pb2.HealthCheckResponse.NOT_SERVING
        await asyncio.to_thread(sim.fault, "none")
        await pong_where(call, lambda p: p.engine_ready)


async def test_facts_unknown_without_any_source(start_agent: Callable[..., Proc]) -> None:
    """No /metrics and --gpu none: every fact is unset (unknown), never 0."""
    async with engine_stub() as engine:
        agent = await asyncio.to_thread(start_agent, engine.url, "--gpu", "none")
        async with heartbeat(agent) as (_, call):
            pong = await pong_where(call, lambda p: p.HasField("engine_ready"))
            assert pong.engine_ready
            for f in (
                "gpu_free_ratio",
                "gpu_used_mb",
                "gpu_total_mb",
                "gpu_temp_c",
                "gpu_util",
                "queue_waiting",
                "running",
                "kv_cache_usage",
                "prefix_cache_hit_rate",
                "capacity",
            ):
                assert not pong.HasField(f), f
            assert pong.gpu_source == "" and pong.engine_dialect == ""
            facts = facts_from_pong(pong)
            assert facts.gpu_free_ratio is None and facts.queue_waiting is None


async def test_gpu_none_ignores_the_engines_gpu_gauges(
    start_sim: Callable[..., Sim], start_agent: Callable[..., Proc]
) -> None:
    """--gpu none reports no GPU figures even when the engine publishes DCGM gauges."""
    sim = start_sim("nogpu")
    agent = start_agent(sim.url, "--gpu", "none")
    async with heartbeat(agent) as (_, call):
        pong = await pong_where(call, lambda p: p.HasField("queue_waiting"))
        assert not pong.HasField("gpu_total_mb") and pong.gpu_source == ""


async def test_dcgm_exporter_url_is_the_gpu_source(start_agent: Callable[..., Proc]) -> None:
    """--gpu dcgm=URL reads GPU figures from that exporter, engine figures from the engine."""
    dcgm_page = (
        'DCGM_FI_DEV_FB_FREE{gpu="0"} 1000\nDCGM_FI_DEV_FB_USED{gpu="0"} 3000\n'
        'DCGM_FI_DEV_GPU_TEMP{gpu="0"} 61\nDCGM_FI_DEV_GPU_UTIL{gpu="0"} 75\n'
    )
    async with (
        engine_stub(metrics="sglang:num_queue_reqs 4\nsglang:num_running_reqs 2\n") as engine,
        engine_stub(metrics=dcgm_page) as dcgm,
    ):
        agent = await asyncio.to_thread(start_agent, engine.url, "--gpu", f"dcgm={dcgm.url}")
        async with heartbeat(agent) as (_, call):
            pong = await pong_where(call, lambda p: p.HasField("gpu_total_mb"))
            assert pong.gpu_source == "dcgm" and pong.engine_dialect == "sglang"
            assert pong.gpu_total_mb == 4000 and pong.gpu_free_ratio == 0.25
            assert pong.gpu_temp_c == 61 and pong.gpu_util == 0.75
            assert pong.queue_waiting == 4 and pong.running == 2


async def test_gpu_faults_come_from_the_engines_page_read_once_per_refresh(
    start_sim: Callable[..., Sim], start_agent: Callable[..., Proc]
) -> None:
    """--gpu engine without NVML: the fault fields (an Xid here) come from the engine's own
    /metrics, the page the agent already reads for the engine's figures. One refresh reads
    it once, as it reads /health once: watching an engine must not double its scrapes."""
    sim = start_sim("faults")
    agent = start_agent(sim.url, "--gpu", "engine")
    sim.fault("xid", code=79)
    async with heartbeat(agent) as (_, call):
        pong = await pong_where(
            call, lambda p: getattr(facts_from_pong(p).gpu_faults, "xid", None) == 79
        )
        assert pong.gpu_source == "engine"

    def scrapes() -> dict[str, int]:
        got: dict[str, int] = sim.stats()["scrapes"]
        return got

    # Nothing else reads this sim: every GET of /health and /metrics is the agent's.
    seen = wait_until(lambda: (c := scrapes())["health"] >= 20 and c, timeout=20)
    assert abs(seen["metrics"] - seen["health"]) <= 2, seen  # one refresh may be mid-way


async def test_micro_inference_runs_while_pings_are_answered(
    start_agent: Callable[..., Proc],
) -> None:
    """A micro-inference ping gets its result later; pings sent meanwhile are answered first."""
    async with engine_stub(completion_delay_s=0.4) as engine:
        agent = await asyncio.to_thread(start_agent, engine.url, "--model", "m1")
        async with heartbeat(agent) as (_, call):
            t0 = time.monotonic()
            await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=3000)
            await ping(call, 2)
            first = await asyncio.wait_for(call.read(), timeout=2.0)
            assert first.seq == 2 and time.monotonic() - t0 < 0.3
            second = await asyncio.wait_for(call.read(), timeout=3.0)
            assert second.seq == 1 and second.kind == pb.Ping.MICRO_INFERENCE
            assert second.ok and second.error == ""
            assert 0.4 <= second.latency_ms / 1e3 < 2.0
        (headers, body), *_ = engine.calls("/v1/completions")
        assert headers["x-pulsegate-probe"] == "micro"
        assert body["model"] == "m1" and body["max_tokens"] == 1


async def test_micro_inference_reports_engine_failure_and_timeout(
    start_agent: Callable[..., Proc],
) -> None:
    """An engine 500 and an engine slower than the ping's timeout both come back not ok."""
    async with engine_stub(completion_status=500) as engine:
        agent = await asyncio.to_thread(start_agent, engine.url)
        async with heartbeat(agent) as (_, call):
            await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            pong = await asyncio.wait_for(call.read(), timeout=3.0)
            assert not pong.ok and "500" in pong.error
            # the model came from /v1/models, since no --model was given
            assert engine.calls("/v1/completions")[0][1]["model"] == "stub-model"
            engine.completion_status, engine.completion_delay_s = 200, 1.0
            await ping(call, 2, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=300)
            pong = await asyncio.wait_for(call.read(), timeout=3.0)
            assert pong.seq == 2 and not pong.ok and "timeout" in pong.error


def test_sigterm_stops_the_agent_cleanly(
    start_sim: Callable[..., Sim], start_agent: Callable[..., Proc]
) -> None:
    """SIGTERM: the agent shuts down gracefully and exits 0."""
    agent = start_agent(start_sim("term").url)
    agent.signal(signal.SIGTERM)
    assert agent.popen.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--gpu", "bogus"], 2, "--gpu must be"),
        (["--gpu", "dcgm=ftp://x"], 2, "must start with http"),
        (["--engine", "localhost:8000"], 2, "--engine must start with http"),
        (["--listen", "256.0.0.1:1"], 1, "cannot listen"),
    ],
)
def test_bad_options_exit_with_a_message(args: list[str], code: int, message: str) -> None:
    """Bad options exit non-zero at once and say what is wrong."""
    base = {"--engine": "http://127.0.0.1:9", "--listen": "127.0.0.1:0", "--gpu": "none"}
    for i in range(0, len(args), 2):
        base[args[i]] = args[i + 1]
    argv = [x for kv in base.items() for x in kv]
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "agent", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == code, r.stderr
    assert message in r.stderr


def test_explicit_nvml_without_a_gpu_fails_clearly() -> None:
    """--gpu nvml where NVML cannot work exits 1 naming the reason (never fake figures)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVML")
    except Exception:
        pass
    argv = ["--engine", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--gpu", "nvml"]
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "agent", *argv],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 1
    assert "NVML" in r.stderr or "nvidia-ml-py" in r.stderr


def test_listening_line_names_the_real_port(start_agent: Callable[..., Proc]) -> None:
    """With port 0 the agent prints the port it really bound, and it accepts there."""
    agent = start_agent("http://127.0.0.1:9", "--gpu", "none")
    assert agent.port > 0

    async def check() -> int:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
            return await health_status(ch, "")

    assert wait_until(lambda: asyncio.run(check()) == 1, timeout=5, what="health SERVING")
