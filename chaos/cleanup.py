"""Remove whatever a chaos lab left behind: `python -m chaos.cleanup` (or `chaos/cleanup`).

Every lab runs this first, so a second run on the same machine always starts clean; run it by
hand after a `kill -9` of a lab. It removes only what a lab creates: namespaces named `pgx-*`
(with every process inside them, and with them their veths, rules, qdiscs and NFQUEUE
helpers), the root-namespace link `pgx0` with its routes, the 10.200.0.0/16 guard route when a
lab added it, and the root-namespace processes a lab recorded (gateways), checked to still be
pulsegate processes. It refuses while a live lab holds the lock, unless --force.
"""

from __future__ import annotations

import argparse
import os
import sys

from chaos import netlab


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="chaos.cleanup", description=__doc__)
    ap.add_argument("--force", action="store_true", help="clean up even while a lab runs")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("chaos.cleanup: needs root", file=sys.stderr)
        return 2
    lock = netlab.Lock()
    if not lock.acquire() and not args.force:
        msg = (
            f"chaos.cleanup: a chaos lab is running (it holds {netlab.LOCK_FILE}); "
            "it cleans up after itself. Use --force to tear it down anyway."
        )
        print(msg, file=sys.stderr)
        return 1
    try:
        done = netlab.cleanup(verbose=True)
    finally:
        lock.release()
    if not done:
        print("chaos.cleanup: nothing to clean up")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
