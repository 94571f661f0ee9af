"""Scalar values from YAML: durations, numbers, names, URLs, addresses, limits.

Each converter takes the raw YAML value and returns the typed one, or raises `ValueError`
whose message is the part after the key path (``"must be >= 1, got 0"``); the loader adds the
path. `parse_duration` is public; the rest are private to the `pulsegate.config` package.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from urllib.parse import urlsplit

from pulsegate.config.schema import MAX_INFLIGHT_AUTO

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


def _limit(v: object) -> int:
    """A concurrency limit: an integer >= 0 (0: none) or `auto` (MAX_INFLIGHT_AUTO)."""
    if v == "auto":
        return MAX_INFLIGHT_AUTO
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"must be an integer >= 0 or 'auto', got {v!r}")
    return v


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


def _shown(url: str) -> str:
    """`url` as an error may show it: anything before an `@` (user:password, a token) is
    replaced, and a long value cut, since a mistyped URL may still carry a secret."""
    at = url.rfind("@")
    if at >= 0:
        scheme = url.find("://")
        head = url[: scheme + 3] if 0 <= scheme < at else ""
        url = head + "***" + url[at:]
    return url if len(url) <= 120 else url[:117] + "..."


def _url(v: object) -> str:
    s = _str(v).rstrip("/")
    if not (s.startswith("http://") or s.startswith("https://")):
        raise ValueError(f"must start with http:// or https://, got {_shown(s)!r}")
    if s.endswith("/v1"):
        raise ValueError("must be the base URL without /v1")
    return s


def _url_any(v: object) -> str:
    s = _str(v)
    if not (s.startswith("http://") or s.startswith("https://")):
        # A webhook URL's path is often its secret (Slack, Teams): never echoed.
        raise ValueError("must start with http:// or https://")
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


def _access_log(base_dir: str | None) -> Callable[[object], str]:
    """`stdout`, or a file path (relative to `base_dir`, the config file's directory) whose
    directory exists; returned absolute, so a reopen after rotation finds the same file."""

    def conv(v: object) -> str:
        s = _str(v)
        if s == "stdout":
            return s
        if not s.strip():
            raise ValueError("must be stdout or a file path")
        full = os.path.abspath(os.path.join(base_dir, s) if base_dir else s)
        if os.path.isdir(full):
            raise ValueError(f"{full} is a directory")
        where = os.path.dirname(full)
        if not os.path.isdir(where):
            raise ValueError(f"directory {where} does not exist")
        if not os.access(full if os.path.exists(full) else where, os.W_OK):
            raise ValueError(f"{full} is not writable by this user")
        return full

    return conv


def _otlp_endpoint(v: object) -> str:
    """The collector's OTLP/HTTP URL; a URL without a path gets the traces path `/v1/traces`
    (what OTEL_EXPORTER_OTLP_ENDPOINT means), one with a path is used as written."""
    s = _url_any(v)
    try:
        u = urlsplit(s)
        u.port  # noqa: B018 - raises on a port that is not a number
    except ValueError:
        raise ValueError("must be a URL like http://collector:4318") from None
    if "@" in u.netloc:
        raise ValueError("must not carry credentials (user:password@)")
    if not u.hostname:
        raise ValueError("must be a URL like http://collector:4318")
    return s.rstrip("/") + "/v1/traces" if u.path in ("", "/") else s
