"""OpenAI's Responses API (POST /v1/responses) driven by the official `openai` client's `responses.create` over
real HTTP on 127.0.0.1: at T = 0 its text is the chat endpoint's, and mlx-lm's own greedy text, for the same
conversation; streamed events in OpenAI's order add up to the response; a function call and its output
round-trip through the chat template; a thinking model's reasoning as a reasoning item; no server-side state; the
response object echoes the request's fields; every field of the installed client's `ResponseCreateParams` is
honoured, ignored as a stateless server must, or refused with a 400 naming it. A tiny real target and DFlash 2
drafter, word-level tokenizers."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import CALL, TIMEOUT, WEATHER_TOOL, emitting, running, save_thinking_target, user
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load
from openai.types.responses.response_create_params import ResponseCreateParamsStreaming

from dflash2_mlx.server.responses_api import IGNORED_FIELDS, REFUSED_FIELDS

MAX = 12
ASK = "w1 w2 w3"
TOOL = {"type": "function", **WEATHER_TOOL}


@pytest.fixture(scope="module")
def plain_server(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as s:
        yield s


@pytest.fixture(scope="module")
def thinking_server(tiny_pair, tiny_dflash2, tmp_path_factory):
    folder = save_thinking_target(tmp_path_factory.mktemp("thinking") / "target", tiny_pair[0])
    with running(folder, tiny_dflash2, "--max-tokens", 32) as s:
        yield s


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def test_text_at_t0_is_the_chat_endpoints_and_mlx_lms(plain_server, tiny_pair):
    app, port = plain_server
    reply = client(port).responses.create(model="default_model", instructions="w5 w6", input=ASK, max_output_tokens=MAX)
    messages = [{"role": "system", "content": "w5 w6"}, *user(ASK)]
    want = client(port).chat.completions.create(model="default_model", messages=messages, max_tokens=MAX)
    model, tok = mlx_lm_load(str(tiny_pair[0]))
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert reply.output_text == want.choices[0].message.content == mlx_lm_generate(model, tok, prompt, max_tokens=MAX)
    assert reply.status == {"length": "incomplete", "stop": "completed"}[want.choices[0].finish_reason]
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (len(prompt), want.usage.completion_tokens)
    assert reply.id.startswith("resp_") and [item.type for item in reply.output] == ["message"]
    items = client(port).responses.create(
        model="default_model",
        max_output_tokens=MAX,
        input=[
            {"role": "developer", "content": "w5 w6"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]},
        ],
    )
    assert items.output_text == reply.output_text  # developer is the template's system; text parts joined


EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def test_streamed_events_come_in_openais_order_and_add_up(plain_server):
    app, port = plain_server
    kw = dict(model="default_model", input=ASK, max_output_tokens=MAX)
    whole = client(port).responses.create(**kw)
    events = list(client(port).responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas and [k for i, k in enumerate(kinds) if k != "response.output_text.delta" or kinds[i - 1] != k] == [
        *EVENTS,
        f"response.{whole.status}",
    ], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    with client(port).responses.stream(**kw) as stream:  # the client's own parsing (its get_final_response
        final = list(stream)[-1]  # wants response.completed, which an incomplete response does not end with)
    assert final.type == f"response.{whole.status}" and final.response.output_text == whole.output_text


def test_a_function_call_and_its_output_round_trip(thinking_server, monkeypatch):
    """The call comes as a function_call item; fed back with its function_call_output, the prompt is the chat
    endpoint's for the same conversation in its shape."""
    app, port = thinking_server
    kw = dict(model="default_model", tools=[TOOL], reasoning={"effort": "none"})
    with emitting(monkeypatch, app.tokenizer, f"w7 {CALL}"):
        reply = client(port).responses.create(input=ASK, **kw)
        events = list(client(port).responses.create(input=ASK, stream=True, **kw))
    assert [item.type for item in reply.output] == ["message", "function_call"]
    call = reply.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    turn = [
        {"role": "user", "content": ASK},
        *[item.model_dump(exclude_none=True) for item in reply.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "w9"},
    ]
    chat_turn = [
        *user(ASK),
        {
            "role": "assistant",
            "content": reply.output[0].content[0].text,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "name": "get_weather", "content": "w9"},
    ]
    with emitting(monkeypatch, app.tokenizer, "w10 w11") as prompts:
        after = client(port).responses.create(input=turn, **kw)
        client(port).chat.completions.create(
            model="default_model",
            messages=chat_turn,
            reasoning_effort="none",
            tools=[{"type": "function", "function": WEATHER_TOOL}],
        )
    assert prompts[0] == prompts[1] and "</tool_call> <|user|> w9" in app.tokenizer.decode(prompts[0])
    assert after.output_text == "w10 w11" and after.status == "completed"


def test_a_thinking_models_reasoning_is_a_reasoning_item(thinking_server, monkeypatch):
    app, port = thinking_server
    with emitting(monkeypatch, app.tokenizer, "w1 w2 </think> w3 w4"):
        reply = client(port).responses.create(model="default_model", input=ASK)
        events = list(client(port).responses.create(model="default_model", input=ASK, stream=True))
    reasoning, message = reply.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "w1 w2 "
    assert reply.output_text == " w3 w4"
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    added = [(e.output_index, e.item.type) for e in events if e.type == "response.output_item.added"]
    assert thought == "w1 w2 " and added == [(0, "reasoning"), (1, "message")]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required", "tools": [TOOL]}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"text": {"format": {"type": "json_object"}}}, "text"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"verbosity": "high"}}, "text"),
        ({"reasoning": {"summary": "everything"}}, "reasoning"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"tools": [{**TOOL, "strict": True, "parameters": {"type": "object", "x-unknown": 1}}]}, "tools"),
    ],
)
def test_what_cannot_be_honoured_gets_a_400_naming_it(plain_server, body, param):
    app, port = plain_server
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).responses.create(**{"model": "default_model", "input": ASK, **body})
    assert caught.value.body["param"] == param, caught.value.body
    assert param in caught.value.body["message"]


def test_the_response_echoes_the_requests_fields(plain_server):
    """instructions, max_output_tokens, tools, tool_choice, text, reasoning, metadata, ... as the request gave them,
    temperature and top_p as they ran; unset: OpenAI's defaults, the server's sampling defaults (--temp 0)."""
    app, port = plain_server
    given = dict(
        instructions="w5 w6",
        max_output_tokens=3,
        temperature=0.0,
        top_p=0.5,
        tools=[TOOL],
        tool_choice="none",
        parallel_tool_calls=False,
        text={"format": {"type": "text"}},
        reasoning={"effort": "low"},
        metadata={"k": "v"},
        user="u1",
    )
    kw = dict(model="default_model", input=ASK)
    for reply in (
        client(port).responses.create(**kw, **given),
        list(client(port).responses.create(**kw, **given, stream=True))[-1].response,
    ):
        echoed = {name: getattr(reply, name) for name in given}
        echoed.update(
            tools=[t.model_dump(exclude_none=True) for t in reply.tools], text=reply.text.model_dump(exclude_none=True)
        )
        echoed.update(reasoning=reply.reasoning.model_dump(exclude_none=True))
        assert echoed == given
        assert (reply.store, reply.previous_response_id, reply.background) == (False, None, False)
    unset = client(port).responses.create(**kw, max_output_tokens=2)
    assert (unset.instructions, unset.tools, unset.tool_choice, unset.parallel_tool_calls) == (None, [], "auto", True)
    assert (unset.temperature, unset.top_p, unset.max_output_tokens, unset.reasoning) == (0.0, 1.0, 2, None)


# -- every field of responses.create: honoured, ignored as a stateless server must, or refused -----------------

CLIENT_FIELDS = ResponseCreateParamsStreaming.__required_keys__ | ResponseCreateParamsStreaming.__optional_keys__
# honoured: (a value the server acts on, a value of the wrong type or range: 400 naming the field)
HONOURED = {
    "model": ("default_model", 5),
    "input": (ASK, 5),
    "instructions": ("w5", 5),
    "max_output_tokens": (3, 0),
    "stream": (False, "yes"),
    "temperature": (0.0, "hot"),
    "top_p": (0.9, "x"),
    "tools": (None, "x"),  # the plain template has no tool format: the thinking one's takes them (above)
    "tool_choice": ("none", "required"),
    "parallel_tool_calls": (False, "no"),  # false: one call at most (tests/test_serve_tool_fields.py)
    "reasoning": ({"effort": "low"}, "x"),
    "text": ({"format": {"type": "text"}}, {"format": {"type": "json_object"}}),
}
# refused unless absent: a value asking for what this server does not do
REFUSED = {
    "background": True,
    "context_management": [{"type": "compaction", "compact_threshold": 1000}],
    "conversation": "conv_1",
    "max_tool_calls": 1,
    "moderation": {"model": "omni-moderation-latest"},
    "previous_response_id": "resp_1",
    "prompt": {"id": "pmpt_1"},
    "top_logprobs": 2,
}
# accepted and not acted on: a value that leaves the answer as it is
IGNORED = {
    "access_programs": {"cyber": "standard"},
    "background_options": {"completion_window": "soonest"},
    "image": {"context_compression": "auto"},
    "include": ["reasoning.encrypted_content"],
    "metadata": {"k": "v"},
    "prompt_cache_key": "k1",
    "prompt_cache_options": {"ttl": "30m", "mode": "implicit"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "u1",
    "service_tier": "auto",
    "store": True,
    "stream_options": {"include_obfuscation": False},
    "truncation": "auto",
    "user": "u1",
}
# values of fields otherwise not acted on that would change the answer: refused
REFUSED_VALUES = {
    "include": ["message.output_text.logprobs"],
    "prompt_cache_options": {"prewarm": True},
}


def test_every_field_of_the_installed_client_has_one_fate():
    fates = [set(HONOURED), set(REFUSED), set(IGNORED)]
    assert set().union(*fates) == CLIENT_FIELDS and sum(map(len, fates)) == len(CLIENT_FIELDS), (
        f"the client sends {sorted(CLIENT_FIELDS - set().union(*fates))} (new) and no longer "
        f"{sorted(set().union(*fates) - CLIENT_FIELDS)}: give each its fate here, in responses_api.py and in "
        "docs/server.md"
    )
    assert set(REFUSED) == set(REFUSED_FIELDS) and set(IGNORED) == set(IGNORED_FIELDS)


def create(port: int, **fields):
    return client(port).responses.create(**{"model": "default_model", "input": ASK, "max_output_tokens": 4, **fields})


@pytest.mark.parametrize("field", sorted(HONOURED))
def test_an_honoured_field_is_read(plain_server, field):
    """Its wrong value gets 400 naming it (the server reads it); its right value is answered."""
    _, port = plain_server
    good, bad = HONOURED[field]
    with pytest.raises(openai.BadRequestError) as caught:
        create(port, **{field: bad})
    assert caught.value.body["param"] == field and field in caught.value.body["message"], caught.value.body
    if good is not None:
        assert create(port, **{field: good}).status in ("completed", "incomplete")


@pytest.mark.parametrize("field, value", [*sorted(REFUSED.items()), *sorted(REFUSED_VALUES.items())])
def test_a_refused_field_gets_a_400_naming_it(plain_server, field, value):
    _, port = plain_server
    with pytest.raises(openai.BadRequestError) as caught:
        create(port, **{field: value})
    assert caught.value.body["param"] == field and field in caught.value.body["message"], caught.value.body


def test_an_ignored_field_changes_nothing(plain_server):
    _, port = plain_server
    want = create(port, max_output_tokens=6).output_text
    assert want, "a weak test: nothing generated"
    for field, value in IGNORED.items():
        assert create(port, max_output_tokens=6, **{field: value}).output_text == want, field
