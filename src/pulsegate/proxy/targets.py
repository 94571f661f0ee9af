"""What the proxy needs per backend, computed once from the config: URL and upstream headers."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from pulsegate.config import BackendConfig

log = logging.getLogger("pulsegate.proxy")


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    url: str
    # Carries the backend's key (`api_key_env`): kept out of the repr, so no log line or
    # traceback that shows a Target shows the key.
    headers: dict[str, str] = field(repr=False)
    resume: str = "vllm"


def target(b: BackendConfig) -> Target:
    headers = {"content-type": "application/json"}
    if b.api_key_env:
        key = os.environ.get(b.api_key_env)
        if key:
            headers["authorization"] = f"Bearer {key}"
        else:
            log.warning("backend %s: environment variable %s is not set", b.name, b.api_key_env)
    return Target(b.name, b.url, headers, b.resume)
