"""`chaos.run --publish`: a run's figures merged into the committed docs/chaos-results.json.

A run of a few faults (`-f stall,xid`) must not throw away the figures of the faults it did
not run. So the committed results are a merge: a (fault, mode) the new run measured replaces
the old one, every other row stays as it was, and each row says which run it came from
(`source`: that run's `started`; `meta.sources` lists those runs, each with its git commit,
load average and settings). Sections other tools publish (`heartbeat`, `replicas`) are kept.
Pure: documents in, a document out.
"""

from __future__ import annotations

from typing import Any

# What a source run is described by: its meta without what belongs to the merged whole.
_WHOLE = ("faults", "modes", "sources")


def merge(
    old: dict[str, Any] | None, new: dict[str, Any], order: tuple[str, ...]
) -> dict[str, Any]:
    """`new` (one run) over `old` (the committed results, merged or not). `order`: the fault
    catalogue's keys, which the merged faults follow (keys it lacks go last)."""
    new_meta = new["meta"]
    runs = [{**r, "source": new_meta["started"]} for r in new["runs"]]
    if old is None:
        return {**_sections(new), "meta": _meta(new_meta, new_meta, [_source(new_meta)]),
                "runs": runs}  # fmt: skip
    old_meta = old["meta"]
    fresh = {(r["fault"], r["mode"]) for r in runs}
    kept = [
        {**r, "source": r.get("source", old_meta["started"])}
        for r in old["runs"]
        if (r["fault"], r["mode"]) not in fresh
    ]
    sources = [*(old_meta.get("sources") or [_source(old_meta)]), _source(new_meta)]
    used = {r["source"] for r in kept + runs}
    sources = [s for s in sources if s["started"] in used]
    merged_runs = sorted(kept + runs, key=lambda r: _rank(r["fault"], order))
    return {
        **_sections(old),
        **_sections(new),
        "meta": _meta(old_meta, new_meta, sources, order),
        "runs": merged_runs,
    }


def _source(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in meta.items() if k not in _WHOLE}


def _sections(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in ("meta", "runs")}


def _meta(
    old: dict[str, Any],
    new: dict[str, Any],
    sources: list[dict[str, Any]],
    order: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The newest run's meta, with the union of faults (newer titles win) and modes."""
    faults = {**old.get("faults", {}), **new.get("faults", {})}
    modes = [
        *old.get("modes", []),
        *(m for m in new.get("modes", []) if m not in old.get("modes", [])),
    ]
    return {
        **new,
        "faults": {k: faults[k] for k in sorted(faults, key=lambda k: _rank(k, order))},
        "modes": modes,
        "sources": sources,
    }


def _rank(key: str, order: tuple[str, ...]) -> int:
    return order.index(key) if key in order else len(order)
