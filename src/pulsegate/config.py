"""Configuration: YAML in, frozen typed objects out, every error named by its key path.

`load_config(path)` reads a file; `parse_config(data)` validates an already-parsed mapping.
Both raise `ConfigError` carrying *every* problem found (not just the first), each as
``"backends[1].url: must start with http:// or https://"``. Unknown keys are errors too:
a typo such as ``eject_bellow`` must not silently fall back to a default.

Durations are written ``"100ms"``, ``"3s"``, ``"2m"`` or as a bare number of seconds.
Nothing here touches the network or the clock; the core may import these types.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(Exception):
    """A configuration that cannot be used; `errors` lists each problem with its key path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in errors))


# ---------------------------------------------------------------------------------------------
# Typed, frozen configuration objects


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    models: tuple[str, ...] = ()
    zone: str = ""
    region: str = ""
    weight: float = 1.0
    agent: str | None = None
    metrics_path: str | None = None
    api_key_env: str | None = None
    # Most concurrent client requests the gateway sends this backend (0: no limit;
    # MAX_INFLIGHT_AUTO, written `auto`: the engine's batch capacity once known).
    max_inflight: int = 0
    # How a broken stream is continued on this engine: "vllm" (continue_final_message) or "none".
    resume: str = "vllm"
    # Most choices (`n`) the engine really answers; 0: no limit. transformers serve ignores
    # `n` and answers one choice: `max_n: 1` routes `n > 1` elsewhere (or refuses it, 400).
    max_n: int = 0


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    admin_token_env: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    workers: int = 1
    # Plain, stateless `/health` polling and round-robin: the chaos lab's baselines.
    mode: str = "pulsegate"


@dataclass(frozen=True, slots=True)
class HeartbeatConfig:
    interval: float = 0.1
    timeout: float = 0.08
    misses_to_dead: int = 3


@dataclass(frozen=True, slots=True)
class ReadinessConfig:
    interval: float = 10.0
    interval_unstable: float = 2.0
    timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class MicroInferenceConfig:
    interval: float = 3.0
    jitter: float = 2.0
    timeout: float = 2.0
    failures_to_eject: int = 2


@dataclass(frozen=True, slots=True)
class CanaryConfig:
    interval: float = 2.0
    payload_bytes: int = 6144
    timeout: float = 0.35
    failures_to_isolate: int = 2


@dataclass(frozen=True, slots=True)
class ProbesConfig:
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    readiness: ReadinessConfig = field(default_factory=ReadinessConfig)
    micro_inference: MicroInferenceConfig = field(default_factory=MicroInferenceConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    # Engine Prometheus scrape (queue, KV cache, GPU gauges); only for backends with metrics_path.
    metrics_interval: float = 1.0


@dataclass(frozen=True, slots=True)
class WeightsConfig:
    latency: float = 0.3
    error_rate: float = 0.3
    queue: float = 0.2
    gpu_free: float = 0.2


@dataclass(frozen=True, slots=True)
class ProbationConfig:
    duration: float = 60.0
    ramp_step: float = 0.01


@dataclass(frozen=True, slots=True)
class HealthConfig:
    weights: WeightsConfig = field(default_factory=WeightsConfig)
    eject_below: float = 30.0
    eject_after: int = 3
    # Score under this (or VRAM > 90% used, or KV cache > 95% full) marks a backend degraded:
    # still routable, down-weighted. Back to ready 5 points above it.
    degrade_below: float = 60.0
    rejoin_above: float = 70.0
    rejoin_after: int = 5
    probation: ProbationConfig = field(default_factory=ProbationConfig)
    max_ejected_fraction: float = 0.5
    # How often the score is evaluated (one "evaluation" of eject_after / rejoin_after).
    evaluate_interval: float = 1.0
    # Consecutive connect errors / 5xx / first-byte timeouts on real traffic that eject at once.
    consecutive_failures: int = 5
    # Ejection backoff: base x n (n = ejections in a row), capped, plus jitter.
    ejection_base: float = 5.0
    ejection_max: float = 300.0
    # EWMA smoothing factor for per-request and probe signals.
    ewma_alpha: float = 0.2


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    prefer_zone: str = ""
    prefer_region: str = ""
    # Bounded-load affinity: a backend above (1 + epsilon) x mean in-flight spills over.
    # 1.0 (2x the mean) keeps >= 95% of a session's requests home at ~5 in flight per
    # backend; 0.25 spills ~20% there (bench/routing.py, docs/routing.md).
    affinity_epsilon: float = 1.0
    prefix_affinity_chars: int = 0
    queue_timeout: float = 2.0
    queue_max: int = 1024
    # Fewer ready backends than this for a model raises an alert and a metric (0: off).
    min_ready: int = 0
    min_ready_per_model: tuple[tuple[str, int], ...] = ()

    def min_ready_for(self, model: str) -> int:
        for m, n in self.min_ready_per_model:
            if m == model:
                return n
        return self.min_ready


@dataclass(frozen=True, slots=True)
class RetryConfig:
    max_attempts: int = 3
    budget_ratio: float = 0.2
    # Retries always allowed per second on top of the ratio, so a quiet gateway can still retry.
    budget_min_per_s: float = 10.0
    # No response headers from a backend within this time: give up on it and try the next.
    per_try_timeout: float = 5.0
    # Non-streamed answers arrive whole: their first byte may take per_try_timeout plus this
    # much per requested token (max_tokens), capped at request_timeout.
    per_token_timeout: float = 0.1
    request_timeout: float = 300.0
    connect_timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    resume: bool = True
    stall_timeout: float = 1.0
    max_resumes: int = 2
    shutdown_grace: float = 10.0


@dataclass(frozen=True, slots=True)
class AlertsConfig:
    webhook: str | None = None
    timeout: float = 2.0
    retries: int = 3


@dataclass(frozen=True, slots=True)
class Config:
    backends: tuple[BackendConfig, ...]
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    probes: ProbesConfig = field(default_factory=ProbesConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    retry: RetryConfig = field(default_factory=RetryConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)
    alerts: AlertsConfig = field(default_factory=AlertsConfig)

    def backend(self, name: str) -> BackendConfig:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# Parsing helpers: each returns a value or records an error under its key path.

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$")
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_duration(value: object) -> float:
    """Seconds from ``"100ms"``, ``"3s"``, ``"2m"``, ``"1h"`` or a number of seconds."""
    if isinstance(value, bool):
        raise ValueError("must be a duration like 100ms, 3s or 2m")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ValueError("must be a non-negative duration")
        return float(value)
    if isinstance(value, str):
        m = _DURATION.match(value)
        if m:
            return float(m.group(1)) * _UNITS[m.group(2)]
    raise ValueError(f"must be a duration like 100ms, 3s or 2m, got {value!r}")


class _Reader:
    """Reads one mapping, recording errors with key paths and rejecting unknown keys."""

    def __init__(self, data: object, path: str, errors: list[str]) -> None:
        self.path = path
        self.errors = errors
        self.seen: set[str] = set()
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            self.error(path, f"must be a mapping, got {type(data).__name__}")
            data = {}
        self.data: Mapping[str, Any] = data

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def error(self, path: str, msg: str) -> None:
        self.errors.append(f"{path}: {msg}")

    def get(self, name: str, default: T, conv: Callable[[object], T]) -> T:
        self.seen.add(name)
        if name not in self.data:
            return default
        try:
            return conv(self.data[name])
        except (TypeError, ValueError) as e:
            self.error(self.key(name), str(e))
            return default

    def sub(self, name: str) -> _Reader:
        self.seen.add(name)
        return _Reader(self.data.get(name), self.key(name), self.errors)

    def finish(self) -> None:
        for k in self.data:
            if k not in self.seen:
                self.error(self.key(str(k)), "unknown key")


def _num(lo: float | None = None, hi: float | None = None) -> Callable[[object], float]:
    def conv(v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ValueError(f"must be a number, got {v!r}")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {v}")
        return float(v)

    return conv


MAX_INFLIGHT_AUTO = -1


def _limit(v: object) -> int:
    """A concurrency limit: an integer >= 0 (0: none) or `auto` (MAX_INFLIGHT_AUTO)."""
    if v == "auto":
        return MAX_INFLIGHT_AUTO
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"must be an integer >= 0 or 'auto', got {v!r}")
    return v


def _int(lo: int | None = None, hi: int | None = None) -> Callable[[object], int]:
    def conv(v: object) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"must be an integer, got {v!r}")
        if lo is not None and v < lo:
            raise ValueError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise ValueError(f"must be <= {hi}, got {v}")
        return v

    return conv


def _dur(min_s: float = 0.0) -> Callable[[object], float]:
    def conv(v: object) -> float:
        s = parse_duration(v)
        if s < min_s:
            raise ValueError(f"must be at least {min_s * 1000:g}ms")
        return s

    return conv


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")
    return v


def _bool(v: object) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def _env_name(v: object) -> str:
    s = _str(v)
    if not _ENV.match(s):
        raise ValueError(f"must be an environment variable name, got {s!r}")
    return s


def _choice(*options: str) -> Callable[[object], str]:
    def conv(v: object) -> str:
        s = _str(v)
        if s not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {s!r}")
        return s

    return conv


def _hostport(v: object) -> tuple[str, int]:
    s = _str(v)
    host, sep, port = s.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"must be HOST:PORT, got {s!r}")
    return host.strip("[]"), int(port)


def _url(v: object) -> str:
    s = _str(v).rstrip("/")
    if not (s.startswith("http://") or s.startswith("https://")):
        raise ValueError(f"must start with http:// or https://, got {s!r}")
    if s.endswith("/v1"):
        raise ValueError("must be the base URL without /v1")
    return s


def _models(v: object) -> tuple[str, ...]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(m, str) and m for m in v):
        raise ValueError("must be a list of model names")
    return tuple(v)


def _path(v: object) -> str:
    s = _str(v)
    if not s.startswith("/"):
        raise ValueError(f"must start with /, got {s!r}")
    return s


# ---------------------------------------------------------------------------------------------
# Sections


def _backend(r: _Reader) -> BackendConfig:
    d = BackendConfig(name="", url="")
    name = r.get("name", "", _str)
    if "name" not in r.data:
        r.error(r.key("name"), "is required")
    elif not _NAME.match(name):
        r.error(r.key("name"), "must be 1-63 letters, digits, '_', '.' or '-'")
    url = r.get("url", "", _url)
    if "url" not in r.data:
        r.error(r.key("url"), "is required")
    agent = r.get("agent", None, _str)
    if agent is not None:
        try:
            _hostport(agent)
        except ValueError as e:
            r.error(r.key("agent"), str(e))
    b = BackendConfig(
        name=name,
        url=url,
        models=r.get("models", d.models, _models),
        zone=r.get("zone", d.zone, _str),
        region=r.get("region", d.region, _str),
        weight=r.get("weight", d.weight, _num(0.0, 1000.0)),
        agent=agent,
        metrics_path=r.get("metrics_path", d.metrics_path, _path),
        api_key_env=r.get("api_key_env", d.api_key_env, _env_name),
        max_inflight=r.get("max_inflight", d.max_inflight, _limit),
        resume=r.get("resume", d.resume, _choice("vllm", "none")),
        max_n=r.get("max_n", d.max_n, _int(0, 128)),
    )
    r.finish()
    return b


def _gateway(r: _Reader) -> GatewayConfig:
    d = GatewayConfig()
    host, port = r.get("listen", (d.host, d.port), _hostport)
    g = GatewayConfig(
        host=host,
        port=port,
        admin_token_env=r.get("admin_token_env", d.admin_token_env, _env_name),
        max_body_bytes=r.get("max_body_bytes", d.max_body_bytes, _int(1024)),
        workers=r.get("workers", d.workers, _int(1, 64)),
        mode=r.get("mode", d.mode, _choice("pulsegate", "round_robin", "polling", "passive")),
    )
    if g.workers > 1 and g.mode != "pulsegate":
        # The baselines keep their verdicts in the proxy process itself: one process only.
        r.error(r.key("workers"), f"must be 1 with gateway.mode '{g.mode}'")
    r.finish()
    return g


def _probes(r: _Reader) -> ProbesConfig:
    hb, rd, mi, ca = (r.sub(k) for k in ("heartbeat", "readiness", "micro_inference", "canary"))
    dh, dr, dm, dc = HeartbeatConfig(), ReadinessConfig(), MicroInferenceConfig(), CanaryConfig()
    heartbeat = HeartbeatConfig(
        interval=hb.get("interval", dh.interval, _dur(0.01)),
        timeout=hb.get("timeout", dh.timeout, _dur(0.001)),
        misses_to_dead=hb.get("misses_to_dead", dh.misses_to_dead, _int(1, 100)),
    )
    readiness = ReadinessConfig(
        interval=rd.get("interval", dr.interval, _dur(0.05)),
        interval_unstable=rd.get("interval_unstable", dr.interval_unstable, _dur(0.05)),
        timeout=rd.get("timeout", dr.timeout, _dur(0.01)),
    )
    micro = MicroInferenceConfig(
        interval=mi.get("interval", dm.interval, _dur(0.05)),
        jitter=mi.get("jitter", dm.jitter, _dur()),
        timeout=mi.get("timeout", dm.timeout, _dur(0.01)),
        failures_to_eject=mi.get("failures_to_eject", dm.failures_to_eject, _int(1, 100)),
    )
    canary = CanaryConfig(
        interval=ca.get("interval", dc.interval, _dur(0.05)),
        payload_bytes=ca.get("payload_bytes", dc.payload_bytes, _int(0, 1 << 20)),
        timeout=ca.get("timeout", dc.timeout, _dur(0.01)),
        failures_to_isolate=ca.get("failures_to_isolate", dc.failures_to_isolate, _int(1, 100)),
    )
    metrics_interval = r.get("metrics_interval", ProbesConfig().metrics_interval, _dur(0.05))
    for sub in (hb, rd, mi, ca):
        sub.finish()
    r.finish()
    if heartbeat.timeout >= heartbeat.interval * heartbeat.misses_to_dead:
        r.error(r.key("heartbeat.timeout"), "must be shorter than interval x misses_to_dead")
    if micro.timeout > micro.interval:
        r.error(r.key("micro_inference.timeout"), "must not exceed micro_inference.interval")
    if canary.timeout > canary.interval:
        r.error(r.key("canary.timeout"), "must not exceed canary.interval")
    return ProbesConfig(heartbeat, readiness, micro, canary, metrics_interval)


def _health(r: _Reader) -> HealthConfig:
    d = HealthConfig()
    w = r.sub("weights")
    dw = d.weights
    weights = WeightsConfig(
        latency=w.get("latency", dw.latency, _num(0.0, 1.0)),
        error_rate=w.get("error_rate", dw.error_rate, _num(0.0, 1.0)),
        queue=w.get("queue", dw.queue, _num(0.0, 1.0)),
        gpu_free=w.get("gpu_free", dw.gpu_free, _num(0.0, 1.0)),
    )
    w.finish()
    if weights.latency + weights.error_rate + weights.queue + weights.gpu_free <= 0:
        r.error(r.key("weights"), "at least one weight must be positive")
    p = r.sub("probation")
    probation = ProbationConfig(
        duration=p.get("duration", d.probation.duration, _dur()),
        ramp_step=p.get("ramp_step", d.probation.ramp_step, _num(0.0001, 1.0)),
    )
    p.finish()
    h = HealthConfig(
        weights=weights,
        eject_below=r.get("eject_below", d.eject_below, _num(0.0, 100.0)),
        eject_after=r.get("eject_after", d.eject_after, _int(1, 1000)),
        degrade_below=r.get("degrade_below", d.degrade_below, _num(0.0, 100.0)),
        rejoin_above=r.get("rejoin_above", d.rejoin_above, _num(0.0, 100.0)),
        rejoin_after=r.get("rejoin_after", d.rejoin_after, _int(1, 1000)),
        probation=probation,
        max_ejected_fraction=r.get("max_ejected_fraction", d.max_ejected_fraction, _num(0.0, 1.0)),
        evaluate_interval=r.get("evaluate_interval", d.evaluate_interval, _dur(0.01)),
        consecutive_failures=r.get("consecutive_failures", d.consecutive_failures, _int(1, 1000)),
        ejection_base=r.get("ejection_base", d.ejection_base, _dur(0.01)),
        ejection_max=r.get("ejection_max", d.ejection_max, _dur(0.01)),
        ewma_alpha=r.get("ewma_alpha", d.ewma_alpha, _num(0.001, 1.0)),
    )
    r.finish()
    if h.rejoin_above <= h.eject_below:
        r.error(r.key("rejoin_above"), "must be greater than health.eject_below")
    if h.ejection_max < h.ejection_base:
        r.error(r.key("ejection_max"), "must not be less than health.ejection_base")
    return h


def _routing(r: _Reader) -> RoutingConfig:
    d = RoutingConfig()
    c = RoutingConfig(
        prefer_zone=r.get("prefer_zone", d.prefer_zone, _str),
        prefer_region=r.get("prefer_region", d.prefer_region, _str),
        affinity_epsilon=r.get("affinity_epsilon", d.affinity_epsilon, _num(0.0, 100.0)),
        prefix_affinity_chars=r.get("prefix_affinity_chars", d.prefix_affinity_chars, _int(0)),
        queue_timeout=r.get("queue_timeout", d.queue_timeout, _dur()),
        queue_max=r.get("queue_max", d.queue_max, _int(0)),
    )
    raw = r.get("min_ready", None, _min_ready)
    if raw is not None:
        default, per_model = raw
        c = replace(c, min_ready=default, min_ready_per_model=per_model)
    r.finish()
    return c


def _min_ready(v: object) -> tuple[int, tuple[tuple[str, int], ...]]:
    """`min_ready: 2` for every model, or `{default: 1, demo-7b: 2}` per model."""
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v, ()
    if isinstance(v, Mapping):
        default = 0
        per: list[tuple[str, int]] = []
        for k, n in v.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{k}: must be a non-negative integer, got {n!r}")
            if k == "default":
                default = n
            else:
                per.append((str(k), n))
        return default, tuple(per)
    raise ValueError(f"must be a non-negative integer or a mapping of model to integer, got {v!r}")


def _retry(r: _Reader) -> RetryConfig:
    d = RetryConfig()
    c = RetryConfig(
        max_attempts=r.get("max_attempts", d.max_attempts, _int(1, 10)),
        budget_ratio=r.get("budget_ratio", d.budget_ratio, _num(0.0, 10.0)),
        budget_min_per_s=r.get("budget_min_per_s", d.budget_min_per_s, _num(0.0)),
        per_try_timeout=r.get("per_try_timeout", d.per_try_timeout, _dur(0.01)),
        per_token_timeout=r.get("per_token_timeout", d.per_token_timeout, _dur()),
        request_timeout=r.get("request_timeout", d.request_timeout, _dur(0.01)),
        connect_timeout=r.get("connect_timeout", d.connect_timeout, _dur(0.01)),
    )
    r.finish()
    return c


def _streaming(r: _Reader) -> StreamingConfig:
    d = StreamingConfig()
    c = StreamingConfig(
        resume=r.get("resume", d.resume, _bool),
        stall_timeout=r.get("stall_timeout", d.stall_timeout, _dur(0.01)),
        max_resumes=r.get("max_resumes", d.max_resumes, _int(0, 10)),
        shutdown_grace=r.get("shutdown_grace", d.shutdown_grace, _dur()),
    )
    r.finish()
    return c


def _alerts(r: _Reader) -> AlertsConfig:
    d = AlertsConfig()
    c = AlertsConfig(
        webhook=r.get("webhook", d.webhook, _url_any),
        timeout=r.get("timeout", d.timeout, _dur(0.01)),
        retries=r.get("retries", d.retries, _int(0, 10)),
    )
    r.finish()
    return c


def _url_any(v: object) -> str:
    s = _str(v)
    if not (s.startswith("http://") or s.startswith("https://")):
        raise ValueError(f"must start with http:// or https://, got {s!r}")
    return s


def parse_config(data: object) -> Config:
    """Validate a parsed YAML document; raises ConfigError listing every problem."""
    errors: list[str] = []
    root = _Reader(data, "", errors)
    root.seen.add("backends")
    raw_backends = root.data.get("backends")
    backends: list[BackendConfig] = []
    if raw_backends is None:
        errors.append("backends: is required (a list of at least one backend)")
    elif not isinstance(raw_backends, list) or not raw_backends:
        errors.append("backends: must be a non-empty list")
    else:
        for i, raw in enumerate(raw_backends):
            backends.append(_backend(_Reader(raw, f"backends[{i}]", errors)))
        seen: dict[str, int] = {}
        for i, b in enumerate(backends):
            if b.name and b.name in seen:
                errors.append(
                    f"backends[{i}].name: duplicate of backends[{seen[b.name]}] ({b.name})"
                )
            seen.setdefault(b.name, i)
    cfg = Config(
        backends=tuple(backends),
        gateway=_gateway(root.sub("gateway")),
        probes=_probes(root.sub("probes")),
        health=_health(root.sub("health")),
        routing=_routing(root.sub("routing")),
        retry=_retry(root.sub("retry")),
        streaming=_streaming(root.sub("streaming")),
        alerts=_alerts(root.sub("alerts")),
    )
    root.finish()
    if cfg.gateway.mode != "pulsegate":
        for i, b in enumerate(cfg.backends):
            if not b.models:
                errors.append(
                    f"backends[{i}].models: required when gateway.mode is {cfg.gateway.mode} "
                    "(no probes discover models in a baseline mode)"
                )
    if errors:
        raise ConfigError(errors)
    return cfg


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a YAML config file."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError([f"{path}: cannot read: {e.strerror}"]) from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError([f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}"]) from e
    return parse_config(data)
