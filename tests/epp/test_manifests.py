"""The Kubernetes example manifests agree with the Envoy config, the CLI and each other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from pulsegate.cli import _parser
from pulsegate.config import parse_config
from pulsegate.epp.endpoints import endpoint_of
from pulsegate.epp.run import HEALTH_SERVICES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
ENVOY_YAML = ROOT / "deploy" / "envoy" / "envoy.yaml"
EPP_CONFIG = ROOT / "deploy" / "envoy" / "pulsegate.yaml"


def _docs() -> dict[tuple[str, str], dict[str, Any]]:
    """Every manifest by (kind, name)."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} twice"
            out[key] = doc
    return out


def _cli_default_port() -> int:
    args = _parser().parse_args(["epp", "-c", "x.yaml"])
    return int(args.listen.rsplit(":", 1)[1])


def _envoy_clusters() -> dict[str, dict[str, Any]]:
    cfg = yaml.safe_load(ENVOY_YAML.read_text())
    return {c["name"]: c for c in cfg["static_resources"]["clusters"]}


def _ports(cluster: dict[str, Any]) -> list[tuple[str, int]]:
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for e in eps
    ]  # fmt: skip


def _container(doc: dict[str, Any]) -> dict[str, Any]:
    (c,) = doc["spec"]["template"]["spec"]["containers"]
    return c  # type: ignore[no-any-return]


def test_inference_pool_uses_the_v1_api_and_names_the_epp_service() -> None:
    """InferencePool v1; its endpointPickerRef is the EPP Service, on the CLI's port."""
    docs = _docs()
    pool = docs[("InferencePool", "pulsegate-pool")]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    ref = pool["spec"]["endpointPickerRef"]
    svc = docs[("Service", ref["name"])]
    (port,) = svc["spec"]["ports"]
    assert ref["port"]["number"] == port["port"] == _cli_default_port() == 9002
    assert ref["failureMode"] == "FailClose"
    assert len(pool["spec"]["targetPorts"]) == 1


def test_epp_deployment_matches_service_envoy_and_cli() -> None:
    """The Deployment listens where the Service, Envoy's picker cluster and the CLI say."""
    docs = _docs()
    dep = docs[("Deployment", "pulsegate-epp")]
    svc = docs[("Service", "pulsegate-epp")]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    c = _container(dep)
    args = c["args"]
    assert args[0] == "epp"
    listen_port = int(args[args.index("--listen") + 1].rsplit(":", 1)[1])
    (svc_port,) = svc["spec"]["ports"]
    assert listen_port == svc_port["targetPort"] == c["ports"][0]["containerPort"]
    ((_, envoy_epp_port),) = _ports(_envoy_clusters()["pulsegate_epp"])
    assert envoy_epp_port == listen_port == _cli_default_port()
    for probe in ("livenessProbe", "readinessProbe"):
        grpc = c[probe]["grpc"]
        assert grpc["port"] == listen_port and grpc["service"] in HEALTH_SERVICES


def test_config_map_is_a_valid_config_mounted_where_c_points() -> None:
    """The ConfigMap's pulsegate.yaml loads; the Deployment mounts it at the -c path;
    its backends serve on the pool's target port and their agents on the DaemonSet's."""
    docs = _docs()
    cm = docs[("ConfigMap", "pulsegate-epp-config")]
    dep = docs[("Deployment", "pulsegate-epp")]
    c = _container(dep)
    config_path = Path(c["args"][c["args"].index("-c") + 1])
    (mount,) = c["volumeMounts"]
    (vol,) = dep["spec"]["template"]["spec"]["volumes"]
    assert vol["name"] == mount["name"] and vol["configMap"]["name"] == "pulsegate-epp-config"
    assert str(config_path.parent) == mount["mountPath"]
    cfg = parse_config(yaml.safe_load(cm["data"][config_path.name]))
    target = docs[("InferencePool", "pulsegate-pool")]["spec"]["targetPorts"][0]["number"]
    agent = _container(docs[("DaemonSet", "pulsegate-agent")])
    agent_port = agent["ports"][0]["containerPort"]
    assert agent["args"][agent["args"].index("--listen") + 1].endswith(f":{agent_port}")
    for b in cfg.backends:
        assert endpoint_of(b.url).endswith(f":{target}")
        assert b.agent is not None and b.agent.endswith(f":{agent_port}")


def test_pool_selector_selects_the_model_servers() -> None:
    """The pool's selector matches the model-server pods, which serve on its target port."""
    docs = _docs()
    pool = docs[("InferencePool", "pulsegate-pool")]["spec"]
    ms = docs[("DaemonSet", "model-server")]
    labels = ms["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    assert _container(ms)["ports"][0]["containerPort"] == pool["targetPorts"][0]["number"]


def test_envoy_config_and_its_picker_config_list_the_same_backends() -> None:
    """deploy/envoy: the pool cluster's hosts are the picker config's endpoints, and the
    retries walk as many endpoints as the picker sends (num_retries + 1 = max_attempts)."""
    cfg = parse_config(yaml.safe_load(EPP_CONFIG.read_text()))
    hosts = [f"{h}:{p}" for h, p in _ports(_envoy_clusters()["inference_pool"])]
    assert hosts == [endpoint_of(b.url) for b in cfg.backends]
    envoy = yaml.safe_load(ENVOY_YAML.read_text())
    hcm = envoy["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    route = hcm["typed_config"]["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["num_retries"] + 1 == cfg.retry.max_attempts
    ext_proc = hcm["typed_config"]["http_filters"][0]["typed_config"]
    assert ext_proc["grpc_service"]["envoy_grpc"]["cluster_name"] == "pulsegate_epp"
    assert ext_proc["message_timeout"]
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == ["envoy.lb"]
    assert ext_proc["processing_mode"]["request_body_mode"] == "BUFFERED"
