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
    # vLLM with `exact_resume`: streams ask for token ids, a break continues as those ids
    # (`dialects/token_ids.py`); the same flag on both ends means the same engine kind.
    token_ids: bool = False


def target(b: BackendConfig) -> Target:
    headers = {"content-type": "application/json"}
    if b.api_key_env:
        key = os.environ.get(b.api_key_env)
        if key:
            headers["authorization"] = f"Bearer {key}"
        else:
            log.warning("backend %s: environment variable %s is not set", b.name, b.api_key_env)
    ids = b.exact_resume and b.engine == "vllm" and b.resume == "vllm" and "completions" in b.apis
    return Target(b.name, b.url, headers, b.resume, ids)
