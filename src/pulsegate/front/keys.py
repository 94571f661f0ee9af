"""Client keys: what a request presents, how it is looked up, how a new one is made. Pure.

A key travels as `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY`
(Anthropic clients). The gateway never holds a key, only the sha256 of its UTF-8 bytes
(`auth.keys[].sha256`, or hashed at load from the variable `key_env` names); a presented
key is hashed and its digest looked up in a dict.

That lookup is constant-time with respect to the stored keys: what a dict compares is the
digest of the *presented* key, so however long a lookup takes, it tells the caller about
the hash of their own guess, never about the bytes of a stored key (to aim a guess at a
stored digest's prefix they would need a sha256 preimage). No per-key `compare_digest`
loop is needed, and the cost is one hash of ~50 bytes whatever the number of keys. A key
found once is then found by its own string (`KeyRing.find`): a str dict compares strings
only when their (randomly seeded) hashes are equal, so that lookup's timing tells a guesser
nothing either, and only keys already proven by their digest are in it.
"""

from __future__ import annotations

import fnmatch
import json
import secrets
from collections.abc import Mapping, Sequence
from hashlib import sha256

from pulsegate.config import KeyConfig
from pulsegate.front.headers import Shown
from pulsegate.front.limits import Account, LimitStore, Quota

# Keys made by `pulsegate key new`: recognisable in a leaked-secret scan, 256 random bits.
KEY_PREFIX = "pg-"
KEY_BYTES = 32
# Distinct model names remembered per key for its allow-list; beyond that every request
# is matched afresh (a client choosing random model names must not grow memory).
MATCH_CACHE_MAX = 256
# Presented keys remembered per ring (`KeyRing.find`).
SEEN_MAX = 4096


def presented(headers: Mapping[str, str]) -> str | None:
    """The key the request carries (`Authorization: Bearer` first, then `x-api-key`), or
    None. An Authorization header of another scheme presents no key."""
    auth = headers.get("authorization")
    if auth is not None:
        if not auth.startswith("Bearer ") and auth[:7].lower() != "bearer ":
            return None
        return auth[7:].strip() or None
    return headers.get("x-api-key") or None


def digest(key: str) -> bytes:
    # surrogateescape: a header's undecodable bytes hash as themselves, never raise.
    return sha256(key.encode("utf-8", "surrogateescape")).digest()


class Models:
    """A key's model allow-list: fnmatch globs, matched case-sensitively, results cached."""

    __slots__ = ("_cache", "all", "globs")

    def __init__(self, globs: Sequence[str]) -> None:
        self.globs = tuple(globs)
        self.all = "*" in self.globs
        self._cache: dict[str, bool] = {}

    def allows(self, model: str) -> bool:
        if self.all:
            return True
        hit = self._cache.get(model)
        if hit is None:
            hit = any(fnmatch.fnmatchcase(model, g) for g in self.globs)
            if len(self._cache) < MATCH_CACHE_MAX:
                self._cache[model] = hit
        return hit


class Caller:
    """A known key, as the door needs it: name, allow-list, quota, the counters it is
    charged on (`account`, bound by the door; None without limits), and everything a
    request would otherwise format afresh made once: its metric labels (a label tuple per
    request and counter is ~0.1 us each) and its limits as header values."""

    __slots__ = ("account", "codes", "completion", "models", "name", "prompt", "quota",
                 "rpm_s", "shown_requests", "shown_tokens", "tpm_s")  # fmt: skip

    def __init__(self, name: str, models: Models, quota: Quota) -> None:
        self.name = name
        self.models = models
        self.quota = quota
        self.account: Account | None = None
        self.prompt = (name, "prompt")
        self.completion = (name, "completion")
        self.codes: dict[int, tuple[str, str]] = {}  # status -> labels
        self.rpm_s = str(quota.rpm)
        self.tpm_s = str(quota.tpm)
        self.shown_requests = Shown()
        self.shown_tokens = Shown()

    @property
    def limited(self) -> bool:
        """Any limit at all: the door has something to take and settle."""
        q = self.quota
        return bool(q.rpm or q.tpm or q.concurrency)

    def code(self, status: int) -> tuple[str, str]:
        labels = self.codes.get(status)
        if labels is None:
            labels = self.codes[status] = (self.name, str(status))
        return labels


class KeyRing:
    """The keys in force, by digest."""

    def __init__(self, keys: Sequence[KeyConfig], share: int = 1) -> None:
        """`share`: the processes enforcing the limits separately (`gateway.workers`);
        each takes its share of every quota (`Quota.share`)."""
        self.by_digest: dict[bytes, Caller] = {}
        # Keys already found by their digest, as presented: a hash is ~0.5 us a request and
        # a str lookup a tenth of that. Only found keys enter (an unknown one is hashed
        # every time, so guessing cannot fill it), at most SEEN_MAX, for this ring's life
        # (a reload makes a new ring). The process reads every key in every request's
        # headers anyway; this keeps the ones in use, never writes them anywhere.
        self._seen: dict[str, Caller] = {}
        self.quotas: dict[str, Quota] = {}
        for k in keys:
            q = Quota(k.rpm, k.tpm, k.concurrency).share(share)
            self.by_digest[bytes.fromhex(k.sha256)] = Caller(k.name, Models(k.models), q)
            self.quotas[k.name] = q

    def bind(self, store: LimitStore) -> None:
        """Each limited key's `account` in `store` (which holds every key in `quotas`)."""
        for c in self.by_digest.values():
            c.account = store.account(c.name) if c.limited else None

    def find(self, key: str) -> Caller | None:
        c = self._seen.get(key)
        if c is None:
            c = self.by_digest.get(sha256(key.encode("utf-8", "surrogateescape")).digest())
            if c is not None and len(self._seen) < SEEN_MAX:
                self._seen[key] = c
        return c


def new_key() -> str:
    """A fresh key: the prefix and 43 URL-safe characters (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def entry_yaml(name: str, key: str, models: Sequence[str] = (), rpm: int = 0, tpm: int = 0) -> str:
    """The keys-file entry for `key` (its digest only), ready to paste under `keys:`."""
    lines = [f"  - name: {name}", f"    sha256: {digest(key).hex()}"]
    if models:
        lines.append("    models: [" + ", ".join(json.dumps(m) for m in models) + "]")
    if rpm:
        lines.append(f"    rpm: {rpm}")
    if tpm:
        lines.append(f"    tpm: {tpm}")
    return "\n".join(lines)


__all__ = ["KEY_PREFIX", "Caller", "KeyRing", "Models", "digest", "entry_yaml", "new_key"]
