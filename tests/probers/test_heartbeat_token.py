"""The gateway's heartbeat client against a token-guarded agent process: the right token gets
heartbeats, a wrong or missing one only misses; the token stays out of reprs; and the
backend's `agent_token_env` key as the loader reads it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from pathlib import Path

import pytest

from pulsegate.clock import SystemClock
from pulsegate.config import ConfigError, HeartbeatConfig, MicroInferenceConfig, parse_config
from pulsegate.health.observations import Heartbeat, Observation
from pulsegate.probers.heartbeat import HeartbeatClient
from support import Proc, Sim

HB = HeartbeatConfig(interval=0.1, timeout=0.08, misses_to_dead=3)
NO_MICRO = MicroInferenceConfig(interval=3600.0, jitter=0.0, timeout=2.0)
TOKEN = "hb-token-9f8e7d6c5b4a"
TOKEN_ARGS = ("--token-env", "PG_HB_TOKEN")


@pytest.fixture
def guarded_agent(start_sim: object, tmp_path: Path, procs: list[Proc]) -> Proc:
    sim: Sim = start_sim("tok")  # type: ignore[operator]
    agent = Proc(
        ["agent", "--engine", sim.url, "--listen", "127.0.0.1:0", "--gpu", "engine", *TOKEN_ARGS],
        tmp_path / "agent.log",
        env={"PG_HB_TOKEN": TOKEN},
    )
    procs.append(agent)
    return agent


async def beats_for(agent: Proc, token: str | None, seconds: float) -> list[Heartbeat]:
    """Run a HeartbeatClient presenting `token` for `seconds`; its heartbeats and misses."""
    seen: list[Heartbeat] = []
    enough = asyncio.Event()

    def emit(_: str, obs: Observation) -> None:
        if isinstance(obs, Heartbeat):
            seen.append(obs)
            if token == TOKEN and len(seen) >= 5:
                enough.set()

    clock = SystemClock(asyncio.get_running_loop())
    client = HeartbeatClient(
        "a",
        f"127.0.0.1:{agent.port}",
        HB,
        NO_MICRO,
        emit,
        rng=random.Random(3),
        clock=clock,
        token=token,
    )
    assert TOKEN not in repr(client)
    task = asyncio.create_task(client.run())
    with contextlib.suppress(TimeoutError):  # the right token: 5 beats; else watch `seconds`
        await asyncio.wait_for(enough.wait(), timeout=seconds)
    await client.close()
    await task
    clock.close()
    return seen


async def test_right_token_gets_heartbeats(guarded_agent: Proc) -> None:
    """A client presenting the agent's token gets pongs in time (heartbeats with an RTT)."""
    seen = await beats_for(guarded_agent, TOKEN, 5.0)
    ok = [hb for hb in seen if hb.rtt_s is not None]
    assert len(ok) >= 5, seen


@pytest.mark.parametrize("token", [None, "not-the-token"])
async def test_wrong_or_no_token_only_misses(guarded_agent: Proc, token: str | None) -> None:
    """Without the token, or with a wrong one, every stream is refused: misses, no pong."""
    seen = await beats_for(guarded_agent, token, 1.0)
    assert seen and all(hb.rtt_s is None for hb in seen), seen
    log = guarded_agent.log_path.read_text()
    assert "missing or wrong token" in log and TOKEN not in log


def test_agent_token_env_is_read_per_backend() -> None:
    """`agent_token_env` is an environment variable name, and only with an `agent`."""
    b = {"name": "a", "url": "http://127.0.0.1:9001", "agent": "127.0.0.1:50051"}
    cfg = parse_config({"backends": [{**b, "agent_token_env": "PG_AGENT_TOKEN"}]})
    assert cfg.backends[0].agent_token_env == "PG_AGENT_TOKEN"
    assert parse_config({"backends": [b]}).backends[0].agent_token_env is None
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [{**b, "agent_token_env": "not a name"}]})
    assert any(
        e.startswith("backends[0].agent_token_env: must be an environment") for e in ei.value.errors
    )
    no_agent = {"name": "a", "url": "http://127.0.0.1:9001", "agent_token_env": "PG_T"}
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [no_agent]})
    assert ei.value.errors == [
        "backends[0].agent_token_env: needs an agent (this backend has no `agent` key)"
    ]
