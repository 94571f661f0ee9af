"""Exact resume's pure parts (`proxy/dialects/token_ids.py`): when ids are asked, how they are
noted and hidden, and the completions request that continues from them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from pulsegate.config import ConfigError, parse_config
from pulsegate.proxy.dialects.base import StreamState
from pulsegate.proxy.dialects.chat import rewrite
from pulsegate.proxy.dialects.token_ids import Ids, first_body, fits, wanted
from pulsegate.proxy.request import Limits, ProxyRequest, parse
from pulsegate.proxy.targets import Target, target

VLLM = Target("a", "http://a", {}, "vllm", True)
OTHER = Target("b", "http://b", {}, "vllm", False)
CHAT = "/v1/chat/completions"
MSGS = [{"role": "user", "content": "hi"}]

# vLLM 0.32's own chunks with `return_token_ids` (recorded from the engine on this box).
ROLE = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}],"prompt_token_ids":[3,90,88],"prompt_text":null}\n\n')  # fmt: skip
TOKEN = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
         b'"choices":[{"index":0,"delta":{"content":">"},"logprobs":null,"finish_reason":null,'
         b'"token_ids":[35]}]}\n\n')  # fmt: skip
CMPL = (b'data: {"id":"cmpl-1","object":"text_completion","created":7,"model":"m","choices":'
        b'[{"index":0,"text":"d","logprobs":null,"finish_reason":null,"stop_reason":null,'
        b'"prompt_token_ids":[77,74],"token_ids":[73]}]}\n\n')  # fmt: skip


def _req(path: str = CHAT, **doc: Any) -> ProxyRequest:
    body = {"model": "m", "stream": True, "max_tokens": 50, **doc}
    if path == CHAT:
        body.setdefault("messages", MSGS)
    else:
        body.setdefault("prompt", "once upon")
    req = parse(path, orjson.dumps(body), None, Limits(4 << 20, 2.0, 0.01, 30.0, 0, ()))
    assert isinstance(req, ProxyRequest)
    return req


def _obj(raw: bytes | None) -> dict[str, Any]:
    assert raw is not None
    return orjson.loads(raw.removeprefix(b"data: "))  # type: ignore[no-any-return]


def test_ids_are_asked_only_of_a_vllm_target_for_a_stream_that_can_use_them() -> None:
    """Resumable chat/completions streams to a `token_ids` target; nothing else."""
    assert wanted(_req(), VLLM, True)
    assert wanted(_req("/v1/completions"), VLLM, True)
    assert not wanted(_req(), OTHER, True)  # another engine kind, or exact_resume off
    assert not wanted(_req(), VLLM, False)  # streaming.resume off
    assert not wanted(_req(stream=False), VLLM, True)
    assert not wanted(_req(n=2), VLLM, True)
    assert not wanted(_req(stop=["\n"]), VLLM, True)  # held text: ids run ahead of it
    assert not wanted(_req(tools=[{"type": "function"}]), VLLM, True)
    assert not wanted(_req(logprobs=True), VLLM, True)
    assert not wanted(_req(max_tokens=None), VLLM, True)  # chat's default budget: unknown
    assert not wanted(_req(return_token_ids=False), VLLM, True)  # the client said no


def test_fits_lists_what_a_completions_continuation_can_carry() -> None:
    """Sampling keys and prompt-only keys fit; echo, logprobs and unknown keys do not."""
    assert fits({"messages": MSGS, "max_tokens": 5, "temperature": 0, "seed": 1,
                 "chat_template_kwargs": {}, "stream_options": {"include_usage": True}},
                "chat")  # fmt: skip
    assert not fits({"messages": MSGS, "max_tokens": 5, "reasoning_effort": "low"}, "chat")
    assert fits({"prompt": "x", "temperature": 0}, "completions")
    assert not fits({"prompt": "x", "echo": True}, "completions")
    assert not fits({"prompt": "x", "logprobs": 2}, "completions")
    assert not fits({"prompt": [1, 2]}, "completions")


def test_first_body_adds_the_flag_before_the_closing_brace() -> None:
    """The client's bytes plus `"return_token_ids":true`; unchanged when not wanted or when
    the client asked itself."""
    req = _req()
    body = first_body(req, VLLM, True)
    assert body == req.body.rstrip()[:-1] + b',"return_token_ids":true}'
    assert orjson.loads(body) == {**req.doc, "return_token_ids": True}
    assert first_body(req, OTHER, True) is req.body
    asked = _req(return_token_ids=True)
    assert first_body(asked, VLLM, True) is asked.body


def test_take_notes_ids_and_hands_vllm_bytes_without_the_flag() -> None:
    """The ids are kept; the client gets `null` where they were, every other byte as sent."""
    ids = Ids(strip=True)
    assert ids.take(_obj(ROLE), ROLE) == ROLE.replace(b"[3,90,88]", b"null")
    assert ids.take(_obj(TOKEN), TOKEN) == TOKEN.replace(b"[35]", b"null")
    assert ids.prompt == [3, 90, 88] and ids.generated == [35] and ids.sent() == 1
    out = Ids(strip=True).take(_obj(CMPL), CMPL)
    assert out == CMPL.replace(b"[77,74]", b"null").replace(b"[73]", b"null")
    keep = Ids(strip=False)
    assert keep.take(_obj(TOKEN), TOKEN) is TOKEN


def test_an_engine_that_sends_no_ids_is_barren_at_its_first_text() -> None:
    """Text without ids, none ever seen: the relay stops noting (`Relay.frame`). Ids seen
    once keep the stream's ids alive, even after text without them."""
    plain = {"choices": [{"index": 0, "delta": {"content": "a"}}]}
    ids = Ids(strip=True)
    ids.note({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    assert not ids.barren  # a role preamble says nothing yet
    ids.note(plain)
    assert ids.barren and not ids.usable(VLLM)
    seen = Ids(strip=True)
    seen.note(_obj(TOKEN))
    seen.note(plain)
    assert not seen.barren and seen.generated == [35]


def test_take_remakes_an_unusual_layout_from_the_object() -> None:
    """Ids the pattern does not find (spaces) are still nulled, from the parsed object."""
    raw = b'data: {"choices": [{"index": 0, "text": "d", "token_ids": [73]}]}\n\n'
    out = Ids(strip=True).take(_obj(raw), raw)
    assert _obj(out) == {"choices": [{"index": 0, "text": "d", "token_ids": None}]}


def test_ids_without_text_yet_are_left_to_the_continuation() -> None:
    """Trailing ids whose text has not come (a detokenizer holding a partial character) are
    not counted as sent and not replayed: the continuation generates them again."""
    ids = Ids(strip=True)
    ids.note(_obj(ROLE))
    ids.note({"choices": [{"index": 0, "delta": {"content": "a"}, "token_ids": [10]}]})
    ids.note({"choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [11, 12]}]})
    assert ids.sent() == 1 and ids.held == 2
    state = StreamState(tokens=ids.sent())
    cont = ids.continuation({"model": "m", "messages": MSGS, "max_tokens": 5}, "chat", state)
    assert orjson.loads(cont.body)["prompt"] == [3, 90, 88, 10]


def test_ids_are_unusable_when_a_chunk_came_without_them_or_for_another_target() -> None:
    """Text without ids, a delta with more than content, no prompt ids, another engine:
    text replay."""
    ids = Ids(strip=True)
    ids.note(_obj(ROLE))
    assert ids.usable(VLLM) and not ids.usable(OTHER)
    ids.note({"choices": [{"index": 0, "delta": {"content": "a"}}]})
    assert not ids.usable(VLLM)
    reasoning = Ids(strip=True)
    reasoning.note(_obj(ROLE))
    reasoning.note({"choices": [{"index": 0, "delta": {"reasoning": "x"}, "token_ids": [1]}]})
    assert not reasoning.usable(VLLM)
    assert not Ids(strip=True).usable(VLLM)  # no prompt ids seen


def test_chat_continuation_is_a_completions_request_of_the_ids() -> None:
    """Prompt ids + generated ids, sampling keys carried, the budget less what was sent,
    ids asked again (a second break), on `/v1/completions`."""
    ids = Ids(strip=True)
    ids.note(_obj(ROLE))
    ids.note(_obj(TOKEN))
    doc = {"model": "m", "messages": MSGS, "max_completion_tokens": 10, "temperature": 0,
           "seed": 4, "min_tokens": 3, "stream": True, "chat_template_kwargs": {"x": 1},
           "stream_options": {"include_usage": True}}  # fmt: skip
    cont = ids.continuation(doc, "chat", StreamState(tokens=1))
    assert cont.path == "/v1/completions"
    assert orjson.loads(cont.body) == {
        "model": "m", "prompt": [3, 90, 88, 35], "max_tokens": 9, "min_tokens": 2,
        "temperature": 0, "seed": 4, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip


def test_completions_continuation_keeps_the_request_with_an_id_prompt() -> None:
    """A completions stream continues with its own keys, `prompt` as the ids, the default
    budget of 16 where the client gave none."""
    ids = Ids(strip=False)
    ids.note(_obj(CMPL))
    body = orjson.loads(ids.continuation({"model": "m", "prompt": "x", "top_k": 3},
                                         "completions", StreamState(tokens=1)).body)  # fmt: skip
    assert body == {"model": "m", "prompt": [77, 74, 73], "top_k": 3, "max_tokens": 15,
                    "stream": True, "return_token_ids": True}  # fmt: skip


def test_continuation_chunks_become_the_clients_chat_chunks() -> None:
    """A completions chunk of the continuation, in chat framing under the first stream's
    id, with its text tracked and its ids noted but not shown; usage merged."""
    state = StreamState(id="chatcmpl-1", created=7, model="m", tokens=4, tokens_before=4)
    ids = Ids(strip=True, prompt=[1], generated=[2, 3, 4, 5])
    choice = {"index": 0, "text": "q", "logprobs": None, "finish_reason": "length",
              "stop_reason": None, "prompt_token_ids": None, "token_ids": [6]}  # fmt: skip
    chunk = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m",
             "choices": [choice]}  # fmt: skip
    out = _obj(rewrite(state, ids.to_client(chunk, "chat"), True))
    assert out == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "delta": {"content": "q"}, "logprobs": None,
                     "finish_reason": "length", "stop_reason": None, "token_ids": None}],
    }  # fmt: skip
    assert ids.generated == [2, 3, 4, 5, 6] and state.sent_text() == "q" and state.tokens == 5
    usage = {"id": "cmpl-9", "object": "text_completion", "created": 9, "model": "m",
             "choices": [], "usage": {"prompt_tokens": 35, "completion_tokens": 6}}  # fmt: skip
    merged = _obj(rewrite(state, ids.to_client(usage, "chat"), True))
    assert merged["object"] == "chat.completion.chunk" and merged["choices"] == []
    assert merged["usage"] == {"prompt_tokens": 31, "completion_tokens": 10, "total_tokens": 41}


@pytest.mark.parametrize("strip", [True, False])
def test_a_client_that_asked_keeps_the_continuations_ids(strip: bool) -> None:
    """Ids reach the client only when it asked for them."""
    ids = Ids(strip=strip, prompt=[1])
    chunk = {"choices": [{"index": 0, "text": "q", "finish_reason": None, "token_ids": [6]}]}
    out = ids.to_client(chunk, "chat")
    assert out["choices"][0]["token_ids"] == (None if strip else [6])


def test_a_second_break_goes_on_from_both_parts() -> None:
    """After a continuation (whose first chunk repeats its whole id prompt), the next
    continuation is the first prompt + every id generated, each once."""
    ids = Ids(strip=True)
    ids.note(_obj(ROLE))
    ids.note(_obj(TOKEN))
    doc = {"model": "m", "messages": MSGS, "max_tokens": 10}
    first = orjson.loads(ids.continuation(doc, "chat", StreamState(tokens=1)).body)
    assert first["prompt"] == [3, 90, 88, 35]
    chunk = {"choices": [{"index": 0, "text": "x", "prompt_token_ids": first["prompt"],
                          "token_ids": [40]}]}  # fmt: skip
    ids.to_client(chunk, "chat")
    again = orjson.loads(ids.continuation(doc, "chat", StreamState(tokens=2)).body)
    assert again["prompt"] == [3, 90, 88, 35, 40] and again["max_tokens"] == 8


def test_exact_resume_is_on_for_vllm_backends_and_checked_at_load() -> None:
    """`backends[].exact_resume` (default true) flags vLLM targets only; set on another
    engine, or with `resume: none`, it is a load error naming the key."""
    url = "http://127.0.0.1:1"
    cfg = parse_config({"backends": [
        {"name": "v", "url": url}, {"name": "off", "url": url, "exact_resume": False},
        {"name": "hf", "url": url, "engine": "transformers"},
        {"name": "none", "url": url, "resume": "none"},
    ]})  # fmt: skip
    assert [target(b).token_ids for b in cfg.backends] == [True, False, False, False]
    with pytest.raises(ConfigError) as ei:
        parse_config({"backends": [{"name": "t", "url": url, "engine": "tgi",
                                    "exact_resume": True}]})  # fmt: skip
    assert any(e.startswith("backends[0].exact_resume:") for e in ei.value.errors), ei.value


def test_the_sims_ids_continue_as_its_text_would() -> None:
    """The sim (vLLM's framing): a completions prompt of a chat's prompt ids + the first k
    generated ids goes on with the rest of the uninterrupted answer, for every k, and its
    usage counts the prompt's words + k (the padding ids are not counted)."""
    from pulsegate.sim.protocol import parse_chat, parse_completion
    from pulsegate.sim.text import TokenGen, piece_id

    def gen(req: Any, n: int) -> list[str]:
        g = TokenGen(req.context, 7, req.keys)
        return [g.next() for _ in range(n)]

    for msgs in (
        MSGS,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": ""}],
    ):
        chat = parse_chat(orjson.dumps({"messages": msgs, "return_token_ids": True}))
        assert chat.prompt_ids is not None
        whole = gen(chat, 12)
        for k in range(12):
            ids = [*chat.prompt_ids, *(piece_id(t) for t in whole[:k])]
            cont = parse_completion(orjson.dumps({"prompt": ids}))
            assert gen(cont, 12 - k) == whole[k:]
            assert cont.prompt_tokens == chat.prompt_tokens + k
