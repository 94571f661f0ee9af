"""Issue #21, item 6: fleet events under steady load, with figures (`chaos/fleet.py`).

    .venv/bin/python bench/fleet_events.py [--quick] [-e zone_loss,rolling_restart,two_lost]
        [--rate 50] [--json bench/results/fleet_events.json]

zone_loss: a whole zone (2 of 4 sims, `prefer_zone` a) SIGKILLed at once, restarted after
the hold. rolling_restart: every backend of 3 restarted in turn by `scripts/rolling_restart.py`
(drain, in-flight 0, restart, warm, undrain, ready). two_lost: 2 of 3 small-batch sims
SIGKILLed under twice what one serves. Each on a fresh loopback fleet (about 1 min 25 s for
all three; --quick halves the holds, about 1 min 10 s). Prints one Markdown row per event and writes
every figure (and the per-step timings) to the JSON. Figures are from a loopback run on a
shared box: the load client, the gateway and the sims share its cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from chaos import fleet  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("-e", "--events", default=",".join(fleet.EVENTS))
    p.add_argument("--quick", action="store_true", help="holds halved")
    p.add_argument("--rate", type=float, default=50.0, help="zone_loss, rolling_restart: req/s")
    p.add_argument("--json", type=Path, default=ROOT / "bench/results/fleet_events.json")
    args = p.parse_args()
    logdir = ROOT / "bench/results/fleet_logs"
    s = fleet.Settings(rate=args.rate, quick=args.quick, logdir=logdir)
    load0 = os.getloadavg()
    t0 = time.time()
    results = asyncio.run(fleet.run_all(args.events.split(","), s))
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
    out = {"argv": sys.argv[1:], "git": rev, "started": time.strftime("%Y-%m-%d %H:%M UTC",
           time.gmtime(t0)), "loadavg_start": load0, "loadavg_end": os.getloadavg(),
           "cpus": os.cpu_count(), "events": results}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    print(fleet.table(results))
    failed = 0
    for k, r in results.items():
        for claim, ok, _ in fleet.checks(k, r):
            failed += not ok
            print(f"  {'PASS' if ok else 'FAIL'} [{k}] {claim}")
    print(f"load average {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
