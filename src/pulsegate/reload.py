"""Reload in place: the config file re-read while the gateway runs, nothing it carries lost.

Asked by `SIGHUP` (what `systemctl reload` sends), `POST /admin/reload` and
`pulsegate reload --url URL`. The file is loaded and validated exactly as `pulsegate check`
does; an invalid file changes nothing (the old config stays in force) and its errors name
each key path. A valid one is applied in one synchronous step on the event loop, so no
request ever sees half of it: backends added start cold and are probed at once, removed
ones take no new request while their requests and streams finish, changed ones keep their
health history unless their URL changed (`Fleet.reconfigure`); every other key applies at
once. The keys bound to the process itself (`gateway.listen`, `gateway.workers`,
`gateway.mode`, and the HTTP server's `client_idle_timeout`, `client_header_timeout`,
`max_client_connections`) keep their running values and the outcome says so: they need a
replacement (`pulsegate serve --replace PID`).

Every reload, applied or refused, is one event in `/admin/events`, one log line and one
count in `pulsegate_config_reloads_total{result}`. Signals arriving while a reload is due
are coalesced: ten SIGHUPs in a second are one or two reloads, and the last file wins.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from pulsegate.config import Config, ConfigError, load_config
from pulsegate.control.service import HealthService
from pulsegate.health.fleet import Reconfigured

log = logging.getLogger("pulsegate.reload")

# The keys a reload cannot change in a running process: the listening socket, the process
# layout, the proxy's kind of verdicts, and what the HTTP server and its connection guard
# were built with (`runtime.runner`, `runtime.client_site`).
PROCESS_KEYS = (
    ("gateway.listen", lambda c: (c.gateway.host, c.gateway.port)),
    ("gateway.workers", lambda c: c.gateway.workers),
    ("gateway.mode", lambda c: c.gateway.mode),
    ("gateway.client_idle_timeout", lambda c: c.gateway.client_idle_timeout),
    ("gateway.client_header_timeout", lambda c: c.gateway.client_header_timeout),
    ("gateway.max_client_connections", lambda c: c.gateway.max_client_connections),
)


@dataclass(frozen=True, slots=True)
class ReloadOutcome:
    ok: bool
    errors: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    restarted: tuple[str, ...] = ()
    # Keys changed in the file that keep their running value (they need a replacement).
    unchanged_keys: tuple[str, ...] = ()
    # How long the event loop (so the proxy path) was busy applying it.
    pause_s: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "errors": list(self.errors),
            "added": list(self.added),
            "removed": list(self.removed),
            "restarted": list(self.restarted),
            "needs_replace": list(self.unchanged_keys),
            "pause_ms": round(self.pause_s * 1000, 3),
        }


def keep_process_keys(running: Config, new: Config) -> tuple[Config, tuple[str, ...]]:
    """`new` with the running values of the keys a reload cannot change, and which of them
    the file changed."""
    changed = tuple(k for k, get in PROCESS_KEYS if get(running) != get(new))
    g = dataclasses.replace(
        new.gateway,
        host=running.gateway.host,
        port=running.gateway.port,
        workers=running.gateway.workers,
        mode=running.gateway.mode,
        client_idle_timeout=running.gateway.client_idle_timeout,
        client_header_timeout=running.gateway.client_header_timeout,
        max_client_connections=running.gateway.max_client_connections,
    )
    return dataclasses.replace(new, gateway=g), changed


class Reloader:
    """Loads the file, hands a valid config to `apply`, records what happened."""

    def __init__(
        self,
        path: str,
        current: Callable[[], Config],
        apply: Callable[[Config], Reconfigured],
        health: HealthService,
    ) -> None:
        self.path = path
        self._current = current
        self._apply = apply
        self._health = health
        self._scheduled = False
        self.counter = health.metrics.reloads

    def reload(self) -> ReloadOutcome:
        """Re-read the file and apply it, or refuse it; synchronous."""
        h = self._health
        try:
            new = load_config(self.path)
        except ConfigError as e:
            return self._refused(tuple(e.errors))
        running = self._current()
        cfg, kept = keep_process_keys(running, new)
        t0 = time.perf_counter()  # the pause itself, for the outcome: not a deadline
        try:
            change = self._apply(cfg)
        except ValueError as e:
            return self._refused((str(e),))
        pause = time.perf_counter() - t0
        out = ReloadOutcome(True, (), change.added, change.removed, change.restarted, kept, pause)
        self.counter.inc(("ok",))
        words = [f"config reloaded from {self.path}"]
        for label, names in (
            ("added", out.added),
            ("removed", out.removed),
            ("restarted (new URL)", out.restarted),
        ):
            if names:
                words.append(f"{label}: {', '.join(names)}")
        if kept:
            words.append(f"{', '.join(kept)} changed: takes effect with serve --replace")
        reason = "; ".join(words)
        h.events.record("config", "loaded", "reloaded", reason, out.as_dict(), "reload")
        log.info("%s (applied in %.2f ms)", reason, pause * 1000)
        return out

    def _refused(self, errors: tuple[str, ...]) -> ReloadOutcome:
        h = self._health
        self.counter.inc(("refused",))
        reason = f"config reload refused, the running config stays: {'; '.join(errors)}"
        h.events.record("config", "loaded", "refused", reason, {"errors": list(errors)}, "reload")
        log.warning(reason)
        return ReloadOutcome(False, errors)

    def request(self) -> None:
        """SIGHUP: reload on the loop's next turn; signals meanwhile are one reload."""
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        self.reload()


def admin_route(
    reloader: Reloader,
) -> tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]:
    """`POST /admin/reload` (admin-guarded like every admin route): 200 with what changed,
    or 400 with the errors (the running config stays)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        out = reloader.reload()
        body = orjson.dumps(out.as_dict())
        return web.Response(
            body=body, status=200 if out.ok else 400, content_type="application/json"
        )

    return ("POST", "/admin/reload", handle)
