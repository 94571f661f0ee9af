"""`make chaos`: every fault against pulsegate and the three baselines; a table and a JSON file.

    .venv/bin/python -m chaos.run                      # full: 22 faults x 4 modes, ~35 min
    .venv/bin/python -m chaos.run --quick              # 5 faults, shorter holds, ~8 min
    .venv/bin/python -m chaos.run -f loss_to,big_drop -m pulsegate,polling
    .venv/bin/python -m chaos.run -m envoy-epp         # Envoy + pulsegate epp (not in a full run)
    .venv/bin/python -m chaos.run --list               # the fault catalogue
    .venv/bin/python -m chaos.run --publish            # also merge into docs/chaos-results.*
    .venv/bin/python -m chaos.run --replicas           # issue 17: 3 replicas, Redis faults, ~2 min
    .venv/bin/python -m chaos.run --fleet              # issue 21: fleet events, loopback, ~2 min

Needs root (network namespaces, iptables). Every namespace, rule and process is removed at
the end, on failure and on Ctrl-C; a run first removes whatever an earlier crashed run left
(`python -m chaos.cleanup` does only that). Raw logs go to the output directory
(default artifacts/chaos/latest).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from chaos import fleet, netlab, publish, replicas, report
from chaos.faults import BY_KEY, FAULTS, QUICK
from chaos.lab import ALL_MODES, ENVOY_EPP, LAB_HEALTH, MODES, POLLING_PROBES, Lab
from chaos.scenario import Settings, run
from chaos.tap import Tap

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chaos.run", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("-f", "--faults", help="comma-separated fault keys (default: all)")
    ap.add_argument("-m", "--modes", help=f"comma-separated modes of {','.join(ALL_MODES)} "
                    f"(default: {','.join(MODES)})")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help=f"faults {','.join(QUICK)}, holds x0.6")
    ap.add_argument("--rate", type=float, default=50.0, help="client requests per second")
    ap.add_argument("--backends", type=int, default=3, help="simulated engines (>= 3)")
    ap.add_argument("--itl-ms", type=float, default=10.0,
                    help="the simulated engines' time between tokens (sim --itl-ms)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "artifacts" / "chaos" / "latest")
    ap.add_argument("--publish", action="store_true", help="merge into docs/chaos-results.*")
    ap.add_argument("--list", action="store_true", help="print the fault catalogue and exit")
    ap.add_argument("--replicas", nargs="?", const=",".join(replicas.BY_KEY), metavar="FAULTS",
                    help="only the Redis faults under 3 replicas (chaos/replicas.py)")  # fmt: skip
    ap.add_argument("--fleet", nargs="?", const=",".join(fleet.EVENTS), metavar="EVENTS",
                    help="only the fleet events, on loopback (chaos/fleet.py)")  # fmt: skip
    return ap.parse_args(argv)


def _git_rev() -> str:
    """HEAD, with `+dirty` when src/ has uncommitted changes (they are what runs)."""
    p = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    d = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"],
                       capture_output=True, text=True, check=False)  # fmt: skip
    return (p.stdout.strip() or "unknown") + ("+dirty" if d.stdout.strip() else "")


async def _main(args: argparse.Namespace, lab: Lab) -> dict[str, Any]:
    keys = args.faults.split(",") if args.faults else list(QUICK if args.quick else BY_KEY)
    unknown = [k for k in keys if k not in BY_KEY]
    if unknown:
        raise SystemExit(f"unknown fault(s): {', '.join(unknown)}; see --list")
    modes = args.modes.split(",") if args.modes else list(MODES)
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        raise SystemExit(f"unknown mode(s): {', '.join(bad)}; choose from {', '.join(ALL_MODES)}")
    if "delay" in keys and importlib.util.find_spec("fnfqueue") is None:
        print("chaos: skipping `delay`: it needs fnfqueue (.venv/bin/pip install fnfqueue)")
        keys.remove("delay")
    settings = Settings(
        rate=args.rate, hold_scale=0.6 if args.quick else 1.0, raw_dir=args.out / "raw"
    )
    load_start = os.getloadavg()
    git = _git_rev()  # the code the run starts with (others may commit while it runs)
    tap = Tap().start()
    runs: list[dict[str, Any]] = []
    t0 = time.time()
    total = len(keys) * len(modes)
    try:
        for fi, key in enumerate(keys):
            fault = BY_KEY[key]
            for mi, mode in enumerate(modes):
                n = fi * len(modes) + mi + 1
                print(f"[{n}/{total}] {key} / {mode} ...", end=" ", flush=True)
                if mode == ENVOY_EPP and fault.needs_serve:  # not run: the table says why
                    runs.append({"fault": key, "mode": mode, "ok": True,
                                 "needs_serve": fault.needs_serve})  # fmt: skip
                    print(f"not run: needs serve ({fault.needs_serve})", flush=True)
                    continue
                r = await run(lab, fault, mode, settings, tap, seed=n)
                r["itl_ms"] = args.itl_ms
                runs.append(r)
                print(report.one_line(r), flush=True)
    finally:
        tap.stop()
    return {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
            "duration_s": round(time.time() - t0, 1),
            # Every scenario starts fresh processes from the working tree: if the code changed
            # during the run, the two differ and the scenarios ran on a mix.
            "git": git if git == _git_rev() else f"{git} (start) .. {_git_rev()} (end)",
            "host": platform.node(),
            "kernel": platform.release(),
            "cpus": _cpus(),
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg(),
            "backends": args.backends,
            "itl_ms": args.itl_ms,
            "rate_rps": settings.rate,
            "pre_s": settings.pre,
            "hold_scale": settings.hold_scale,
            "client_timeout_s": settings.timeout,
            "quick": args.quick,
            "lab_health": LAB_HEALTH,
            "polling_probes": POLLING_PROBES,
            "faults": {k: _fault_meta(k, settings.hold_scale) for k in keys},
            "modes": modes,
        },
        "runs": runs,
    }


def _fault_meta(key: str, hold_scale: float) -> dict[str, Any]:
    f = BY_KEY[key]
    return {"title": f.title, "kind": f.kind, "hold_s": max(1.0, f.hold * hold_scale)}


def _cpus() -> int:
    return len(os.sched_getaffinity(0))


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    if args.list:
        for f in FAULTS:
            print(f"{f.key:12} {f.kind:8} hold {f.hold:4.0f}s  {f.title}")
        for rf in replicas.FAULTS:  # --replicas
            print(f"{rf.key:12} {'redis':8} hold {replicas.HOLD_S:4.0f}s  {rf.title}")
        for key in fleet.EVENTS:  # --fleet
            print(f"{key:16} fleet    (chaos/fleet.py)")
        return 0
    if args.fleet:  # processes and the admin API only: no namespaces, no root
        return _fleet(args)
    netlab.ensure_tools()
    reason = netlab.why_unavailable()
    if reason:
        print(f"chaos: cannot run: {reason}", file=sys.stderr)
        return 2
    if args.backends < 3:
        print("chaos: at least 3 backends", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    lab = Lab(args.backends, out / "logs", engine_args=("--itl-ms", f"{args.itl_ms:g}"))
    lab.install_signal_handlers()
    if args.replicas:
        with lab:
            return _replicas(args, lab)
    with lab:
        doc = asyncio.run(_main(args, lab))
    (out / "chaos-results.json").write_text(json.dumps(doc, indent=1))
    md = report.markdown(doc)
    (out / "chaos-results.md").write_text(md)
    print()
    print(md)
    if args.publish:
        # Merged: the faults this run measured replace their older rows, the rest stay (each
        # row names its run), and so do the heartbeat and --replicas sections.
        old = DOCS / "chaos-results.json"
        prior = json.loads(old.read_text()) if old.exists() else None
        public = publish.merge(prior, _public(doc), tuple(BY_KEY))
        old.write_text(json.dumps(public, indent=1))
        (DOCS / "chaos-results.md").write_text(report.markdown(public))
        print(f"published to {DOCS / 'chaos-results.md'}")
    failed = [r for r in doc["runs"] if not r.get("ok")]
    return 1 if failed else 0


def _public(doc: dict[str, Any]) -> dict[str, Any]:
    """The committed JSON: every figure, without the host name."""
    meta = {k: v for k, v in doc["meta"].items() if k != "host"}
    return {
        "meta": meta,
        "runs": doc["runs"],
        **({"heartbeat": doc["heartbeat"]} if "heartbeat" in doc else {}),
        **({"replicas": doc["replicas"]} if "replicas" in doc else {}),
    }


def _replicas(args: argparse.Namespace, lab: Lab) -> int:
    """`--replicas`: the Redis faults only; with --publish, merged into docs/chaos-results."""
    keys = args.replicas.split(",")
    unknown = [k for k in keys if k not in replicas.BY_KEY]
    if unknown:
        raise SystemExit(f"unknown Redis fault(s): {', '.join(unknown)}; {list(replicas.BY_KEY)}")
    s = replicas.Settings(rate=args.rate, raw_dir=args.out / "raw")
    t0, load_start = time.time(), os.getloadavg()
    runs = asyncio.run(replicas.run_all(lab, keys, s))
    doc = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
                    "duration_s": round(time.time() - t0, 1), "git": _git_rev(),
                    "kernel": platform.release(), "cpus": _cpus(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg(), "backends": args.backends,
                    "rate_rps": s.rate, "hold_s": s.hold}, "runs": runs}  # fmt: skip
    (args.out / "replicas-results.json").write_text(json.dumps(doc, indent=1))
    md = "\n".join(report.replicas_section(doc)) + "\n"
    (args.out / "replicas-results.md").write_text(md)
    print()
    print(md)
    old = DOCS / "chaos-results.json"
    if args.publish and old.exists():
        public = json.loads(old.read_text())
        public["replicas"] = doc
        old.write_text(json.dumps(public, indent=1))
        (DOCS / "chaos-results.md").write_text(report.markdown(public))
        print(f"published to {DOCS / 'chaos-results.md'}")
    return 1 if any(not r.get("ok") for r in runs) else 0


def _fleet(args: argparse.Namespace) -> int:
    """`--fleet`: zone loss, rolling restart, two of three lost (chaos/fleet.py), on loopback;
    the table and every figure in the output directory."""
    args.out.mkdir(parents=True, exist_ok=True)
    s = fleet.Settings(rate=args.rate, quick=args.quick, logdir=args.out / "logs" / "fleet")
    t0, load_start = time.time(), os.getloadavg()
    results = asyncio.run(fleet.run_all(args.fleet.split(","), s))
    doc = {"meta": {"started": time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t0)),
                    "git": _git_rev(), "cpus": _cpus(), "loadavg_start": load_start,
                    "loadavg_end": os.getloadavg(), "rate_rps": s.rate, "quick": s.quick},
           "events": results}  # fmt: skip
    (args.out / "fleet-results.json").write_text(json.dumps(doc, indent=1))
    md = fleet.table(results) + "\n"
    (args.out / "fleet-results.md").write_text(md)
    print()
    print(md)
    old = DOCS / "chaos-results.json"
    if args.publish and old.exists():
        public = json.loads(old.read_text())
        public["fleet"] = doc
        old.write_text(json.dumps(public, indent=1))
        (DOCS / "chaos-results.md").write_text(report.markdown(public))
        print(f"published to {DOCS / 'chaos-results.md'}")
    return 0 if all(fleet.passed(k, r) for k, r in results.items()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
