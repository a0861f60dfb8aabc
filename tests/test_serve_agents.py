"""`dflash2 serve` for agents and under load, over real HTTP on 127.0.0.1 with the official `openai` client: the
cycle costs measured before serving (never inside a request), the served model names, tool calls.

The servers run in this process (`test_serve.running`): a tiny real target and DFlash 2 drafter loaded from
folders, a real tokenizer."""

from __future__ import annotations

import itertools
import json
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import openai
import pytest
from helpers import GOOD, SPECIALS, TIMEOUT, WORDS, chat_ids, expected, held_first, request, running, user, wait_for
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import load as load_tokenizer
from mlx_lm.tool_parsers import json_tools

import dflash2_apps.serve as serve
import dflash2_mlx.server.app as server_app
from dflash2_mlx import costs, generate
from dflash2_mlx.adaptive import AdaptiveBlocks
from dflash2_mlx.generate import CycleResponse
from dflash2_mlx.server import responses, scheduler


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)


# -- warm start: the cycle costs are loaded or measured before serving -------------------------------------------


@pytest.fixture
def measurements(monkeypatch, tmp_path):
    """The name of the thread of every measurement of the cycle costs (costs cached in a file of this test's)."""
    monkeypatch.setenv("DFLASH2_COSTS", str(tmp_path / "costs.json"))
    calls, real = [], costs.measure_costs

    def recorded(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs, "measure_costs", recorded)
    return calls


def measured_in_requests(port: int, calls: list) -> int:
    """How many measurements three requests (plain, streaming, text) ran, each answered in full."""
    before = len(calls)
    api = client(port)
    reply = api.chat.completions.create(model="default_model", messages=user("w3 w4 w5"), max_tokens=6)
    assert reply.choices[0].finish_reason in ("stop", "length")
    chunks = list(api.chat.completions.create(model="default_model", messages=user("w6 w7"), max_tokens=6, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert api.completions.create(model="default_model", prompt="w1 w2 w3", max_tokens=6).choices[0].text is not None
    return len(calls) - before


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adaptive", "ddtree"])
def test_cycle_costs_are_measured_before_serving_never_in_a_request(
    tiny_pair, tiny_dflash2, measurements, mode, monkeypatch, caplog
):
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
    monkeypatch.setattr(server_app, "warm_start", lambda model, drafter, defaults: {})
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
        assert "'gpt-4o' does not exist here: this server serves 'tiny', 'alias-a', 'alias-b', 'alias-c'" in str(
            caught.value
        )
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
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<mask>"],
    )
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
        out.append(text[i : i + n])
        i += n


@pytest.mark.parametrize("streaming", [False, True])
def test_tool_calls_are_split_off_the_text_however_it_comes(tool_tokenizer, streaming):
    """A fixed text (no model): content, two calls and content again, fed whole and in pieces of 1 to 5
    characters (markers cut anywhere): the same content and calls either way, parsed by mlx-lm's parser."""
    second = CALL.replace("Paris", "Oslo")
    text = f"Let me look. {CALL} and {second} done"
    results = []
    for sizes in [(len(text),), (1,), (2, 3), (5, 1, 4)]:
        tools, content, calls = responses.ToolCalls(tool_tokenizer, TOOLS, streaming), "", []
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
    expect = [
        {"type": "function", "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
        for city in ("Paris", "Oslo")
    ]
    if streaming:
        expect = [{**call, "index": i} for i, call in enumerate(expect)]
    assert calls == expect


def test_a_call_cut_short_is_dropped_and_one_without_its_end_marker_is_kept(tool_tokenizer):
    """As mlx_lm.server: at the end, an open call is parsed; one that does not parse (cut by max_tokens) is
    dropped, with mlx-lm's warning."""
    tools = responses.ToolCalls(tool_tokenizer, TOOLS, False)
    assert tools.feed(CALL.removesuffix(" </tool_call>")) == ("", [])
    content, calls = tools.finish()
    assert content == "" and [c["function"]["name"] for c in calls] == ["get_weather"]
    tools = responses.ToolCalls(tool_tokenizer, TOOLS, False)
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
            yield CycleResponse(
                text=detokenizer.last_segment,
                tokens=[t],
                accepted=None if n == 1 else 0,
                prompt_tokens=len(prompt),
                prompt_tps=1.0,
                generation_tokens=n,
                generation_tps=1.0,
                peak_memory=0.0,
                finish_reason="stop" if last else None,
                verify_mode="dflash",
                block_size=None if n == 1 else 4,
            )

    monkeypatch.setattr(scheduler, "relayed_cycles", generation)
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
        chunks = list(
            client(port).chat.completions.create(
                model="default_model", messages=ASK, tools=TOOLS, tool_choice="auto", stream=True
            )
        )
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls = [call for c in chunks for call in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "w7 w8" and len(calls) == 1
    assert (calls[0].index, calls[0].type, calls[0].function.name) == (0, "function", "get_weather")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"} and calls[0].id
    assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_tool_choice_none_renders_no_tools_and_parses_nothing(tool_server, tool_tokenizer, monkeypatch):
    app, port = tool_server
    with emitting(monkeypatch, tool_tokenizer, CALL) as prompts:
        reply = client(port).chat.completions.create(
            model="default_model", messages=ASK, tools=TOOLS, tool_choice="none"
        )
    assert prompts == [tool_tokenizer.apply_chat_template(ASK, add_generation_prompt=True)]
    assert reply.choices[0].message.content == CALL and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "stop"


def test_the_next_turn_carries_the_call_and_its_result(tool_server, tool_tokenizer, monkeypatch):
    """The assistant's call (arguments as OpenAI sends them, a JSON string) and the tool's result go through the
    template: the prompt is the template's rendering of them, arguments decoded as mlx_lm.server decodes them."""
    app, port = tool_server
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
    }
    turn = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "w9"},
    ]
    decoded = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "w9"},
    ]
    want = tool_tokenizer.apply_chat_template(decoded, add_generation_prompt=True, tools=TOOLS)
    call_ids = tool_tokenizer.encode(CALL, add_special_tokens=False)
    assert any(want[i : i + len(call_ids)] == call_ids for i in range(len(want)))  # the call, rendered as it came
    with emitting(monkeypatch, tool_tokenizer, "w10 w11") as prompts:
        reply = client(port).chat.completions.create(model="default_model", messages=turn, tools=TOOLS)
    assert prompts == [want]
    assert reply.choices[0].message.content == "w10 w11" and reply.choices[0].finish_reason == "stop"
    assert not reply.choices[0].message.tool_calls


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"tools": TOOLS, "tool_choice": "required"}, '\'tool_choice\' must be "auto" or "none"'),
        ({"tools": [{"type": "function"}]}, "tools[0] must be {'type': 'function'"),
        ({"tools": "get_weather"}, "'tools' must be a list"),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{city"}}],
                    },
                ]
            },
            "the arguments of the call to 'get_weather' are not valid JSON",
        ),
    ],
)
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


# -- prompt-cache slots ----------------------------------------------------------------------------------------


def interleaved(port: int, app) -> dict:
    """Three conversations, turns interleaved (A1 B1 C1, then A2 B2 C2): A by chat, B by streaming chat with usage,
    C by text completions. The cached tokens and the prompt of each second turn, and whether its text equals
    plain decoding's from scratch."""
    api, out = client(port), {}
    a1, b1, c1 = user("w20 w21 w22 w23 w24"), user("w30 w31 w32 w33"), "w40 w41 w42 w43 w44 w45"
    ra = api.chat.completions.create(model="default_model", messages=a1, max_tokens=8).choices[0].message.content
    rb = "".join(
        c.choices[0].delta.content or ""
        for c in api.chat.completions.create(model="default_model", messages=b1, max_tokens=8, stream=True)
        if c.choices
    )
    rc = api.completions.create(model="default_model", prompt=c1, max_tokens=8).choices[0].text
    a2 = [*a1, {"role": "assistant", "content": ra}, *user("w25 w26")]
    reply = api.chat.completions.create(model="default_model", messages=a2, max_tokens=8)
    out["A"] = (
        reply.usage.prompt_tokens_details.cached_tokens,
        chat_ids(app, a1),
        reply.choices[0].message.content == expected(app, chat_ids(app, a2), 8).text,
    )
    b2 = [*b1, {"role": "assistant", "content": rb}, *user("w34")]
    chunks = list(
        api.chat.completions.create(
            model="default_model", messages=b2, max_tokens=8, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    out["B"] = (
        chunks[-1].usage.prompt_tokens_details.cached_tokens,
        chat_ids(app, b1),
        text == expected(app, chat_ids(app, b2), 8).text,
    )
    c2 = f"{c1} {rc} w46 w47"
    reply = api.completions.create(model="default_model", prompt=c2, max_tokens=8)
    out["C"] = (
        reply.usage.prompt_tokens_details.cached_tokens,
        app.tokenizer.encode(c1),
        reply.choices[0].text == expected(app, c2, 8).text,
    )
    return out


@pytest.mark.slow
def test_interleaved_conversations_each_reuse_their_own_prefix(tiny_pair, tiny_dflash2):
    """Three slots: every second turn takes its whole first turn (prompt and all but perhaps the reply's last
    token) from the cache, whatever ran in between, and answers as plain decoding from scratch does."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        for name, (cached, first, same) in interleaved(port, app).items():
            assert same, name
            assert cached >= len(first), (name, cached, len(first))
        health = request(port, "GET", "/health")[2]["prompt_cache"]
        assert health["slots"] == 3 and health["max_slots"] == 10 and health["bytes"] > 0


def test_negative_control_one_slot_forgets_the_other_conversations(tiny_pair, tiny_dflash2):
    """With one slot (mlx_lm.server's --prompt-cache-size 1) each first turn evicts the one before: the second
    turns of A and B find only C's sequence, which shares at most the chat template's opening with them."""
    with running(tiny_pair[0], tiny_dflash2, "--prompt-cache-size", 1) as (app, port):
        got = interleaved(port, app)
        for name in ("A", "B"):
            cached, first, same = got[name]
            assert same and cached < len(first) - 2, (name, cached, len(first))
        assert request(port, "GET", "/health")[2]["prompt_cache"]["slots"] == 1


@pytest.mark.slow
def test_a_byte_budget_keeps_only_what_fits(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--prompt-cache-bytes", "1") as (app, port):
        got = interleaved(port, app)
        assert all(cached == 0 and same for cached, _, same in got.values()), got
        info = request(port, "GET", "/health")[2]["prompt_cache"]
        assert (info["slots"], info["bytes"], info["max_bytes"]) == (0, 0, 1)


# -- concurrency: batched decoding ------------------------------------------------------------------------------


PROMPTS = [user(" ".join(f"w{7 * i + j + 3}" for j in range(1 + i % 5))) for i in range(8)]


def eight_clients(app, port, monkeypatch, max_tokens=24, extra: dict | None = None) -> tuple[list, list, list, dict]:
    """8 clients with the openai client at once (every other one streaming), T = 0: the first request is held
    after its first token until the other 7 are queued; then, at its first cycle's end, it joins them in the
    batch. Returns (replies as (text, completion tokens, finish reason, batch size), the single-request outputs
    of the same prompts, the response ids, /health). `extra`: mlx_lm.server's logits-processor fields, sent by
    every client and applied to the single-request outputs by mlx-lm's `make_logits_processors`."""
    processors = make_logits_processors(**extra) if extra else None
    wants = [
        generate(
            app.worker.model,
            app.tokenizer,
            chat_ids(app, p),
            None,
            verify_mode="off",
            max_tokens=max_tokens,
            logits_processors=processors,
        )
        for p in PROMPTS
    ]
    results, ids = [None] * 8, [None] * 8
    api = client(port)

    def one(i):
        try:
            answer(i)
        except openai.APIError as e:
            results[i] = ("error", f"{getattr(e, 'status_code', '')} {e}")

    def answer(i):
        kw = {"model": "default_model", "messages": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0}
        if extra:
            kw["extra_body"] = {**extra, "logit_bias": {str(k): v for k, v in extra.get("logit_bias", {}).items()}}
        if i % 2:
            chunks = list(api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            stats = chunks[-1].model_extra["dflash"]
            results[i] = (text, chunks[-1].usage.completion_tokens, finish, stats["batch_size"])
            ids[i] = chunks[0].id
        else:
            reply = api.chat.completions.create(**kw)
            results[i] = (
                reply.choices[0].message.content,
                reply.usage.completion_tokens,
                reply.choices[0].finish_reason,
                reply.model_extra["dflash"]["batch_size"],
            )
            ids[i] = reply.id

    with held_first(monkeypatch) as (gate, holding):
        threads = [threading.Thread(target=one, args=(0,))]
        threads[0].start()
        assert holding.wait(TIMEOUT), "the first request never ran"
        threads += [threading.Thread(target=one, args=(i,)) for i in range(1, 8)]
        for t in threads[1:]:
            t.start()
        wait_for(lambda: app.worker.jobs.qsize() == 7, "the other seven to queue")
        gate.set()
        for t in threads:
            t.join(TIMEOUT)
    return results, wants, ids, request(port, "GET", "/health")[2]


@pytest.mark.slow
def test_eight_concurrent_clients_are_batched_and_answer_as_one_alone(tiny_pair, tiny_dflash2, monkeypatch):
    """Every reply equals the target's own greedy output of its prompt (the prompts' outputs all differ, so a
    reply given to the wrong client shows), none lost or repeated, and the server decoded them together: the
    first one moved from the speculative path into the batch, the others joined it."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        results, wants, ids, health = eight_clients(app, port, monkeypatch)
    want = [(w.text, len(w.tokens), w.finish_reason) for w in wants]
    assert len({w[0] for w in want}) == 8  # distinct answers: a swap or a duplicate cannot pass
    assert [r[:3] for r in results] == want
    assert len(set(ids)) == 8 and None not in ids
    assert health["batch"]["max_size"] == 8 and health["batch"]["batched_steps"] > 0
    assert all(r[3] >= 2 for r in results), results  # each was decoded in a batch
    assert health["active"] == 0 and health["queued"] == 0


@pytest.mark.slow
def test_batched_requests_apply_their_logits_processors(tiny_pair, tiny_dflash2, monkeypatch):
    """A repetition penalty and a logit bias: applied in the batch as mlx-lm applies them alone (the prompt and
    the tokens generated so far as their context, speculative ones included)."""
    extra = {"repetition_penalty": 1.5, "repetition_context_size": 8, "logit_bias": {204: -100.0, 180: 5.0}}
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        results, wants, ids, health = eight_clients(app, port, monkeypatch, extra=extra)
        plain = [expected(app, chat_ids(app, p), 24).text for p in PROMPTS]
    assert [r[:3] for r in results] == [(w.text, len(w.tokens), w.finish_reason) for w in wants]
    assert health["batch"]["max_size"] == 8
    assert sum(w.text != t for w, t in zip(wants, plain)) >= 6  # the processors changed the answers


@pytest.mark.slow
def test_negative_control_decode_concurrency_one_serves_one_at_a_time(tiny_pair, tiny_dflash2, monkeypatch):
    """--decode-concurrency 1: the same answers, one request at a time, each alone: the batching checks fail."""
    with running(tiny_pair[0], tiny_dflash2, "--decode-concurrency", 1) as (app, port):
        results, wants, ids, health = eight_clients(app, port, monkeypatch)
    assert [r[:3] for r in results] == [(w.text, len(w.tokens), w.finish_reason) for w in wants]
    assert health["batch"]["max_size"] == 0 and all(r[3] == 0 for r in results)


@pytest.mark.parametrize("victim, how", [(3, "cancelled"), (2, "timeout")])
def test_a_request_stopped_in_the_batch_leaves_it_alone(tiny_pair, tiny_dflash2, monkeypatch, victim, how):
    """A request cancelled inside the batch (as the handler cancels one whose client left), or past its timeout,
    stops at the next step with the others still decoding; they finish unchanged. The one past its timeout gets
    the 504 it gets alone."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        ids_of, real, seen = chat_ids(app, PROMPTS[victim]), scheduler.Worker._record, []

        def record(worker, e, token, logprobs, finish):
            if e.job.prompt == ids_of and e.generated >= 4 and not seen:
                if how == "cancelled":
                    e.job.cancelled.set()
                else:
                    e.job.deadline = time.monotonic()
                seen.append(len(worker.active))
            return real(worker, e, token, logprobs, finish)

        monkeypatch.setattr(scheduler.Worker, "_record", record)
        results, wants, ids, health = eight_clients(app, port, monkeypatch)
    assert seen == [8]  # stopped while all eight were active
    assert results[victim][0] == "error"
    if how == "timeout":
        assert results[victim][1].startswith("504") and "ran past its timeout" in results[victim][1]
    assert [r[:3] for i, r in enumerate(results) if i != victim] == [
        (w.text, len(w.tokens), w.finish_reason) for i, w in enumerate(wants) if i != victim
    ]
    assert health["active"] == 0


def test_a_request_left_alone_in_the_batch_goes_on_speculatively(tiny_pair, tiny_dflash2, monkeypatch):
    """A long request (streamed) starts alone, speculatively; a short one queues behind it: both decode in the
    batch; when the short one is done, the long one, alone with more than RESUME_MIN_TOKENS to go, leaves the
    batch and finishes speculatively. Its text, streamed across the three phases, is the target's own greedy
    output; so is the short one's."""
    long_prompt, short_prompt = PROMPTS[1], PROMPTS[6]
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        want_long = expected(app, chat_ids(app, long_prompt), 48)
        want_short = expected(app, chat_ids(app, short_prompt), 4)
        assert want_long.finish_reason == "length"  # it runs its 48 tokens: long past the short one
        api, got = client(port), {}
        modes, real = [], scheduler.Worker._continued

        def continued(worker, r, resumed, generated):
            modes.append(r.verify_mode)
            return real(worker, r, resumed, generated)

        monkeypatch.setattr(scheduler.Worker, "_continued", continued)

        def long_client():
            chunks = list(
                api.chat.completions.create(
                    model="default_model",
                    messages=long_prompt,
                    max_tokens=48,
                    stream=True,
                    stream_options={"include_usage": True},
                )
            )
            got["long"] = (
                "".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
                chunks[-1].usage.completion_tokens,
                chunks[-1].model_extra["dflash"],
            )

        with held_first(monkeypatch) as (gate, holding):
            first = threading.Thread(target=long_client)
            first.start()
            assert holding.wait(TIMEOUT)
            second = threading.Thread(
                target=lambda: got.update(
                    short=api.chat.completions.create(model="default_model", messages=short_prompt, max_tokens=4)
                )
            )
            second.start()
            wait_for(lambda: app.worker.jobs.qsize() == 1, "the short request to queue")
            gate.set()
            first.join(TIMEOUT)
            second.join(TIMEOUT)
        health = request(port, "GET", "/health")[2]
    text, n, stats = got["long"]
    assert (text, n) == (want_long.text, 48)
    assert got["short"].choices[0].message.content == want_short.text
    assert stats["batch_size"] == 2 and health["batch"]["max_size"] == 2
    # the resumed generation was speculative, and the answer's last record came from it
    assert modes and set(modes) == {"dflash"} and stats["verify_mode"] == "dflash"
    assert len(modes) < 48 - 4  # far fewer records than tokens left: cycles, not the batch's steps


@pytest.mark.slow
def test_a_request_sent_as_the_batch_empties_joins_it(tokenizer, monkeypatch):
    """Two requests batched (the first moved in from the speculative path); the short one ends and, one batch step
    later (a client's next request, sent as its last answer ends), a third arrives: it joins the batch, the long
    one never having left it (RESUME_GRACE_STEPS), rather than the long one moving out to go on speculatively and
    back in at its next cycle. Every answer is plain decoding's from scratch."""
    from helpers import make_dflash2_drafter, make_target

    model = make_target("qwen3", seed=3)
    worker = scheduler.Worker(model, tokenizer, make_dflash2_drafter(model, block_size=8), 8, True)
    kw = {"temp": 0.0, "verify_mode": "dflash", "block_size": 4, "eos_token_ids": []}
    prompts = [[5 + i] + list(range(20 + 3 * i, 30 + 5 * i)) for i in range(3)]
    lengths = [40, 4, 20]  # the long one has 30-odd tokens to go when the short one ends: it could leave
    jobs = [scheduler.Job(p, {**kw, "max_tokens": n}, time.monotonic() + TIMEOUT) for p, n in zip(prompts, lengths)]
    ended, submitted, resumed = threading.Event(), [], []
    real_end, real_continued = scheduler.Worker._end, scheduler.Worker._continued

    def end(self, job, reason, cached):
        real_end(self, job, reason, cached)
        if job is jobs[1]:
            ended.set()

    def continued(self, r, resumed_entry, generated):
        resumed.append(r.verify_mode)
        return real_continued(self, r, resumed_entry, generated)

    def submit_third():
        if not submitted:
            submitted.append(worker.submit(jobs[2]))

    class Generator(scheduler.BatchGenerator):
        def next(self):
            if ended.is_set():
                submit_third()
            return super().next()

    monkeypatch.setattr(scheduler.Worker, "_end", end)
    monkeypatch.setattr(scheduler.Worker, "_continued", continued)
    monkeypatch.setattr(scheduler, "BatchGenerator", Generator)
    out = []
    try:
        with held_first(monkeypatch) as (gate, holding):
            worker.submit(jobs[0])
            assert holding.wait(TIMEOUT)
            worker.submit(jobs[1])
            gate.set()
            for i, job in enumerate(jobs):
                tokens = []
                while (event := job.events.get(timeout=TIMEOUT))[0] == "record":
                    tokens += event[1].tokens
                assert event[:2] == ("end", "finished"), event
                out.append(tokens)
                if i == 0:
                    submit_third()  # not sent from a batch step: the long one left the batch before one came
    finally:
        assert worker.stop()
    assert submitted == [True]
    assert out == [
        generate(model, tokenizer, p, None, verify_mode="off", max_tokens=n, eos_token_ids=[]).tokens
        for p, n in zip(prompts, lengths)
    ]
    assert resumed == []  # the long one never went back to the speculative path
    assert jobs[2].batch_size == 2 and jobs[0].batch_size == 2  # the third decoded together with the long one


def worker_answers(
    worker,
    prompts: list[list[int]],
    kw: dict,
    monkeypatch,
    records: list | None = None,
) -> list[tuple[list[int], int]]:
    """The tokens and cached prompt tokens of each prompt, sent to `worker` (no HTTP) while its first generation
    is held after one record, so that all of them are active at once. `records`: gets each prompt's records."""
    jobs = [scheduler.Job(p, dict(kw), time.monotonic() + TIMEOUT) for p in prompts]
    with held_first(monkeypatch) as (gate, holding):
        worker.submit(jobs[0])
        assert holding.wait(TIMEOUT)
        for job in jobs[1:]:
            worker.submit(job)
        gate.set()
        out = []
        for job in jobs:
            tokens, mine = [], []
            while (event := job.events.get(timeout=TIMEOUT))[0] == "record":
                tokens += event[1].tokens
                mine.append(event[1])
            assert event[:2] == ("end", "finished"), event
            out.append((tokens, event[2]))
            if records is not None:
                records.append(mine)
    return out


def test_batched_requests_get_the_logprobs_mlx_lm_computes(tokenizer, monkeypatch):
    """Three requests asking for logprobs (3 best) decoded together, one moved into the batch after its first
    cycle: each token's log-probability and its row's best three equal those of mlx-lm's own `stream_generate`
    of the same prompt (within 1e-4), for the tokens of the speculative cycle and of the batch alike."""
    from helpers import make_dflash2_drafter, make_target
    from mlx_lm import stream_generate as mlx_stream

    model = make_target("qwen3", seed=3)
    worker = scheduler.Worker(model, tokenizer, make_dflash2_drafter(model, block_size=8), 8, True)
    kw = {"max_tokens": 12, "temp": 0.0, "verify_mode": "dflash", "block_size": 4, "eos_token_ids": [], "logprobs": 3}
    prompts = [[5 + i] + list(range(20 + 3 * i, 30 + 5 * i)) for i in range(3)]
    records: list = []
    try:
        worker_answers(worker, prompts, kw, monkeypatch, records)
        assert worker.batch_size_max == 3
    finally:
        assert worker.stop()
    for prompt, mine in zip(prompts, records):
        got = [n for r in mine for n in r.token_logprobs]
        want = [(r.token, r.logprobs) for r in mlx_stream(model, tokenizer, mx.array(prompt), max_tokens=12)]
        assert [t for r in mine for t in r.tokens] == [t for t, _ in want]
        assert len(got) == len(want) == 12
        for (chosen, top), (token, row) in zip(got, want):
            best = np.argsort(-np.array(row))[:3]
            assert abs(chosen - row[token].item()) < 1e-4
            assert [i for i, _ in top] == best.tolist()
            assert np.allclose([v for _, v in top], np.array(row)[best], atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "llama_swa", "qwen3_5"])
def test_batching_every_cache_kind_answers_as_alone(arch, tokenizer, monkeypatch):
    """KV caches, sliding-window caches that wrap (window 8) and a hybrid target's GatedDeltaNet state: four
    prompts batched (one moved in from the speculative path after a cycle), then their next turns batched from
    the slots the first wave left; every answer is plain decoding's from scratch."""
    from helpers import make_dflash2_drafter, make_hybrid, make_target

    model = make_hybrid(arch, seed=2) if arch == "qwen3_5" else make_target(arch, seed=3)
    worker = scheduler.Worker(model, tokenizer, make_dflash2_drafter(model, block_size=8), 8, True)
    kw = {"max_tokens": 20, "temp": 0.0, "verify_mode": "dflash", "block_size": 4, "eos_token_ids": []}

    def alone(p):
        return generate(
            model,
            tokenizer,
            p,
            None,
            verify_mode="off",
            max_tokens=20,  # noqa: E731
            eos_token_ids=[],
        ).tokens

    try:
        prompts = [[5 + i] + list(range(20 + 3 * i, 30 + 5 * i)) for i in range(4)]
        first = worker_answers(worker, prompts, kw, monkeypatch)
        assert [tokens for tokens, _ in first] == [alone(p) for p in prompts]
        assert worker.batch_size_max == 4
        turns = [p + tokens + [7, 8] for p, (tokens, _) in zip(prompts, first)]
        second = worker_answers(worker, turns, kw, monkeypatch)
        assert [tokens for tokens, _ in second] == [alone(p) for p in turns]
        # each next turn found its conversation's slot: the batched ones the whole first turn (all but its last
        # token, generated but never fed); the first, alone again and speculative, only what the drafter saw of
        # it (the prompt and the first cycle, before it moved into the batch: the batch leaves no drafter context)
        assert all(cached >= len(p) + 19 for (_, cached), p in zip(second[1:], prompts[1:])), second
        assert len(prompts[0]) < second[0][1] < len(prompts[0]) + 19, second
    finally:
        assert worker.stop()


def test_a_seeded_request_runs_alone_and_draws_as_alone(tiny_pair, tiny_dflash2, monkeypatch):
    """A request with a seed (T > 0) queued behind a running one: nothing is batched (a shared batch's draws could
    not be the seed's), it runs alone after the first, and its text is the one the same request gets on an
    idle server."""
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        api = client(port)
        seeded = {"model": "default_model", "messages": PROMPTS[2], "max_tokens": 16, "temperature": 0.9, "seed": 7}
        got = {}
        with held_first(monkeypatch) as (gate, holding):
            first = threading.Thread(
                target=lambda: got.update(
                    first=api.chat.completions.create(model="default_model", messages=PROMPTS[0], max_tokens=16)
                )
            )
            first.start()
            assert holding.wait(TIMEOUT)
            second = threading.Thread(target=lambda: got.update(seeded=api.chat.completions.create(**seeded)))
            second.start()
            wait_for(lambda: app.worker.jobs.qsize() == 1, "the seeded request to queue")
            gate.set()
            first.join(TIMEOUT)
            second.join(TIMEOUT)
        alone = api.chat.completions.create(**seeded)
        health = request(port, "GET", "/health")[2]
    assert health["batch"]["max_size"] == 0
    assert got["first"].model_extra["dflash"]["batch_size"] == got["seeded"].model_extra["dflash"]["batch_size"] == 0
    assert got["seeded"].choices[0].message.content == alone.choices[0].message.content
    assert got["first"].choices[0].message.content == expected(app, chat_ids(app, PROMPTS[0]), 16).text
