"""The request fields that shape tool calls, driven by the official `openai` and `anthropic` clients over real HTTP
on 127.0.0.1: a function tool's `strict` (its calls' arguments checked against its schema once generated: a
mismatch is a 500 the client does not retry at T = 0, never a call sent), `parallel_tool_calls` false and
Anthropic's `disable_parallel_tool_use` (the answer ends after its first call, the generation stopped there), and
the Responses API's `text.verbosity`, `reasoning.summary` and `truncation`. The schema checks' expected verdicts
are JSON Schema's own rules, written out case by case. The generated text is fixed (`emitting`): a tiny random
model emits no call on cue."""

from __future__ import annotations

import json

import anthropic
import openai
import pydantic
import pytest
from helpers import CALL, TIMEOUT, WEATHER_TOOL, emitting, running, save_thinking_target

from dflash2_mlx.server.schema import check_schema, violation

ASK = [{"role": "user", "content": "w1 w2 w3"}]
NO_THINKING = dict(model="default_model", reasoning_effort="none")  # the template closes the thinking at once
TWO_CALLS = f"w7 {CALL} w8 {CALL} w9"
STRICT = {"type": "function", "function": {**WEATHER_TOOL, "strict": True}}
# the generated call's city is "Paris": a schema asking for an integer city refuses it
MISMATCH = {
    "type": "function",
    "function": {
        **WEATHER_TOOL,
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "integer"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server(tiny_pair, tiny_dflash2, tmp_path_factory):
    folder = save_thinking_target(tmp_path_factory.mktemp("tools") / "target", tiny_pair[0])
    with running(folder, tiny_dflash2, "--max-tokens", 48) as s:
        yield s


def client(port: int, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=retries)


def tokens(app, text: str) -> int:
    return len(app.tokenizer.encode(text, add_special_tokens=False))


# -- strict: the arguments checked against the schema ------------------------------------------------------------


class Weather(pydantic.BaseModel):
    city: str


def test_the_clients_strict_tools_are_answered_and_parsed(server, monkeypatch):
    """`pydantic_function_tool` sends strict true (and `chat.completions.parse` wants it): a matching call comes
    back, parsed by the client into its model."""
    app, port = server
    tool = openai.pydantic_function_tool(Weather, name="get_weather")
    assert tool["function"]["strict"] is True
    with emitting(monkeypatch, app.tokenizer, CALL):
        reply = client(port).chat.completions.parse(messages=ASK, tools=[tool], **NO_THINKING)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Weather(city="Paris") and reply.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("text", [CALL, CALL.removesuffix(" </tool_call>")])  # a call ended by EOS is checked too
def test_a_strict_call_that_does_not_match_is_refused_and_not_retried(server, monkeypatch, stream, text):
    app, port = server
    with emitting(monkeypatch, app.tokenizer, text) as prompts:
        with pytest.raises(openai.APIError) as caught:
            reply = client(port, retries=2).chat.completions.create(
                messages=ASK, tools=[MISMATCH], stream=stream, **NO_THINKING
            )
            list(reply) if stream else None
    message = caught.value.message
    assert "get_weather" in message and "arguments.city must be integer" in message and "strict false" in message
    if not stream:
        assert caught.value.status_code == 500
    assert len(prompts) == 1  # x-should-retry false at T = 0: the client does not generate the same call again


def test_a_call_of_a_tool_that_is_not_strict_is_not_checked(server, monkeypatch):
    app, port = server
    loose = {"type": "function", "function": {**MISMATCH["function"], "strict": False}}
    with emitting(monkeypatch, app.tokenizer, CALL):
        reply = client(port).chat.completions.create(messages=ASK, tools=[loose], **NO_THINKING)
    assert json.loads(reply.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris"}


def test_responses_and_messages_check_strict_tools_too(server, monkeypatch):
    app, port = server
    responses = client(port).responses
    tool = {"type": "function", "name": "get_weather", "parameters": MISMATCH["function"]["parameters"]}
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
    anthropic_tool = {"name": "get_weather", "input_schema": MISMATCH["function"]["parameters"]}
    kw = dict(model="default_model", messages=ASK, max_tokens=32, thinking={"type": "disabled"})
    with emitting(monkeypatch, app.tokenizer, CALL):
        got = responses.create(model="default_model", input="w1", tools=[{**tool, "strict": False}])
        assert json.loads(got.output[-1].arguments) == {"city": "Paris"}
        with pytest.raises(openai.InternalServerError, match="get_weather"):
            responses.create(model="default_model", input="w1", tools=[{**tool, "strict": True}])
        assert messages.messages.create(tools=[anthropic_tool], **kw).content[-1].input == {"city": "Paris"}
        with pytest.raises(anthropic.InternalServerError, match="get_weather"):
            messages.messages.create(tools=[{**anthropic_tool, "strict": True}], **kw)


@pytest.mark.parametrize(
    "parameters, fragment",
    [
        ({"type": "object", "properties": {"city": {"type": "string", "x-unknown": 1}}}, "x-unknown"),
        ({"type": "text"}, "type"),
        ({"type": "object", "properties": {"city": {"$ref": "https://x/schema"}}}, "$ref"),
    ],
)
def test_a_strict_schema_that_cannot_be_checked_gets_a_400(server, parameters, fragment):
    _, port = server
    tool = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": parameters}}
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).chat.completions.create(messages=ASK, tools=[tool], **NO_THINKING)
    assert caught.value.body["param"] == "tools" and fragment in caught.value.body["message"]
    assert "strict false" in caught.value.body["message"]


# JSON Schema's verdicts, from its rules: (schema, value, whether it matches)
VERDICTS = [
    ({"type": "integer"}, 3, True),
    ({"type": "integer"}, 3.0, True),  # a number with no fraction is an integer
    ({"type": "integer"}, 3.5, False),
    ({"type": "integer"}, True, False),  # booleans are never numbers
    ({"type": "number"}, False, False),
    ({"type": ["string", "null"]}, None, True),
    ({"enum": ["a", 1]}, True, False),
    ({"const": 1}, 1.0, True),
    ({"type": "object", "required": ["a"]}, {}, False),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "additionalProperties": False}, {"b": 1}, False),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, {"b": "x"}, False),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2], True),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2, 3], False),
    ({"type": "array", "uniqueItems": True}, [1, 1], False),
    ({"prefixItems": [{"type": "string"}], "items": {"type": "integer"}}, ["a", 2], True),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, 2.5, False),
    ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, 2, False),  # both match
    ({"allOf": [{"minimum": 1}, {"maximum": 3}]}, 4, False),
    ({"not": {"type": "string"}}, 1, True),
    ({"exclusiveMinimum": 0}, 0, False),
    ({"multipleOf": 0.5}, 1.5, True),
    ({"multipleOf": 0.5}, 1.2, False),
    ({"pattern": "^[A-Z]"}, "Paris", True),
    ({"pattern": "^[A-Z]"}, "paris", False),
    ({"minLength": 2}, "a", False),
    ({"format": "date-time"}, "not a date", True),  # an annotation
    (
        {
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node",
        },
        {"next": {"next": {"next": 3}}},
        False,
    ),
    (False, 1, False),
    (True, 1, True),
]


@pytest.mark.parametrize("schema, value, matches", VERDICTS)
def test_the_schema_checks_follow_json_schema(schema, value, matches):
    check_schema(schema)
    assert (violation(value, schema) is None) == matches


# -- parallel_tool_calls false: the answer ends after its first call -----------------------------------------------


def test_parallel_tool_calls_false_ends_the_answer_at_its_first_call(server, monkeypatch):
    app, port = server
    tools = [{"type": "function", "function": WEATHER_TOOL}]
    with emitting(monkeypatch, app.tokenizer, TWO_CALLS):
        both = client(port).chat.completions.create(messages=ASK, tools=tools, **NO_THINKING)
        one = client(port).chat.completions.create(messages=ASK, tools=tools, parallel_tool_calls=False, **NO_THINKING)
        chunks = list(
            client(port).chat.completions.create(
                messages=ASK, tools=tools, parallel_tool_calls=False, stream=True, **NO_THINKING
            )
        )
    assert len(both.choices[0].message.tool_calls) == 2 and both.choices[0].message.content.strip() == "w7  w8  w9"
    assert len(one.choices[0].message.tool_calls) == 1 and one.choices[0].finish_reason == "tool_calls"
    assert one.choices[0].message.content.strip() == "w7"
    # the generation stopped at the call's end marker: its tokens, and none of what followed, are counted
    assert one.usage.completion_tokens == tokens(app, f"w7 {CALL}")
    streamed = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or []]
    assert len(streamed) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls"


def test_responses_and_messages_make_one_call_when_asked(server, monkeypatch):
    app, port = server
    tool = {"type": "function", **WEATHER_TOOL}
    kw = dict(model="default_model", input="w1", tools=[tool], reasoning={"effort": "none"})
    messages = anthropic.Anthropic(base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0)
    anthropic_kw = dict(
        model="default_model",
        messages=ASK,
        max_tokens=40,
        thinking={"type": "disabled"},
        tools=[{"name": "get_weather", "input_schema": WEATHER_TOOL["parameters"]}],
    )
    with emitting(monkeypatch, app.tokenizer, TWO_CALLS):
        both = client(port).responses.create(**kw)
        one = client(port).responses.create(**kw, parallel_tool_calls=False)
        one_anthropic = messages.messages.create(
            **anthropic_kw, tool_choice={"type": "auto", "disable_parallel_tool_use": True}
        )
    assert [item.type for item in both.output].count("function_call") == 2
    assert [item.type for item in one.output] == ["message", "function_call"] and one.status == "completed"
    assert one.parallel_tool_calls is False  # echoed
    assert [block.type for block in one_anthropic.content] == ["text", "tool_use"]
    assert one_anthropic.stop_reason == "tool_use"


def test_parallel_tool_calls_must_be_a_boolean(server):
    _, port = server
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).chat.completions.create(messages=ASK, extra_body={"parallel_tool_calls": "no"}, **NO_THINKING)
    assert caught.value.body["param"] == "parallel_tool_calls"


# -- the Responses API's text.verbosity, reasoning.summary, truncation ---------------------------------------------


def test_verbosity_other_than_medium_gets_a_400_naming_the_fix(server):
    _, port = server
    kw = dict(model="default_model", input="w1", max_output_tokens=2)
    assert client(port).responses.create(**kw, text={"verbosity": "medium"}).status in ("completed", "incomplete")
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).responses.create(**kw, text={"verbosity": "low"})
    assert caught.value.body["param"] == "text" and "instructions" in caught.value.body["message"]


def test_a_reasoning_summary_changes_nothing_and_is_checked(server, monkeypatch):
    app, port = server
    kw = dict(model="default_model", input="w1")
    with emitting(monkeypatch, app.tokenizer, "w1 w2 </think> w3 w4"):
        plain = client(port).responses.create(**kw)
        asked = client(port).responses.create(**kw, reasoning={"summary": "detailed"})
    strip = lambda r: [{**i.model_dump(), "id": None} for i in r.output]  # noqa: E731
    assert strip(asked) == strip(plain) and asked.output[0].content[0].text == "w1 w2 "
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).responses.create(**kw, reasoning={"summary": "everything"})
    assert caught.value.body["param"] == "reasoning" and "summary" in caught.value.body["message"]


def test_truncation_auto_over_the_context_gets_a_400_that_says_nothing_is_truncated(server):
    _, port = server
    long_input = " ".join(f"w{i % 200}" for i in range(600))  # over the 512-token context
    for truncation, said in (("auto", True), ("disabled", False)):
        with pytest.raises(openai.BadRequestError) as caught:
            client(port).responses.create(model="default_model", input=long_input, truncation=truncation)
        body = caught.value.body
        assert body["code"] == "context_length_exceeded" and body["param"] == "input"
        assert ("'truncation': \"auto\" drops nothing here" in body["message"]) == said, body["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).responses.create(model="default_model", input="w1", extra_body={"truncation": "sometimes"})
    assert caught.value.body["param"] == "truncation"
