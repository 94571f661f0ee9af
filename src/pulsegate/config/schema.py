"""The configuration's shape: frozen, typed sections with their documented defaults.

`Config` is the whole file; each other class is one YAML section (``probes.heartbeat`` is
`HeartbeatConfig`). No parsing and no checks here: `pulsegate.config.loader` builds these from
YAML and names each bad key. The health core and the balancer need only these types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# `max_inflight: auto`: follow the engine's batch capacity once it is known.
MAX_INFLIGHT_AUTO = -1
# The APIs a backend may serve (`backends[].apis`); `tokenize` covers /tokenize and
# /detokenize. What each engine kind serves by default: `config/apis.py`.
APIS = ("chat", "completions", "responses", "embeddings", "messages", "rerank", "score", "tokenize")


@dataclass(frozen=True, slots=True)
class AgentTlsConfig:
    """`agent_tls`: TLS to the backend's agent (`pulsegate agent --tls-cert`), PEM paths."""

    ca: str | None = None  # verify the agent against this CA (None: the system's roots)
    cert: str | None = None  # with `key`: our client certificate, for mutual TLS
    key: str | None = None
    # The name the agent's certificate must carry (None: the host of `agent`, which may be
    # an IP address, then matched against the certificate's IP SANs).
    server_name: str | None = None


@dataclass(frozen=True, slots=True)
class BackendConfig:
    name: str
    url: str
    models: tuple[str, ...] = ()
    zone: str = ""
    region: str = ""
    weight: float = 1.0
    agent: str | None = None
    # Environment variable holding the agent's shared token (`pulsegate agent --token-env`).
    agent_token_env: str | None = None
    # TLS (and mutual TLS) to the agent; None: plaintext, as the agent serves by default.
    agent_tls: AgentTlsConfig | None = None
    metrics_path: str | None = None
    api_key_env: str | None = None
    # Most concurrent client requests the gateway sends this backend (0: no limit;
    # MAX_INFLIGHT_AUTO, written `auto`: the engine's batch capacity once known).
    max_inflight: int = 0
    # How a broken stream is continued on this engine: "vllm" (continue_final_message) or "none".
    resume: str = "vllm"
    # On a vLLM engine (`engine: vllm`, `resume: vllm`): ask a resumable stream for its token
    # ids and continue a break as those ids (`/v1/completions`), token for token what one
    # engine would have produced; false: text replay only (docs/streams.md, "Exact resume").
    exact_resume: bool = True
    # Most choices (`n`) the engine really answers; 0: no limit. transformers serve ignores
    # `n` and answers one choice: `max_n: 1` routes `n > 1` elsewhere (or refuses it, 400).
    max_n: int = 0
    # The engine kind (vllm, sglang, tgi, llama.cpp, transformers, openai) and the APIs the
    # gateway sends it; a request for any other API never reaches it (`config/apis.py`).
    engine: str = "vllm"
    apis: tuple[str, ...] = APIS


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    admin_token_env: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    # An idle keep-alive client connection is closed after this long (nginx's default;
    # aiohttp's own is 3,630 s). Read at start, not on reload.
    client_idle_timeout: float = 75.0
    # Most client connections one process holds (per worker, like nginx's
    # worker_connections: the open-file limit it protects is per process); past it a new
    # connection is answered 503 at once and closed (`conn_guard.py`). Lowered at start to
    # what the open-file limit leaves. Read at start, not on reload.
    max_client_connections: int = 10_000
    # A request head not whole this long after its first byte: 408 and closed (nginx's
    # `client_header_timeout` is 60 s; HAProxy's docs advise 10 s for `timeout
    # http-request`). Read at start, not on reload.
    client_header_timeout: float = 10.0
    # The whole request body must arrive within this (a 4 MiB body at >= 1.1 Mbit/s):
    # 408 `request_timeout`. Applies at reload.
    client_body_timeout: float = 30.0
    workers: int = 1
    # Plain, stateless `/health` polling and round-robin: the chaos lab's baselines.
    mode: str = "pulsegate"
    # One JSON line per client request (`observe/access_log.py`): "stdout" or a file path
    # (absolute once loaded); None: off.
    access_log: str | None = None


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
class ConnectProbeConfig:
    """`probes.connect` (docs/connect-evidence.md): a TCP connect to the engine's port on a
    new connection (closed at once, no request), so SYNs dropped or a full accept queue are
    seen while pooled connections still work. interval 0: off."""

    interval: float = 0.5
    timeout: float = 0.25


@dataclass(frozen=True, slots=True)
class ProbesConfig:
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    readiness: ReadinessConfig = field(default_factory=ReadinessConfig)
    micro_inference: MicroInferenceConfig = field(default_factory=MicroInferenceConfig)
    canary: CanaryConfig = field(default_factory=CanaryConfig)
    # Engine Prometheus scrape (queue, KV cache, GPU gauges); only for backends with metrics_path.
    metrics_interval: float = 1.0
    connect: ConnectProbeConfig = field(default_factory=ConnectProbeConfig)


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
    # New connections failed in a row (proxy or `probes.connect`), none made, that eject at
    # once with cause connect (`health/connects.py`); 0: off.
    connect_failures: int = 3
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
class HedgeConfig:
    """`retry.hedge` (docs/stall-and-hedge.md): a stream whose first token is later than
    `factor` x the fleet's usual TTFT p95 is sent to the next best backend too; the first
    to answer wins, the other is cancelled. Within `budget` hedges per request."""

    enabled: bool = False
    factor: float = 2.0
    budget: float = 0.05


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
    # A new upstream connection (TCP, and TLS for https) within this, else the attempt moves
    # to the next backend at once (nothing was sent). Under the kernel's 1 s SYN retransmit,
    # so a lost SYN costs 250 ms, not 1 s+; a LAN connect takes < 1 ms. An https backend (a
    # hosted API far away) gets at least 3 s (proxy/upstream.py, docs/connect-evidence.md).
    connect_timeout: float = 0.25
    hedge: HedgeConfig = field(default_factory=HedgeConfig)


@dataclass(frozen=True, slots=True)
class StreamingConfig:
    resume: bool = True
    stall_timeout: float = 1.0
    # Once a stream's first token is out, no token for max(stall_floor, stall_factor x its
    # backend's recent inter-token p99 or its own longest gap) cuts it, at most
    # stall_timeout (docs/stall-and-hedge.md has the measurement). stall_factor 0: off.
    stall_floor: float = 0.15
    stall_factor: float = 4.0
    max_resumes: int = 2
    shutdown_grace: float = 10.0


@dataclass(frozen=True, slots=True)
class AlertsConfig:
    webhook: str | None = None
    timeout: float = 2.0
    retries: int = 3


@dataclass(frozen=True, slots=True)
class ObservabilityConfig:
    # OTLP/HTTP traces (`observe/traces.py`): the collector's URL (`http://host:4318`,
    # `/v1/traces` added when the URL has no path); None: off.
    otlp_endpoint: str | None = None
    service_name: str = "pulsegate"  # the traces' `service.name`


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    # Gateway replicas that name the same Redis share evidence, probing and limits
    # (`replicas/`); None: this gateway works alone. The URL may carry a password: it is
    # kept out of reprs, logs, errors and the admin API.
    redis: str | None = field(default=None, repr=False)
    replica_id: str = "auto"  # "auto": hostname-pid


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """One client key of the front door (`auth:`): its name, the sha256 of the key (never
    the key itself), the models it may ask for and its limits (0: none)."""

    name: str
    # Lower-case hex sha256 of the key's UTF-8 bytes: from the file, or hashed at load from
    # the variable `key_env` names. Not a secret, but kept out of reprs all the same.
    sha256: str = field(repr=False)
    models: tuple[str, ...] = ("*",)  # fnmatch globs
    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens (prompt + completion) per minute
    concurrency: int = 0  # requests in flight at once
    key_env: str | None = None  # the variable's name only


@dataclass(frozen=True, slots=True)
class AuthConfig:
    keys: tuple[KeyConfig, ...] = ()
    # The file the keys were read from (`auth.keys_file`), re-read on every reload.
    keys_file: str | None = None


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
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    # The front door: client keys and their limits; None: no keys asked for.
    auth: AuthConfig | None = None

    def backend(self, name: str) -> BackendConfig:
        for b in self.backends:
            if b.name == name:
                return b
        raise KeyError(name)
