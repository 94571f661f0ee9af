"""Fixtures of the endpoint picker's pure tests."""

from __future__ import annotations

import pytest
from pick_support import URLS, Setup, verdict


@pytest.fixture
def setup() -> Setup:
    return Setup([verdict(n) for n in URLS])
