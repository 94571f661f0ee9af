"""What the per-API parse and `apis:` routing cost per request, against the JSON decode.

    .venv/bin/python bench/api_parse.py [--calls 50000] [--rounds 5] [--backends 8]

In this process, on the thread's CPU clock: `proxy.request.parse` of a chat request, an
embeddings request and a rerank request, with every backend serving every API (vLLM's
default: the avoid list is one dict lookup) and with half the backends `apis: [chat]` (the
avoid list built, and the `api_not_served` scan over the backends of the model), and the
`pulsegate_api_requests_total` increment. The baseline is `orjson.loads` of the same chat
body, measured in the same round: every parse must decode the body anyway, so the ratio
says what the parse adds to the unavoidable part. Figures: median over rounds of
nanoseconds per call, and of each round's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import orjson

from pulsegate.config import parse_config
from pulsegate.observe.metrics import Registry
from pulsegate.proxy.metrics import ProxyMetrics
from pulsegate.proxy.request import Limits, parse
from timing import ns_per_call

CHAT = orjson.dumps(
    {
        "model": "m",
        "messages": [{"role": "user", "content": "Say hello in five words, please."}],
        "max_tokens": 64,
        "user": "session-1",
    }
)
EMB = orjson.dumps({"model": "m", "input": ["alpha bravo charlie", "delta echo"]})
RERANK = orjson.dumps({"model": "m", "query": "alpha", "documents": ["a", "b", "c"]})


def limits(n: int, half_chat_only: bool) -> Limits:
    backends: list[dict[str, Any]] = []
    for i in range(n):
        b: dict[str, Any] = {"name": f"b{i}", "url": "http://127.0.0.1:9", "models": ["m"]}
        if half_chat_only and i % 2:
            b["apis"] = ["chat"]
        backends.append(b)
    cfg = parse_config({"backends": backends})
    return Limits(4 << 20, 5.0, 0.1, 300.0, 0, tuple(cfg.backends))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", type=int, default=8)
    a = ap.parse_args()
    every, mixed = limits(a.backends, False), limits(a.backends, True)
    counter = ProxyMetrics(Registry()).api_requests
    cases: dict[str, Callable[[], object]] = {
        "baseline: orjson.loads(chat)": lambda: orjson.loads(CHAT),
        "chat, every backend every api": lambda: parse("/v1/chat/completions", CHAT, None, every),
        "chat, half the backends chat-only": lambda: parse(
            "/v1/chat/completions", CHAT, None, mixed
        ),
        "embeddings, every backend every api": lambda: parse("/v1/embeddings", EMB, None, every),
        "embeddings, half chat-only (avoid + scan)": lambda: parse(
            "/v1/embeddings", EMB, None, mixed
        ),
        "rerank, every backend every api": lambda: parse("/v1/rerank", RERANK, None, every),
        "api counter inc": lambda: counter.inc(("chat", "200")),
    }
    per: dict[str, list[float]] = {k: [] for k in cases}
    ratio: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        base = 0.0
        for name, fn in cases.items():
            ns = ns_per_call(fn, a.calls)
            if name.startswith("baseline"):
                base = ns
            per[name].append(ns)
            ratio[name].append(ns / base)
    print(f"{a.backends} backends, {a.calls} calls x {a.rounds} rounds (median)")
    for name in cases:
        print(
            f"  {name:<44} {statistics.median(per[name]):8.0f} ns"
            f"   {statistics.median(ratio[name]):5.2f}x baseline"
        )


if __name__ == "__main__":
    main()
