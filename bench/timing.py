"""Timing helpers shared by the in-process micro-benchmarks (run as `python bench/X.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def ns_per_call(fn: Callable[[], object], calls: int) -> float:
    """Thread CPU nanoseconds per call of `fn`, after 1,000 warm-up calls."""
    for _ in range(1000):
        fn()
    t0 = time.thread_time_ns()
    for _ in range(calls):
        fn()
    return (time.thread_time_ns() - t0) / calls
