"""Request bodies for the inference probes: a tiny micro-inference and a realistic canary.

The canary must look like a real prompt on the wire (R19): 4-8 KB of plausible English - a
system prompt with policy excerpts and a user question - so the request spans several
1500-byte MTU segments exactly as client traffic does. Random bytes would also cross the
MTU, but a prompt keeps token counts and engine work realistic (about 1,500 tokens for
6 KB) and reads sanely in an engine's request log. The text is drawn once per backend from
the injected `random.Random`, so runs are reproducible.
"""

from __future__ import annotations

import enum
import random
from typing import Any

import orjson

CANARY_USER = "pulsegate-canary"


class Api(enum.Enum):
    """The OpenAI endpoint a backend answers one-token probes on. An embedding model
    (`apis: [embeddings]`) is probed with an embedding of the same text: a forward pass
    through the same GPU, which is what the probe proves."""

    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    EMBEDDINGS = "/v1/embeddings"


def probe_api(apis: tuple[str, ...]) -> Api:
    """The endpoint to probe a backend serving `apis` on first: completions, else chat,
    else embeddings; a backend with none of them (rerank or score only) is tried on
    completions, and its 404 reported as it is."""
    if "completions" in apis or ("chat" not in apis and "embeddings" not in apis):
        return Api.COMPLETIONS
    return Api.CHAT if "chat" in apis else Api.EMBEDDINGS


def micro_body(model: str, api: Api) -> bytes:
    """The micro-inference: one token for a four-letter prompt, deterministic (an
    embedding of it, for an embedding model)."""
    if api is Api.EMBEDDINGS:
        return orjson.dumps({"model": model, "input": "ping"})
    req: dict[str, Any] = {"model": model, "max_tokens": 1, "temperature": 0}
    if api is Api.COMPLETIONS:
        req["prompt"] = "ping"
    else:
        req["messages"] = [{"role": "user", "content": "ping"}]
    return orjson.dumps(req)


def canary_body(text: CanaryText, model: str, api: Api, payload_bytes: int) -> bytes:
    """The canary request: at least `payload_bytes` bytes of body (within one sentence of it),
    one output token, flagged synthetic with ``"user": "pulsegate-canary"``."""
    # The JSON overhead (model name, field names) is a few hundred bytes at most: estimate
    # from the shortest body, then add sentences until the body is long enough.
    n = 0
    body = _canary(text, n, model, api)
    need = payload_bytes - len(body)
    while need > 0 and n < len(text.excerpts):
        need -= len(text.excerpts[n]) + 1
        n += 1
    body = _canary(text, n, model, api)
    while len(body) < payload_bytes and n < len(text.excerpts):
        n += 1
        body = _canary(text, n, model, api)
    return body


def _canary(text: CanaryText, n: int, model: str, api: Api) -> bytes:
    system = text.preamble + " ".join(text.excerpts[:n])
    if api is Api.EMBEDDINGS:  # the same bytes on the wire, embedded as one passage
        doc = {"model": model, "input": f"{system}\n\n{text.question}", "user": CANARY_USER}
        return orjson.dumps(doc)
    req: dict[str, Any] = {
        "model": model,
        "max_tokens": 1,
        "temperature": 0,
        "user": CANARY_USER,
    }
    if api is Api.COMPLETIONS:
        req["prompt"] = f"{system}\n\nCustomer: {text.question}\n\nAssistant:"
    else:
        req["messages"] = [
            {"role": "system", "content": system},
            {"role": "user", "content": text.question},
        ]
    return orjson.dumps(req)


class CanaryText:
    """A system prompt (preamble + numbered policy excerpts) and a customer question.

    Holds enough excerpts for `payload_bytes`; `canary_body` uses as many as it needs.
    """

    def __init__(self, rng: random.Random, payload_bytes: int) -> None:
        org = rng.choice(_ORGS)
        self.preamble = _PREAMBLE.format(org=org, field=rng.choice(_FIELDS))
        self.question = _fill(rng, rng.choice(_QUESTIONS))
        self.excerpts: list[str] = []
        size = len(self.preamble) + len(self.question)
        section = 1
        while size < payload_bytes + 512:
            sentences = " ".join(_fill(rng, rng.choice(_SENTENCES)) for _ in range(3))
            excerpt = f"Section {section // 4 + 1}.{section % 4 + 1}: {sentences}"
            self.excerpts.append(excerpt)
            size += len(excerpt) + 1
            section += 1


def _fill(rng: random.Random, template: str) -> str:
    return template.format(**{k: rng.choice(v) for k, v in _SLOTS.items()})


_PREAMBLE = (
    "You are a careful support assistant for {org}, a {field} company. Answer the customer "
    "using only the policy excerpts below. Quote the section you rely on, keep the answer "
    "under three sentences, and say plainly when the excerpts do not cover the question. "
    "Never promise refunds, delivery dates or discounts the excerpts do not state.\n\n"
    "Policy excerpts:\n"
)
_ORGS = ("Northwind Supply", "Harbor & Pine", "Bluebird Outfitters", "Aster Logistics")
_FIELDS = ("office supplies", "outdoor equipment", "home goods", "freight and parcel")
_QUESTIONS = (
    "Hi, I ordered {n} {item} for our {place} office on {day} and only part of the order "
    "arrived. The tracking page still says in transit. Can I get the rest shipped express, "
    "and will the {plan} plan cover the difference?",
    "Hello - we received {n} {item} yesterday but two were damaged in the box. We are on the "
    "{plan} plan. What is the fastest way to get replacements to {place} before {day}?",
    "Could you explain how returns work for {item}? We bought {n} last {day} through the "
    "{plan} plan and would like to send some back to the {place} warehouse.",
)
_SENTENCES = (
    "Orders placed before {time} on a business day ship the same day from the {place} warehouse.",
    "Customers on the {plan} plan may return {item} within {n} days if the packaging is unopened.",
    "Damaged deliveries must be reported within {n} days with a photo of the box and the "
    "packing slip.",
    "Express shipping to {place} is available for orders under {n} kilograms at a flat fee.",
    "Replacement {item} are sent once the carrier confirms the original parcel was lost.",
    "The {plan} plan includes free standard shipping on orders of {n} items or more.",
    "Refunds are issued to the original payment method within {n} business days of receipt.",
    "Orders that leave the warehouse after {time} on {day} are delivered the next week.",
    "Bulk orders of {item} require a purchase order number and manager approval.",
    "Support tickets about {item} are answered within {n} hours on working days.",
    "Partial shipments are tracked separately; each parcel gets its own tracking number.",
    "Customers in {place} may collect orders in person after receiving a pickup code.",
)
_SLOTS: dict[str, tuple[str, ...]] = {
    "n": ("2", "3", "5", "7", "10", "12", "14", "20", "30"),
    "item": (
        "desk chairs",
        "monitor arms",
        "label printers",
        "tents",
        "water filters",
        "storage bins",
        "headsets",
        "standing desks",
        "paper reams",
        "lamps",
    ),
    "place": ("Rotterdam", "Denver", "Leeds", "Osaka", "Halifax", "Lyon", "Austin", "Perth"),
    "day": ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday"),
    "plan": ("Basic", "Business", "Business Plus", "Enterprise"),
    "time": ("11:00", "13:00", "14:30", "16:00"),
}
