"""The admin API's door: no change from a web page, no 500 on odd tokens, no credentials in URLs.

Every gateway here is a real process on loopback (`support.Gateway`) with a simulated engine
behind it; nothing is mocked.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pulsegate.config import ConfigError, parse_config
from pulsegate.status import run_reload
from support import Gateway, Sim, backend_entry, fast_probes

DRAIN = "/admin/backends/a/drain"
FORM = {"content-type": "application/x-www-form-urlencoded"}


def _state(gw: Gateway, token: str | None = None) -> str:
    return str(gw.backends(token)["a"]["state"])


def _error(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI-shaped error of a refusal."""
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    return err  # type: ignore[no-any-return]


@pytest.fixture
def loopback_gw(start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]) -> Gateway:
    gw = start_gateway({"backends": [backend_entry(start_sim("a"))], "probes": fast_probes()})
    gw.wait_all_ready()
    return gw


def test_cross_origin_form_drain_is_refused_on_loopback(loopback_gw: Gateway) -> None:
    """With no token, a web page's form POST (evil Origin, form body) cannot drain a backend."""
    gw = loopback_gw
    r = httpx.post(
        gw.url + DRAIN, headers={"origin": "https://evil.example", **FORM}, content=b"x=1"
    )
    assert r.status_code == 403, r.text
    assert _error(r)["code"] == "cross_origin_refused"
    assert _state(gw) == "ready"


@pytest.mark.parametrize(
    ("headers", "code"),
    [
        ({"origin": "https://evil.example"}, "cross_origin_refused"),
        ({"origin": "null"}, "cross_origin_refused"),
        ({"origin": "http://127.0.0.1:1"}, "cross_origin_refused"),
        ({"host": "evil.example"}, "host_not_loopback"),
        (
            {"host": "rebound.evil.example:80", "origin": "http://rebound.evil.example:80"},
            "host_not_loopback",
        ),
        (FORM, "form_content_refused"),
        ({"content-type": "multipart/form-data; boundary=x"}, "form_content_refused"),
        ({"content-type": "text/plain;charset=UTF-8"}, "form_content_refused"),
    ],
    ids=["evil", "null", "other-port", "host", "rebound", "urlencoded", "multipart", "text"],
)
def test_tokenless_changes_a_browser_could_send_are_refused(
    loopback_gw: Gateway, headers: dict[str, str], code: str
) -> None:
    """Each of Origin, Host (DNS rebinding) and simple-form content types alone is refused."""
    gw = loopback_gw
    for path in (DRAIN, "/admin/reload"):
        r = httpx.post(gw.url + path, headers=headers, content=b"x")
        assert r.status_code == 403, (path, r.text)
        assert _error(r)["code"] == code
        assert _error(r)["type"] == "permission_error"
    assert _state(gw) == "ready"


def test_loopback_clients_still_change_the_fleet(loopback_gw: Gateway) -> None:
    """A plain POST, a JSON one, the dashboard's own same-origin fetch and `pulsegate reload`
    are taken from a loopback gateway with no token."""
    gw = loopback_gw
    r = httpx.post(gw.url + DRAIN)  # curl -X POST, the CLI: no Origin, no body
    assert r.status_code == 200, r.text
    assert _state(gw) in ("draining", "drained")
    r = httpx.post(gw.url + "/admin/backends/a/undrain", json={})
    assert r.status_code == 200, r.text
    # The dashboard: fetch(path, {method: "POST"}) from the page the gateway served.
    r = httpx.post(gw.url + DRAIN, headers={"origin": gw.url})
    assert r.status_code == 200, r.text
    r = httpx.post(
        gw.url.replace("127.0.0.1", "localhost") + "/admin/backends/a/undrain",
        headers={"origin": gw.url.replace("127.0.0.1", "localhost")},
    )
    assert r.status_code == 200, r.text
    out, err = io.StringIO(), io.StringIO()
    assert run_reload(gw.url, None, out=out, err=err) == 0, err.getvalue()
    assert httpx.get(gw.url + "/admin/events").status_code == 200  # reads as before


def test_non_loopback_gateway_without_token_refuses_changes(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Listening beyond loopback with no token: every change is refused, reads still answer."""
    sim = start_sim("a")
    gw = start_gateway(
        {
            "gateway": {"listen": "0.0.0.0:0"},
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
        }
    )
    url = f"http://127.0.0.1:{gw.port}"
    for path in (DRAIN, "/admin/reload"):
        r = httpx.post(url + path)
        assert r.status_code == 403, r.text
        err = _error(r)
        assert err["code"] == "admin_token_required"
        assert "gateway.admin_token_env" in err["message"]
    assert httpx.get(url + "/admin/backends").status_code == 200


def test_token_check_is_unchanged_when_configured(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """With a token the gateway may listen anywhere; the right token changes the fleet."""
    sim = start_sim("a")
    gw = start_gateway(
        {
            "gateway": {"listen": "0.0.0.0:0", "admin_token_env": "PG_HARDEN_TOKEN"},
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
        },
        env={"PG_HARDEN_TOKEN": "s3cret"},
    )
    url = f"http://127.0.0.1:{gw.port}"
    assert httpx.post(url + DRAIN).status_code == 401
    r = httpx.post(url + DRAIN, headers={"authorization": "Bearer s3cret"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "raw",
    [b"Bearer \xff\xfe\x80", b"Bearer s3cre\xe9", b"\xc3("],
    ids=["ff", "latin1", "no-bearer"],
)
def test_non_utf8_bearer_token_is_401_not_500(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway], raw: bytes
) -> None:
    """A token that is not UTF-8 is compared as bytes and refused with a 401."""
    sim = start_sim("a")
    gw = start_gateway(
        {
            "gateway": {"admin_token_env": "PG_HARDEN_TOKEN"},
            "backends": [backend_entry(sim)],
            "probes": fast_probes(),
        },
        env={"PG_HARDEN_TOKEN": "s3cret"},
    )
    for method, path in (("GET", "/admin/backends"), ("POST", DRAIN)):
        r = httpx.request(method, gw.url + path, headers=[(b"authorization", raw)])
        assert r.status_code == 401, (method, r.status_code, r.text)
        assert _error(r)["code"] == "unauthorized"
    assert "Traceback" not in gw.log_path.read_text()


def test_credentials_in_a_backend_url_are_refused_at_load(tmp_path: Path) -> None:
    """`user:password@` in a backend URL is a config error naming backends[i].url, never
    repeating the password; `pulsegate check` shows it."""
    doc = {
        "backends": [
            {"name": "ok", "url": "http://127.0.0.1:8000"},
            {"name": "leaky", "url": "https://alice:hunter2@api.example.com", "api_key_env": "K"},
            {"name": "user-only", "url": "http://bob@127.0.0.1:8001"},
        ]
    }
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    errors = e.value.errors
    assert [x.split(":", 1)[0] for x in errors] == ["backends[1].url", "backends[2].url"], errors
    assert "credentials" in errors[0]
    assert "hunter2" not in str(e.value) and "alice" not in str(e.value)
    path = tmp_path / "leaky.yaml"
    path.write_text(yaml.safe_dump(doc))
    p = subprocess.run(
        [sys.executable, "-m", "pulsegate", "check", "-c", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 2, p
    assert "error: backends[1].url: must not carry credentials" in p.stderr
    assert "hunter2" not in p.stdout + p.stderr


def test_a_mistyped_url_is_not_echoed_with_its_secrets() -> None:
    """A backend URL without its scheme, or a webhook URL (whose path is often the secret),
    is refused without repeating the credentials or the path."""
    doc = {
        "backends": [{"name": "b", "url": "alice:hunter2@api.example.com"}],
        "alerts": {"webhook": "hooks.example.com/services/T00/B00/s3cr3t"},
    }
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    text = str(e.value)
    assert "backends[0].url" in text and "alerts.webhook" in text, text
    assert "hunter2" not in text and "s3cr3t" not in text, text


def test_backend_keys_stay_out_of_reprs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The proxy's target and the probers' per-backend state hold the backend's key as a
    header; neither repr shows it (a log line or a traceback that prints them)."""
    from pulsegate.probers.scheduler import _Backend
    from pulsegate.proxy.targets import target

    monkeypatch.setenv("PG_TEST_BACKEND_KEY", "sk-live-do-not-show")
    cfg = parse_config(
        {
            "backends": [
                {
                    "name": "h",
                    "url": "https://api.example.com",
                    "api_key_env": "PG_TEST_BACKEND_KEY",
                }
            ]
        }
    )
    b = cfg.backends[0]
    t = target(b)
    assert t.headers["authorization"] == "Bearer sk-live-do-not-show"
    assert "sk-live" not in repr(t)
    probe_state = _Backend(b, {}, None, ())  # type: ignore[arg-type]
    probe_state.headers = {"x": {"Authorization": t.headers["authorization"]}}  # type: ignore[dict-item]
    assert "sk-live" not in repr(probe_state)


@pytest.fixture
def worker_pids() -> Iterator[set[int]]:
    """Worker PIDs seen by a test: any still running at the end are killed by PID."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_workers_refuse_cross_origin_changes_they_relay(
    start_sim: Callable[..., Sim],
    start_gateway: Callable[..., Gateway],
    worker_pids: set[int],
) -> None:
    """With `gateway.workers: 2` the worker that takes the connection makes the Origin, Host
    and form checks (the primary never sees those headers); the CLI's plain POST passes."""
    sim = start_sim("a")
    gw = start_gateway(
        {"gateway": {"workers": 2}, "backends": [backend_entry(sim)], "probes": fast_probes()}
    )
    r = httpx.get(gw.url + "/admin/workers", timeout=5)
    worker_pids.update(w["pid"] for w in r.json()["workers"])
    gw.wait_all_ready()
    fresh = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0), timeout=10)
    with fresh as c:
        for _ in range(4):  # new connections: spread over both workers
            r = c.post(gw.url + DRAIN, headers={"origin": "https://evil.example", **FORM})
            assert r.status_code == 403 and _error(r)["code"] == "cross_origin_refused"
            r = c.post(gw.url + DRAIN, headers={"host": "evil.example"})
            assert r.status_code == 403 and _error(r)["code"] == "host_not_loopback"
            r = c.post(gw.url + DRAIN, headers=FORM, content=b"x=1")
            assert r.status_code == 403 and _error(r)["code"] == "form_content_refused"
        assert _state(gw) == "ready"
        assert c.post(gw.url + DRAIN, headers={"origin": gw.url}).status_code == 200
        assert _state(gw) in ("draining", "drained")


@pytest.fixture
def browser() -> Iterator[Any]:
    """Headless Debian chromium through Playwright (as tests/observe/test_dashboard_page.py)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip("Debian chromium is not installed (apt-get install -y chromium)")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=args)
        try:
            yield b
        finally:
            b.close()


def test_a_real_browser_drains_from_the_dashboard_but_not_from_another_site(
    loopback_gw: Gateway, start_sim: Callable[..., Sim], browser: Any
) -> None:
    """In Chromium, a page of another origin (a sim's port) that submits a form and fetches
    no-cors to the tokenless gateway drains nothing; the dashboard's own buttons' POST does."""
    gw = loopback_gw
    other = start_sim("elsewhere")  # any other loopback origin, as a local dev server
    page = browser.new_page()
    page.goto(other.url + "/health")
    page.evaluate(
        """url => {
            fetch(url, {method: "POST", mode: "no-cors"});
            const f = document.createElement("form");
            f.method = "POST"; f.action = url;
            document.body.appendChild(f); f.submit();
        }""",
        gw.url + DRAIN,
    )
    page.wait_for_url(gw.url + DRAIN, timeout=5000)  # the form's answer was loaded
    assert "cross_origin_refused" in page.content()
    assert _state(gw) == "ready"
    page.goto(gw.url + "/dashboard")
    status = page.evaluate(
        "path => fetch(path, {method: 'POST', cache: 'no-store'}).then(r => r.status)", DRAIN
    )
    assert status == 200
    assert _state(gw) in ("draining", "drained")
