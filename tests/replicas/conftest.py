"""The replicas' fixtures: a real redis-server on loopback, stopped by its PID."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from replicas.redis_server import REDIS, RedisServer, free_port


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if REDIS is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    server = RedisServer(free_port(), tmp_path / "redis.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
