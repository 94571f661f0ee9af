"""The front door (`auth:`): who is asking, may they ask for this model, and is it too often.

`FrontDoor` implements `proxy.exchange.Door` over a `KeyRing` (the keys in force, by
digest) and a `LimitStore` (their buckets). Per request:

- `identify` (before the body is read): the presented key's digest names the caller, or
  the answer is 401 `invalid_api_key`. It sets `ex.key` (the name) and `ex.ticket`, so the
  forwarder calls `settle` for every request a known key made, refused or not, and
  `pulsegate_key_requests_total` counts them all. `ex.ticket` is the key's `Caller`: its
  limits' `Account` is bound when the ring is made, so a request looks nothing up.
- `admit` (after the parse): the model against the key's globs (403 `model_not_allowed`),
  then one request and the prompt's estimated tokens from the store (429 `rate_limited`
  with `Retry-After`). The `x-ratelimit-*` headers go on the refusal and on the answer.
- `settle` (when the request ends): frees the slot in flight and corrects the tokens by
  the answer's usage.

Prompt tokens are estimated as body bytes / 4: OpenAI's rule of thumb for English is ~4
characters a token (cl100k measures ~4.2), and the JSON envelope (`{"model": ...,
"messages": [{"role": ...`, ~60 bytes) counts too, so ordinary prompts are over-estimated
by a few tokens, on the safe side; CJK text (3 bytes a character, about one token each) is
under-estimated ~3x until `settle` charges the difference. Completion tokens are only
known at the end and are charged then.

Nothing secret leaves here: errors name no key, the metrics and `ex.key` carry the key's
name, and the key itself is never stored (only its digest, in the ring).
"""

from __future__ import annotations

import math
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from pulsegate.clock import Clock
from pulsegate.config import Config
from pulsegate.front.fleet import FleetLimits
from pulsegate.front.keys import Caller, KeyRing, presented
from pulsegate.front.limits import Account, LimitStore, LocalLimits, Quota
from pulsegate.proxy.exchange import Exchange
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.request import ProxyRequest, Rejection

if TYPE_CHECKING:
    from pulsegate.front.fleet_sync import FleetSync

BYTES_PER_TOKEN = 4
# The label of refusals that have no key name (no key, an unknown key): not a valid name.
NO_KEY = "-"

_MISSING = Rejection(
    401,
    "missing API key: send 'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
    "invalid_api_key",
)
_UNKNOWN = Rejection(401, "invalid API key", "invalid_api_key")


class FrontDoor:
    def __init__(
        self,
        ring: KeyRing,
        store: LimitStore,
        metrics: ProxyMetrics,
        sync: FleetSync | None = None,
        url: str | None = None,
    ) -> None:
        self.ring = ring
        self.store = store
        # With `cluster.redis`: the reports that make the store's limits fleet-wide, and
        # the URL they go to (compared on reload; never shown).
        self.sync = sync
        self.url = url
        ring.bind(store)
        self._requests = metrics.key_requests
        self._tokens = metrics.key_tokens
        self._rejections = metrics.key_rejections

    def identify(self, headers: Mapping[str, str], ex: Exchange) -> Rejection | None:
        key = presented(headers)
        if key is None:
            self._rejections.inc((NO_KEY, "missing_key"))
            return _MISSING
        caller = self.ring.find(key)
        if caller is None:
            self._rejections.inc((NO_KEY, "unknown_key"))
            return _UNKNOWN
        ex.key = caller.name
        ex.ticket = caller
        return None

    def listing(self, headers: Mapping[str, str]) -> Rejection | Callable[[str], bool]:
        """`GET /v1/models` needs a key too, and lists only the models the key may use."""
        key = presented(headers)
        caller = self.ring.find(key) if key is not None else None
        if caller is None:
            reason = "missing_key" if key is None else "unknown_key"
            self._rejections.inc((NO_KEY, reason))
            return _MISSING if key is None else _UNKNOWN
        return caller.models.allows

    def admit(self, req: ProxyRequest, ex: Exchange, now: float) -> Rejection | None:
        c = ex.ticket
        if type(c) is not Caller:  # never identified: closed, not open
            return _UNKNOWN
        m = c.models
        if not m.all and not m.allows(req.model):
            self._rejections.inc((c.name, "model_not_allowed"))
            return Rejection(
                403, f"key '{c.name}' may not use model '{req.model}'", "model_not_allowed"
            )
        a = c.account
        if a is None:
            return None  # no limits: nothing to take, nothing to settle
        estimate = len(req.body) // BYTES_PER_TOKEN if a.tokens is not None else 0
        reason = a.take(estimate, now)
        headers = rate_headers(c, a)
        if reason:
            self._rejections.inc((c.name, reason))
            after = a.retry_after
            wait = max(1, math.ceil(after))
            headers["retry-after"] = str(wait)
            # The openai and anthropic clients read this first: a 0.2 s wait is not 1 s.
            headers["retry-after-ms"] = str(max(1, math.ceil(after * 1000)))
            return Rejection(429, _over(c.name, c.quota, reason, wait), "rate_limited", headers)
        ex.charged = estimate
        ex.reply_headers = headers
        return None

    def settle(self, ex: Exchange, now: float) -> None:
        c = ex.ticket
        if type(c) is not Caller:
            return
        self._requests.inc(c.code(ex.status))
        tin, tout = ex.tokens_in, ex.tokens_out
        if tin is not None:
            self._tokens.inc(c.prompt, tin)
        if tout is not None:
            self._tokens.inc(c.completion, tout)
        estimate = ex.charged
        a = c.account
        if estimate >= 0 and a is not None:
            used = (estimate if tin is None else tin) + (tout or 0)
            # Only a slot in flight or a token count has anything to settle.
            if c.quota.concurrency or (used != estimate and a.tokens is not None):
                a.settle(used - estimate, now)


def rate_headers(c: Caller, a: Account) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` headers for the limits `c` has, at `a`'s levels: the limit,
    what is left (whole units) and the time until the bucket is full again."""
    r = a.requests
    if r is not None:
        s = c.shown_requests
        s.show(r.level, r.capacity, r.rate)
        h = {
            "x-ratelimit-limit-requests": c.rpm_s,
            "x-ratelimit-remaining-requests": s.remaining_s,
            "x-ratelimit-reset-requests": s.reset_s,
        }
    else:
        h = {}
    t = a.tokens
    if t is not None:
        s = c.shown_tokens
        s.show(t.level, t.capacity, t.rate)
        h["x-ratelimit-limit-tokens"] = c.tpm_s
        h["x-ratelimit-remaining-tokens"] = s.remaining_s
        h["x-ratelimit-reset-tokens"] = s.reset_s
    return h


def _over(name: str, q: Quota, reason: str, wait: int) -> str:
    what = {
        "rpm": f"{q.rpm} requests per minute",
        "tpm": f"{q.tpm} tokens per minute",
        "concurrency": f"{q.concurrency} requests at once",
    }[reason]
    return f"key '{name}' is over its limit of {what}; retry in {wait}s"


def front_door(
    cfg: Config,
    metrics: ProxyMetrics,
    now: float,
    old: FrontDoor | None = None,
    clock: Clock | None = None,
) -> FrontDoor | None:
    """The door `cfg.auth` describes, or None without `auth:`. With `old` (a reload) the
    store carries over, retuned: keys whose limits are unchanged keep their counters (a
    change of `cluster.redis` starts a new store). With `cluster.redis` (and the `clock`
    its reports run on) the limits hold for the whole fleet (`front/fleet.py`); without it,
    with `gateway.workers` N > 1, each worker enforces 1/N of every limit (`Quota.share`)."""
    if cfg.auth is None:
        return None
    url = cfg.cluster.redis if clock is not None else None
    ring = KeyRing(cfg.auth.keys, 1 if url else cfg.gateway.workers)
    if old is not None and old.url == url:
        old.store.retune(ring.quotas, now)
        return FrontDoor(ring, old.store, metrics, old.sync, url)
    if url is None or clock is None:
        return FrontDoor(ring, LocalLimits(ring.quotas, now), metrics)
    # redis-py loads only where a Redis is named: it is a tenth of a second of every start.
    from pulsegate.front.fleet_sync import FleetSync

    fleet = FleetLimits(ring.quotas, now, participant(), cfg.gateway.workers)
    return FrontDoor(ring, fleet, metrics, FleetSync(fleet, url, clock), url)


def participant() -> str:
    """This process's name among the fleet's participants: host and pid (every worker is
    one), and a random tail, since containers' processes all tend to be pid 1."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


__all__ = ["BYTES_PER_TOKEN", "NO_KEY", "FrontDoor", "front_door", "rate_headers"]
