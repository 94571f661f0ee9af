"""What the stream dialects cost per event, against the JSON decode every relayed event gets.

    .venv/bin/python bench/typed_relay.py [--calls 50000] [--rounds 5]

In this process, on the thread's CPU clock: the relay's per-event work on the first
upstream (pass-through: decode, then the dialect's `track`) for a chat chunk, a Responses
`response.output_text.delta` and a Messages `content_block_delta`, and on a continuation
(`rewrite`: decode, rewrite, re-encode); and the once-per-stream `for_api`. The baseline is
`orjson.loads` of the same chat chunk, measured in the same round: the relay decodes every
event anyway, so the ratio says what the dialect adds. Figures: median over rounds of
nanoseconds per call, and of each round's ratio to the baseline.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

import orjson

from pulsegate.proxy.dialects import Messages, Responses, for_api
from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.dialects.chat import track
from timing import ns_per_call

_CHOICE = {"index": 0, "delta": {"content": " alpha"}, "logprobs": None, "finish_reason": None}
CHAT = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                     "model": "m", "choices": [_CHOICE]})  # fmt: skip
RESP = orjson.dumps({"type": "response.output_text.delta", "item_id": "msg_0123456789abcdef",
                     "output_index": 0, "content_index": 0, "delta": " alpha", "logprobs": [],
                     "sequence_number": 42})  # fmt: skip
MSG = orjson.dumps({"type": "content_block_delta", "index": 0,
                    "delta": {"type": "text_delta", "text": " alpha"}})  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    chat = StreamState()
    resp, msgs = Responses(), Messages()
    resp_cont, msgs_cont = Responses(), Messages()
    resp_cont.state.item_added = resp_cont.state.part_added = True
    resp_cont.state.item_id = "msg_first"
    msgs_cont.state.block = 0
    cases: dict[str, Callable[[], object]] = {
        "baseline: orjson.loads(chat chunk)": lambda: orjson.loads(CHAT),
        "chat: loads + track": lambda: track(chat, orjson.loads(CHAT)),
        "responses: loads + track": lambda: resp.track(orjson.loads(RESP)),
        "messages: loads + track": lambda: msgs.track(orjson.loads(MSG)),
        "responses continuation: loads + rewrite": lambda: resp_cont.rewrite(orjson.loads(RESP)),
        "messages continuation: loads + rewrite": lambda: msgs_cont.rewrite(orjson.loads(MSG)),
        "for_api (once per stream)": lambda: for_api("responses", "/v1/responses", {}),
    }
    ns: dict[str, list[float]] = {k: [] for k in cases}
    ratio: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(a.rounds):
        base = ns_per_call(cases["baseline: orjson.loads(chat chunk)"], a.calls)
        for name, fn in cases.items():
            v = base if name.startswith("baseline") else ns_per_call(fn, a.calls)
            ns[name].append(v)
            ratio[name].append(v / base)
        # keep the trackers' text lists from growing across rounds
        chat.text.clear()
        resp.state.text.clear()
        msgs.state.text.clear()
        resp_cont.state.text.clear()
        msgs_cont.state.text.clear()
    width = max(map(len, cases))
    for name in cases:
        print(f"{name:<{width}}  {statistics.median(ns[name]):8.0f} ns"
              f"  x{statistics.median(ratio[name]):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
