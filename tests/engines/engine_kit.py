"""Helpers of the engine suite: the engine pool, gateway configs, SSE parsing, figures.

Engines come from `scripts/engines.py` (venvs, the tiny model, start and stop by process
group); this module only names them for the tests and shares them across a session.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import engines as eng  # noqa: E402

LOG_DIR = ROOT / "build" / "engine-logs"
FIGURES_PATH = ROOT / "build" / "engine-figures.json"
MODEL = eng.MODEL_ID
# vLLM starts in 30-50 s alone; two or three at once on two shared cores take longer.
ENGINE_START_S = 240.0
_FIGURES: list[tuple[str, dict[str, Any]]] = []


class EnginePool:
    """Named engines for the session: `hf`, `vllm-a`, `vllm-b` (tiny-llama) and `vllm-h16`."""

    KINDS = {
        "hf": ("hf", eng.MODEL_DIR),
        "vllm-a": ("vllm", eng.MODEL_DIR),
        "vllm-b": ("vllm", eng.MODEL_DIR),
        "vllm-h16": ("vllm", eng.MODEL_H16_DIR),
    }

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.engines: dict[str, eng.Engine] = {}

    def spawn(self, name: str) -> eng.Engine:
        """Start `name` unless it runs; do not wait."""
        e = self.engines.get(name)
        if e is None:
            kind, model = self.KINDS[name]
            e = self.engines[name] = eng.new_engine(name, kind, self.log_dir, model)
        if not e.alive():
            e.stop()  # what is left of its process group, if anything
            e.start()
        return e

    def get(self, name: str, timeout: float = ENGINE_START_S) -> eng.Engine:
        """`name`, started if needed and answering `/health`."""
        e = self.spawn(name)
        if e.ready_s is None or not e.healthy():
            e.wait_healthy(timeout)
        return e

    def stop_all(self) -> None:
        for e in self.engines.values():
            e.stop()


def backend(e: eng.Engine, **extra: Any) -> dict[str, Any]:
    """The gateway's config entry for engine `e` (vLLM: metrics scrape; hf: no resume, one
    choice)."""
    entry: dict[str, Any] = {"name": e.name, "url": e.url, "models": [MODEL]}
    if e.kind == "vllm":
        entry["metrics_path"] = "/metrics"
    else:
        # transformers serve answers 422 to continue_final_message (an unknown field), and
        # one choice whatever `n` says.
        entry["resume"] = "none"
        entry["max_n"] = 1
    return {**entry, **extra}


def real_probes() -> dict[str, Any]:
    """Probe settings for real engines on a shared 2-core box: quick, with CPU-sized timeouts.

    The canary is 1.5 KB (still two MTU segments): this tokenizer makes a token of every
    byte, so the default 6 KB is ~6,100 tokens, which vLLM refuses in 40-90 ms (over the
    2,048-token context: a 400 that still proves the path) and transformers serve computes
    in 0.8-1.1 s on one CPU thread - over the 350 ms default timeout and, since it serves
    one request at a time, holding the micro-inference behind it past its own timeout.
    1.5 KB (~1,700 tokens) takes vLLM 90-170 ms and transformers serve 270-510 ms."""
    return {
        "readiness": {"interval": "500ms", "interval_unstable": "200ms", "timeout": "1s"},
        "micro_inference": {"interval": "2s", "jitter": "500ms", "timeout": "2s"},
        "canary": {"interval": "2s", "timeout": "2s", "payload_bytes": 1536},
        "metrics_interval": "250ms",
    }


def gateway_config(*backends: dict[str, Any], **sections: Any) -> dict[str, Any]:
    """A gateway config for `backends` with `real_probes()` and a 3 s stall timeout.

    The stall timeout is 3 s, not 1 s: on this two-core box, shared, a vLLM starting up or a
    neighbour's benchmark starves a running engine for over a second at times, and the
    watchdog then cut streams of engines that were fine, to resume them elsewhere (with no
    other engine left it now waits instead: docs/real-engines.md, finding 6). Sections given
    here replace these."""
    cfg: dict[str, Any] = {
        "backends": list(backends),
        "probes": real_probes(),
        "streaming": {"stall_timeout": "3s"},
    }
    cfg.update(sections)
    return cfg


def sse_data(resp: httpx.Response) -> list[bytes]:
    """Every event's data field of an SSE response, in order (`b"[DONE]"` included)."""
    out: list[bytes] = []
    buf = b""
    for chunk in resp.iter_bytes():
        buf += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            lines = [ln[5:].lstrip(b" ") for ln in ev.split(b"\n") if ln.startswith(b"data:")]
            if lines:
                out.append(b"\n".join(lines))
    if buf.strip():
        out.append(b"<<incomplete event: " + buf + b">>")
    return out


def record_figures(title: str, figures: dict[str, Any]) -> None:
    """Figures printed at the end of the run and written to build/engine-figures.json."""
    _FIGURES.append((title, figures))


def write_figures(terminalreporter: Any) -> None:
    """Print the recorded figures in pytest's summary and write them as JSON."""
    if not _FIGURES:
        return
    terminalreporter.section("real-engine figures")
    for title, figures in _FIGURES:
        terminalreporter.write_line(f"{title}:")
        for k, v in figures.items():
            terminalreporter.write_line(f"  {k}: {v}")
    FIGURES_PATH.parent.mkdir(exist_ok=True)
    FIGURES_PATH.write_text(json.dumps(dict(_FIGURES), indent=2) + "\n")


# ---------------------------------------------------------------------------------------------
# Steady client load


@dataclass
class Sample:
    """One client request: when it left and came back (wall clock), how it went."""

    sent: float
    done: float = 0.0
    status: int | None = None
    backend: str | None = None
    attempts: int | None = None
    error: str | None = None  # None: a complete, well-formed answer


class Load:
    """`rate` requests per second to the gateway from worker threads, until `stop()`.

    Each request is a short greedy chat (`tokens` tokens), streamed every other time; a
    stream counts as an answer only with one `[DONE]`, no error event and every token. Times
    are wall clock so they compare with the gateway's event `ts`."""

    def __init__(self, url: str, rate: float = 10.0, tokens: int = 8, workers: int = 16) -> None:
        self.url = url
        self.rate = rate
        self.tokens = tokens
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="load")
        self._client = httpx.Client(timeout=30, limits=httpx.Limits(max_connections=workers))
        self._thread = threading.Thread(target=self._dispatch, name="load", daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> list[Sample]:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join()
            self._pool.shutdown(wait=True)
            self._client.close()
        return self.samples

    def _dispatch(self) -> None:
        period = 1.0 / self.rate
        nxt = time.monotonic()
        i = 0
        while not self._stop.is_set():
            self._pool.submit(self._one, i)
            i += 1
            nxt += period
            self._stop.wait(max(0.0, nxt - time.monotonic()))

    def _one(self, i: int) -> None:
        s = Sample(sent=time.time())
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}"}],
            "max_tokens": self.tokens,
            "temperature": 0,
        }
        try:
            if i % 2:
                self._stream(s, body)
            else:
                r = self._client.post(f"{self.url}/v1/chat/completions", json=body)
                self._note(s, r)
                if r.status_code == 200 and r.json()["usage"]["completion_tokens"] != self.tokens:
                    s.error = "short answer"
        except (httpx.HTTPError, ValueError, KeyError) as e:
            s.error = f"{type(e).__name__}: {e}"
        s.done = time.time()
        with self._lock:
            self.samples.append(s)

    def _stream(self, s: Sample, body: dict[str, Any]) -> None:
        url = f"{self.url}/v1/chat/completions"
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with self._client.stream("POST", url, json=body) as r:
            self._note(s, r)
            if r.status_code != 200:
                r.read()
                return
            events = sse_data(r)
        if events.count(b"[DONE]") != 1 or events[-1] != b"[DONE]":
            s.error = f"{events.count(b'[DONE]')} [DONE]"
            return
        usage = None
        for e in events[:-1]:
            obj = json.loads(e)
            if "error" in obj:
                s.error = f"error event: {obj['error'].get('message', '')[:200]}"
                return
            usage = obj.get("usage") or usage
        if usage is None or usage["completion_tokens"] != self.tokens:
            s.error = f"usage {usage}"

    @staticmethod
    def _note(s: Sample, r: httpx.Response) -> None:
        s.status = r.status_code
        s.backend = r.headers.get("x-pulsegate-backend")
        a = r.headers.get("x-pulsegate-attempts")
        s.attempts = int(a) if a else None
        if r.status_code != 200:
            s.error = f"HTTP {r.status_code}"


def failed(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if s.error is not None]
