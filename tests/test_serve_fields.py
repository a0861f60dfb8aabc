"""Every request field mlx_lm.server reads is honoured, ignored as mlx_lm.server ignores it, or refused with a 400
naming it; over real HTTP on 127.0.0.1. The field list is mlx_lm.server 0.32.2's, checked against the installed
source, so a field a newer mlx-lm reads fails here until it gets its fate. The penalties' and XTC's references are
mlx-lm's own generation with its own processors and sampler, never this server's plain mode."""

from __future__ import annotations

import re
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import mlx_lm.server
import pytest
from helpers import (
    CONTEXT,
    COSTS,
    GOOD,
    SiblingOracle,
    chat_ids,
    drafter_config,
    expected,
    make_oracle,
    make_target,
    prompts,
    request,
    running,
    serving_thread,
    user,
)
from mlx_lm import generate as mlx_lm_generate
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors, make_sampler
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash2_mlx import generate
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.server import GenerationArguments, ServeSettings, build_server
from dflash2_mlx.server import app as app_module
from dflash2_mlx.server.protocol import IGNORED_FIELDS, REFUSED_FIELDS

# the request fields mlx_lm.server 0.32.2 reads (`self.body.get(...)`, `body.get(...)`, `body[...]`), read off its
# source by hand; `test_the_list_is_the_installed_mlx_lm_servers` checks it against the installed file
MLX_LM_FIELDS = {
    "stream",
    "stream_options",
    "model",
    "draft_model",
    "num_draft_tokens",
    "adapters",
    "max_completion_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_penalty",
    "presence_context_size",
    "frequency_penalty",
    "frequency_context_size",
    "xtc_probability",
    "xtc_threshold",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "seed",
    "chat_template_kwargs",
    "stop",
    "messages",
    "tools",
    "role_mapping",
    "prompt",
}

# honoured: (endpoint, a value the server acts on, a value of the wrong type or range: 400 naming the field)
HONOURED = {
    "stream": ("chat", False, "yes"),
    "stream_options": ("chat", {"include_usage": False}, "all"),
    "model": ("chat", "default_model", 5),
    "max_completion_tokens": ("chat", 3, 0),
    "max_tokens": ("chat", 3, 0),
    "temperature": ("chat", 0.0, "hot"),
    "top_p": ("chat", 0.9, "x"),
    "top_k": ("chat", 5, 1.5),
    "min_p": ("chat", 0.1, "x"),
    "repetition_penalty": ("chat", 1.3, -1),
    "repetition_context_size": ("chat", 8, 0),
    "presence_penalty": ("chat", 0.5, "x"),
    "presence_context_size": ("chat", 8, 0),
    "frequency_penalty": ("chat", 0.5, "x"),
    "frequency_context_size": ("chat", 8, 0),
    "xtc_probability": ("chat", 0.5, 2),
    "xtc_threshold": ("chat", 0.2, -1),
    "logit_bias": ("chat", {"17": 1.0}, {"w": 1}),
    "logprobs": ("chat", True, "x"),
    "top_logprobs": ("chat", None, 99),  # with logprobs true; 99 is over OpenAI's 20
    "seed": ("chat", 3, "x"),
    "chat_template_kwargs": ("chat", {"enable_thinking": False}, "x"),
    "stop": ("chat", ["w9"], 5),
    "messages": ("chat", GOOD, "x"),
    "tools": ("chat", None, "x"),  # the tiny template has no tool format: its good value is tested elsewhere
    "prompt": ("text", "w1 w2", ""),
}
# refused: a value this server cannot act on (400 naming the field), and the value saying what it does anyway
REFUSED = {
    "draft_model": ("other/drafter", "default_model"),
    "num_draft_tokens": (1, 3),
    "adapters": ("my-adapter", None),
}
IGNORED = {"role_mapping": {"system_prompt": "Be brief.", "user": "USER: "}}  # mlx_lm.server: templateless only
# honoured beyond mlx_lm.server's fields (it ignores them), as HONOURED; their effect: tests/test_serve_tool_fields.py
OPENAI_HONOURED = {"parallel_tool_calls": ("chat", False, "no")}


def mlx_lm_server_fields() -> set[str]:
    source = Path(mlx_lm.server.__file__).read_text()
    return set(re.findall(r'body\.get\(\s*"(\w+)"', source)) | set(re.findall(r'body\["(\w+)"\]', source))


def test_the_list_is_the_installed_mlx_lm_servers():
    assert mlx_lm_server_fields() == MLX_LM_FIELDS, (
        f"mlx_lm.server reads {sorted(mlx_lm_server_fields() - MLX_LM_FIELDS)} (new) and no longer "
        f"{sorted(MLX_LM_FIELDS - mlx_lm_server_fields())}: give each its fate here and in docs/server.md"
    )


def test_every_field_has_one_fate():
    fates = [set(HONOURED), set(REFUSED), set(IGNORED)]
    assert set().union(*fates) == MLX_LM_FIELDS and sum(map(len, fates)) == len(MLX_LM_FIELDS)
    assert set(REFUSED) == set(REFUSED_FIELDS)
    # what the server accepts and does not act on: fields mlx_lm.server never reads, or ignores here too
    assert not (set(IGNORED_FIELDS) & MLX_LM_FIELDS) - set(IGNORED)
    assert set(IGNORED) <= set(IGNORED_FIELDS)
    assert not set(OPENAI_HONOURED) & (MLX_LM_FIELDS | set(IGNORED_FIELDS) | set(REFUSED_FIELDS))


@pytest.fixture(scope="module")
def served(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--max-tokens", 8) as s:
        yield s


def body_with(field: str, value) -> tuple[str, dict]:
    kind = {**HONOURED, **OPENAI_HONOURED}.get(field, ("chat",))[0]
    base = {"messages": GOOD} if kind == "chat" else {"prompt": "w1 w2"}
    body = {**base, "max_tokens": 4, field: value}
    if field == "top_logprobs":
        body["logprobs"] = True
    return "/v1/chat/completions" if kind == "chat" else "/v1/completions", body


@pytest.mark.parametrize("field", sorted(HONOURED | OPENAI_HONOURED))
def test_an_honoured_field_is_read(served, field):
    """Its wrong value gets 400 naming it (the server reads it); its right value is answered."""
    _, port = served
    _, good, bad = {**HONOURED, **OPENAI_HONOURED}[field]
    status, _, body = request(port, "POST", *body_with(field, bad))
    assert status == 400 and body["error"]["param"] == field and field in body["error"]["message"], body
    if good is not None:
        status, _, body = request(port, "POST", *body_with(field, good))
        assert status == 200, body


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_a_refused_field_gets_400_naming_it_and_the_fix(served, field):
    _, port = served
    refused, honoured = REFUSED[field]
    status, _, body = request(port, "POST", *body_with(field, refused))
    message = body["error"]["message"]
    assert status == 400 and body["error"]["param"] == field, body
    assert field in message and ("leave" in message or "fuse" in message), message  # the field and the fix
    status, _, body = request(port, "POST", *body_with(field, honoured))  # --block-size 4: 3 drafts per cycle
    assert status == 200, body


def test_an_ignored_field_changes_nothing(served):
    app, port = served
    want = expected(app, chat_ids(app, user("w3 w4")), 6).text
    for field, value in IGNORED.items():
        status, _, body = request(
            port, "POST", "/v1/chat/completions", {"messages": user("w3 w4"), "max_tokens": 6, field: value}
        )
        assert status == 200 and body["choices"][0]["message"]["content"] == want, body


# -- presence and frequency penalties: mlx-lm's output in every verify mode -------------------------------------

MAX_TOKENS = 40


@contextmanager
def serving(model, tokenizer, drafter, **defaults):
    app, server = build_server(
        model,
        tokenizer,
        drafter,
        model_id="tiny",
        defaults=GenerationArguments(eos_token_ids=[], **defaults),
        settings=ServeSettings(port=0, context_length=CONTEXT),
    )
    with serving_thread(app, server) as port:
        yield app, port


@pytest.fixture(scope="module")
def no_eos(tokenizer):
    wrapper = TokenizerWrapper(tokenizer._tokenizer)
    wrapper.eos_token_ids = []
    return wrapper


@pytest.mark.parametrize("mode", ["dflash", "adaptive", "ddtree"])
@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
def test_penalties_give_mlx_lms_output_at_t0(mode, field, tokenizer, no_eos, monkeypatch):
    """A drafter that proposes the processed target's continuation (so drafts are accepted and verified against
    processed rows): the answer is mlx-lm's stream_generate with make_logits_processors of the same penalty."""
    monkeypatch.setattr(app_module, "load_or_measure_costs", lambda *a: COSTS)  # adaptive: no timing at startup
    model = make_target("llama", seed=2)
    prompt = prompts(1, seed=20)[0] * 2  # repeats for the penalty to act on
    value, size = (1.5, 12) if field == "presence_penalty" else (0.7, 16)
    context = field.replace("penalty", "context_size")
    procs = make_logits_processors(**{field: value, context: size})
    want = [
        r.token for r in mlx_lm_stream_generate(model, no_eos, prompt, max_tokens=MAX_TOKENS, logits_processors=procs)
    ]
    unprocessed = [r.token for r in mlx_lm_stream_generate(model, no_eos, prompt, max_tokens=MAX_TOKENS)]
    assert want != unprocessed, "the penalty changes nothing: a weak test"
    ours = generate(
        model,
        tokenizer,
        prompt,
        None,
        verify_mode="off",
        max_tokens=MAX_TOKENS,
        eos_token_ids=[],
        logits_processors=procs,
    )
    assert ours.tokens == want  # the text the server must answer is the text of mlx-lm's tokens
    if mode == "ddtree":
        drafter = SiblingOracle(drafter_config(model, block_size=8), model, prompt, 16, None, None, procs)
        bind_drafter(drafter, model)
        defaults = dict(tree_budget=16)
    else:
        drafter, defaults = make_oracle(model, prompt, 8, spoil_seed=3, processors=procs), {}
    with serving(model, tokenizer, drafter, verify_mode=mode, block_size=8, **defaults) as (app, port):
        status, _, body = request(
            port, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": MAX_TOKENS, field: value, context: size}
        )
    assert status == 200, body
    assert body["choices"][0]["text"] == ours.text
    assert body["dflash"]["verify_mode"] == mode and body["dflash"]["accepted"] > 0, body["dflash"]


def test_frequency_penalty_changes_the_answer_as_mlx_lm_server_would(served, tiny_pair):
    """The official client's case: frequency_penalty 1.5 on the served folders, against mlx-lm's generate of
    the folder's model with mlx_lm.server's processors."""
    app, port = served
    model, tok = mlx_lm_load(str(tiny_pair[0]))
    ids = chat_ids(app, user("w3 w14 w15"))
    procs = make_logits_processors(frequency_penalty=1.5, frequency_context_size=20)
    want = mlx_lm_generate(model, tok, ids, max_tokens=16, logits_processors=procs)
    assert want != mlx_lm_generate(model, tok, ids, max_tokens=16), "a weak test"
    status, _, body = request(
        port,
        "POST",
        "/v1/chat/completions",
        {"messages": user("w3 w14 w15"), "max_tokens": 16, "frequency_penalty": 1.5},
    )
    assert status == 200 and body["choices"][0]["message"]["content"] == want, body


# -- XTC: mlx_lm.server's sampler, drawn from as mlx-lm draws ---------------------------------------------------


def test_xtc_is_mlx_lms_sampler(served, tiny_pair):
    """At T > 0 with a seed, the answer is mlx-lm's generate with mlx_lm.server's XTC sampler (plain decoding:
    no draft can be verified against XTC's random cut, and the answer says so); at T = 0 XTC changes nothing,
    as in mlx-lm, whose sampler is greedy there."""
    app, port = served
    model, tok = mlx_lm_load(str(tiny_pair[0]))
    ids = prompts(1, seed=4)[0]
    xtc = {"xtc_probability": 1.0, "xtc_threshold": 0.001}

    def mlx_lm_text(**kw) -> str:
        sampler = make_sampler(1.0, top_p=1.0, xtc_special_tokens=tok.encode("\n") + list(tok.eos_token_ids), **kw)
        mx.random.seed(7)
        return mlx_lm_generate(model, tok, ids, max_tokens=12, sampler=sampler)

    want = mlx_lm_text(**xtc)
    assert want != mlx_lm_text(), "XTC changes nothing here: a weak test"
    status, _, body = request(
        port, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 12, "temperature": 1.0, "seed": 7, **xtc}
    )
    assert status == 200 and body["choices"][0]["text"] == want, body
    assert body["dflash"]["verify_mode"] == "off"
    status, _, body = request(port, "POST", "/v1/completions", {"prompt": ids, "max_tokens": 12, **xtc})
    assert body["choices"][0]["text"] == expected(app, ids, 12).text
    assert body["dflash"]["verify_mode"] == "dflash"


# -- chat_template_kwargs --------------------------------------------------------------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    "{% if brief %}w7 w7 {% endif %}"
)  # mlx-lm's wrapper sets enable_thinking itself


@pytest.mark.parametrize("flag", [None, '{"brief": true}'])
def test_chat_template_kwargs_reach_the_template(tiny_pair, tiny_dflash2, flag):
    """The request's chat_template_kwargs (over --chat-template-args, as mlx_lm.server merges them) are the
    template's: the prompt is the template's rendering with them, the answer its continuation."""
    flags = [] if flag is None else ["--chat-template-args", flag]
    with running(tiny_pair[0], tiny_dflash2, *flags) as (app, port):
        app.tokenizer._tokenizer.chat_template = THINKING_TEMPLATE
        messages = user("w3 w14")
        plain = app.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        brief = app.tokenizer.apply_chat_template(messages, add_generation_prompt=True, brief=True)
        assert brief != plain
        for kwargs, ids in (
            ({"brief": True}, brief),
            ({"brief": False}, plain),
            (None, plain if flag is None else brief),
        ):
            status, _, body = request(
                port,
                "POST",
                "/v1/chat/completions",
                {"messages": messages, "max_tokens": 8, "chat_template_kwargs": kwargs},
            )
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] == len(ids)
            assert body["choices"][0]["message"]["content"] == expected(app, ids, 8).text
        status, _, body = request(
            port, "POST", "/v1/chat/completions", {"messages": messages, "chat_template_kwargs": {"tokenize": False}}
        )
        assert (
            status == 400
            and body["error"]["param"] == "chat_template_kwargs"
            and "tokenize" in body["error"]["message"]
        ), body
