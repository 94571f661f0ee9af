"""Fleet events (issue #21, item 6): several backends at once, under steady load, on loopback.

    .venv/bin/python bench/fleet_events.py [--quick] [-e zone_loss,rolling_restart,two_lost]
    .venv/bin/python -m chaos.run --fleet [EVENTS]

A `Fault` of the lab (`chaos/faults.py`) acts on one backend inside its namespace; a fleet
event acts on several and needs no network fault, only processes and the admin API, so it
runs here on loopback (no root, no namespaces): `pulsegate sim`s on fixed ports (a restart
must find the same address) behind one `pulsegate serve`, and the lab's open-loop client
(`chaos/load.py`: half streamed, half 3-5 KB prompts, unique prompts, its own deadline).

    zone_loss        4 sims, a0 a1 in zone a, b0 b1 in b, `routing.prefer_zone: a`; 50 req/s;
                     a0 and a1 SIGKILLed at the same moment, held, restarted on their ports.
                     Wanted: no client error (requests retried, streams resumed), traffic on
                     b while a is out, back on a once it returns (probation ramp).
    rolling_restart  3 sims, 50 req/s; each in turn: drain, wait for its in-flight to end,
                     SIGTERM, restart, engine warm, undrain, wait until ready at full
                     weight, next, by `scripts/rolling_restart.py` itself (the operators'
                     flow); 48-token answers (~510 ms), so each drain waits for streams.
                     Wanted: 0 errors, 0 cut streams.
    two_lost         3 sims with small batches (`--max-batch 4`, `max_inflight: 4`, ~370 ms an
                     answer: ~10.8 req/s each), offered 2x what one serves; two SIGKILLed at
                     once. Wanted: what cannot be served is refused fast (503 + Retry-After),
                     no client waits past `routing.queue_timeout` + a margin, the survivor's
                     goodput held.

Every request is one `chaos.load.Result`; figures are computed from them and from the
gateway's `/admin/events`, `/admin/backends` and `/metrics`. The processes are
`chaos/loopfleet.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import io
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from chaos.load import Load, Result
from chaos.loopfleet import MODEL, Fleet, SimSpec, wait_for
from chaos.measure import percentile

EVENTS = ("zone_loss", "rolling_restart", "two_lost")
# Small batches for two_lost, as bench/overload.py: ~370 ms an answer of 16 tokens.
SMALL = {"max_batch": 4, "ttft_ms": 50.0, "itl_ms": 20.0}
# A client waiting longer than queue_timeout + this was not shed, it timed out.
WAIT_MARGIN_S = 1.0
CUT = ("stream_cut", "stream_error", "stream_bad")
# rolling_restart's answers: 48 tokens (~510 ms), so every drain has streams to wait for.
ROLL_TOKENS = 48


@dataclass
class Settings:
    rate: float = 50.0
    quick: bool = False  # holds halved
    logdir: Path = Path("artifacts/fleet")
    probation_s: float = 10.0  # the lab's; tests shorten it

    def hold(self, seconds: float) -> float:
        return seconds * (0.5 if self.quick else 1.0)

    def health(self) -> dict[str, Any]:
        return {"probation": {"duration": f"{self.probation_s:g}s", "ramp_step": 0.1}}


# ----------------------------------------------------------------------------- figures


def ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000, 1)


def figures(results: list[Result]) -> dict[str, Any]:
    """What the clients saw: requests, errors by kind, cut streams, latency."""
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"{r.error}:{r.status}" if r.error == "status" else r.error
            errors[key] = errors.get(key, 0) + 1
    ok = [r.latency for r in results if r.ok]
    return {
        "requests": len(results),
        "streams": sum(r.stream for r in results),
        "errors": sum(errors.values()),
        "error_kinds": errors,
        "cut_streams": sum(1 for r in results if r.stream and r.error in CUT),
        "p50_ms": ms(percentile(ok, 50)),
        "p99_ms": ms(percentile(ok, 99)),
        "max_ms": ms(max(ok, default=None)),
        "retried": sum(1 for r in results if r.attempts > 1),
    }


def first_event(events: list[dict[str, Any]], name: str, to: str, after: float) -> float | None:
    ts = [e["ts"] for e in events if e.get("backend") == name and e.get("to") == to]
    return min((t for t in ts if t >= after), default=None)


async def run_load(fleet: Fleet, s: Settings, body: Callable[[Load], Any], **kw: Any) -> Any:
    """Start the load, run `body(load)`, stop the load; (body's result, results)."""
    load = Load(fleet.url, rate=kw.pop("rate", s.rate), seed=kw.pop("seed", 0), **kw)
    load.start()
    try:
        out = await body(load)
    finally:
        results = await load.stop()
    return out, results


def kill_all(fleet: Fleet, names: list[str]) -> float:
    """SIGKILL every one of `names` at the same moment (signals first, then the reaping)."""
    t = time.time()
    for n in names:
        os.kill(fleet.sims[n].pid, signal.SIGKILL)
    for n in names:
        fleet.sims[n].popen.wait(timeout=5)
    return t


def sent_in(results: list[Result], t0: float, t1: float) -> list[Result]:
    return [r for r in results if t0 <= r.t0 < t1]


def since(t: float | None, t0: float) -> float | None:
    return None if t is None else round(t - t0, 3)


# ----------------------------------------------------------------------------- the events


async def zone_loss(s: Settings) -> dict[str, Any]:
    """Zone a (both of its backends) SIGKILLed at once under load; restarted after the hold."""
    zone_a, zone_b = ["a0", "a1"], ["b0", "b1"]
    specs = [SimSpec(n, "a") for n in zone_a] + [SimSpec(n, "b") for n in zone_b]
    fleet = Fleet(specs, s.logdir / "zone_loss", s.health(), {"routing": {"prefer_zone": "a"}})
    try:
        await wait_for(fleet.full, 60, "fleet ready")
        resumes0 = fleet.counter("pulsegate_stream_resumes_total")

        async def body(load: Load) -> tuple[float, float, float]:
            await asyncio.sleep(s.hold(4))
            t_kill = kill_all(fleet, zone_a)
            await asyncio.sleep(s.hold(8))
            t_back = time.time()
            for n in zone_a:
                await asyncio.to_thread(fleet.start_sim, n)
            t_full = await wait_for(lambda: fleet.full(zone_a), 90, "zone a back at full weight")
            await asyncio.sleep(2.0)
            return t_kill, t_back, t_full

        (t_kill, t_back, t_full), res = await run_load(fleet, s, body)
        events = await asyncio.to_thread(fleet.events)
        resumes = fleet.counter("pulsegate_stream_resumes_total") - resumes0
    finally:
        fleet.close()
    out = figures(res)
    lost = sent_in(res, t_kill, t_back)
    # The last request sent after the kill whose first try still went to zone a (retried):
    # from then on every request went straight to zone b.
    tried_a = [r.t0 for r in lost if r.attempts > 1]
    spill = max(tried_a, default=t_kill) - t_kill
    settled = [r for r in lost if r.t0 > t_kill + spill]
    home_a = [r.t0 for r in res if r.t0 >= t_back and r.backend in zone_a]
    tail = sent_in(res, t_full, t_full + 2.0)
    t_first_a = min(home_a, default=t_full)
    ramping = sent_in(res, t_first_a, t_full)  # zone a back, not yet at full weight
    out |= {
        "killed": zone_a,
        "held_s": round(t_back - t_kill, 2),
        "ejected_s": {n: since(first_event(events, n, "ejected", t_kill), t_kill) for n in zone_a},
        "sent_while_lost": len(lost),
        "errors_while_lost": sum(not r.ok for r in lost),
        "retried_while_lost": len(tried_a),
        "spill_s": round(spill, 3),
        "on_b_after_spill": round(
            sum(r.backend in zone_b for r in settled) / max(1, len(settled)), 3
        ),
        "streams_resumed": int(resumes),
        "first_on_a_after_restart_s": since(min(home_a, default=None), t_back),
        "a_full_weight_after_restart_s": round(t_full - t_back, 2),
        "on_a_after_return": round(sum(r.backend in zone_a for r in tail) / max(1, len(tail)), 3),
        "on_a_while_ramping": round(
            sum(r.backend in zone_a for r in ramping) / max(1, len(ramping)), 3
        ),
        # Per second from the kill: (s, requests sent, of them answered first by zone a).
        "timeline": [
            (i, len(sec), sum(r.backend in zone_a for r in sec))
            for i in range(int(t_full - t_kill) + 3)
            if (sec := sent_in(res, t_kill + i, t_kill + i + 1))
        ],
    }
    return out


def operator_script() -> Any:
    """`scripts/rolling_restart.py`, the operators' flow, loaded by path (scripts/ is no
    package): the bench runs the very code it documents."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "rolling_restart.py"
    spec = importlib.util.spec_from_file_location("rolling_restart", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


async def rolling_restart(s: Settings) -> dict[str, Any]:
    """Every backend in turn, by `scripts/rolling_restart.py`: drain, in-flight to 0,
    SIGTERM and restart, engine warm, undrain, ready at full weight."""
    names = ["r0", "r1", "r2"]
    roll = operator_script()
    fleet = Fleet([SimSpec(n) for n in names], s.logdir / "rolling_restart", s.health(), {})
    steps: list[dict[str, Any]] = []

    def restart(name: str, _url: str) -> None:
        fleet.sims[name].stop()  # SIGTERM: the sim has nothing in flight by now
        fleet.start_sim(name)

    try:
        await wait_for(fleet.full, 60, "fleet ready")
        resumes0 = fleet.counter("pulsegate_stream_resumes_total")
        admin = roll.Admin(fleet.url)

        async def body(load: Load) -> None:
            await asyncio.sleep(s.hold(3))
            for n in names:
                t0 = time.time()
                phases = await asyncio.to_thread(roll.restart_one, [admin], n, restart)
                steps.append({"backend": n, **{k: round(v, 3) for k, v in phases.items()},
                              "total_s": round(time.time() - t0, 2)})  # fmt: skip
            await asyncio.sleep(s.hold(2))

        with contextlib.redirect_stdout(io.StringIO()):  # the script's JSON lines
            _, res = await run_load(fleet, s, body, max_tokens=ROLL_TOKENS)
        resumes = fleet.counter("pulsegate_stream_resumes_total") - resumes0
    finally:
        fleet.close()
    return figures(res) | {"steps": steps, "streams_resumed": int(resumes)}


async def side_requests(url: str, n: int) -> list[dict[str, Any]]:
    """`n` concurrent requests whose status, Retry-After and latency are kept (the load's
    `Result` rows carry no headers). aiohttp, as the load's own client: with an httpx client
    opened on the bench's loop mid-event, the refusals read 261-289 ms and the load's 503 p99
    210 ms on the loaded box; with this, 37-57 ms and 16 ms."""
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "side"}]}
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> dict[str, Any]:
            t0 = time.monotonic()
            try:
                doc = {**body, "stream": i % 2 == 1}
                async with session.post(url + "/v1/chat/completions", json=doc) as r:
                    await r.read()
                    status, ra = r.status, r.headers.get("retry-after")
            except (aiohttp.ClientError, TimeoutError) as e:
                status, ra = 0, type(e).__name__
            return {"status": status, "retry_after": ra, "ms": round((time.monotonic() - t0) * 1e3)}

        return list(await asyncio.gather(*(one(i) for i in range(n))))


async def two_lost(s: Settings) -> dict[str, Any]:
    """Two of three small-batch backends SIGKILLed under twice what one can serve."""
    names = ["c0", "c1", "c2"]
    lost, survivor = names[1:], names[0]
    specs = [SimSpec(n, **SMALL) for n in names]  # type: ignore[arg-type]
    service_s = (SMALL["ttft_ms"] + 16 * SMALL["itl_ms"]) / 1000
    one = SMALL["max_batch"] / service_s  # what one backend serves, req/s (~10.8)
    extra = {"backends": {"max_inflight": SMALL["max_batch"]}}
    fleet = Fleet(specs, s.logdir / "two_lost", s.health(), extra)
    queue_timeout = 2.0  # routing.queue_timeout's default
    try:
        await wait_for(fleet.full, 60, "fleet ready")
        resumes0 = fleet.counter("pulsegate_stream_resumes_total")
        hold = s.hold(12)

        async def body(load: Load) -> tuple[float, float, list[dict[str, Any]]]:
            await asyncio.sleep(s.hold(4))
            t_kill = kill_all(fleet, lost)
            await asyncio.sleep(hold / 2)
            side = await side_requests(fleet.url, 20)
            await asyncio.sleep(max(0.0, t_kill + hold - time.time()))
            return t_kill, time.time(), side

        (t_kill, t_end, side), res = await run_load(fleet, s, body, rate=2 * one)
        resumes = fleet.counter("pulsegate_stream_resumes_total") - resumes0
        events = await asyncio.to_thread(fleet.events)
    finally:
        fleet.close()
    out = figures(res)
    during = sent_in(res, t_kill, t_end)
    shed = [r for r in during if r.status == 503]
    other = [r for r in during if not r.ok and r.status != 503]
    settled_from = t_kill + 2 * queue_timeout  # the queue's first waiters have had their answer
    served = [r for r in res if r.ok and settled_from <= r.t1 < t_end]
    goodput = len(served) / max(1e-9, t_end - settled_from)
    refused = [x for x in side if x["status"] != 200]
    out |= {
        "offered_rps": round(2 * one, 1),
        "survivor_capacity_rps": round(one, 1),
        "ejected_s": {n: since(first_event(events, n, "ejected", t_kill), t_kill) for n in lost},
        "sent_while_lost": len(during),
        "shed_503": len(shed),
        "shed_p50_ms": ms(percentile([r.latency for r in shed], 50)),
        "shed_p99_ms": ms(percentile([r.latency for r in shed], 99)),
        "shed_max_ms": ms(max((r.latency for r in shed), default=None)),
        "other_errors_while_lost": len(other),
        "other_error_kinds": sorted(
            {r.error if r.error != "status" else str(r.status) for r in other}
        ),
        "longest_wait_ms": ms(max((r.latency for r in during), default=None)),
        "wait_bound_ms": ms(queue_timeout + WAIT_MARGIN_S),
        "survivor_goodput_rps": round(goodput, 1),
        "goodput_vs_capacity": round(goodput / one, 3),
        "side_refusals": len(refused),
        "side_refusals_with_retry_after": sum(
            1 for x in refused if x["status"] == 503 and x["retry_after"]
        ),
        "side": side,
        "streams_resumed": int(resumes),
        "survivor": survivor,
        # Requests sent just before the kill that failed (in flight on a killed backend):
        # (sent relative to the kill s, status, error, stream, attempts, latency s).
        "failed_sent_before": [
            (round(r.t0 - t_kill, 3), r.status, r.error, r.stream, r.attempts, round(r.latency, 3))
            for r in res
            if not r.ok and r.t0 < t_kill
        ],
    }
    return out


RUNNERS: dict[str, Callable[[Settings], Any]] = {
    "zone_loss": zone_loss,
    "rolling_restart": rolling_restart,
    "two_lost": two_lost,
}


async def run_all(keys: list[str], s: Settings) -> dict[str, dict[str, Any]]:
    """The events named, one after another, each on a fresh fleet."""
    unknown = [k for k in keys if k not in RUNNERS]
    if unknown:
        raise SystemExit(f"unknown fleet event(s): {', '.join(unknown)}; have {', '.join(EVENTS)}")
    out: dict[str, dict[str, Any]] = {}
    for k in keys:
        print(f"fleet: {k} ...", flush=True)
        t0 = time.monotonic()
        out[k] = await RUNNERS[k](s)
        out[k]["wall_s"] = round(time.monotonic() - t0, 1)
        print(f"fleet: {k} done in {out[k]['wall_s']:g} s", flush=True)
    return out


def _n(v: Any, unit: str = "") -> str:
    return "-" if v is None else f"{v:,}{unit}" if isinstance(v, int) else f"{v:g}{unit}"


def what_happened(key: str, r: dict[str, Any]) -> str:
    """The event's own figures, in words."""
    if key == "zone_loss":
        ej = " / ".join(_n(v and round(v * 1000), " ms") for v in r["ejected_s"].values())
        return (f"a0 / a1 ejected {ej} after the kill; {r['streams_resumed']} streams resumed, "
                f"{r['retried']} requests retried; {r['on_b_after_spill']:.0%} of what was sent "
                f"while a was out served by b; after the restart first on a in "
                f"{_n(r['first_on_a_after_restart_s'], ' s')}, a at full weight in "
                f"{_n(r['a_full_weight_after_restart_s'], ' s')} ({r['on_a_while_ramping']:.0%} "
                "on a meanwhile), then "
                f"{r['on_a_after_return']:.0%} on a")  # fmt: skip
    if key == "rolling_restart":
        steps = ", ".join(
            f"{x['backend']} {x['total_s']:g} s (drain {x['drain_s']:g}, restart "
            f"{x['restart_s']:g}, warm {x['warm_s']:g}, ready {x['ready_s']:g})"
            for x in r["steps"]
        )
        return f"{steps}; {r['streams_resumed']} streams resumed"
    return (f"offered {r['offered_rps']:g} req/s (survivor serves {r['survivor_capacity_rps']:g});"
            f" {r['shed_503']} shed with 503 in p50 / p99 / max {_n(r['shed_p50_ms'])} / "
            f"{_n(r['shed_p99_ms'])} / {_n(r['shed_max_ms'])} ms, side refusals with "
            f"Retry-After {r['side_refusals_with_retry_after']}/{r['side_refusals']}; longest "
            f"wait {_n(r['longest_wait_ms'])} ms (bound {_n(r['wait_bound_ms'])}); survivor "
            f"goodput {r['survivor_goodput_rps']:g} req/s ({r['goodput_vs_capacity']:.0%}); "
            f"other errors {r['other_errors_while_lost']}; {r['streams_resumed']} streams "
            "resumed")  # fmt: skip


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| event | requests (streams) | client errors | cut streams | p50 / p99 ms "
        "| what happened |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for k, r in results.items():
        kinds = ", ".join(f"{n} {e}" for e, n in sorted(r["error_kinds"].items()))
        errors = f"{r['errors']}" + (f" ({kinds})" if kinds else "")
        rows.append(f"| {k} | {r['requests']:,} ({r['streams']:,}) | {errors} | "
                    f"{r['cut_streams']} | {_n(r['p50_ms'])} / {_n(r['p99_ms'])} | "
                    f"{what_happened(k, r)} |")  # fmt: skip
    return "\n".join(rows)


def checks(key: str, r: dict[str, Any]) -> list[tuple[str, bool, bool]]:
    """What must hold, as (claim, held, is_timing). The tests assert the outcomes; the
    timing claims are the bench's (a loaded box can miss them without a bug)."""
    ok_zero = [("0 client errors", r["errors"] == 0, False),
               ("0 cut streams", r["cut_streams"] == 0, False)]  # fmt: skip
    if key == "zone_loss":
        return [
            *ok_zero,
            ("all sent while a was out (after the spill) served by b",
             r["on_b_after_spill"] == 1.0, False),
            ("zone a serves again after its restart", r["first_on_a_after_restart_s"] is not None,
             False),
            (">= 90% on a once back at full weight", r["on_a_after_return"] >= 0.9, False),
        ]  # fmt: skip
    if key == "rolling_restart":
        return [
            *ok_zero,
            ("every backend restarted", len(r["steps"]) == 3, False),
            ("no stream needed a resume (a drain lets streams finish)",
             r["streams_resumed"] == 0, False),
        ]  # fmt: skip
    return [
        ("0 cut streams", r["cut_streams"] == 0, False),
        ("every client error a 503", set(r["error_kinds"]) <= {"status:503"}, False),
        ("every side refusal a 503 with Retry-After",
         r["side_refusals_with_retry_after"] == r["side_refusals"], False),
        ("nothing in flight on the lost backends failed", not r["failed_sent_before"], False),
        ("no client waited past queue_timeout + 1 s",
         r["longest_wait_ms"] is not None and r["longest_wait_ms"] <= r["wait_bound_ms"], True),
        ("503s fast: p99 < 100 ms", (r["shed_p99_ms"] or 0) < 100, True),
        ("survivor goodput >= 80% of what it serves", r["goodput_vs_capacity"] >= 0.8, True),
    ]  # fmt: skip


def passed(key: str, r: dict[str, Any]) -> bool:
    return all(ok for _, ok, _ in checks(key, r))
