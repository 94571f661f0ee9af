"""Tests of the gateway's own stalls run on uvloop, the gateway's loop: it runs due timers
before it reads sockets, so a plain deadline that passed during a stall always beats the
answer that came meanwhile (the asyncio loop reads sockets first)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Any]:
    return {"uvloop": uvloop.new_event_loop}
