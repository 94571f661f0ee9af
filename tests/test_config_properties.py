"""Properties of the config loader (`config/loader.py`) on generated documents.

A valid config is mutated at drawn key paths (a section, a backend, an auth key, the root)
with drawn YAML-like values: null, booleans, huge and negative integers, NaN and infinities,
strings, lists and mappings with odd keys. What must hold (issue #22): `parse_config` returns
a `Config` or raises `ConfigError` whose every message starts with the key path it is about;
never another exception. The same through `load_config` on the document's YAML text, and on
arbitrary text (which must be a `ConfigError` naming the file when it is not YAML).
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path
from typing import Any

import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from pulsegate.config import Config, ConfigError, load_config, parse_config

SECTIONS = ["gateway", "probes", "health", "routing", "retry", "streaming", "alerts"]
SECTIONS += ["observability", "auth"]
KEYS = [
    "access_log",
    "admin_token_env",
    "affinity_epsilon",
    "agent",
    "agent_token_env",
    "api_key_env",
    "apis",
    "budget_min_per_s",
    "budget_ratio",
    "ca",
    "cert",
    "client_idle_timeout",
    "concurrency",
    "connect_timeout",
    "consecutive_failures",
    "degrade_below",
    "eject_after",
    "eject_below",
    "ejection_base",
    "ejection_max",
    "engine",
    "evaluate_interval",
    "ewma_alpha",
    "key",
    "key_env",
    "listen",
    "max_attempts",
    "max_body_bytes",
    "max_ejected_fraction",
    "max_inflight",
    "max_n",
    "max_resumes",
    "metrics_interval",
    "metrics_path",
    "min_ready",
    "mode",
    "models",
    "name",
    "otlp_endpoint",
    "per_token_timeout",
    "per_try_timeout",
    "prefer_region",
    "prefer_zone",
    "prefix_affinity_chars",
    "queue_max",
    "queue_timeout",
    "region",
    "rejoin_above",
    "rejoin_after",
    "request_timeout",
    "resume",
    "retries",
    "rpm",
    "server_name",
    "service_name",
    "shutdown_grace",
    "stall_timeout",
    "timeout",
    "tpm",
    "url",
    "webhook",
    "weight",
    "workers",
    "zone",
    "weights",
    "probation",
    "agent_tls",
    "keys",
    "keys_file",
    "sha256",
    "unknown_key",
]

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**64, -(2**63), 10**400, 0, -1, 65536]),
    st.floats(),  # NaN and both infinities included
    st.text(max_size=30),
    st.sampled_from(["auto", "1s", "10ms", "-1s", "1e9s", "nan", "inf", "127.0.0.1:0", ":80"]),
    st.sampled_from(["http://127.0.0.1:1", "https://u:p@h/x", "vllm", "sim", "*", "chat"]),
)
_keys = st.one_of(st.text(max_size=8), st.sampled_from(KEYS), st.integers(), st.booleans())
_values = st.recursive(
    _scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_keys, inner, max_size=4),
    max_leaves=12,
)
_SEG = r"""([^\s:.'"\[\]]+|'[^']*'|"[^"]*")(\[\d+\])*"""
# `a.b[0].c: ...`, a quoted odd key (`gateway.'a b': unknown key`) or `(top level): ...`
_PATH = re.compile(rf"^(\(top level\)|{_SEG}(\.{_SEG})*): ")


def _base() -> dict[str, Any]:
    return {
        "backends": [
            {"name": "a", "url": "http://127.0.0.1:8001", "models": ["m"]},
            {"name": "b", "url": "http://127.0.0.1:8002"},
        ],
        "gateway": {"listen": "127.0.0.1:0"},
        "auth": {"keys": [{"name": "k", "sha256": "0" * 64}]},
    }


@st.composite
def documents(draw: st.DrawFn) -> object:
    doc: Any = _base()
    for _ in range(draw(st.integers(1, 6))):
        where = draw(st.sampled_from(["root", "section", "key", "backend", "auth_key", "whole"]))
        value = draw(_values)
        if where == "whole":
            doc = value
            continue
        if not isinstance(doc, dict):
            continue
        if where == "root":
            doc[draw(_keys)] = value
        elif where == "section":
            doc[draw(st.sampled_from([*SECTIONS, "backends"]))] = value
        elif where == "key":
            sec = doc.setdefault(draw(st.sampled_from(SECTIONS)), {})
            if isinstance(sec, dict):
                sec[draw(st.sampled_from(KEYS))] = value
        elif where in ("backend", "auth_key"):
            items = doc.get("backends") if where == "backend" else None
            if where == "auth_key" and isinstance(doc.get("auth"), dict):
                items = doc["auth"].get("keys")
            if isinstance(items, list) and items and isinstance(items[0], dict):
                item = items[draw(st.integers(0, len(items) - 1))]
                if isinstance(item, dict):
                    item[draw(st.sampled_from(KEYS))] = value
    return doc


def _check(load: Any) -> Config | None:
    try:
        return load()  # type: ignore[no-any-return]
    except ConfigError as e:
        errors = e.errors
    assert errors, "a ConfigError lists its problems"
    for msg in errors:
        assert _PATH.match(msg), f"no key path in {msg!r}"
    return None


@settings(max_examples=500, deadline=None)
@given(documents())
def test_any_document_is_a_config_or_a_config_error_naming_key_paths(doc: object) -> None:
    """`parse_config` on a mutated document: a `Config` or a `ConfigError` whose messages
    each start with a key path; nothing else escapes."""
    cfg = _check(lambda: parse_config(doc))
    assert cfg is None or cfg.backends


_DIR = Path(tempfile.mkdtemp(prefix="pulsegate-config-props-"))


def _yaml_safe(v: object) -> bool:
    """Values `yaml.safe_dump` writes and reads back as given (NaN is not equal to itself)."""
    if isinstance(v, float):
        return not math.isnan(v)
    if isinstance(v, list):
        return all(_yaml_safe(x) for x in v)
    if isinstance(v, dict):
        return all(_yaml_safe(k) and _yaml_safe(x) for k, x in v.items())
    return True


@settings(max_examples=150, deadline=None)
@given(documents())
def test_the_same_through_a_yaml_file(doc: object) -> None:
    """The document's YAML text through `load_config`: the same verdict as `parse_config`."""
    path = _DIR / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    via_file = _check(lambda: load_config(path))
    if _yaml_safe(doc):
        assert (via_file is None) == (_check(lambda: parse_config(doc)) is None)


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
def test_arbitrary_text_is_a_config_error(text: str) -> None:
    """Arbitrary text in the config file (not YAML, YAML of the wrong shape, odd bytes) is a
    `ConfigError`, never another exception; a YAML syntax error names the file."""
    path = _DIR / "t.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    errors = ["(none)"]
    try:
        load_config(path)
    except ConfigError as e:
        errors = e.errors
    assert errors
    assert all(str(path) in m or _PATH.match(m) for m in errors), errors


def teardown_module() -> None:
    for p in _DIR.iterdir():
        p.unlink()
    _DIR.rmdir()
