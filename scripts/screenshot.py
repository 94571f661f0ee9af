#!/usr/bin/env python3
"""Screenshot the live dashboard during a demo fault, for the README (docs/img/dashboard.png).

Runs `pulsegate demo` (three simulated engines, the gateway, light traffic, a fault cycle),
opens /dashboard in headless Debian Chromium through Playwright as soon as the gateway is up
(so the page gathers a score trend), waits for the demo's first fault to eject a backend,
lets the page show it for a few seconds, and saves a PNG. Stops the demo by its PID.

    .venv/bin/python scripts/screenshot.py [--out docs/img/dashboard.png]

Needs `pip install playwright` (no browser download) and `apt-get install chromium`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pulsegate.announce import read_until

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
GATEWAY = re.compile(rb"gateway\s+(http://[\w.\-]+:\d+)/v1")
MAX_BYTES = 300_000


def gateway_url(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Read the demo's stdout until it prints the gateway URL."""
    assert proc.stdout is not None
    m, buf = read_until(proc.stdout, GATEWAY, timeout, proc)
    if m:
        return m.group(1).decode()
    raise SystemExit(f"the demo did not start: {buf.decode(errors='replace')}")


def ejected(url: str) -> str | None:
    """The first backend the gateway reports as ejected, if any."""
    with urllib.request.urlopen(f"{url}/admin/backends", timeout=2) as r:
        for b in json.load(r)["backends"]:
            if b["state"] == "ejected":
                return str(b["name"])
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--port", type=int, default=0, help="gateway port (0: any free port)")
    ap.add_argument("--fault-after", type=float, default=25.0, help="seconds of calm first")
    ap.add_argument("--show", type=float, default=4.0, help="seconds to show the fault")
    ap.add_argument("--width", type=int, default=1400)
    ap.add_argument("--height", type=int, default=820)
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    demo = subprocess.Popen(
        [
            *(sys.executable, "-m", "pulsegate", "demo", "--port", str(args.port)),
            *("--fault-after", str(args.fault_after), "--fault-hold", "60"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        url = gateway_url(demo, timeout=60)
        print(f"demo gateway at {url}", flush=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
            page = browser.new_page(
                viewport={"width": args.width, "height": args.height}, device_scale_factor=1
            )
            page.goto(f"{url}/dashboard")
            page.wait_for_selector(".card[data-state=ready]", timeout=30_000)
            deadline = time.monotonic() + args.fault_after + 30
            name = None
            while name is None and time.monotonic() < deadline:
                time.sleep(0.2)
                name = ejected(url)
            if name is None:
                raise SystemExit("no backend was ejected: is the demo's fault cycle running?")
            print(f"{name} ejected; showing it for {args.show:g}s", flush=True)
            page.wait_for_selector(f'.card[data-backend="{name}"][data-state=ejected]')
            time.sleep(args.show)
            out = Path(args.out)
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out), type="png")
            browser.close()
        size = out.stat().st_size
        print(f"wrote {out} ({size // 1024} KiB)", flush=True)
        if size > MAX_BYTES:
            print(f"warning: over {MAX_BYTES // 1000} KB; try a smaller --width/--height")
            return 1
        return 0
    finally:
        if demo.poll() is None:
            os.kill(demo.pid, signal.SIGINT)  # the demo stops its own children in order
            try:
                demo.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(demo.pid, signal.SIGKILL)
                demo.wait(timeout=5)
        if demo.stdout is not None:
            demo.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
