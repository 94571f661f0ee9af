"""The live dashboard in a real headless Chromium, against a real gateway and simulated engines.

Needs Playwright (python) and Debian's `chromium`; Playwright never downloads a browser here.
The screenshot lands in artifacts/dashboard.png (and the detail panel in
artifacts/dashboard-detail.png) for CI to keep.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

CHROMIUM = Path("/usr/bin/chromium")
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
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
STATIC = Path(__file__).resolve().parents[2] / "src/pulsegate/observe/static/dashboard.html"
TOKEN_ENV = "PULSEGATE_TEST_ADMIN_TOKEN"
TOKEN = "dashboard-test-token"
UNKNOWN = "\u2013"  # the en dash the page shows for an unknown value


def test_page_is_self_contained() -> None:
    """The page loads nothing from elsewhere: no CDN, no external script, style or font."""
    html = STATIC.read_text()
    assert not re.search(r"<script[^>]+src=", html)
    assert not re.search(r"<link[^>]+href=", html)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", html)
    assert not re.search(r"fetch\(\s*['\"]https?:", html)


@pytest.fixture
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright is not installed (pip install -e '.[dev]' installs it)",
    )
    if not CHROMIUM.exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=BROWSER_ARGS)
        try:
            yield b
        finally:
            b.close()


def _backends(gw: Gateway) -> dict[str, dict[str, Any]]:
    return gw.backends(TOKEN)


def _card(name: str, state: str | None = None) -> str:
    sel = f'.card[data-backend="{name}"]'
    return sel + (f'[data-state="{state}"]' if state else "")


@pytest.mark.slow
def test_dashboard_follows_the_fleet(
    browser: Any,
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
) -> None:
    """Every backend is listed, a fault shows as ejected within 2 s, drain works with a token."""
    sims = [start_sim(n) for n in ("east-a", "east-b", "west-a")]
    zones = {"east-a": "east-1a", "east-b": "east-1b", "west-a": "west-1a"}
    gw = start_gateway(
        {
            "gateway": {"admin_token_env": TOKEN_ENV},
            "backends": [backend_entry(s, zone=zones[s.name]) for s in sims],
            "probes": fast_probes(),
        },
        env={TOKEN_ENV: TOKEN},
    )
    wait_until(
        lambda: all(b["state"] == "ready" for b in _backends(gw).values()),
        timeout=20,
        what="all backends ready",
    )
    page = browser.new_page(viewport={"width": 1400, "height": 800})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    # Without the token the admin API answers 401: the page says so and asks for it.
    page.goto(f"{gw.url}/dashboard")
    page.wait_for_selector("#authmsg:visible", timeout=5000)
    page.fill("#tokenInput", TOKEN)
    page.press("#tokenInput", "Enter")
    for s in sims:
        page.wait_for_selector(_card(s.name, "ready"), timeout=5000)
    assert page.locator(".card").count() == 3
    assert page.is_hidden("#authmsg")

    # Unknown signals (no engine metrics scrape configured here) read as a dash, never 0.
    api = _backends(gw)
    for s in sims:
        card = page.locator(_card(s.name))
        assert card.locator("[data-f=where]").inner_text().startswith(zones[s.name])
        if api[s.name]["signals"]["gpu_free"] is None:
            assert card.locator("[data-f=vram]").inner_text() == UNKNOWN
        if api[s.name]["signals"]["kv_cache_usage"] is None:
            assert card.locator("[data-f=kv]").inner_text() == UNKNOWN

    # Some traffic, so the totals have something to show.
    with httpx.Client(base_url=gw.url, timeout=10) as client:
        for i in range(6):
            r = client.post(
                "/v1/chat/completions",
                json={"model": "demo-7b", "messages": [{"role": "user", "content": f"q{i}"}]},
            )
            assert r.status_code == 200
    wait_until(lambda: page.inner_text("#t-rps") != UNKNOWN, timeout=5, what="requests/s shown")

    # Inject a fault; once the gateway reports the ejection, the page shows it within 2 s.
    sims[1].fault("error", rate=1.0)
    wait_until(
        lambda: _backends(gw)["east-b"]["state"] == "ejected", timeout=15, what="east-b ejected"
    )
    t0 = time.monotonic()
    page.wait_for_selector(_card("east-b", "ejected"), timeout=2000)
    shown_after = time.monotonic() - t0
    assert shown_after < 2.0
    page.wait_for_selector('#events li[data-state="ejected"]', timeout=2000)
    assert "east-b" in page.locator('#events li[data-state="ejected"]').first.inner_text()
    assert page.inner_text("#t-routable") == "2 / 3"
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"))

    # Clicking a backend shows its signals and its own events.
    page.click(_card("east-b"))
    page.wait_for_selector("#drawer:visible")
    assert page.inner_text("#d-name") == "east-b"
    assert "error rate" in page.inner_text("#d-signals")
    page.wait_for_selector('#d-events li[data-state="ejected"]', timeout=3000)
    page.screenshot(path=str(ARTIFACTS / "dashboard-detail.png"))

    # Drain and undrain from the page (the token is set, so the buttons are there).
    page.click(_card("west-a"))
    wait_until(lambda: page.inner_text("#d-name") == "west-a", timeout=3, what="west-a panel")
    page.click("#a-drain")
    page.wait_for_selector(_card("west-a", "drained"), timeout=3000)
    assert _backends(gw)["west-a"]["state"] == "drained"
    page.click("#a-undrain")
    wait_until(
        lambda: _backends(gw)["west-a"]["state"] != "drained", timeout=5, what="west-a undrained"
    )
    page.wait_for_selector(_card("west-a", "ready"), timeout=10_000)
    assert errors == []
