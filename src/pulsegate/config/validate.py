"""Cross-key checks: values that are each valid alone but contradict one another.

Each function takes already-typed sections and returns its problems as ``(key, message)``
pairs, the key relative to the section it was read from (`probes`, `health`, ... or the file's
root for the `backends` checks). It records nothing itself: the loader adds the section's path
and keeps every problem in the order the file is read, so `pulsegate check` lists them stably.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

from pulsegate.config.schema import (
    BackendConfig,
    Config,
    GatewayConfig,
    HealthConfig,
    KeyConfig,
    ProbesConfig,
    StreamingConfig,
    WeightsConfig,
)

Problem = tuple[str, str]


def _has_credentials(url: str) -> bool:
    """`url` carries a `user[:password]@` part."""
    try:
        return "@" in urlsplit(url).netloc
    except ValueError:  # a malformed authority: reported by the URL's own check, if at all
        return "@" in url.split("//", 1)[-1].split("/", 1)[0]


def backend_problems(backends: Sequence[BackendConfig]) -> list[Problem]:
    """Two backends with one name, credentials in a URL (keys from the root:
    ``backends[2].name``)."""
    problems: list[Problem] = []
    seen: dict[str, int] = {}
    for i, b in enumerate(backends):
        if _has_credentials(b.url):
            # It would show in /admin/backends, events and logs, and clash with api_key_env
            # on every probe. The message never repeats the URL.
            problems.append(
                (
                    f"backends[{i}].url",
                    "must not carry credentials (user:password@); put the key in an "
                    "environment variable named by api_key_env",
                )
            )
        if b.name and b.name in seen:
            problems.append(
                (f"backends[{i}].name", f"duplicate of backends[{seen[b.name]}] ({b.name})")
            )
        seen.setdefault(b.name, i)
    return problems


def key_problems(keys: Sequence[KeyConfig], where: str) -> list[Problem]:
    """Two keys with one name or one key (the same digest), keys relative to the list
    (``[2].name``); `where` is the list's own path, for the message."""
    problems: list[Problem] = []
    names: dict[str, int] = {}
    digests: dict[str, int] = {}
    for i, k in enumerate(keys):
        if k.name and k.name in names:
            problems.append((f"[{i}].name", f"duplicate of {where}[{names[k.name]}] ({k.name})"))
        names.setdefault(k.name, i)
        if k.sha256 and k.sha256 in digests:
            # Two names for one key: which name (and limits) a request has would be a
            # matter of order. The message names the other entry, never the digest.
            field = "key_env" if k.key_env else "sha256"
            j = digests[k.sha256]
            problems.append((f"[{i}].{field}", f"the same key as {where}[{j}] ({keys[j].name})"))
        digests.setdefault(k.sha256, i)
    return problems


def gateway_problems(g: GatewayConfig) -> list[Problem]:
    """`workers` > 1 with a baseline `mode` (keys under `gateway`)."""
    if g.workers > 1 and g.mode != "pulsegate":
        # The baselines keep their verdicts in the proxy process itself: one process only.
        return [("workers", f"must be 1 with gateway.mode '{g.mode}'")]
    return []


def probes_problems(p: ProbesConfig) -> list[Problem]:
    """Probe timeouts that could never fire before the next probe (keys under `probes`)."""
    problems: list[Problem] = []
    hb, micro, canary = p.heartbeat, p.micro_inference, p.canary
    if hb.timeout >= hb.interval * hb.misses_to_dead:
        problems.append(("heartbeat.timeout", "must be shorter than interval x misses_to_dead"))
    if micro.timeout > micro.interval:
        problems.append(("micro_inference.timeout", "must not exceed micro_inference.interval"))
    if canary.timeout > canary.interval:
        problems.append(("canary.timeout", "must not exceed canary.interval"))
    if p.connect.interval and p.connect.timeout > p.connect.interval:
        problems.append(("connect.timeout", "must not exceed connect.interval"))
    return problems


def weights_problems(w: WeightsConfig) -> list[Problem]:
    """All four score weights zero: no score at all (keys under `health`)."""
    if w.latency + w.error_rate + w.queue + w.gpu_free <= 0:
        return [("weights", "at least one weight must be positive")]
    return []


def health_problems(h: HealthConfig) -> list[Problem]:
    """Hysteresis and backoff bounds the wrong way round (keys under `health`)."""
    problems: list[Problem] = []
    if h.rejoin_above <= h.eject_below:
        problems.append(("rejoin_above", "must be greater than health.eject_below"))
    if h.ejection_max < h.ejection_base:
        problems.append(("ejection_max", "must not be less than health.ejection_base"))
    return problems


def redis_url_problems(url: str) -> list[Problem]:
    """`cluster.redis` that redis-py could not connect to (key `redis` under `cluster`). The
    URL may hold a password: the message never repeats it."""
    shape = [
        ("redis", "must be redis://[:PASSWORD@]HOST[:PORT][/DB], rediss://... or unix:///PATH")
    ]
    try:
        u = urlsplit(url)
        _ = u.port  # raises ValueError when not a number in 0-65535
    except ValueError:
        return shape
    if u.scheme in ("redis", "rediss"):
        db = u.path.strip("/")
        return [] if u.hostname and (not db or db.isdigit()) else shape
    return [] if u.scheme == "unix" and u.path else shape


def streaming_problems(s: StreamingConfig) -> list[Problem]:
    """A stall floor above the stall timeout: the rhythm could never cut sooner than the
    fixed rule, which is surely not what was meant."""
    if s.stall_factor > 0 and s.stall_floor > s.stall_timeout:
        return [("stall_floor", f"must not exceed stall_timeout ({s.stall_timeout * 1000:g}ms)")]
    return []


def mode_problems(cfg: Config) -> list[Problem]:
    """Backends without `models` in a baseline mode (keys from the root)."""
    if cfg.gateway.mode == "pulsegate":
        return []
    return [
        (
            f"backends[{i}].models",
            f"required when gateway.mode is {cfg.gateway.mode} "
            "(no probes discover models in a baseline mode)",
        )
        for i, b in enumerate(cfg.backends)
        if not b.models
    ]
