"""The agent's door: the shared token (none, wrong, right), one micro-inference per stream,
its timeout clipped to the agent's own, the cap on concurrent streams, a flood on one stream
that neither grows the agent nor delays another stream's pongs, and the engine probed on a
pool of its own. Every agent is a real `pulsegate agent` process, talked to with grpcio."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import grpc
import pytest
from engine_stub import engine_stub

from pulsegate.agent.wire import heartbeat_stub, pb
from support import Proc

TOKEN = "s3cret-agent-token-0123456789"
ENV = {"PG_AGENT_TOKEN": TOKEN}
TOKEN_ARGS = ("--token-env", "PG_AGENT_TOKEN", "--gpu", "none")
Stream = Any


@asynccontextmanager
async def stream(agent: Proc, token: str | None = TOKEN) -> AsyncIterator[Stream]:
    """A grpcio heartbeat call to `agent` presenting `token` (None: no metadata)."""
    md = (("authorization", f"Bearer {token}"),) if token is not None else None
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}")
    call = heartbeat_stub(channel).Stream(metadata=md)
    try:
        yield call
    finally:
        call.cancel()
        await channel.close()


async def ping(call: Stream, seq: int, **kw: Any) -> Any:
    await call.write(pb.Ping(seq=seq, send_ns=time.monotonic_ns(), **kw))


async def refused_with(call: Stream) -> grpc.StatusCode:
    """Read: the call must end with an error and no pong. Nothing is written first: the agent
    refuses the stream as it opens, and a write racing with that refusal is reported by
    grpcio as INTERNAL (the stream reset), not with the agent's own status."""
    try:
        got = await asyncio.wait_for(call.read(), timeout=3.0)
    except grpc.aio.AioRpcError as e:
        code: grpc.StatusCode = e.code()
        return code
    raise AssertionError(f"a refused stream answered: {got}")


# -- the token -------------------------------------------------------------------------------


@pytest.mark.parametrize("token", [None, "wrong-token", TOKEN + "x", ""])
async def test_stream_without_the_right_token_is_refused(
    start_agent: Callable[..., Proc], token: str | None
) -> None:
    """No token, a wrong one, a longer one or an empty one: UNAUTHENTICATED, no pong sent."""
    async with engine_stub() as engine:
        agent = await asyncio.to_thread(start_agent, engine.url, *TOKEN_ARGS, env=ENV)
        async with stream(agent, token) as call:
            assert await refused_with(call) == grpc.StatusCode.UNAUTHENTICATED
        async with stream(agent) as call:  # the agent is still fine for the right one
            await ping(call, 5)
            pong = await asyncio.wait_for(call.read(), timeout=3.0)
            assert pong.seq == 5
    log = agent.log_path.read_text()
    assert "missing or wrong token" in log and TOKEN not in log


async def test_right_token_gets_pongs(start_agent: Callable[..., Proc]) -> None:
    """With the right token in the metadata the stream is served as before."""
    async with engine_stub() as engine:
        agent = await asyncio.to_thread(start_agent, engine.url, *TOKEN_ARGS, env=ENV)
        async with stream(agent) as call:
            for seq in (1, 2, 3):
                await ping(call, seq)
                assert (await asyncio.wait_for(call.read(), timeout=3.0)).seq == seq


def test_token_env_that_is_not_set_stops_the_agent(tmp_path: Path) -> None:
    """--token-env naming an unset variable exits 2 naming the variable (never runs open)."""
    env = {k: v for k, v in os.environ.items() if k != "PG_UNSET_TOKEN"}
    argv = ["--engine", "http://127.0.0.1:9", "--listen", "127.0.0.1:0", "--gpu", "none"]
    r = subprocess.run(
        [sys.executable, "-m", "pulsegate", "agent", *argv, "--token-env", "PG_UNSET_TOKEN"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert r.returncode == 2 and "PG_UNSET_TOKEN" in r.stderr


# -- micro-inference limits ------------------------------------------------------------------


async def test_second_micro_inference_while_one_runs_is_busy_at_once(
    start_agent: Callable[..., Proc],
) -> None:
    """A micro-inference request while one is in flight is answered busy at once, not queued."""
    async with engine_stub(completion_delay_s=1.0) as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--model", "m1", *TOKEN_ARGS, env=ENV
        )
        async with stream(agent) as call:
            await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            await ping(call, 2, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            busy = await asyncio.wait_for(call.read(), timeout=2.0)
            # The first answer is the second ping's, busy: not queued behind the first (1 s).
            assert busy.seq == 2 and busy.busy and not busy.ok
            done = await asyncio.wait_for(call.read(), timeout=3.0)
            assert done.seq == 1 and done.ok and not done.busy
            # once it is done, the next one runs
            await ping(call, 3, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            again = await asyncio.wait_for(call.read(), timeout=3.0)
            assert again.seq == 3 and again.ok
        assert len(engine.calls("/v1/completions")) == 2


async def test_an_embedding_engine_is_probed_with_an_embedding(
    start_agent: Callable[..., Proc],
) -> None:
    """`--api embeddings`: an engine serving only embeddings gets its micro-inference as a
    one-input embedding call (completions and chat would be 404: a false failure)."""
    async with engine_stub(embeddings=True) as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--model", "m1", "--api", "embeddings", *TOKEN_ARGS, env=ENV
        )
        async with stream(agent) as call:
            await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            done = await asyncio.wait_for(call.read(), timeout=3.0)
            assert done.seq == 1 and done.ok, done
        ((_, body),) = engine.calls("/v1/embeddings")
        assert body == {"model": "m1", "input": "ping"}
        assert not engine.calls("/v1/completions") and not engine.calls("/v1/chat/completions")


async def test_callers_micro_timeout_is_clipped_to_the_agents(
    start_agent: Callable[..., Proc],
) -> None:
    """timeout_ms of a minute against --micro-timeout 0.3: the answer is a timeout at ~0.3 s."""
    async with engine_stub(completion_delay_s=5.0) as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--model", "m1", "--micro-timeout", "0.3", *TOKEN_ARGS, env=ENV
        )
        async with stream(agent) as call:
            t0 = time.monotonic()
            await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=60_000)
            pong = await asyncio.wait_for(call.read(), timeout=3.0)
            assert pong.seq == 1 and not pong.ok and "timeout" in pong.error
            assert time.monotonic() - t0 < 1.5


# -- the stream cap --------------------------------------------------------------------------


async def test_streams_beyond_the_cap_are_refused(start_agent: Callable[..., Proc]) -> None:
    """--max-streams 2: a third stream gets RESOURCE_EXHAUSTED; once one closes, a new one is
    served."""
    async with engine_stub() as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--max-streams", "2", *TOKEN_ARGS, env=ENV
        )
        async with stream(agent) as a, stream(agent) as b:
            for call in (a, b):
                await ping(call, 1)
                assert (await asyncio.wait_for(call.read(), timeout=3.0)).seq == 1
            async with stream(agent) as c:
                assert await refused_with(c) == grpc.StatusCode.RESOURCE_EXHAUSTED
            await a.done_writing()  # a ends; its slot frees when the agent sees the end
            assert await asyncio.wait_for(a.read(), timeout=3.0) is grpc.aio.EOF
            deadline = time.monotonic() + 5.0
            while True:
                async with stream(agent) as d:
                    code = None
                    try:
                        await ping(d, 9)
                        if (await asyncio.wait_for(d.read(), timeout=3.0)).seq == 9:
                            break
                    except grpc.aio.AioRpcError as e:
                        code = e.code()
                    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the closed stream's slot never freed"
                await asyncio.sleep(0.05)  # poll interval, the loop ends on the state


# -- a flood ---------------------------------------------------------------------------------


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_micro_flood_on_one_stream_neither_grows_the_agent_nor_delays_pongs(
    start_agent: Callable[..., Proc],
) -> None:
    """1,000 micro-inference requests a second for 3 s on one stream (another process): the
    agent's memory grows by under 15 MB and another stream's pongs stay under 80 ms."""
    async with engine_stub(completion_delay_s=0.5) as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--model", "m1", *TOKEN_ARGS, env=ENV
        )
        async with stream(agent) as call:
            for seq in range(1, 21):  # warm both sides up before measuring the baseline
                await ping(call, seq)
                await asyncio.wait_for(call.read(), timeout=3.0)
            before = rss_mb(agent.pid)
            flood = await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).with_name("flood.py")),
                str(agent.port),
                TOKEN,
                "1000",
                "3",
                stdout=asyncio.subprocess.PIPE,
            )
            rtts: list[float] = []
            peak = before
            seq = 100
            while flood.returncode is None:
                seq += 1
                t0 = time.monotonic()
                await ping(call, seq)
                pong = await asyncio.wait_for(call.read(), timeout=3.0)
                assert pong.seq == seq
                rtts.append(time.monotonic() - t0)
                peak = max(peak, rss_mb(agent.pid))
                try:
                    await asyncio.wait_for(asyncio.shield(flood.wait()), timeout=0.02)
                except TimeoutError:
                    pass
            out = (await flood.communicate())[0].decode()
        assert flood.returncode == 0, out
        counts = dict(kv.split("=") for kv in out.split())
        sent, busy = int(counts["sent"]), int(counts["busy"])
        assert sent >= 2500 and busy >= sent - 10, out  # each one busy at once, not queued
        # at most one engine call at a time: 3 s of 0.5 s completions
        assert len(engine.calls("/v1/completions")) <= 8
    assert len(rtts) >= 50
    assert max(rtts) < 0.08, sorted(rtts)[-5:]
    assert peak - before < 15, (before, peak)


# -- the engine probed on its own pool -------------------------------------------------------


async def test_engine_health_is_read_while_micro_inferences_hold_connections(
    start_agent: Callable[..., Proc],
) -> None:
    """Six streams each waiting on a slow micro-inference (more than the pool's 4
    connections): an engine turning unready still shows in pongs within a second, as a 503,
    never as unreachable."""
    async with engine_stub(completion_delay_s=3.0) as engine:
        agent = await asyncio.to_thread(
            start_agent, engine.url, "--model", "m1", *TOKEN_ARGS, env=ENV
        )
        async with (
            stream(agent) as s1,
            stream(agent) as s2,
            stream(agent) as s3,
            stream(agent) as s4,
            stream(agent) as s5,
            stream(agent) as s6,
        ):
            calls = (s1, s2, s3, s4, s5, s6)
            for call in calls:
                await ping(call, 1, kind=pb.Ping.MICRO_INFERENCE, timeout_ms=2000)
            deadline = time.monotonic() + 3.0
            while len(engine.calls("/v1/completions")) < 4:  # the micro pool is full
                assert time.monotonic() < deadline, "micro-inferences never reached the engine"
                await asyncio.sleep(0.01)
            engine.health_status = 503
            t0 = time.monotonic()
            seq = 10
            while True:
                seq += 1
                await ping(s1, seq)
                pong = await asyncio.wait_for(s1.read(), timeout=3.0)
                if pong.kind == pb.Ping.MICRO_INFERENCE:
                    continue
                assert not pong.engine_unreachable, pong.engine_status
                if not pong.engine_ready:
                    assert "503" in pong.engine_status
                    break
                assert time.monotonic() - t0 < 1.0, "the engine's /health waited behind pings"
                await asyncio.sleep(0.02)  # poll interval, the loop ends on the state
