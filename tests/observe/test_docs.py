"""The docs' generated parts match the code they are drawn from.

docs/architecture.md carries the health state diagram and transition table drawn from
`pulsegate.health.machine.TRANSITIONS`; docs/signals.md carries the score curves drawn from
`pulsegate.health.score`. Each generated part sits between `<!-- generated:NAME -->` and
`<!-- /generated:NAME -->`. After changing the table or the curves, regenerate with

    .venv/bin/python tests/observe/test_docs.py --write

docs/requirements.md is written by hand: it must list every requirement id (R17) cited in
src/pulsegate/ and docs/.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from pathlib import Path

from pulsegate.config import WeightsConfig
from pulsegate.health import score
from pulsegate.health.machine import Event, edges, mermaid
from pulsegate.health.signals import Signals
from pulsegate.health.verdict import State

DOCS = Path(__file__).resolve().parents[2] / "docs"
ARCHITECTURE = DOCS / "architecture.md"
SIGNALS = DOCS / "signals.md"
REQUIREMENTS = DOCS / "requirements.md"
SRC = Path(__file__).resolve().parents[2] / "src" / "pulsegate"


def state_diagram() -> str:
    return "```mermaid\n" + mermaid() + "\n```"


def transition_table() -> str:
    rows = ["| from | event | to |", "| --- | --- | --- |"]
    rows += [f"| {s.value} | `{e.value}` | {t.value} |" for s, e, t in edges()]
    return "\n".join(rows)


def _x(v: float, pct: bool) -> str:
    return f"{v * 100:g}%" if pct else f"{v:g}x"


def score_curves() -> str:
    w = WeightsConfig()
    curves = (
        ("latency", "smoothed latency / own baseline", w.latency, score.LATENCY_KNOTS, False),
        ("error_rate", "failed share of requests, probes", w.error_rate, score.ERROR_KNOTS, True),
        ("queue", "waiting / capacity (batch size)", w.queue, score.QUEUE_KNOTS, False),
        ("gpu_free", "free VRAM ratio", w.gpu_free, score.GPU_FREE_KNOTS, True),
    )
    rows = [
        "| dimension | input | default weight | sub-score at knots |",
        "| --- | --- | --- | --- |",
    ]
    for name, what, weight, knots, pct in curves:
        pts = ", ".join(f"{_x(x, pct)} → {y:g}" for x, y in knots)
        rows.append(f"| `{name}` | {what} | {weight:g} | {pts} |")
    return "\n".join(rows)


GENERATED: dict[tuple[Path, str], Callable[[], str]] = {
    (ARCHITECTURE, "state-diagram"): state_diagram,
    (ARCHITECTURE, "transitions"): transition_table,
    (SIGNALS, "score-curves"): score_curves,
}


def _block(name: str) -> re.Pattern[str]:
    n = re.escape(name)
    return re.compile(rf"(<!-- generated:{n}[^>]*-->\n)(.*?)(\n<!-- /generated:{n} -->)", re.S)


def current(path: Path, name: str) -> str:
    m = _block(name).search(path.read_text())
    assert m, f"{path.name} has no generated:{name} block"
    return m.group(2)


def write() -> None:
    """Rewrite every generated block from the code."""
    for (path, name), make in GENERATED.items():
        text = path.read_text()
        new, n = _block(name).subn(lambda m, make=make: m.group(1) + make() + m.group(3), text)
        assert n == 1, f"{path.name}: generated:{name} block not found"
        path.write_text(new)


def test_state_diagram_is_drawn_from_the_table() -> None:
    """docs/architecture.md's Mermaid diagram is exactly machine.mermaid()."""
    assert current(ARCHITECTURE, "state-diagram") == state_diagram(), "run test_docs.py --write"


def test_transition_table_is_drawn_from_the_table() -> None:
    """docs/architecture.md lists every legal move, in table order, and nothing else."""
    assert current(ARCHITECTURE, "transitions") == transition_table(), "run test_docs.py --write"


def test_every_state_and_event_is_explained() -> None:
    """Each state and each event is named in the prose of docs/architecture.md."""
    text = ARCHITECTURE.read_text()
    for st in State:
        assert f"**{st.value}**" in text, st
    for ev in Event:
        assert f"`{ev.value}`" in text, ev


def test_score_curves_match_the_code() -> None:
    """docs/signals.md's curve table is drawn from score.py's knots and default weights."""
    assert current(SIGNALS, "score-curves") == score_curves(), "run test_docs.py --write"


def test_every_signal_is_explained() -> None:
    """Every key of `signals` in GET /admin/backends has its own entry in docs/signals.md."""
    text = SIGNALS.read_text()
    for key in Signals(0.2).snapshot(0.0):
        assert f"| `{key}` |" in text, key


def test_dashboard_doc_exists() -> None:
    """docs/dashboard.md covers the page, the status command and the monitoring stack."""
    text = (DOCS / "dashboard.md").read_text()
    for needle in ("/dashboard", "pulsegate status", "deploy/grafana", "alerts.yml"):
        assert needle in text, needle


# "R17", or a range "R24-R26" (which cites R25 too).
_CITED = re.compile(r"\bR(\d+)(?:\s*[-\u2013]\s*R(\d+))?\b")
_LISTED = re.compile(r"^\| R(\d+) \|", re.M)


def cited_requirements() -> dict[int, str]:
    """Each requirement number cited under src/pulsegate/ and docs/, with one file citing it."""
    cited: dict[int, str] = {}
    for root in (SRC, DOCS):
        for path in sorted(root.rglob("*")):
            if not path.is_file() or path == REQUIREMENTS or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue  # images and other binary files cite nothing
            for m in _CITED.finditer(text):
                lo = int(m.group(1))
                for n in range(lo, int(m.group(2) or lo) + 1):
                    cited.setdefault(n, str(path.relative_to(DOCS.parent)))
    return cited


def test_every_cited_requirement_is_listed() -> None:
    """Every R<number> cited in src/pulsegate/ or docs/ has its row in docs/requirements.md."""
    listed = {int(n) for n in _LISTED.findall(REQUIREMENTS.read_text())}
    cited = cited_requirements()
    assert cited, "no requirement ids found: the scan is broken"
    missing = {f"R{n}": where for n, where in sorted(cited.items()) if n not in listed}
    assert not missing, f"cited but not in docs/requirements.md: {missing}"


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write()
        print("docs regenerated")
    else:
        sys.exit(__doc__)
