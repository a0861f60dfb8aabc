"""`dflash2 serve` for agents and under load, over real HTTP on 127.0.0.1 with the official `openai` client: the
cycle costs measured before serving (never inside a request), the served model names, tool calls.

The servers run in this process (`test_serve.running`): a tiny real target and DFlash 2 drafter loaded from
folders, a real tokenizer."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from conftest import SPECIALS, WORDS
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools
from test_serve import GOOD, TIMEOUT, request, running, user

import dflash2_apps.serve as serve
from dflash2_mlx import adaptive
from dflash2_mlx.adaptive import AdaptiveBlocks
from dflash2_mlx.generate import CycleResponse


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


# -- warm start: the cycle costs are loaded or measured before serving -------------------------------------------


@pytest.fixture
def measurements(monkeypatch, tmp_path):
    """The name of the thread of every measurement of the cycle costs (costs cached in a file of this test's)."""
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    calls, real = [], adaptive.measure_costs

    def recorded(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(adaptive, "measure_costs", recorded)
    return calls


def measured_in_requests(port: int, calls: list) -> int:
    """How many measurements three requests (plain, streaming, text) ran, each answered in full."""
    before = len(calls)
    api = client(port)
    reply = api.chat.completions.create(model="default_model", messages=user("w3 w4 w5"), max_tokens=6)
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model="default_model", messages=user("w6 w7"), max_tokens=6,
                                              stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert api.completions.create(model="default_model", prompt="w1 w2 w3", max_tokens=6).choices[0].text is not None
    return len(calls) - before


@pytest.mark.parametrize("mode", ["adaptive", "ddtree"])
def test_cycle_costs_are_measured_before_serving_never_in_a_request(tiny_pair, tiny_dflash2, measurements, mode,
                                                                     monkeypatch, caplog):
    """The costs are measured once, in the thread that builds the server, before it listens; then requests run
    none, even when every generation says the curve is stale (adaptive mode's verdict drops the cached copy,
    which without the warm start makes the next request measure again: see the negative control below)."""
    monkeypatch.setattr(AdaptiveBlocks, "stale", lambda self: True)
    with running(tiny_pair[0], tiny_dflash2, "--verify-mode", mode, "--block-size", 8) as (app, port):
        assert measurements == [threading.current_thread().name]
        with caplog.at_level("INFO"):
            assert measured_in_requests(port, measurements) == 0
        if mode == "adaptive":
            assert "no longer match this machine" in caplog.text  # the stale verdict was reached, and logged
        health = request(port, "GET", "/health")[2]
        assert health["verify_mode"] == mode and health["queued"] == 0 and health["running"] is False
        assert health["model"] == app.model_id and health["memory"]["active_gb"] > 0
        assert health["memory"]["peak_gb"] >= health["memory"]["active_gb"]


def test_negative_control_requests_that_measure_are_caught(tiny_pair, tiny_dflash2, measurements, monkeypatch):
    """Without the warm start the same check fails: the first request measures, and after each stale verdict
    the next one measures again."""
    monkeypatch.setattr(AdaptiveBlocks, "stale", lambda self: True)
    monkeypatch.setattr(serve, "warm_start", lambda model, drafter, defaults: {})
    with running(tiny_pair[0], tiny_dflash2, "--verify-mode", "adaptive") as (app, port):
        assert measurements == []
        assert measured_in_requests(port, measurements) == 3
        assert set(measurements) == {"dflash2-worker"}


def test_health_reports_the_mode_without_costs_for_dflash(tiny_pair, tiny_dflash2, measurements):
    """Fixed-block mode needs no costs: nothing is measured at all."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        status, _, health = request(port, "GET", "/health")
        assert status == 200 and health["status"] == "ok" and health["verify_mode"] == "dflash"
        assert client(port).chat.completions.create(model="default_model", messages=GOOD, max_tokens=3).choices
    assert measurements == []


# -- served model names ----------------------------------------------------------------------------------------


def test_the_model_answers_to_its_id_and_its_served_names(tiny_pair, tiny_dflash2):
    flags = ["--model-id", "tiny", "--served-model-name", "alias-a,alias-b", "--served-model-name", "alias-c"]
    with running(tiny_pair[0], tiny_dflash2, *flags) as (app, port):
        api = client(port)
        names = ["tiny", "alias-a", "alias-b", "alias-c"]
        assert [m.id for m in api.models.list()] == names
        for name in [*names, "default_model"]:
            reply = api.chat.completions.create(model=name, messages=GOOD, max_tokens=2)
            assert reply.model == (name if name != "default_model" else "tiny")
        chunks = list(api.chat.completions.create(model="alias-b", messages=GOOD, max_tokens=2, stream=True))
        assert {c.model for c in chunks} == {"alias-b"}
        assert api.completions.create(model="alias-c", prompt="w1 w2", max_tokens=2).model == "alias-c"
        with pytest.raises(openai.NotFoundError) as caught:
            api.chat.completions.create(model="gpt-4o", messages=GOOD, max_tokens=2)
        assert caught.value.code == "model_not_found"
        assert "'gpt-4o' does not exist here: this server serves 'tiny', 'alias-a', 'alias-b', 'alias-c'" in \
            str(caught.value)
        assert request(port, "GET", "/health")[2]["served_model_names"] == names


def test_served_model_names_refuse_empty_names():
    assert serve.served_names(["a, b", "c"]) == ("a", "b", "c")
    with pytest.raises(ValueError, match="--served-model-name takes names, separated by commas"):
        serve.served_names(["a,,b"])


# -- tool calls ------------------------------------------------------------------------------------------------

TOOL_WORDS = ["<tool_call>", "</tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}']
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
# Qwen 2.5's way of rendering tools and calls, on the word-level vocabulary (words it lacks become <unk>): its
# "<tool_call>" and "tool_call.name" make mlx-lm pick its json_tools parser, as for Qwen 2.5 checkpoints
TOOL_TEMPLATE = (
    "{%- if tools %}<|system|> {% for tool in tools %}{{ tool.function.name }} {% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|> {{ m.content }} "
    "{%- for tool_call in m.tool_calls %}{%- set tool_call = tool_call.function %}"
    '<tool_call> {"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}} </tool_call> '
    "{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|user|> {{ m.content }} "
    "{%- else %}<|{{ m.role }}|> {{ m.content }} {% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|> {% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def save_tool_tokenizer(folder: Path) -> None:
    """conftest's word-level tokenizer (same ids for its words) with the words of a tool call in its last slots
    and a chat template that renders tools."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + WORDS + TOOL_WORDS
    tokens += [f"x{i}" for i in range(256 - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=["<|user|>", "<|assistant|>", "<mask>"])
    fast.chat_template = TOOL_TEMPLATE
    fast.save_pretrained(folder)


@pytest.fixture(scope="module")
def tool_target(tiny_pair, tmp_path_factory):
    """The tiny target (tiny_dflash2's) with the tool-calling tokenizer."""
    folder = tmp_path_factory.mktemp("tools") / "target"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_pair[0] / name, folder / name)
    save_tool_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def tool_tokenizer(tool_target):
    return load_tokenizer(tool_target)


def test_mlx_lm_reads_the_tool_format_from_the_template(tool_tokenizer, tokenizer):
    assert tool_tokenizer.has_tool_calling and tool_tokenizer.tool_parser is json_tools.parse_tool_call
    assert (tool_tokenizer.tool_call_start, tool_tokenizer.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert not tokenizer.has_tool_calling  # conftest's template renders no tools
    call = tool_tokenizer.encode(CALL, add_special_tokens=False)
    assert tool_tokenizer.decode(call) == CALL and tool_tokenizer.unk_token_id not in call


def pieces(text: str, sizes) -> list[str]:
    out, i = [], 0
    for n in itertools.cycle(sizes):
        if i >= len(text):
            return out
        out.append(text[i:i + n])
        i += n


@pytest.mark.parametrize("streaming", [False, True])
def test_tool_calls_are_split_off_the_text_however_it_comes(tool_tokenizer, streaming):
    """A fixed text (no model): content, two calls and content again, fed whole and in pieces of 1 to 5
    characters (markers cut anywhere): the same content and calls either way, parsed by mlx-lm's parser."""
    second = CALL.replace("Paris", "Oslo")
    text = f"Let me look. {CALL} and {second} done"
    results = []
    for sizes in [(len(text),), (1,), (2, 3), (5, 1, 4)]:
        tools, content, calls = serve.ToolCalls(tool_tokenizer, TOOLS, streaming), "", []
        for piece in pieces(text, sizes):
            got, done = tools.feed(piece)
            content, calls = content + got, calls + done
        got, done = tools.finish()
        content, calls = content + got, calls + done
        assert tools.made and all(c.pop("id") for c in calls)  # each call has an id (random)
        results.append((content, calls))
    assert all(r == results[0] for r in results)
    content, calls = results[0]
    assert content == "Let me look.  and  done"
    expect = [{"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
              for city in ("Paris", "Oslo")]
    if streaming:
        expect = [{**call, "index": i} for i, call in enumerate(expect)]
    assert calls == expect


def test_a_call_cut_short_is_dropped_and_one_without_its_end_marker_is_kept(tool_tokenizer):
    """As mlx_lm.server: at the end, an open call is parsed; one that does not parse (cut by max_tokens) is
    dropped, with mlx-lm's warning."""
    tools = serve.ToolCalls(tool_tokenizer, TOOLS, False)
    assert tools.feed(CALL.removesuffix(" </tool_call>")) == ("", [])
    content, calls = tools.finish()
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    tools = serve.ToolCalls(tool_tokenizer, TOOLS, False)
    tools.feed(CALL[:40])
    assert tools.finish() == ("", [])


@contextmanager
def emitting(monkeypatch, tokenizer, text: str):
    """The server's generations replaced by one that commits the tokens of `text`, then EOS, one token per
    record, decoded by the tokenizer's own streaming detokenizer (the model is tiny and random: no weights of
    its would emit a tool call). The prompts each generation got are kept."""
    prompts = []

    def generation(model, tok, prompt, drafter=None, prompt_cache=None, **kwargs):
        prompts.append(list(prompt))
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        detokenizer = tokenizer.detokenizer
        for n, t in enumerate(ids, 1):
            last = n == len(ids)
            if last:
                detokenizer.finalize()
            else:
                detokenizer.add_token(t)
            yield CycleResponse(text=detokenizer.last_segment, tokens=[t], accepted=None if n == 1 else 0,
                                prompt_tokens=len(prompt), prompt_tps=1.0, generation_tokens=n,
                                generation_tps=1.0, peak_memory=0.0, finish_reason="stop" if last else None,
                                verify_mode="dflash", block_size=None if n == 1 else 4)

    monkeypatch.setattr(serve, "stream_generate", generation)
    yield prompts


@pytest.fixture(scope="module")
def tool_server(tool_target, tiny_dflash2):
    with running(tool_target, tiny_dflash2, "--max-tokens", 16) as s:
        yield s


ASK = user("w1 w2 w3")


def test_a_tool_call_over_http(tool_server, tool_tokenizer, monkeypatch):
    """Real: the HTTP server, the openai client, the tools rendered by the chat template (the prompt's length says
    so), mlx-lm's parser. Not the model's: the text generated is the call's tokens (`emitting`)."""
    app, port = tool_server
    with_tools = tool_tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tools=TOOLS)
    assert len(with_tools) > len(tool_tokenizer.apply_chat_template(ASK, add_generation_prompt=True))
    with emitting(monkeypatch, tool_tokenizer, CALL) as prompts:
        reply = client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS)
    assert prompts == [with_tools] and reply.usage.prompt_tokens == len(with_tools)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call(tool_server, tool_tokenizer, monkeypatch):
    """As above, streamed: the call comes whole in one delta.tool_calls (index 0), after the text before it."""
    app, port = tool_server
    with emitting(monkeypatch, tool_tokenizer, f"w7 w8 {CALL}"):
        chunks = list(client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS,
                                                           tool_choice="auto", stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "w7 w8" and len(calls) == 1
    assert (calls[0].index, calls[0].type, calls[0].function.name) == (0, "function", "get_weather")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_tool_choice_none_renders_no_tools_and_parses_nothing(tool_server, tool_tokenizer, monkeypatch):
    app, port = tool_server
    with emitting(monkeypatch, tool_tokenizer, CALL) as prompts:
        reply = client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS,
                                                     tool_choice="none")
    assert prompts == [tool_tokenizer.apply_chat_template(ASK, add_generation_prompt=True)]
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_the_next_turn_carries_the_call_and_its_result(tool_server, tool_tokenizer, monkeypatch):
    """The assistant's call (arguments as OpenAI sends them, a JSON string) and the tool's result go through the
    template: the prompt is the template's rendering of them, arguments decoded as mlx_lm.server decodes them."""
    app, port = tool_server
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}
    turn = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "w9"}]
    decoded = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "w9"}]
    want = tool_tokenizer.apply_chat_template(decoded, add_generation_prompt=True, tools=TOOLS)
    call_ids = tool_tokenizer.encode(CALL, add_special_tokens=False)
    assert any(want[i:i + len(call_ids)] == call_ids for i in range(len(want)))  # the call, rendered as it came
    with emitting(monkeypatch, tool_tokenizer, "w10 w11") as prompts:
        reply = client(port).chat.completions.create(model="default_model", messages=turn, tools=TOOLS)
    assert prompts == [want]
    assert reply.choices[0].message.content == "w10 w11" and reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls


@pytest.mark.parametrize("body, fragment", [
    ({"tools": TOOLS, "tool_choice": "required"}, "'tool_choice' must be \"auto\" or \"none\""),
    ({"tools": [{"type": "function"}]}, "tools[0] must be {'type': 'function'"),
    ({"tools": "get_weather"}, "'tools' must be a list"),
    ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{city"}}]}]},
     "the arguments of the call to 'get_weather' are not valid JSON"),
])
def test_bad_tool_requests_get_a_400(tool_server, body, fragment):
    app, port = tool_server
    status, _, reply = request(port, "POST", "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, **body})
    assert status == 400 and fragment in reply["error"]["message"], reply


def test_a_template_without_tools_gets_a_400(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        with pytest.raises(openai.BadRequestError) as caught:
            client(port).chat.completions.create(model="default_model", messages=ASK, tools=TOOLS)
        assert "this model's chat template does not support tools" in str(caught.value)
        assert caught.value.body["param"] == "tools"
