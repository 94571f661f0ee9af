"""Fixtures for the health core tests (the harness lives in harness.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .harness import Harness


@pytest.fixture
def make() -> Callable[..., Harness]:
    """Factory for a Harness (keyword arguments as Harness)."""
    return Harness


@pytest.fixture
def ready3() -> Harness:
    """Three ready backends a, b, c serving model m, with 30 s of healthy traffic behind them."""
    h = Harness()
    h.make_ready()
    h.run(30.0, h.healthy_traffic())
    return h
