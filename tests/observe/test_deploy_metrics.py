"""deploy/: the Grafana dashboard and the alert rules only use metrics a real gateway exports."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from support import Gateway, Sim, backend_entry, fast_probes, wait_until

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
GRAFANA = DEPLOY / "grafana" / "pulsegate.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
METRIC = re.compile(r"\b(pulsegate_[a-z0-9_]+)\b(\{[^}]*\})?")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")


def _strings(node: Any, keys: frozenset[str]) -> Iterator[str]:
    if isinstance(node, dict):
        for k, v in node.items():
            if k in keys and isinstance(v, str):
                yield v
            else:
                yield from _strings(v, keys)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, keys)


def grafana_exprs() -> list[str]:
    doc = json.loads(GRAFANA.read_text())
    return list(_strings(doc, frozenset({"expr", "query", "definition"})))


def alert_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(ALERTS.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def all_exprs() -> list[str]:
    return grafana_exprs() + [r["expr"] for r in alert_rules()]


def referenced() -> dict[str, set[str]]:
    """Metric name -> label names used in its selectors, over every expression in deploy/."""
    out: dict[str, set[str]] = {}
    for expr in all_exprs():
        for name, selector in METRIC.findall(expr):
            out.setdefault(name, set()).update(label for label, _op in MATCHER.findall(selector))
    return out


def test_expressions_are_balanced() -> None:
    """Every PromQL expression has balanced (), {} and [] (a cheap guard against typos)."""
    pairs = {")": "(", "}": "{", "]": "["}
    for expr in all_exprs():
        stack: list[str] = []
        for ch in re.sub(r'"[^"]*"', '""', expr):
            if ch in "({[":
                stack.append(ch)
            elif ch in pairs:
                assert stack and stack.pop() == pairs[ch], expr
        assert not stack, expr


def test_alert_rules_are_complete() -> None:
    """Ejection, panic, error rate and model-down alerts exist, each with severity and summary."""
    rules = alert_rules()
    names = {r["alert"] for r in rules}
    assert {
        "PulsegateBackendEjected",
        "PulsegatePanicMode",
        "PulsegateClientErrorRate",
        "PulsegateModelDown",
    } <= names
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical"), r["alert"]
        assert r["annotations"]["summary"], r["alert"]
    ejected = next(r for r in rules if r["alert"] == "PulsegateBackendEjected")
    assert ejected["annotations"]["summary"].startswith("node {{ $labels.backend }} ejected:")


def test_grafana_dashboard_shape() -> None:
    """Unique panel ids, a datasource variable, and DCGM GPU utilisation beside our metrics."""
    doc = json.loads(GRAFANA.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    assert any(v["name"] == "datasource" for v in doc["templating"]["list"])
    for p in doc["panels"]:
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    assert any("DCGM_FI_DEV_GPU_UTIL" in e for e in grafana_exprs())


def _exported(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Family names (with _bucket/_sum/_count for histograms) and label names seen per name."""
    names: set[str] = set()
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update({f"{name}_bucket", f"{name}_sum", f"{name}_count"})
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s", line)
            assert m, line
            found = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(3) or ""))
            labels.setdefault(m.group(1), set()).update(found)
    return names, labels


@pytest.mark.slow
def test_every_referenced_metric_is_exported(
    start_sim: Callable[..., Sim], start_gateway: Callable[..., Gateway]
) -> None:
    """Each pulsegate_* name in deploy/ is in a real gateway's /metrics, with those labels."""
    sim = start_sim("east-a")
    gw = start_gateway({"backends": [backend_entry(sim)], "probes": fast_probes()})
    gw.wait_all_ready(timeout=20)
    r = httpx.post(
        f"{gw.url}/v1/chat/completions",
        json={"model": "demo-7b", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert r.status_code == 200
    assert httpx.post(f"{gw.url}/admin/backends/east-a/eject", timeout=5).status_code == 200
    wait_until(
        lambda: "pulsegate_ejections_total{" in httpx.get(f"{gw.url}/metrics", timeout=5).text,
        timeout=5,
        what="an ejection sample",
    )
    names, labels = _exported(httpx.get(f"{gw.url}/metrics", timeout=5).text)
    refs = referenced()
    assert len(refs) >= 14
    missing = sorted(set(refs) - names)
    assert not missing, f"referenced in deploy/ but not exported: {missing}"
    for name, used in refs.items():
        if name in labels:  # a family with samples: its selectors use real label names
            assert used <= labels[name], (name, used, labels[name])
