"""The compiled build (`make compiled`, setup.py): what `make test-compiled` runs is compiled.

Under PULSEGATE_COMPILED=1 (set by `make test-compiled`, with PYTHONPATH=build/compiled)
every module setup.py names must load from its C extension, so the proxy tests that run
beside this one exercise the compiled code and not the sources. In the plain suite, the
list must hold the request path's modules (it is a glob of proxy/: a moved directory would
empty it unseen), and the records made per request or per token must be plain classes: a
dataclass's `__init__` or a NamedTuple's constructor stays an interpreted call when
compiled (profiled at one such call per token and five per request before they were changed).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import runpy
import types
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

ROOT = Path(__file__).resolve().parents[1]
COMPILED: list[str] = runpy.run_path(str(ROOT / "setup.py"), run_name="setup")["COMPILED"]


def _module(path: str) -> str:
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def test_the_list_holds_the_request_path() -> None:
    names = {_module(p) for p in COMPILED}
    hot = {"client_conn", "upstream_conn", "relay", "pipe", "sse", "dialects.chat"}
    assert {f"pulsegate.proxy.{m}" for m in hot} | {"pulsegate.balancer"} <= names
    assert "pulsegate.proxy.exchange" in names
    assert all((ROOT / p).is_file() for p in COMPILED)


def _records() -> list[type]:
    """Made per request (the head, the parsed request, the record, the attempt, the opened
    upstream) or per streamed event."""
    from pulsegate.proxy.attempt import Opened
    from pulsegate.proxy.client_conn import Head
    from pulsegate.proxy.exchange import Attempt, Exchange
    from pulsegate.proxy.request import ProxyRequest
    from pulsegate.proxy.sse import Event

    return [Head, ProxyRequest, Exchange, Attempt, Opened, Event]


@pytest.mark.parametrize("cls", _records(), ids=lambda c: c.__name__)
def test_the_hot_records_are_plain_classes(cls: type) -> None:
    assert not dataclasses.is_dataclass(cls)
    assert not issubclass(cls, tuple)
    compiled = not isinstance(cls.__init__, types.FunctionType)
    assert compiled == (os.environ.get("PULSEGATE_COMPILED") == "1")


@pytest.mark.skipif(os.environ.get("PULSEGATE_COMPILED") != "1", reason="make test-compiled")
def test_every_listed_module_loads_compiled() -> None:
    plain = []
    for path in COMPILED:
        mod = importlib.import_module(_module(path))
        if not (mod.__file__ or "").endswith(".so"):
            plain.append(mod.__file__)
    assert plain == []


@pytest.mark.skipif(os.environ.get("PULSEGATE_COMPILED") != "1", reason="make test-compiled")
def test_a_gateway_the_tests_start_serves_from_the_compiled_library(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """The proxy tests' gateways are child processes: they inherit PYTHONPATH, and this one
    has mypyc's shared library mapped while it answers a chat completion."""
    sim = start_sim("a")
    gw = start_gateway({"backends": [backend_entry(sim)], "probes": fast_probes()})
    gw.wait_all_ready()
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    maps = Path(f"/proc/{gw.pid}/maps").read_text()
    assert "__mypyc." in maps
    assert "proxy path: compiled (mypyc)" in gw.log_path.read_text()


def test_the_gateway_says_how_its_proxy_path_runs(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """One log line at start, so an operator sees which build serves."""
    gw = start_gateway({"backends": [backend_entry(start_sim("a"))], "probes": fast_probes()})
    want = "compiled (mypyc)" if os.environ.get("PULSEGATE_COMPILED") == "1" else "pure Python"
    wait_until(lambda: f"proxy path: {want}" in gw.log_path.read_text(), 5, what=want)
