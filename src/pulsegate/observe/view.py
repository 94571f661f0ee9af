"""What the admin API and the dashboard read of a gateway process.

A single-process `Gateway` and a multi-process gateway's primary both offer it: the health
service, the proxy side's metrics (the workers' sums in a primary), the in-flight counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pulsegate.config import Config
from pulsegate.control.service import HealthService
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.metrics import ProxyMetrics


class GatewayView(Protocol):
    config: Config
    registry: Registry
    proxy_metrics: ProxyMetrics
    health: HealthService

    @property
    def inflight(self) -> Mapping[str, int]: ...

    def names(self) -> Sequence[str]: ...

    def backend_view(self, name: str) -> dict[str, Any]: ...
