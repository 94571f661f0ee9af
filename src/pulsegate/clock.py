"""The one place that reads the real clock. Everything else takes `now` as an argument."""

from __future__ import annotations

import time

monotonic = time.monotonic
wall = time.time
