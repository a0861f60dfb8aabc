"""A thinking model's reasoning apart from its answer in /v1/chat/completions (`reasoning_content`, and
`reasoning` as mlx_lm.server names it), streamed as its own deltas; `enable_thinking` and `reasoning_effort` as the
template takes them; tool calls after the reasoning. Over real HTTP on 127.0.0.1 with the official `openai`
client, a tiny real target and DFlash 2 drafter, and a word-level tokenizer whose template thinks as Qwen 3's
(`helpers.THINK_TEMPLATE`). The expected split is made here, by hand, from mlx-lm's own greedy text."""

from __future__ import annotations

import json

import openai
import pytest
from helpers import CALL, TIMEOUT, WEATHER_TOOL, emitting, running, save_thinking_target, user
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load

TOOLS = [{"type": "function", "function": WEATHER_TOOL}]
ASK = user("w1 w2 w3")


@pytest.fixture(scope="module")
def thinking_folder(tiny_pair, tmp_path_factory):
    return save_thinking_target(tmp_path_factory.mktemp("thinking") / "target", tiny_pair[0])


@pytest.fixture(scope="module")
def thinking_server(thinking_folder, tiny_dflash2):
    with running(thinking_folder, tiny_dflash2, "--max-tokens", 16) as s:
        yield s


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


def split(text: str, reasoning: bool) -> tuple[str, str]:
    """(reasoning, content) of a text that starts in its reasoning or not, cut at the literal markers."""
    parts, state, rest = {True: "", False: ""}, reasoning, text
    while rest:
        marker = "</think>" if state else "<think>"
        at = rest.find(marker)
        if at < 0:
            parts[state] += rest
            break
        parts[state] += rest[:at]
        rest, state = rest[at + len(marker) :], not state
    return parts[True], parts[False]


def streamed(chunks) -> tuple[str, str, list]:
    """(reasoning, content, finish reasons) of a chat stream."""
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return reasoning, content, [c.choices[0].finish_reason for c in chunks if c.choices]


@pytest.mark.parametrize("kwargs, thinks", [({}, True), ({"enable_thinking": False}, False)])
def test_the_real_models_reasoning_is_split_as_mlx_lm_renders_it(thinking_server, thinking_folder, kwargs, thinks):
    """T = 0: the text is mlx-lm's greedy text for the template's prompt, split at the think markers; a template
    that opens the thinking (the default) makes all of it reasoning until "</think>", one told
    enable_thinking false none of it. Streamed deltas add up to the same."""
    app, port = thinking_server
    model, tok = mlx_lm_load(str(thinking_folder))
    prompt = tok.apply_chat_template(ASK, add_generation_prompt=True, **kwargs)
    assert tok.decode(prompt).endswith("<think> </think>" if not thinks else "<think>")
    want_reasoning, want_content = split(mlx_lm_generate(model, tok, prompt, max_tokens=12), thinks)
    assert want_reasoning if thinks else want_content, "a weak test: nothing to split"
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    reply = client(port).chat.completions.create(model="default_model", messages=ASK, max_tokens=12, extra_body=extra)
    message = reply.choices[0].message
    assert reply.usage.prompt_tokens == len(prompt)
    assert (getattr(message, "reasoning_content", None) or "", message.content) == (want_reasoning, want_content)
    assert getattr(message, "reasoning", None) == (want_reasoning or None)  # mlx_lm.server's name for it
    chunks = list(
        client(port).chat.completions.create(
            model="default_model", messages=ASK, max_tokens=12, stream=True, extra_body=extra
        )
    )
    reasoning, content, finishes = streamed(chunks)
    assert (reasoning, content) == (want_reasoning, want_content)
    assert finishes[-1] == reply.choices[0].finish_reason


def test_fixed_reasoning_then_answer_streams_as_separate_deltas(thinking_server, thinking_folder, monkeypatch):
    """A fixed text (the generation replaced, `emitting`): the reasoning comes in reasoning_content deltas, all
    before the content's; no delta carries both; the marker is in neither."""
    app, port = thinking_server
    with emitting(monkeypatch, app.tokenizer, "w1 w2 </think> w3 w4"):
        reply = client(port).chat.completions.create(model="default_model", messages=ASK)
        chunks = list(client(port).chat.completions.create(model="default_model", messages=ASK, stream=True))
    message = reply.choices[0].message
    assert (message.reasoning_content, message.content) == ("w1 w2 ", " w3 w4")
    assert streamed(chunks)[:2] == ("w1 w2 ", " w3 w4")
    kinds = [
        ("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "")
        + ("c" if c.choices[0].delta.content else "")
        for c in chunks
    ]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, reverse=True) and "rc" not in kinds and kinds[0] == "r" and kinds[-1] == "c", kinds


@pytest.mark.parametrize("text, content", [(f"w1 </think> w3 {CALL}", " w3 "), (f"w1 {CALL}", "")])
def test_a_tool_call_after_the_reasoning_is_parsed(thinking_server, monkeypatch, text, content):
    """After "</think>", or straight from the reasoning (mlx-lm's reasoning -> tool transition): the call is
    parsed by mlx-lm's parser, finish_reason "tool_calls"; streamed, the same."""
    app, port = thinking_server
    with emitting(monkeypatch, app.tokenizer, text):
        reply = client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS)
        chunks = list(
            client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS, stream=True)
        )
    message = reply.choices[0].message
    assert message.reasoning_content == "w1 " and (message.content or "") == content
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert reply.choices[0].finish_reason == "tool_calls"
    reasoning, streamed_content, finishes = streamed(chunks)
    calls = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
    assert (reasoning, streamed_content, finishes[-1]) == ("w1 ", content, "tool_calls")
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}]


@pytest.mark.parametrize(
    "body, kwargs",
    [
        ({"reasoning_effort": "none"}, {"enable_thinking": False, "reasoning_effort": "none"}),
        ({"reasoning_effort": "high"}, {"reasoning_effort": "high"}),
        ({"chat_template_kwargs": {"enable_thinking": False}}, {"enable_thinking": False}),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}}, {"reasoning_effort": "none"}),
    ],
)
def test_thinking_switches_reach_the_template(thinking_server, monkeypatch, body, kwargs):
    """reasoning_effort goes to the template as its variable ("none" also turns thinking off),
    chat_template_kwargs has the last word: the prompt is the template's rendering with those arguments."""
    app, port = thinking_server
    want = app.tokenizer.apply_chat_template(ASK, add_generation_prompt=True, **kwargs)
    assert want != app.tokenizer.apply_chat_template(ASK, add_generation_prompt=True), "a weak test"
    with emitting(monkeypatch, app.tokenizer, "w5") as prompts:
        client(port).chat.completions.create(model="default_model", messages=ASK, extra_body=body)
    assert prompts == [want]


def test_an_earlier_turns_reasoning_goes_back_to_the_template(thinking_server, monkeypatch):
    app, port = thinking_server
    turn = [*ASK, {"role": "assistant", "content": "w7", "reasoning_content": "w6"}, *user("w8")]
    want = app.tokenizer.apply_chat_template(turn, add_generation_prompt=True)
    assert "<think> w6 </think> w7" in app.tokenizer.decode(want)
    with emitting(monkeypatch, app.tokenizer, "w5") as prompts:
        client(port).chat.completions.create(model="default_model", messages=turn)
    assert prompts == [want]


def test_a_bad_reasoning_effort_gets_a_400(thinking_server):
    app, port = thinking_server
    with pytest.raises(openai.BadRequestError) as caught:
        client(port).chat.completions.create(model="default_model", messages=ASK, extra_body={"reasoning_effort": 3})
    assert caught.value.body["param"] == "reasoning_effort" and "must be a string" in caught.value.body["message"]
