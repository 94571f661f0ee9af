"""The loader: walks the YAML document section by section, naming each problem by its key path.

`_Reader` reads one mapping and records every error under its path (``backends[1].url``),
unknown keys included; the section functions build the typed `schema` objects from it with the
`values` converters, and run the `validate` cross-key checks where the original order of the
messages puts them. `parse_config` raises one `ConfigError` listing every problem found.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import yaml

from pulsegate.config.agent_tls import agent_tls_problems
from pulsegate.config.apis import ENGINE_APIS, ENGINES, _apis
from pulsegate.config.schema import (
    AgentTlsConfig,
    AlertsConfig,
    AuthConfig,
    BackendConfig,
    CanaryConfig,
    ClusterConfig,
    Config,
    ConnectProbeConfig,
    GatewayConfig,
    HealthConfig,
    HeartbeatConfig,
    HedgeConfig,
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
from pulsegate.config.validate import (
    Problem,
    backend_problems,
    gateway_problems,
    health_problems,
    key_problems,
    mode_problems,
    probes_problems,
    redis_url_problems,
    streaming_problems,
    weights_problems,
)
from pulsegate.config.values import (
    _NAME,
    _access_log,
    _bool,
    _choice,
    _dur,
    _env_name,
    _hostport,
    _int,
    _limit,
    _min_ready,
    _models,
    _num,
    _otlp_endpoint,
    _path,
    _str,
    _url,
    _url_any,
)

T = TypeVar("T")
# A key an error can name as is; any other (empty, spaced, a colon, a quote) is quoted.
# Matched with `fullmatch`: a `$` would also match before a final newline ("0\n").
_PLAIN_KEY = re.compile(r"[^\s:.'\"\[\]]+")


class ConfigError(Exception):
    """A configuration that cannot be used; `errors` lists each problem with its key path."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {e}" for e in errors))


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
        self.errors.append(f"{path or '(top level)'}: {msg}")

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

    def record(self, problems: list[Problem]) -> None:
        """Record cross-key problems, their keys relative to this mapping."""
        for key, msg in problems:
            self.error(self.key(key), msg)

    def finish(self) -> None:
        for k in self.data:
            if k not in self.seen:  # an empty, spaced or non-string key is quoted
                name = k if isinstance(k, str) and _PLAIN_KEY.fullmatch(k) else repr(k)
                self.error(self.key(name), "unknown key")


def _required_name(r: _Reader) -> str:
    """The entry's `name`: required, 1-63 of letters, digits, '_', '.' or '-' (a backend's,
    a client key's: both end up as metric labels)."""
    name = r.get("name", "", _str)
    if "name" not in r.data:
        r.error(r.key("name"), "is required")
    elif not _NAME.match(name):
        r.error(r.key("name"), "must be 1-63 letters, digits, '_', '.' or '-'")
    return name


def _backend(r: _Reader) -> BackendConfig:
    d = BackendConfig(name="", url="")
    name = _required_name(r)
    url = r.get("url", "", _url)
    if "url" not in r.data:
        r.error(r.key("url"), "is required")
    agent = r.get("agent", None, _str)
    if agent is not None:
        try:
            _hostport(agent)
        except ValueError as e:
            r.error(r.key("agent"), str(e))
    agent_token_env = r.get("agent_token_env", d.agent_token_env, _env_name)
    if agent_token_env is not None and agent is None:
        r.error(r.key("agent_token_env"), "needs an agent (this backend has no `agent` key)")
    agent_tls = _agent_tls(r) if "agent_tls" in r.data else None
    if agent_tls is not None and agent is None:
        r.error(r.key("agent_tls"), "needs an agent (this backend has no `agent` key)")
    engine = r.get("engine", d.engine, _choice(*ENGINES))  # `apis` defaults by engine kind
    b = BackendConfig(
        name=name,
        url=url,
        models=r.get("models", d.models, _models),
        zone=r.get("zone", d.zone, _str),
        region=r.get("region", d.region, _str),
        weight=r.get("weight", d.weight, _num(0.0, 1000.0)),
        agent=agent,
        agent_token_env=agent_token_env,
        agent_tls=agent_tls,
        metrics_path=r.get("metrics_path", d.metrics_path, _path),
        api_key_env=r.get("api_key_env", d.api_key_env, _env_name),
        max_inflight=r.get("max_inflight", d.max_inflight, _limit),
        resume=r.get("resume", d.resume, _choice("vllm", "none")),
        exact_resume=r.get("exact_resume", d.exact_resume, _bool),
        max_n=r.get("max_n", d.max_n, _int(0, 128)),
        engine=engine,
        apis=r.get("apis", ENGINE_APIS[engine], _apis),
    )
    if "exact_resume" in r.data and b.exact_resume and (engine, b.resume) != ("vllm", "vllm"):
        r.error(
            r.key("exact_resume"), "needs `engine: vllm` and `resume: vllm` (token ids are vLLM's)"
        )
    r.finish()
    return b


def _agent_tls(backend: _Reader) -> AgentTlsConfig:
    """A backend's `agent_tls` mapping; its files are checked as the heartbeat will load them."""
    r = backend.sub("agent_tls")
    tls = AgentTlsConfig(
        ca=r.get("ca", None, _str),
        cert=r.get("cert", None, _str),
        key=r.get("key", None, _str),
        server_name=r.get("server_name", None, _str),
    )
    r.finish()
    r.record(agent_tls_problems(tls))
    return tls


def _gateway(r: _Reader, base_dir: str | None) -> GatewayConfig:
    d = GatewayConfig()
    host, port = r.get("listen", (d.host, d.port), _hostport)
    g = GatewayConfig(
        host=host,
        port=port,
        admin_token_env=r.get("admin_token_env", d.admin_token_env, _env_name),
        max_body_bytes=r.get("max_body_bytes", d.max_body_bytes, _int(1024)),
        client_idle_timeout=r.get("client_idle_timeout", d.client_idle_timeout, _dur(0.1)),
        max_client_connections=r.get(
            "max_client_connections", d.max_client_connections, _int(1, 1_000_000)
        ),
        client_header_timeout=r.get("client_header_timeout", d.client_header_timeout, _dur(0.1)),
        client_body_timeout=r.get("client_body_timeout", d.client_body_timeout, _dur(0.1)),
        workers=r.get("workers", d.workers, _int(1, 64)),
        mode=r.get("mode", d.mode, _choice("pulsegate", "round_robin", "polling", "passive")),
        access_log=r.get("access_log", d.access_log, _access_log(base_dir)),
    )
    r.record(gateway_problems(g))
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
    cn, dn = r.sub("connect"), ConnectProbeConfig()
    connect = ConnectProbeConfig(
        interval=cn.get("interval", dn.interval, _dur()),
        timeout=cn.get("timeout", dn.timeout, _dur(0.01)),
    )
    for sub in (hb, rd, mi, ca, cn):
        sub.finish()
    r.finish()
    probes = ProbesConfig(heartbeat, readiness, micro, canary, metrics_interval, connect)
    r.record(probes_problems(probes))
    return probes


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
    r.record(weights_problems(weights))
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
        connect_failures=r.get("connect_failures", d.connect_failures, _int(0, 1000)),
        ejection_base=r.get("ejection_base", d.ejection_base, _dur(0.01)),
        ejection_max=r.get("ejection_max", d.ejection_max, _dur(0.01)),
        ewma_alpha=r.get("ewma_alpha", d.ewma_alpha, _num(0.001, 1.0)),
    )
    r.finish()
    r.record(health_problems(h))
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
        hedge=_hedge(r.sub("hedge")),
    )
    r.finish()
    return c


def _hedge(r: _Reader) -> HedgeConfig:
    d = HedgeConfig()
    c = HedgeConfig(
        enabled=r.get("enabled", d.enabled, _bool),
        factor=r.get("factor", d.factor, _num(1.0, 100.0)),
        budget=r.get("budget", d.budget, _num(0.0, 1.0)),
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
        stall_floor=r.get("stall_floor", d.stall_floor, _dur(0.01)),
        stall_factor=r.get("stall_factor", d.stall_factor, _num(0.0, 1000.0)),
    )
    r.record(streaming_problems(c))
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


_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def _sha256(v: object) -> str:
    # Never echo the value: a key pasted here by mistake must not land in an error or a log.
    if not isinstance(v, str) or not _HEX64.match(v):
        raise ValueError(
            "must be 64 lower-case hex digits, the sha256 of the key (`pulsegate key new`)"
        )
    return v


def _key(r: _Reader) -> KeyConfig:
    """One `auth` key entry; a `key_env` key is hashed here and only its digest kept."""
    name = _required_name(r)
    digest = r.get("sha256", "", _sha256)
    env = r.get("key_env", None, _env_name)
    if "sha256" in r.data and "key_env" in r.data:
        r.error(r.key("key_env"), "set sha256 or key_env, not both")
    elif "sha256" not in r.data and "key_env" not in r.data:
        r.error(r.path, "needs sha256 or key_env")
    elif env is not None:
        key = os.environ.get(env)
        if not key:
            r.error(r.key("key_env"), f"environment variable {env} is not set")
        else:
            digest = hashlib.sha256(key.encode()).hexdigest()
    k = KeyConfig(
        name=name,
        sha256=digest,
        models=r.get("models", ("*",), _models),
        rpm=r.get("rpm", 0, _int(0)),
        tpm=r.get("tpm", 0, _int(0)),
        concurrency=r.get("concurrency", 0, _int(0)),
        key_env=env,
    )
    r.finish()
    return k


def _keys_file(path: str, base_dir: str | None, errors: list[str]) -> object:
    """The `keys:` list of the keys file (relative to the config file's directory)."""
    where = f"auth.keys_file: {path}"
    full = os.path.join(base_dir, path) if base_dir else path
    try:
        with open(full, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except OSError as e:
        errors.append(f"{where}: cannot read: {e.strerror}")
        return None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        errors.append(f"{where}: not valid YAML{at}: {getattr(e, 'problem', e)}")
        return None
    r = _Reader(doc, where, errors)
    r.seen.add("keys")
    r.finish()
    if "keys" not in r.data:
        errors.append(f"{where}: needs a top-level `keys:` list")
    return r.data.get("keys")


def _auth(r: _Reader, base_dir: str | None) -> AuthConfig | None:
    if "auth" not in r.data:
        r.seen.add("auth")
        return None
    a = r.sub("auth")
    file = a.get("keys_file", None, _str)
    a.seen.add("keys")
    raw: object = a.data.get("keys")
    prefix = "auth.keys"
    a.finish()
    if file is not None and "keys" in a.data:
        a.error("auth", "set keys_file or keys, not both")
        return AuthConfig()
    if file is not None:
        raw = _keys_file(file, base_dir, a.errors)
        prefix = f"auth.keys_file: {file}: keys"
        if raw is None:
            return AuthConfig(keys_file=file)  # the file's own error is recorded
    if not isinstance(raw, list) or not raw:
        # An empty list would refuse every request: more likely a mistake than a wish.
        a.error(prefix, "must be a non-empty list of keys")
        return AuthConfig(keys_file=file)
    keys = tuple(_key(_Reader(e, f"{prefix}[{i}]", a.errors)) for i, e in enumerate(raw))
    for key, msg in key_problems(keys, prefix):
        a.error(prefix + key, msg)
    return AuthConfig(keys=keys, keys_file=file)


def _observability(r: _Reader) -> ObservabilityConfig:
    d = ObservabilityConfig()
    c = ObservabilityConfig(
        otlp_endpoint=r.get("otlp_endpoint", d.otlp_endpoint, _otlp_endpoint),
        service_name=r.get("service_name", d.service_name, _str),
    )
    r.finish()
    return c


def _cluster(r: _Reader) -> ClusterConfig:
    d = ClusterConfig()
    c = ClusterConfig(
        redis=r.get("redis", d.redis, _str),
        replica_id=r.get("replica_id", d.replica_id, _name_or_auto),
    )
    if c.redis is not None:
        r.record(redis_url_problems(c.redis))
    r.finish()
    return c


def _name_or_auto(v: object) -> str:
    s = _str(v)
    if not s or len(s) > 128 or not s.isprintable() or " " in s:
        raise ValueError("must be a short name without spaces, or auto")
    return s


def parse_config(data: object, base_dir: str | None = None) -> Config:
    """Validate a parsed YAML document; raises ConfigError listing every problem.
    `base_dir`: where a relative `auth.keys_file` is (the config file's directory)."""
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
        root.record(backend_problems(backends))
    cfg = Config(
        backends=tuple(backends),
        gateway=_gateway(root.sub("gateway"), base_dir),
        probes=_probes(root.sub("probes")),
        health=_health(root.sub("health")),
        routing=_routing(root.sub("routing")),
        retry=_retry(root.sub("retry")),
        streaming=_streaming(root.sub("streaming")),
        alerts=_alerts(root.sub("alerts")),
        observability=_observability(root.sub("observability")),
        auth=_auth(root, base_dir),
        cluster=_cluster(root.sub("cluster")),
    )
    root.finish()
    root.record(mode_problems(cfg))
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
    return parse_config(data, os.path.dirname(os.path.abspath(path)))
