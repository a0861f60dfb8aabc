"""Anthropic's Messages API (POST /v1/messages) driven by the official `anthropic` client over real HTTP on
127.0.0.1: at T = 0 its text is the chat endpoint's, and mlx-lm's own greedy text, for the same conversation;
streamed events in Anthropic's order add up to the message; stop sequences; tool_use and tool_result blocks
round-trip through the chat template; a thinking model's reasoning in thinking blocks, cut at its
`budget_tokens` as mlx-lm's own greedy text forced to the think-end marker there, its signature and its text
(shown or omitted) fed back; errors in Anthropic's shape; the API key as x-api-key. A tiny real target and DFlash 2
drafter, word-level tokenizers."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import anthropic
import mlx.core as mx
import openai
import pytest
from helpers import (
    CALL,
    COSTS,
    TIMEOUT,
    WEATHER_TOOL,
    SiblingOracle,
    drafter_config,
    emitting,
    make_oracle,
    request,
    running,
    save_thinking_target,
    user,
)
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.generate import BatchGenerator

from dflash2_mlx import generate
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.server.messages_api import signature, thinking_budget

MAX = 12
SYSTEM = "w5 w6"
ASK = "w1 w2 w3"
TOOL = {
    "name": WEATHER_TOOL["name"],
    "description": WEATHER_TOOL["description"],
    "input_schema": WEATHER_TOOL["parameters"],
}


@pytest.fixture(scope="module")
def plain_server(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as s:
        yield s


@pytest.fixture(scope="module")
def thinking_folder(tiny_pair, tmp_path_factory):
    return save_thinking_target(tmp_path_factory.mktemp("thinking") / "target", tiny_pair[0])


@pytest.fixture(scope="module")
def thinking_server(thinking_folder, tiny_dflash2):
    with running(thinking_folder, tiny_dflash2, "--max-tokens", 32) as s:
        yield s


def claude(port: int, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key=key, timeout=TIMEOUT, max_retries=0)


def chat(port: int, messages: list, **kw):
    api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    return api.chat.completions.create(model="default_model", messages=messages, **kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_text_at_t0_is_the_chat_endpoints_and_mlx_lms(plain_server, tiny_pair):
    app, port = plain_server
    reply = claude(port).messages.create(
        model="default_model", max_tokens=MAX, system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )
    messages = [{"role": "system", "content": SYSTEM}, *user(ASK)]
    want = chat(port, messages, max_tokens=MAX)
    model, tok = mlx_lm_load(str(tiny_pair[0]))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert text_of(reply) == want.choices[0].message.content == mlx_lm_generate(model, tok, prompt, max_tokens=MAX)
    assert reply.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(prompt), want.usage.completion_tokens)
    assert reply.role == "assistant" and reply.type == "message" and reply.id.startswith("msg_")
    # system as text blocks, content as text blocks: the same conversation
    blocks = claude(port).messages.create(
        model="default_model",
        max_tokens=MAX,
        system=[{"type": "text", "text": SYSTEM}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK}]}],
    )
    assert text_of(blocks) == text_of(reply)


EVENT_ORDER = re.compile(
    r"message_start (content_block_start (content_block_delta )*content_block_stop )*"
    r"message_delta message_stop "
)


def test_streamed_events_come_in_anthropics_order_and_add_up(plain_server):
    app, port = plain_server
    kw = dict(model="default_model", max_tokens=MAX, messages=[{"role": "user", "content": ASK}])
    whole = claude(port).messages.create(**kw)
    events = list(claude(port).messages.create(stream=True, **kw))
    assert EVENT_ORDER.fullmatch(" ".join(e.type for e in events) + " "), [e.type for e in events]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == text_of(whole) and text
    final = events[-2]
    assert (final.delta.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    with claude(port).messages.stream(**kw) as stream:  # the client's own accumulation
        assert "".join(stream.text_stream) == text_of(whole)
        assert stream.get_final_message().content[0].text == text_of(whole)


def test_a_stop_sequence_cuts_the_text_and_is_named(plain_server):
    app, port = plain_server
    kw = dict(model="default_model", max_tokens=MAX, messages=[{"role": "user", "content": ASK}])
    full = text_of(claude(port).messages.create(**kw))
    stop = full.split()[3]
    reply = claude(port).messages.create(stop_sequences=[stop, "w239 w238"], **kw)
    assert text_of(reply) == full[: full.index(stop)] and stop not in text_of(reply)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    events = list(claude(port).messages.create(stop_sequences=[stop], stream=True, **kw))
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)
    assert text_of(reply) == chat(port, user(ASK), max_tokens=MAX, stop=[stop]).choices[0].message.content


def test_tool_use_and_its_result_round_trip(thinking_server, monkeypatch):
    """The call comes as a tool_use block (stop_reason "tool_use"); sent back with its tool_result, the prompt is
    the chat endpoint's for the same conversation in OpenAI's shape, and the template's rendering of it."""
    app, port = thinking_server
    kw = dict(model="default_model", max_tokens=32, tools=[TOOL], thinking={"type": "disabled"})
    with emitting(monkeypatch, app.tokenizer, f"w7 {CALL}"):
        reply = claude(port).messages.create(messages=[{"role": "user", "content": ASK}], **kw)
        events = list(claude(port).messages.create(messages=[{"role": "user", "content": ASK}], stream=True, **kw))
    assert reply.stop_reason == "tool_use" and [b.type for b in reply.content] == ["text", "tool_use"]
    use = reply.content[1]
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id
    partial = "".join(
        e.delta.partial_json for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    )
    assert json.loads(partial) == {"city": "Paris"} and events[-2].delta.stop_reason == "tool_use"
    turn = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": [b.model_dump() for b in reply.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "w9"}]},
    ]
    openai_turn = [
        *user(ASK),
        {
            "role": "assistant",
            "content": reply.content[0].text,
            "tool_calls": [
                {
                    "id": use.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(use.input)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": use.id, "name": "get_weather", "content": "w9"},
    ]
    with emitting(monkeypatch, app.tokenizer, "w10 w11") as prompts:
        after = claude(port).messages.create(messages=turn, **kw)
        chat(
            port,
            openai_turn,
            tools=[{"type": "function", "function": WEATHER_TOOL}],
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
    assert prompts[0] == prompts[1] and "</tool_call> <|user|> w9" in app.tokenizer.decode(prompts[0])
    assert text_of(after) == "w10 w11" and after.stop_reason == "end_turn"


def test_a_thinking_models_reasoning_comes_in_thinking_blocks(thinking_server, monkeypatch):
    app, port = thinking_server
    kw = dict(
        model="default_model",
        max_tokens=32,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    with emitting(monkeypatch, app.tokenizer, "w1 w2 </think> w3 w4") as prompts:
        reply = claude(port).messages.create(**kw)
        events = list(claude(port).messages.create(stream=True, **kw))
        claude(port).messages.create(**{**kw, "thinking": {"type": "disabled"}})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", "w1 w2 "),
        ("text", " w3 w4"),
    ]
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    thought = "".join(
        e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
    )
    assert thought == "w1 w2 " and EVENT_ORDER.fullmatch(" ".join(e.type for e in events) + " ")
    tok = app.tokenizer
    assert prompts[2] == tok.apply_chat_template(user(ASK), add_generation_prompt=True, enable_thinking=False)
    assert prompts[0] == tok.apply_chat_template(user(ASK), add_generation_prompt=True, enable_thinking=True)


def split_at_think_end(text: str) -> tuple[str, str]:
    """(reasoning, answer) of a text that starts in its reasoning, cut at the literal marker."""
    reasoning, _, answer = text.partition("</think>")
    return reasoning, answer


@pytest.mark.parametrize("budget", [2, 5])
def test_a_thinking_budget_ends_the_thinking_there(thinking_server, thinking_folder, budget):
    """T = 0, the real model, which never closes its thinking by itself here: the thinking block is mlx-lm's first
    `budget` greedy tokens, then the answer is mlx-lm's greedy continuation of the prompt, those tokens and
    "</think>" (the marker forced where the model would have gone on thinking); streamed, the same."""
    app, port = thinking_server
    model, tok = mlx_lm_load(str(thinking_folder))
    prompt = tok.apply_chat_template(user(ASK), add_generation_prompt=True, enable_thinking=True)
    free = [r.token for r in mlx_lm_stream_generate(model, tok, prompt, max_tokens=budget + 4)]
    (end,) = tok.think_end_tokens
    assert end not in free and tok.eos_token_id not in free, "a weak test: the model closes its thinking itself"
    forced = [*prompt, *free[:budget], end]
    rest = [r.token for r in mlx_lm_stream_generate(model, tok, forced, max_tokens=12 - budget - 1)]
    reasoning, answer = split_at_think_end(tok.decode(forced[len(prompt) :] + rest))
    assert reasoning.strip() and answer.strip() and reasoning != tok.decode(free), "a weak test"
    kw = dict(
        model="default_model",
        max_tokens=12,
        messages=[{"role": "user", "content": ASK}],
        thinking={"type": "enabled", "budget_tokens": budget},
    )
    reply = claude(port).messages.create(**kw)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in reply.content] == [
        ("thinking", reasoning),
        ("text", answer),
    ]
    assert reply.usage.output_tokens == budget + 1 + len(rest)
    with claude(port).messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    unbounded = claude(port).messages.create(**{**kw, "thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert [b.type for b in unbounded.content] == ["thinking"] and unbounded.content[0].thinking.split()[
        :budget
    ] == reasoning.split()


@pytest.mark.parametrize("mode", ["dflash", "adaptive", "ddtree"])
def test_the_budget_holds_in_every_verify_mode(thinking_folder, mode):
    """A drafter that proposes the processed target's continuation (the forced marker included, so drafts past
    the budget are accepted and verified against processed rows): the tokens are mlx-lm's greedy ones forced to
    the think-end marker after `budget` tokens."""
    model, tok = mlx_lm_load(str(thinking_folder))
    prompt = tok.apply_chat_template(user(ASK), add_generation_prompt=True)
    budget, (end,) = 5, tok.think_end_tokens
    free = [r.token for r in mlx_lm_stream_generate(model, tok, prompt, max_tokens=budget + 4)]
    assert end not in free, "a weak test: the model closes its thinking itself"
    rest = [r.token for r in mlx_lm_stream_generate(model, tok, [*prompt, *free[:budget], end], max_tokens=10)]
    want = [*free[:budget], end, *rest]
    procs = [thinking_budget(tok, budget)]
    if mode == "ddtree":
        drafter = SiblingOracle(drafter_config(model, block_size=8), model, prompt, 16, None, None, procs)
        bind_drafter(drafter, model)
    else:
        drafter = make_oracle(model, prompt, 8, spoil_seed=3, processors=procs)
    ours = generate(
        model,
        tok,
        prompt,
        drafter,
        verify_mode=mode,
        block_size=8,
        max_tokens=len(want),
        logits_processors=procs,
        **({"costs": COSTS} if mode == "adaptive" else {"tree_budget": 16} if mode == "ddtree" else {}),
    )
    assert ours.tokens[: len(want)] == want and sum(ours.accepted) > 0, (ours.tokens, want)


def test_the_budget_holds_in_mlx_lms_batched_decoding(thinking_folder):
    """Batched requests (mlx-lm's BatchGenerator, which the server decodes them with) give the processor each
    sequence's prompt and tokens, as plain decoding does: the budgeted one is mlx-lm's greedy text forced to the
    think-end marker after `budget` tokens, beside a request without a budget."""
    model, tok = mlx_lm_load(str(thinking_folder))
    prompts = [tok.apply_chat_template(user(text), add_generation_prompt=True) for text in (ASK, "w4 w5")]
    budget, (end,) = 3, tok.think_end_tokens
    free = [r.token for r in mlx_lm_stream_generate(model, tok, prompts[0], max_tokens=budget + 4)]
    assert end not in free, "a weak test: the model closes its thinking itself"
    rest = [r.token for r in mlx_lm_stream_generate(model, tok, [*prompts[0], *free[:budget], end], max_tokens=6)]
    want = [*free[:budget], end, *rest]
    gen = BatchGenerator(model, completion_batch_size=2, prefill_batch_size=2)
    try:
        uids = gen.insert(prompts, max_tokens=[len(want), 8], logits_processors=[[thinking_budget(tok, budget)], []])
        got, done = {uid: [] for uid in uids}, set()
        while len(done) < len(uids):
            _, responses = gen.next()
            for r in responses:
                got[r.uid].append(r.token)
                if r.finish_reason:
                    done.add(r.uid)
    finally:
        gen.close()
    assert got[uids[0]] == want


def test_the_budget_forces_each_token_of_a_longer_end_marker():
    """A template whose think-end marker is three tokens (7, 8, 9): past the budget, only the marker's next token
    is left (its first, then the one after the part already forced); inside the budget, or once the section is
    closed, the row is left as it was."""
    markers = SimpleNamespace(think_start_tokens=(5,), think_end_tokens=(7, 8, 9))
    process = thinking_budget(markers, 2)
    logits = mx.arange(12, dtype=mx.float32)[None] / 10
    cases = {
        (1, 5, 3): None,  # one thinking token: under the budget
        (1, 5, 3, 4): 7,
        (1, 5, 3, 4, 7): 8,
        (1, 5, 3, 4, 7, 8): 9,
        (1, 5, 3, 4, 7, 8, 9): None,  # closed
        (5, 3, 4, 7, 8, 9, 2, 5, 3, 1): 7,  # a second section, over its budget
        (1, 2, 3, 4): None,  # no thinking
    }
    for tokens, forced in cases.items():
        row = process(mx.array(tokens, dtype=mx.uint32), logits)
        if forced is None:
            assert mx.array_equal(row, logits), tokens
        else:
            assert mx.argmax(row).item() == forced and mx.isinf(row).sum().item() == 11, tokens


@pytest.mark.parametrize("display", [None, "omitted"])
def test_a_thinking_block_fed_back_reaches_the_template(thinking_server, monkeypatch, display):
    """The block as answered (its text, or with display "omitted" none, and its signature, which the official
    client's ThinkingBlockParam requires) goes back to the template as the assistant turn's reasoning, as the
    chat endpoint's reasoning_content; streamed, the client's accumulated block is the same."""
    app, port = thinking_server
    thinking = {"type": "enabled", "budget_tokens": 1024, **({"display": display} if display else {})}
    kw = dict(model="default_model", max_tokens=32, thinking=thinking)
    ask = [{"role": "user", "content": ASK}]
    with emitting(monkeypatch, app.tokenizer, "w1 w2 </think> w3 w4"):
        reply = claude(port).messages.create(messages=ask, **kw)
        with claude(port).messages.stream(messages=ask, **kw) as stream:
            events = list(stream)
            final = stream.get_final_message()
    block = reply.content[0]
    assert block.type == "thinking" and block.thinking == ("" if display else "w1 w2 ")
    assert block.signature and block.signature == signature("w1 w2 ")
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    kinds = [e.delta.type for e in events if e.type == "content_block_delta" and e.index == 0]
    assert kinds == ([] if display else ["thinking_delta"] * kinds.count("thinking_delta")) + ["signature_delta"]
    turn = [*ask, {"role": "assistant", "content": [b.model_dump() for b in reply.content]}, *user("w8")]
    chat_turn = [*user(ASK), {"role": "assistant", "content": " w3 w4", "reasoning_content": "w1 w2 "}, *user("w8")]
    with emitting(monkeypatch, app.tokenizer, "w5") as prompts:
        claude(port).messages.create(messages=turn, **kw)
        chat(port, chat_turn)
    assert prompts[0] == prompts[1] and "<think> w1 w2 </think>" in app.tokenizer.decode(prompts[0])


def test_count_tokens_is_the_templates_length(plain_server):
    app, port = plain_server
    counted = claude(port).messages.count_tokens(
        model="default_model", system=SYSTEM, messages=[{"role": "user", "content": ASK}]
    )
    want = app.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, *user(ASK)], add_generation_prompt=True
    )
    assert counted.input_tokens == len(want)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"container": "c1"}, "container"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
        ({"tool_choice": {"type": "any"}, "tools": [TOOL]}, "tool_choice"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": ASK}, {"role": "assistant", "content": "w4"}]}, "messages"),
        ({"stop_sequences": "w4"}, "stop_sequences"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
        ({"temperature": -1}, "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 0}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": "many"}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "full"}}, "thinking"),
        (
            {
                "messages": [
                    {"role": "user", "content": ASK},
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "", "signature": "dflash2:!"}]},
                    {"role": "user", "content": ASK},
                ]
            },
            "messages",
        ),
    ],
)
def test_what_cannot_be_honoured_gets_a_400_in_anthropics_shape(plain_server, body, param):
    app, port = plain_server
    full = {"model": "default_model", "max_tokens": 4, "messages": [{"role": "user", "content": ASK}], **body}
    status, _, reply = request(port, "POST", "/v1/messages", {k: v for k, v in full.items() if v is not None})
    assert status == 400 and reply["type"] == "error", reply
    message = reply["error"]["message"]
    assert reply["error"]["type"] == "invalid_request_error" and re.match(rf"'{param}[.']|{param}\[", message), reply


def test_the_client_raises_anthropics_errors(plain_server):
    app, port = plain_server
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude(port).messages.create(model="default_model", max_tokens=4, messages=[], stop_sequences=["w1"])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude(port).messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": ASK}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_comes_as_x_api_key(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--api-key", "sesame") as (app, port):
        ask = dict(model="default_model", max_tokens=2, messages=[{"role": "user", "content": ASK}])
        assert claude(port, "sesame").messages.create(**ask).content
        with pytest.raises(anthropic.AuthenticationError) as caught:
            claude(port, "wrong").messages.create(**ask)
        assert caught.value.body["error"]["type"] == "authentication_error"
