"""Configuration: YAML in, frozen typed objects out, every error named by its key path.

`load_config(path)` reads a file; `parse_config(data)` validates an already-parsed mapping.
Both raise `ConfigError` carrying *every* problem found (not just the first), each as
``"backends[1].url: must start with http:// or https://"``. Unknown keys are errors too:
a typo such as ``eject_bellow`` must not silently fall back to a default.

Durations are written ``"100ms"``, ``"3s"``, ``"2m"`` or as a bare number of seconds.
Nothing here touches the network or the clock; the core may import these types.

Modules, one concept each; `loader` imports `values` and `validate`, and all three import
`schema`, which imports nothing of pulsegate:

- `schema`: the frozen dataclasses, one per YAML section, with their defaults.
- `values`: scalar converters (durations, numbers, names, URLs, HOST:PORT, limits).
- `loader`: walks the document, names each problem by its key path, raises `ConfigError`.
- `validate`: cross-key checks (timeouts against intervals, hysteresis, duplicate names).
- `agent_tls`: the files of a backend's `agent_tls`, checked at load (`agent.tls`).
- `apis`: the APIs each engine kind serves (`backends[].apis` defaults by `engine`).
"""

from pulsegate.config.loader import ConfigError, load_config, parse_config
from pulsegate.config.schema import (
    MAX_INFLIGHT_AUTO,
    AgentTlsConfig,
    AlertsConfig,
    AuthConfig,
    BackendConfig,
    CanaryConfig,
    Config,
    GatewayConfig,
    HealthConfig,
    HeartbeatConfig,
    KeyConfig,
    MicroInferenceConfig,
    ObservabilityConfig,
    ProbationConfig,
    ProbesConfig,
    ReadinessConfig,
    RetryConfig,
    RoutingConfig,
    StreamingConfig,
    WeightsConfig,
)
from pulsegate.config.values import parse_duration

__all__ = [
    "MAX_INFLIGHT_AUTO",
    "AgentTlsConfig",
    "AlertsConfig",
    "AuthConfig",
    "BackendConfig",
    "CanaryConfig",
    "Config",
    "ConfigError",
    "GatewayConfig",
    "HealthConfig",
    "HeartbeatConfig",
    "KeyConfig",
    "MicroInferenceConfig",
    "ObservabilityConfig",
    "ProbationConfig",
    "ProbesConfig",
    "ReadinessConfig",
    "RetryConfig",
    "RoutingConfig",
    "StreamingConfig",
    "WeightsConfig",
    "load_config",
    "parse_config",
    "parse_duration",
]
