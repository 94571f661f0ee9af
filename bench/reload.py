"""Hot reload's "Done when" figures: reloads and replacements under steady load, in one run.

    .venv/bin/python bench/reload.py            # ~45 s: 20 reloads, 3 replacements
    .venv/bin/python bench/reload.py --quick    # ~20 s smoke: 8 reloads, 1 replacement

Five simulated engines a..e (30 ms to the first token, 10 ms a token) and one gateway
(`serve -c FILE` on a fixed port, fast probes, `streaming.shutdown_grace: 10s`) serving
a, b, c at first. All along an open-loop client offers 50 requests/s (every other one
streamed, 64 tokens, model demo-7b) on a few keep-alive connection pools. Meanwhile, one
step every 1.5 s, FILE is rewritten (temp file, rename) and POST /admin/reload asked,
cycling:
  add      a spare engine joins: time from the answer until its client_requests_total grows
  remove   the longest-serving engine leaves: its count 1 s after the answer, and again just
           before it is next added (or at the end of the run): any difference is growth
  change   the weight or the zone of a kept engine: applied, its health kept (same `since`)
  invalid  one url `ftp://x`: 400 naming backends[0].url, the running backends unchanged
           (FILE is then restored, so a replacement always starts from a valid file)
After 3 of the invalid steps, spread over the run, `serve -c FILE --replace PID` on the same
address: time to its listening line, and to the old PID's exit. The next reload waits for
that exit: while both processes listen, a POST could land on either.

A request fails on any exception before its status, or a status other than 200; a stream
is cut if it broke after its 200, its last event is not `data: [DONE]`, or an event
carries an error. Targets: no failure and no cut stream; an add serving within 2 s;
nothing new on a removed engine after 1 s; `pause_ms` under 5 ms. Prints the figures and a
PASS/FAIL line per target, writes bench/results/reload.json (process logs in
bench/results/reload_logs/); exits 0 unless the bench itself broke. Every process is
stopped by its PID at the end (perf.procs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from pulsegate.announce import LISTENING, host_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from perf.procs import Child, Procs, free_port
from support import fast_probes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "reload.json"
LOGS = HERE / "results" / "reload_logs"
MODEL = "demo-7b"
TOKENS = 64  # ~0.67 s a request on the sim: ~34 in flight at 50/s
SIMS = ("a", "b", "c", "d", "e")
FIRST = 3  # serving at the start; the others are the spares the adds take
KINDS = ("add", "remove", "change", "invalid")
GRACE_S = 10.0  # streaming.shutdown_grace
ADD_TARGET_S = 2.0
QUIET_AFTER_S = 1.0  # a removed engine gets nothing new after this
PAUSE_TARGET_MS = 5.0
ADD_WATCH_S = 5.0  # an add still idle after this is reported as never served
POLL_S = 0.02
START_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = GRACE_S + 10.0  # the drain (grace), its 1 s linger, slack
REQUEST_TIMEOUT_S = 15.0
POOLS = 4  # keep-alive clients the requests rotate over
EXAMPLES = 5  # kept per kind of problem
clock = time.perf_counter


class BenchError(Exception):
    """The bench itself could not run (a process did not start, the fleet never ready)."""


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000, 1)


class Timeline:
    """What the controller did and when (seconds from the start): examples name the step
    they happened in."""

    def __init__(self) -> None:
        self.t0 = clock()
        self.steps: list[tuple[float, str]] = []

    def now(self) -> float:
        return clock() - self.t0

    def mark(self, what: str) -> None:
        self.steps.append((round(self.now(), 3), what))

    def during(self, t: float) -> str:
        last = "warm-up"
        for at, what in self.steps:
            if at > t:
                break
            last = f"{what} (+{t - at:.2f} s)"
        return last


# ---------------------------------------------------------------------------------- load


class Load:
    """Open loop: request i starts at start + i/rate on pool i % POOLS whether or not the
    earlier ones finished; odd ones streamed. At most `max_requests`, until `stop()`."""

    def __init__(self, url: str, rate: float, max_requests: int, timeline: Timeline) -> None:
        self.url = f"{url}/v1/chat/completions"
        self.rate = rate
        self.max_requests = max_requests
        self.timeline = timeline
        self.counts: Counter[str] = Counter()
        self.kinds: dict[str, Counter[str]] = {"failed": Counter(), "cut": Counter()}
        self.examples: dict[str, list[dict[str, Any]]] = {"failed": [], "cut": []}
        self.latency: dict[str, list[float]] = {"plain": [], "stream": []}
        self.lag: list[float] = []
        self.elapsed = 0.0
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()

    def stop(self) -> None:
        self._stopping = True

    async def run(self) -> None:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=32)
        pools = [httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) for _ in range(POOLS)]
        start = clock()
        try:
            for i in range(self.max_requests):
                due = start + i / self.rate
                if (delay := due - clock()) > 0:
                    await asyncio.sleep(delay)
                if self._stopping:
                    break
                self.lag.append(clock() - due)
                task = asyncio.create_task(self._one(pools[i % POOLS], i))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self.elapsed = clock() - start
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=REQUEST_TIMEOUT_S + 5)
        finally:
            for task in self._tasks:
                task.cancel()
            for pool in pools:
                await pool.aclose()

    def _problem(self, kind: str, t0: float, stream: bool, what: str, backend: str) -> None:
        self.counts[kind] += 1
        self.kinds[kind][what.split(":")[0]] += 1
        if len(self.examples[kind]) < EXAMPLES:
            t = t0 - self.timeline.t0
            self.examples[kind].append(
                {
                    "t_s": round(t, 3),
                    "stream": stream,
                    "what": what[:300],
                    "backend": backend,
                    "during": self.timeline.during(t),
                }
            )

    async def _one(self, pool: httpx.AsyncClient, i: int) -> None:
        stream = i % 2 == 1
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"request {i}: tell a story"}],
            "max_tokens": TOKENS,
            "stream": stream,
        }
        self.counts["sent"] += 1
        self.counts["streams_sent"] += stream
        t0 = clock()
        backend = ""
        answered = False  # a 200 arrived: what breaks from here on is a cut stream
        problem: str | None = None
        try:
            if stream:
                async with pool.stream("POST", self.url, json=body) as r:
                    backend = r.headers.get("x-pulsegate-backend", "")
                    if r.status_code != 200:
                        text = (await r.aread())[:200].decode(errors="replace")
                        self._problem("failed", t0, stream, f"HTTP {r.status_code}: {text}", "")
                        return
                    answered = True
                    problem = await _read_events(r)
            else:
                r = await pool.post(self.url, json=body)
                backend = r.headers.get("x-pulsegate-backend", "")
                if r.status_code != 200:
                    what = f"HTTP {r.status_code}: {r.text[:200]}"
                    self._problem("failed", t0, stream, what, backend)
                    return
                if "choices" not in r.json():
                    self._problem("failed", t0, stream, f"no choices: {r.text[:200]}", backend)
                    return
        except Exception as e:  # any exception fails the request: its name is the figure
            what = f"{type(e).__name__}: {e}"
            self._problem("cut" if answered else "failed", t0, stream, what, backend)
            return
        if problem is not None:
            self._problem("cut", t0, stream, problem, backend)
            return
        self.counts["ok"] += 1
        self.counts["streams_ok"] += stream
        self.latency["stream" if stream else "plain"].append(clock() - t0)

    def summary(self) -> dict[str, Any]:
        c = self.counts
        lat = {
            k: {"p50_ms": ms(pct(v, 0.5)), "p99_ms": ms(pct(v, 0.99)), "max_ms": ms(max(v))}
            for k, v in self.latency.items()
            if v
        }
        return {
            "offered_rps": self.rate,
            "seconds": round(self.elapsed, 1),
            "sent": c["sent"],
            "streams_sent": c["streams_sent"],
            "ok": c["ok"],
            "streams_ok": c["streams_ok"],
            "failed": c["failed"],
            "cut_streams": c["cut"],
            "failed_kinds": dict(self.kinds["failed"]),
            "cut_kinds": dict(self.kinds["cut"]),
            "examples": self.examples,
            "latency": lat,
            "scheduler_lag_p99_ms": ms(pct(self.lag, 0.99)),
            "scheduler_lag_max_ms": ms(max(self.lag, default=0.0)),
        }


async def _read_events(r: httpx.Response) -> str | None:
    """None for a whole stream; else what is wrong with it."""
    buf = b""
    last = b""
    async for chunk in r.aiter_bytes():
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            last = ev
            data = ev.removeprefix(b"data: ")
            if data == b"[DONE]":
                continue
            try:
                obj = orjson.loads(data)
            except orjson.JSONDecodeError:
                return f"bad event: {ev[:120]!r}"
            if isinstance(obj, dict) and "error" in obj:
                return f"error event: {data[:200].decode(errors='replace')}"
    if last != b"data: [DONE]":
        return f"no [DONE]: last event {last[:120]!r}, {len(buf)} bytes left over"
    return None


# ---------------------------------------------------------------------------------- processes


async def announced(child: Child, within: float) -> int | None:
    """The port of `child`'s `listening on` line (its stdout goes to its log), or None if
    it exited or `within` seconds passed first. Polls the log: the load keeps running."""
    deadline = clock() + within
    while clock() < deadline:
        exited = child.popen.poll() is not None
        if m := LISTENING.search(child.log.read_bytes()):
            return host_port(m)[1]
        if exited:
            return None
        await asyncio.sleep(0.01)
    return None


def log_tail(child: Child, n: int = 600) -> str:
    return child.log.read_text(errors="replace")[-n:]


def serve_argv(path: Path, replace: int | None = None) -> list[str]:
    extra = ["--replace", str(replace)] if replace is not None else []
    return [sys.executable, "-m", "pulsegate", "serve", "-c", str(path), *extra]


# ---------------------------------------------------------------------------------- the run


class Bench:
    """The fleet, the gateway's file, and the reload / replacement steps with their figures."""

    def __init__(self, procs: Procs, timeline: Timeline, rate: float) -> None:
        self.procs = procs
        self.timeline = timeline
        self.rate = rate
        self.port = free_port()
        self.path = procs.log_dir / "gateway.yaml"
        self.sim_url: dict[str, str] = {}
        self.spec = {n: {"zone": f"z{1 + i % 2}", "weight": 1.0} for i, n in enumerate(SIMS)}
        self.active = list(SIMS[:FIRST])  # in the order they joined: removes take the oldest
        self.spares = list(SIMS[FIRST:])
        self.gw: Child | None = None
        self.admin = httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{self.port}",
            timeout=10,
            # A fresh connection each time: it reaches the process listening now.
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self.stats = httpx.AsyncClient(timeout=5)
        self.reloads: list[dict[str, Any]] = []
        self.adds: list[dict[str, Any]] = []
        self.removes: list[dict[str, Any]] = []
        self.replacements: list[dict[str, Any]] = []
        self._out: dict[str, dict[str, Any]] = {}  # removed, awaiting their end count
        self._watchers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- files and reads

    def config(self, active: list[str], bad_url: bool = False) -> dict[str, Any]:
        backends = [
            {"name": n, "url": self.sim_url[n], "models": [MODEL], **self.spec[n]} for n in active
        ]
        if bad_url:
            backends[0] = {**backends[0], "url": "ftp://x"}
        return {
            "gateway": {"listen": f"127.0.0.1:{self.port}"},
            "backends": backends,
            "probes": fast_probes(),
            "streaming": {"shutdown_grace": f"{GRACE_S:g}s"},
        }

    def write(self, config: dict[str, Any]) -> None:
        """Whole or not at all, as an operator's deploy: a temp file, then a rename."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config))
        tmp.replace(self.path)

    async def served(self, name: str) -> tuple[int, int]:
        """(client_requests_total, inflight) of engine `name`."""
        s = (await self.stats.get(f"{self.sim_url[name]}/sim/stats")).json()
        return int(s["client_requests_total"]), int(s["inflight"])

    async def backends(self) -> dict[str, dict[str, Any]]:
        r = await self.admin.get("/admin/backends")
        r.raise_for_status()
        return {b["name"]: b for b in r.json()["backends"]}

    # -- start

    async def start(self) -> None:
        sims = {
            n: self.procs.start(
                f"sim-{n}",
                [sys.executable, "-m", "pulsegate", "sim", "--port", "0", "--name", n],
                announce=False,
            )
            for n in SIMS
        }
        ports = await asyncio.gather(*(announced(c, START_TIMEOUT_S) for c in sims.values()))
        for (n, child), port in zip(sims.items(), ports, strict=True):
            if port is None:
                raise BenchError(f"sim {n} did not start:\n{log_tail(child)}")
            self.sim_url[n] = f"http://127.0.0.1:{port}"
        self.write(self.config(self.active))
        self.gw = self.procs.start("gateway-0", serve_argv(self.path), announce=False)
        if await announced(self.gw, START_TIMEOUT_S) is None:
            raise BenchError(f"the gateway did not start:\n{log_tail(self.gw)}")
        deadline = clock() + START_TIMEOUT_S
        while clock() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if all(b["state"] == "ready" for b in (await self.backends()).values()):
                    return
            await asyncio.sleep(0.1)
        raise BenchError("the fleet was not ready within 30 s")

    # -- reloads

    async def reload(self, i: int, kind: str) -> None:
        rec: dict[str, Any] = {"i": i, "kind": kind, "t_s": round(self.timeline.now(), 3)}
        try:
            await self._reload(kind, rec)
        except Exception as e:  # a step that broke is a figure, not the end of the run
            rec["expected"] = False
            rec.setdefault("notes", []).append(f"step broke: {type(e).__name__}: {e}")
        self.reloads.append(rec)

    async def _reload(self, kind: str, rec: dict[str, Any]) -> None:
        notes: list[str] = rec.setdefault("notes", [])
        before: dict[str, dict[str, Any]] = {}
        if kind == "add":
            name = self.spares.pop(0)
            count_before, _ = await self.served(name)
            if (out := self._out.pop(name, None)) is not None:
                out["count_end"] = count_before
                out["window_s"] = round(self.timeline.now() - out["t_s"], 2)
            self.active.append(name)
            self.write(self.config(self.active))
        elif kind == "remove":
            name = self.active.pop(0)
            self.spares.append(name)
            self.write(self.config(self.active))
        elif kind == "change":
            name = self.active[0]
            n_changes = sum(r["kind"] == "change" for r in self.reloads)
            key = ("weight", "zone")[n_changes % 2]
            spec = self.spec[name]
            if key == "weight":
                spec["weight"] = 2.0 if spec["weight"] == 1.0 else 1.0
            else:
                spec["zone"] = "z2" if spec["zone"] == "z1" else "z1"
            rec["change"] = f"{key} -> {spec[key]}"
            before = await self.backends()
            self.write(self.config(self.active))
        else:
            name = self.active[0]
            self.write(self.config(self.active, bad_url=True))
        rec["backend"] = name
        self.timeline.mark(f"reload {rec['i']} {kind} {name}")
        t_send = clock()
        r = await self.admin.post("/admin/reload")
        t_answer = clock()
        body = r.json()
        rec.update(status=r.status_code, answer=body, rtt_ms=ms(t_answer - t_send))
        if kind == "invalid":
            self.write(self.config(self.active))  # the running config, for later replacements
            errors = body.get("errors", [])
            rec["expected"] = r.status_code == 400 and any("backends[0].url" in e for e in errors)
            names = set(await self.backends())
            if names != set(self.active):
                rec["expected"] = False
                notes.append(f"backends after the refusal: {sorted(names)}")
            return
        rec["pause_ms"] = body.get("pause_ms")
        want = {
            "ok": True,
            "added": [name] if kind == "add" else [],
            "removed": [name] if kind == "remove" else [],
            "restarted": [],
            "needs_replace": [],
        }
        got = {k: body.get(k) for k in want}
        rec["expected"] = r.status_code == 200 and got == want
        if got != want:
            notes.append(f"answer {got} != {want}")
        if kind == "add":
            self._watch(self._watch_add(name, count_before, t_answer))
        elif kind == "remove":
            self._watch(self._watch_remove(name, t_answer))
        else:
            after = (await self.backends())[name]
            was = before.get(name, {})
            kept = (after["state"], after["since"]) == (was.get("state"), was.get("since"))
            rec["health_kept"] = kept
            if not kept:
                rec["expected"] = False
                notes.append(
                    f"health of {name}: {was.get('state')}@{was.get('since')}"
                    f" -> {after['state']}@{after['since']}"
                )
            if after["zone"] != self.spec[name]["zone"]:
                rec["expected"] = False
                notes.append(f"zone {after['zone']!r}, the file says {self.spec[name]['zone']!r}")

    def _watch(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch_add(self, name: str, count_before: int, t_answer: float) -> None:
        rec: dict[str, Any] = {"backend": name, "t_s": round(t_answer - self.timeline.t0, 3)}
        self.adds.append(rec)
        rec["first_served_s"] = None
        while (waited := clock() - t_answer) < ADD_WATCH_S:
            with contextlib.suppress(httpx.HTTPError):
                if (await self.served(name))[0] > count_before:
                    rec["first_served_s"] = round(waited, 3)
                    return
            await asyncio.sleep(POLL_S)

    async def _watch_remove(self, name: str, t_answer: float) -> None:
        rec: dict[str, Any] = {"backend": name, "t_s": round(t_answer - self.timeline.t0, 3)}
        self.removes.append(rec)
        rec["count_at_answer"], rec["inflight_at_answer"] = await self.served(name)
        await asyncio.sleep(max(0.0, t_answer + QUIET_AFTER_S - clock()))
        rec["count_1s"], rec["inflight_1s"] = await self.served(name)
        self._out[name] = rec

    async def finish_watchers(self) -> None:
        if self._watchers:
            await asyncio.wait(set(self._watchers), timeout=ADD_WATCH_S + 2)
        for name, rec in self._out.items():  # never re-added: their end is the run's end
            with contextlib.suppress(httpx.HTTPError):
                rec["count_end"], _ = await self.served(name)
                rec["window_s"] = round(self.timeline.now() - rec["t_s"], 2)
        self._out.clear()

    # -- replacements

    async def replace(self, k: int) -> None:
        old = self.gw
        assert old is not None
        rec: dict[str, Any] = {"k": k, "t_s": round(self.timeline.now(), 3), "old_pid": old.pid}
        self.replacements.append(rec)
        self.timeline.mark(f"replacement {k} of pid {old.pid}")
        t0 = clock()
        new = self.procs.start(f"gateway-{k}", serve_argv(self.path, old.pid), announce=False)
        rec["new_pid"] = new.pid
        port = await announced(new, START_TIMEOUT_S)
        if port is None:
            rec["error"] = f"no listening line (rc {new.popen.poll()}): {log_tail(new)}"
            return  # the old one keeps serving
        rec["listening_s"] = round(clock() - t0, 3)
        rec["same_port"] = port == self.port
        self.timeline.mark(f"replacement {k} listening")
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(old.popen.wait, EXIT_TIMEOUT_S)
        rc = old.popen.poll()
        rec["old_rc"] = rc
        if rc is None:
            rec["error"] = f"old pid {old.pid} still running after {EXIT_TIMEOUT_S:g} s"
        else:
            rec["old_exit_s"] = round(clock() - t0, 3)
            self.timeline.mark(f"replacement {k}: old pid exited")
        self.gw = new
        with contextlib.suppress(httpx.HTTPError):
            rec["backends_same"] = set(await self.backends()) == set(self.active)

    async def close(self) -> None:
        await self.admin.aclose()
        await self.stats.aclose()


async def run(a: argparse.Namespace, procs: Procs) -> dict[str, Any]:
    timeline = Timeline()
    bench = Bench(procs, timeline, a.rate)
    try:
        await bench.start()
        timeline.mark("fleet ready")
        load = Load(bench.url, a.rate, int(a.rate * a.max_seconds), timeline)
        load_task = asyncio.create_task(load.run())
        await asyncio.sleep(a.warmup)
        # After the invalid steps (the file is whole again), spread over the run.
        invalid_at = [i for i in range(a.reloads) if KINDS[i % 4] == "invalid"]
        replace_at = {
            invalid_at[int((k + 0.5) * len(invalid_at) / a.replacements)]
            for k in range(a.replacements)
            if invalid_at
        }
        due = clock()
        for i in range(a.reloads):
            await asyncio.sleep(max(0.0, due - clock()))
            await bench.reload(i, KINDS[i % 4])
            if i in replace_at:
                await bench.replace(len(bench.replacements) + 1)
            due = max(due + a.interval, clock())
            if load_task.done():
                break
        await asyncio.sleep(a.tail)
        timeline.mark("load stopping")
        load.stop()
        await asyncio.wait_for(load_task, REQUEST_TIMEOUT_S + 10)
        await bench.finish_watchers()
    finally:
        await bench.close()
    return {
        "args": {**vars(a), "json": str(a.json)},
        "port": bench.port,
        "load": load.summary(),
        "reloads": bench.reloads,
        "adds": bench.adds,
        "removes": bench.removes,
        "replacements": bench.replacements,
        "timeline": timeline.steps,
    }


# ---------------------------------------------------------------------------------- report


def verdicts(res: dict[str, Any]) -> list[dict[str, Any]]:
    load, adds, removes = res["load"], res["adds"], res["removes"]
    applied = [r["pause_ms"] for r in res["reloads"] if r.get("pause_ms") is not None]
    served = [a["first_served_s"] for a in adds]
    slow = [a["backend"] for a in adds if (s := a["first_served_s"]) is None or s > ADD_TARGET_S]
    growth = {
        r["backend"]: r["count_end"] - r["count_1s"]
        for r in removes
        if "count_end" in r and "count_1s" in r
    }
    grew = {k: v for k, v in growth.items() if v}
    reps = res["replacements"]
    good_reps = [
        r for r in reps if r.get("old_rc") == 0 and r.get("same_port") and "error" not in r
    ]
    as_expected = sum(bool(r.get("expected")) for r in res["reloads"])
    max_add = max((s for s in served if s is not None), default=None)
    return [
        {
            "target": "no failed request, no cut stream",
            "pass": load["failed"] == 0 and load["cut_streams"] == 0 and load["ok"] > 0,
            "figure": f"{load['failed']} failed, {load['cut_streams']} cut, of {load['sent']}",
        },
        {
            "target": f"an added backend serves within {ADD_TARGET_S:g} s",
            "pass": bool(adds) and not slow,
            "figure": f"max {max_add} s over {len(adds)} adds; slow or never: {slow}",
        },
        {
            "target": f"a removed backend gets nothing new after {QUIET_AFTER_S:g} s",
            "pass": bool(growth) and not grew,
            "figure": f"growth {grew or 0} over {len(growth)} removes",
        },
        {
            "target": f"reload pause_ms under {PAUSE_TARGET_MS:g} ms",
            "pass": bool(applied) and max(applied) < PAUSE_TARGET_MS,
            "figure": f"p50 {statistics.median(applied) if applied else None}"
            f" max {max(applied, default=None)} ms over {len(applied)} applied",
        },
        {
            "target": "every reload answered as expected",
            "pass": as_expected == len(res["reloads"]) > 0,
            "figure": f"{as_expected}/{len(res['reloads'])}",
        },
        {
            "target": "every replacement: same port, old pid exited 0",
            "pass": len(good_reps) == len(reps) == res["args"]["replacements"],
            "figure": f"{len(good_reps)}/{len(reps)}",
        },
    ]


def report(res: dict[str, Any]) -> None:
    ld = res["load"]
    print(
        f"load      offered {ld['offered_rps']:g}/s for {ld['seconds']} s: {ld['sent']} requests"
        f" ({ld['streams_sent']} streamed); ok {ld['ok']}, failed {ld['failed']},"
        f" cut streams {ld['cut_streams']}"
    )
    for kind, lat in ld["latency"].items():
        print(f"          {kind:6} p50 {lat['p50_ms']} ms  p99 {lat['p99_ms']} ms"
              f"  max {lat['max_ms']} ms")  # fmt: skip
    print(f"          scheduler lag p99 {ld['scheduler_lag_p99_ms']} ms,"
          f" max {ld['scheduler_lag_max_ms']} ms")  # fmt: skip
    print("reloads   i  kind     backend  status  pause_ms  rtt_ms  expected")
    for r in res["reloads"]:
        extra = r.get("change", "") + ("; " + "; ".join(r["notes"]) if r.get("notes") else "")
        print(
            f"          {r['i']:<2} {r['kind']:8} {r.get('backend', '?'):8}"
            f" {r.get('status', '-')!s:7} {r.get('pause_ms', '-')!s:9}"
            f" {r.get('rtt_ms', '-')!s:7} {r.get('expected')!s:8}"
            f" {extra}"
        )
    pauses = [r["pause_ms"] for r in res["reloads"] if r.get("pause_ms") is not None]
    if pauses:
        print(f"pause_ms  p50 {statistics.median(pauses):.3f}  max {max(pauses):.3f}"
              f"  (n={len(pauses)} applied)")  # fmt: skip
    for a in res["adds"]:
        print(f"add       {a['backend']} at {a['t_s']} s: first served after"
              f" {a['first_served_s']} s")  # fmt: skip
    for r in res["removes"]:
        if "count_1s" not in r:
            print(f"remove    {r['backend']} at {r['t_s']} s: no count read")
            continue
        print(
            f"remove    {r['backend']} at {r['t_s']} s: +{r['count_1s'] - r['count_at_answer']}"
            f" in the first {QUIET_AFTER_S:g} s (inflight {r['inflight_at_answer']} ->"
            f" {r['inflight_1s']}), +{r.get('count_end', r['count_1s']) - r['count_1s']} after,"
            f" window {r.get('window_s')} s"
        )
    for p in res["replacements"]:
        print(
            f"replace   #{p['k']} at {p['t_s']} s pid {p['old_pid']} -> {p.get('new_pid')}:"
            f" listening {p.get('listening_s')} s, old exit {p.get('old_exit_s')} s"
            f" (rc {p.get('old_rc')}), same port {p.get('same_port')},"
            f" backends {p.get('backends_same')} {p.get('error', '')}"
        )
    for kind in ("failed", "cut"):
        if ld[f"{kind}_kinds"]:
            print(f"{kind:9} {ld[f'{kind}_kinds']}")
        for ex in ld["examples"][kind]:
            print(f"  example {json.dumps(ex)}")
    for v in res["verdicts"]:
        print(f"{'PASS' if v['pass'] else 'FAIL'}  {v['target']}: {v['figure']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~20 s: 8 reloads, 1 replacement")
    ap.add_argument("--rate", type=float, default=50.0, help="requests/s offered")
    ap.add_argument("--reloads", type=int, default=20)
    ap.add_argument("--replacements", type=int, default=3)
    ap.add_argument("--interval", type=float, default=1.5, help="seconds between reloads")
    ap.add_argument("--warmup", type=float, default=5.0, help="seconds of load before")
    ap.add_argument("--tail", type=float, default=5.0, help="seconds of load after")
    ap.add_argument("--max-seconds", type=float, default=170.0, help="the load's bound")
    ap.add_argument("--json", type=Path, default=RESULTS)
    a = ap.parse_args()
    if a.quick:
        a.reloads, a.replacements, a.warmup, a.tail, a.max_seconds = 8, 1, 2.0, 3.0, 60.0
    shutil.rmtree(LOGS, ignore_errors=True)  # this run's logs only
    LOGS.mkdir(parents=True)
    procs = Procs(LOGS)
    try:
        res = asyncio.run(run(a, procs))
    except Exception:
        traceback.print_exc()
        print(f"the bench broke; logs in {LOGS}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
    res["verdicts"] = verdicts(res)
    report(res)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(res, indent=2))
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
