"""The recorders of one proxy process, from its config: the access log and the tracer.

`ProxySide` owns one `Recording` (the single-process gateway and every proxy worker alike):
it makes the access log (`gateway.access_log`) and the tracer
(`observability.otlp_endpoint`) the config asks for, gives the attempt opener the tracer's
`traceparent` hook, and follows reloads: a reload reopens the access log (as SIGUSR1 does),
moves it when its target changed, and starts, stops or replaces the tracer when its keys
changed. With neither key set it holds nothing, and the proxy path pays nothing.
"""

from __future__ import annotations

import asyncio

from pulsegate.config import Config
from pulsegate.observe.access_log import AccessLog
from pulsegate.observe.traces import Tracer
from pulsegate.proxy.attempt import AttemptOpener
from pulsegate.proxy.exchange import Recorder
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.ports import Verdicts
from pulsegate.runtime import TaskSet


class Recording:
    def __init__(
        self, cfg: Config, verdicts: Verdicts, metrics: ProxyMetrics, opener: AttemptOpener
    ) -> None:
        self.verdicts = verdicts
        self.metrics = metrics
        self.opener = opener
        self.access_log: AccessLog | None = self._access_log(cfg)
        self.tracer: Tracer | None = self._tracer(cfg)
        self.config = cfg
        self.started = False
        self._closing = TaskSet("recording")  # retired logs and tracers finishing
        self._retiring: set[asyncio.Task[None]] = set()
        self._wire()

    @property
    def recorders(self) -> tuple[Recorder, ...]:
        return tuple(r for r in (self.access_log, self.tracer) if r is not None)

    def _access_log(self, cfg: Config) -> AccessLog | None:
        target = cfg.gateway.access_log
        return None if target is None else AccessLog(target, self.metrics.access_log_dropped)

    def _tracer(self, cfg: Config) -> Tracer | None:
        if cfg.observability.otlp_endpoint is None:
            return None
        return Tracer(cfg.observability, self.verdicts, self.metrics.traces_dropped)

    def _wire(self) -> None:
        self.opener.trace = self.tracer.headers if self.tracer is not None else None

    def start(self) -> None:
        """On the running loop: the access log's flush task, the tracer's export thread."""
        self.started = True
        if self.access_log is not None:
            self.access_log.start()
        if self.tracer is not None:
            self.tracer.start()

    def reopen(self) -> None:
        """SIGUSR1: reopen the access log's file (it was rotated)."""
        if self.access_log is not None:
            self.access_log.reopen()

    def reconfigure(self, cfg: Config) -> None:
        """A reload: reopen the log, or move, start or stop it and the tracer."""
        old, self.config = self.config, cfg
        target = cfg.gateway.access_log
        if self.access_log is not None and target is not None:
            self.access_log.reopen(target if target != old.gateway.access_log else None)
        elif target != old.gateway.access_log:
            # On or off. Turned off: the lines of requests still in flight on the old
            # `Forwarder` are not written.
            self._retire(self.access_log)
            self.access_log = self._access_log(cfg)
            if self.access_log is not None and self.started:
                self.access_log.start()
        if cfg.observability != old.observability:
            self._retire(self.tracer)
            self.tracer = self._tracer(cfg)
            if self.tracer is not None and self.started:
                self.tracer.start()
            self._wire()

    def _retire(self, rec: AccessLog | Tracer | None) -> None:
        """A recorder the reload replaced: requests still in flight on the old `Forwarder`
        may still record into it for a moment; it writes what it has, then closes."""
        if rec is None:
            return
        if isinstance(rec, AccessLog):
            task = self._closing.spawn(rec.close(), "access-log-close")
        else:
            task = self._closing.spawn(asyncio.to_thread(rec.close), "tracer-close")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def close(self) -> None:
        """Shutdown: write every pending line, export every queued span."""
        self.opener.trace = None
        if self.access_log is not None:
            await self.access_log.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)
        await asyncio.gather(*self._retiring, return_exceptions=True)


__all__ = ["Recording"]
