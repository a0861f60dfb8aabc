"""The drop-in for mlx-lm's generation API (`dflash2_mlx.lm`) and its per-token responses. The reference is
mlx-lm itself: its `stream_generate` on the same target gives the tokens, texts and log-probabilities; which
tokens were accepted drafts is known from the spoiled oracle (where its drafts stop being the target's own)."""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings

import mlx.core as mx
import numpy as np
import openai
import pytest
from helpers import COSTS, OracleDrafter, SiblingOracle, drafter_config, make_target, prompts, running, user
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_model

from dflash2_mlx import lm
from dflash2_mlx.loading import bind_drafter

generate_module = importlib.import_module("dflash2_mlx.generate")

N = 40  # tokens per generation
BIAS = {17: 2.5, 40: 1.5, 99: -30.0}


def without_eos(tokenizer) -> TokenizerWrapper:
    """The tokenizer with no EOS ids, so that mlx-lm's stream_generate runs to max_tokens as ours does."""
    wrapper = TokenizerWrapper(tokenizer._tokenizer)
    wrapper.eos_token_ids = []
    return wrapper


class CountingOracle(OracleDrafter):
    """The spoiled oracle, recording for each block it drafts how many leading drafts are the target's own
    greedy continuation: exactly the drafts a correct loop accepts (the first spoiled one is rejected)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.right: list[int] = []

    def draft_rows(self, block, context, cache):
        hidden, logits = super().draft_rows(block, context, cache)
        proposal, greedy = mx.argmax(logits, axis=-1).tolist(), self.pending[1]
        self.right.append(next((i for i, (p, g) in enumerate(zip(proposal, greedy)) if p != g), len(proposal)))
        return hidden, logits


def mlx_lm_responses(model, tokenizer, prompt, max_tokens=N, **kw) -> list:
    return list(mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, **kw))


def logprob_rows(responses) -> np.ndarray:
    return np.stack([np.array(r.logprobs.astype(mx.float32)) for r in responses])


@pytest.mark.parametrize("seed", [3, 11])
def test_per_token_responses_equal_mlx_lms_and_mark_the_accepted_drafts(tokenizer, seed):
    """Greedy, dflash mode, the qwen3 fixture and the spoiled oracle (every acceptance length): one response per
    token whose token, text and logprobs [V] are mlx-lm's own stream_generate's (logprobs within 1e-4), and whose
    from_draft is True exactly for the drafts the oracle got right, the leading right ones of each block."""
    model = make_target("qwen3", seed=seed)
    prompt = prompts(1, seed=seed)[0]
    oracle = CountingOracle(drafter_config(model, block_size=8), model, prompt, spoil_seed=seed)
    bind_drafter(oracle, model)
    no_eos = without_eos(tokenizer)
    ours = list(
        lm.stream_generate(model, no_eos, prompt, max_tokens=N, draft_model=oracle, verify_mode="dflash", block_size=6)
    )
    theirs = mlx_lm_responses(model, no_eos, prompt)
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert [r.text for r in ours] == [r.text for r in theirs]
    np.testing.assert_allclose(logprob_rows(ours), logprob_rows(theirs), atol=1e-4, rtol=0)
    # the prefill token, then per drafted block: its right drafts (accepted), then the bonus token
    expected = ([False] + [d for right in oracle.right for d in [True] * right + [False]])[:N]
    assert [r.from_draft for r in ours] == expected
    assert 5 < sum(expected) < N - 5  # both kinds, many of each
    assert [r.generation_tokens for r in ours] == list(range(1, N + 1))
    assert [r.finish_reason for r in ours] == [None] * (N - 1) + ["length"] == [r.finish_reason for r in theirs]
    assert all(r.verify_mode == "dflash" and r.prompt_tokens == len(prompt) for r in ours)


@pytest.mark.parametrize("mode", ["off", "dflash", "adaptive", "ddtree"])
def test_logprobs_are_the_processed_rows_in_every_mode(tokenizer, mode, monkeypatch):
    """With mlx-lm's logits processors (logit bias, repetition penalty) each token's logprobs are the row mlx-lm
    chose it from, processed (its `generate_step`'s), in every verify mode: a tree's accepted path included."""
    monkeypatch.setattr(generate_module, "load_or_measure_costs", lambda target, drafter, B: COSTS)
    model = make_target("qwen3", seed=5)
    prompt = prompts(1, seed=21)[0]
    procs = make_logits_processors(logit_bias=BIAS, repetition_penalty=1.3, repetition_context_size=12)
    oracle_type = SiblingOracle if mode == "ddtree" else OracleDrafter
    oracle = oracle_type(drafter_config(model, block_size=8), model, prompt, 4, None, None, procs)
    bind_drafter(oracle, model)
    no_eos = without_eos(tokenizer)
    extra = {"tree_budget": 16} if mode == "ddtree" else {}  # siblings too: paths leave the first-born branch
    ours = list(
        lm.stream_generate(
            model, no_eos, prompt, max_tokens=N, draft_model=oracle, verify_mode=mode, logits_processors=procs, **extra
        )
    )
    theirs = mlx_lm_responses(model, no_eos, prompt, logits_processors=procs)
    assert [r.token for r in ours] == [r.token for r in theirs]
    np.testing.assert_allclose(logprob_rows(ours), logprob_rows(theirs), atol=1e-4, rtol=0)
    assert (sum(r.from_draft for r in ours) > 5) == (mode != "off")


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_per_token_responses_on_llama_and_the_hybrid(tokenizer, arch):
    """The per-token comparison on the llama fixture and the hybrid (GatedDeltaNet) one, whose rejected drafts
    are undone by rebuilding recurrent state: tokens and logprobs are mlx-lm's, from_draft the oracle's."""
    from helpers import make_hybrid

    model = make_hybrid(arch, seed=3) if arch == "qwen3_5" else make_target(arch, seed=3)
    prompt = prompts(1, seed=13)[0]
    oracle = CountingOracle(drafter_config(model, block_size=8), model, prompt, spoil_seed=7)
    bind_drafter(oracle, model)
    no_eos = without_eos(tokenizer)
    ours = list(
        lm.stream_generate(model, no_eos, prompt, max_tokens=N, draft_model=oracle, verify_mode="dflash", block_size=5)
    )
    theirs = mlx_lm_responses(model, no_eos, prompt)
    assert [r.token for r in ours] == [r.token for r in theirs]
    np.testing.assert_allclose(logprob_rows(ours), logprob_rows(theirs), atol=1e-4, rtol=0)
    expected = ([False] + [d for right in oracle.right for d in [True] * right + [False]])[:N]
    assert [r.from_draft for r in ours] == expected and sum(expected) > 5


def test_eos_ends_as_mlx_lms_does(tokenizer):
    """At EOS the last response's token is the EOS, with no text of its own and finish_reason "stop", as mlx-lm's."""
    model = make_target("qwen3", seed=2)
    prompt = prompts(1, seed=8)[0]
    oracle = CountingOracle(drafter_config(model, block_size=8), model, prompt, spoil_seed=1)
    bind_drafter(oracle, model)
    free = [r.token for r in mlx_lm_responses(model, without_eos(tokenizer), prompt)]
    stopping = without_eos(tokenizer)
    stopping.eos_token_ids = {free[12]}  # a token the greedy run emits: it stops there
    ours = list(lm.stream_generate(model, stopping, prompt, max_tokens=N, draft_model=oracle, verify_mode="dflash"))
    theirs = mlx_lm_responses(model, stopping, prompt)

    def fields(r):
        return (r.token, r.text, r.generation_tokens, r.finish_reason)

    assert [fields(r) for r in ours] == [fields(r) for r in theirs]
    assert ours[-1].finish_reason == "stop" and len(ours) <= 13


SCRIPT = """
import sys
from mlx_lm import load, generate, stream_generate
from mlx_lm.sample_utils import make_sampler, make_logits_processors

model, tokenizer = load(sys.argv[1])
sampler = make_sampler(temp=0.0)
processors = make_logits_processors(logit_bias={17: 2.5, 99: -30.0}, repetition_penalty=1.3, repetition_context_size=12)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "w1 w2 w3 w4"}], add_generation_prompt=True)
print(generate(model, tokenizer, prompt, max_tokens=24, sampler=sampler, logits_processors=processors))
for response in stream_generate(model, tokenizer, "w5 w6 w7", max_tokens=12, sampler=sampler):
    print(repr(response.text), response.token, response.generation_tokens, response.finish_reason)
"""
MLX_LM_IMPORTS = (
    "from mlx_lm import load, generate, stream_generate\n"
    "from mlx_lm.sample_utils import make_sampler, make_logits_processors\n"
)
OUR_IMPORT = "from dflash2_mlx.lm import load, generate, stream_generate, make_sampler, make_logits_processors\n"

FOREIGN_SCRIPT = """
import sys
import mlx.core as mx
from mlx_lm import load, generate
from mlx_lm.sample_utils import make_sampler



def second_best(logprobs):
    return mx.argsort(logprobs, axis=-1)[:, -2]


model, tokenizer = load(sys.argv[1])
mx.random.seed(7)
print(generate(model, tokenizer, "w1 w2 w3", max_tokens=20, sampler=make_sampler(temp=0.9, top_k=30)))
print(generate(model, tokenizer, "w1 w2 w3", max_tokens=20, sampler=second_best))
"""


def run_script(source: str, folder, tmp_path, capsys) -> str:
    path = tmp_path / "script.py"
    path.write_text(source)
    argv = sys.argv
    sys.argv = [str(path), str(folder)]
    try:
        capsys.readouterr()
        runpy.run_path(str(path), run_name="__main__")
    finally:
        sys.argv = argv
    return capsys.readouterr().out


@pytest.fixture
def speculating(monkeypatch):
    """The DFlash decode loop's steps, as the generations run it (empty: no speculative loop ran)."""
    steps, real = [], generate_module.dflash_steps

    def counted(*args, **kwargs):
        for step in real(*args, **kwargs):
            steps.append(step)
            yield step

    monkeypatch.setattr(generate_module, "dflash_steps", counted)
    return steps


def test_an_mlx_lm_script_prints_the_same_text_with_the_import_switched(
    tiny_pair, tmp_path, capsys, monkeypatch, speculating
):
    """A script written for mlx-lm (load, make_sampler, make_logits_processors, generate, stream_generate), run with
    mlx-lm, then with its imports switched to dflash2_mlx.lm and the drafter named by $DFLASH2_DRAFT_MODEL: the same
    output, from the speculative loop."""
    target_dir, drafter_dir = tiny_pair
    expected = run_script(SCRIPT, target_dir, tmp_path, capsys)
    assert not speculating
    switched = SCRIPT.replace(MLX_LM_IMPORTS, OUR_IMPORT)
    assert switched != SCRIPT
    monkeypatch.setenv("DFLASH2_DRAFT_MODEL", str(drafter_dir))
    ours = run_script(switched, target_dir, tmp_path, capsys)
    assert ours == expected
    assert len(expected.splitlines()) == 13 and expected.split("\n")[0].strip()
    assert speculating  # it ran speculatively, not by mlx-lm's loop or our plain one


def test_a_foreign_sampler_warns_and_still_matches_mlx_lm(tiny_pair, tmp_path, capsys, monkeypatch, speculating):
    """mlx-lm's own make_sampler at T > 0 and a custom callable (the runner-up token) cannot be read as a
    distribution: plain decoding with that very sampler, one warning each, and mlx-lm's exact draws."""
    target_dir, drafter_dir = tiny_pair
    expected = run_script(FOREIGN_SCRIPT, target_dir, tmp_path, capsys)
    switched = FOREIGN_SCRIPT.replace("from mlx_lm import load, generate", "from dflash2_mlx.lm import load, generate")
    assert switched != FOREIGN_SCRIPT
    monkeypatch.setenv("DFLASH2_DRAFT_MODEL", str(drafter_dir))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = run_script(switched, target_dir, tmp_path, capsys)
    assert ours == expected
    first, second = expected.splitlines()
    assert first != second and first.strip() and second.strip()
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(said) == 2 and all("plain decoding" in s and "make_sampler" in s for s in said), said
    assert not speculating


@pytest.mark.parametrize(
    "args",
    [
        dict(temp=0.7),
        dict(temp=1.0, top_p=0.9),
        dict(temp=0.9, top_p=0.0, top_k=0),
        dict(temp=0.8, min_p=0.5, min_tokens_to_keep=4),
        dict(temp=1.2, top_k=5),
        dict(temp=0.0, top_p=0.5),
    ],
)
def test_make_sampler_is_mlx_lms_and_its_parameters_say_what_it_draws(args):
    """Calling it is calling mlx-lm's make_sampler(**args); and the parameters it carries draw the very same tokens
    for the same random state (rows where every filter bites), so speculation tests drafts against its law."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_make_sampler

    from dflash2_mlx.sampling import sample

    logits = mx.random.normal((3000, 50), key=mx.random.key(1)) * 2.0
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    ours = lm.make_sampler(**args)
    draws = []
    for draw in (ours, mlx_lm_make_sampler(**args), lambda _: sample(logits, ours.params)):
        mx.random.seed(0)
        draws.append(np.array(draw(logprobs)))
    assert (draws[0] == draws[1]).all() and (draws[2] == draws[1]).all()
    assert len(set(draws[1].tolist())) > (1 if args["temp"] == 0 else 4)


def test_our_make_sampler_speculates(tiny_pair, speculating):
    """dflash2_mlx.lm.make_sampler's sampler carries its parameters: no warning, the speculative loop runs."""
    model, tokenizer = lm.load(str(tiny_pair[0]), draft_model=str(tiny_pair[1]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = lm.generate(model, tokenizer, "w1 w2", max_tokens=8, sampler=lm.make_sampler(temp=0.7, top_p=0.9))
    assert isinstance(text, str) and speculating


def test_the_response_has_mlx_lms_fields_in_its_order_then_ours():
    from dataclasses import fields

    from mlx_lm.generate import GenerationResponse as Theirs

    theirs = [f.name for f in fields(Theirs)]
    ours = [f.name for f in fields(lm.GenerationResponse)]
    assert ours[: len(theirs)] == theirs and len(ours) > len(theirs)


def test_num_draft_tokens_and_the_progress_callback(tiny_pair):
    """num_draft_tokens n drafts exactly n per cycle (dflash mode at block n + 1), as mlx-lm's draft model does; the
    progress callback hears the prefill's start and end."""
    model, tokenizer = lm.load(str(tiny_pair[0]), draft_model=str(tiny_pair[1]))
    calls = []
    responses = list(
        lm.stream_generate(
            model,
            tokenizer,
            [10, 11, 12],
            max_tokens=20,
            num_draft_tokens=3,
            prompt_progress_callback=lambda done, total: calls.append((done, total)),
        )
    )
    starts = {}  # cycle -> (tokens before it, mode, block size)
    for r in responses[1:]:
        starts.setdefault(r.cycle, (r.generation_tokens - 1, r.verify_mode, r.block_size))
    # 3 drafts per cycle, fewer only where fewer tokens are left (mlx-lm: min(max_tokens - produced, n))
    assert [(mode, B) for _, mode, B in starts.values()] == [
        ("dflash", min(4, 20 - before + 1)) for before, *_ in starts.values()
    ]
    assert len(starts) > 3 and sum(B == 4 for *_, B in starts.values()) > 2
    assert calls == [(0, 3), (3, 3)]


def test_what_cannot_be_honoured_is_refused(tiny_pair, tokenizer):
    model, _ = load_model(tiny_pair[0])
    cases = [
        (dict(draft_model=make_target("qwen3", seed=9)), ValueError, "DFlash drafter"),
        (dict(max_kv_size=64), ValueError, "max_kv_size"),
        (dict(kv_bits=4), ValueError, "kv_bits"),
        (dict(prompt_cache=[]), ValueError, "make_prompt_cache"),
        (dict(temperature=0.5), TypeError, "temperature"),
    ]
    for kwargs, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            lm.generate(model, tokenizer, "w1 w2", max_tokens=4, **kwargs)
    with pytest.raises(ValueError, match="non-zero"):
        lm.generate(model, tokenizer, "w1 w2", max_tokens=0)


def test_make_prompt_cache_continues_the_conversation_as_mlx_lms(tiny_pair):
    """mlx-lm's prompt-cache use: each call passes only its new tokens; the text is what mlx-lm's own cache gives."""
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_cache

    model, tokenizer = lm.load(str(tiny_pair[0]), draft_model=str(tiny_pair[1]))
    turns = [[10, 11, 12, 13], [14, 15], [16]]
    theirs_cache, ours_cache = mlx_lm_cache(model), lm.make_prompt_cache(model)
    theirs = [
        [r.token for r in mlx_lm_stream_generate(model, tokenizer, t, max_tokens=6, prompt_cache=theirs_cache)]
        for t in turns
    ]
    ours = [
        [
            r.token
            for r in lm.stream_generate(
                model, tokenizer, t, max_tokens=6, prompt_cache=ours_cache, verify_mode="dflash"
            )
        ]
        for t in turns
    ]
    assert ours == theirs
    assert ours_cache.reused > 0


# -- the server's logprobs, with the official client ---------------------------------------------------------


@pytest.fixture(scope="module")
def logprob_server(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--max-tokens", 12) as s:
        yield s


def client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=60, max_retries=0)


def reference(app, prompt, max_tokens=12) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """(token text, logprob, the 3 best (text, logprob)) per generated token by mlx-lm, the EOS left out."""
    out = []
    for r in mlx_lm_stream_generate(app.worker.model, app.tokenizer, prompt, max_tokens=max_tokens):
        if r.finish_reason == "stop":
            break
        row = np.array(r.logprobs.astype(mx.float32))
        best = np.argsort(-row)[:3]
        out.append(
            (
                app.tokenizer.decode([r.token]),
                float(row[r.token]),
                [(app.tokenizer.decode([int(i)]), float(row[i])) for i in best],
            )
        )
    return out


def close(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0]
        and abs(x[1] - y[1]) < 1e-4
        and [t for t, _ in x[2]] == [t for t, _ in y[2]]
        and np.allclose([v for _, v in x[2]], [v for _, v in y[2]], atol=1e-4)
        for x, y in zip(a, b)
    )


def test_server_chat_logprobs_in_openais_shape(logprob_server):
    app, port = logprob_server
    messages = user("w1 w2 w3 w4")
    expected = reference(app, app.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    answer = client(port).chat.completions.create(
        model=app.model_id, messages=messages, max_tokens=12, logprobs=True, top_logprobs=3
    )
    content = answer.choices[0].logprobs.content
    got = [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content]
    assert close(got, expected) and len(got) >= 3
    assert all(c.bytes == list(c.token.encode()) for c in content)
    chunks = client(port).chat.completions.create(
        model=app.model_id, messages=messages, max_tokens=12, logprobs=True, top_logprobs=3, stream=True
    )
    streamed = [
        (c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs])
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for c in chunk.choices[0].logprobs.content
    ]
    assert close(streamed, expected)
    plain = client(port).chat.completions.create(model=app.model_id, messages=messages, max_tokens=12)
    assert plain.choices[0].logprobs is None


def test_server_completion_logprobs_in_openais_shape(logprob_server):
    app, port = logprob_server
    prompt = "w5 w6 w7"
    expected = reference(app, prompt)
    answer = client(port).completions.create(model=app.model_id, prompt=prompt, max_tokens=12, logprobs=3)
    choice = answer.choices[0]
    lp = choice.logprobs
    # greedy: the chosen token is the best one, so each top_logprobs dict holds just the 3 best
    got = [
        (t, v, sorted(top.items(), key=lambda p: -p[1]))
        for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
    ]
    assert close(got, expected) and len(lp.tokens) == len(expected) >= 3
    assert all(t in top and abs(top[t] - v) < 1e-4 for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(choice.text[o:].lstrip().startswith(t) for o, t in zip(lp.text_offset, lp.tokens))
    chunks = list(
        client(port).completions.create(model=app.model_id, prompt=prompt, max_tokens=12, logprobs=3, stream=True)
    )
    parts = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    streamed = [(t, v, o) for part in parts for t, v, o in zip(part.tokens, part.token_logprobs, part.text_offset)]
    assert len(parts) > 1 and streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
    bare = client(port).completions.create(model=app.model_id, prompt=prompt, max_tokens=12, logprobs=0)
    lp0 = bare.choices[0].logprobs
    assert lp0.tokens == lp.tokens and lp0.top_logprobs == [{t: v} for t, v in zip(lp0.tokens, lp0.token_logprobs)]


def test_server_logprobs_leave_out_the_eos_and_come_from_the_rows(logprob_server, monkeypatch):
    """The rows the loop hands over become the answer's numbers (a generation replaced by one whose rows are
    known); the EOS that ends it adds no text and is not listed, as it is not in the message."""
    from dflash2_mlx.generate import CycleResponse
    from dflash2_mlx.server import scheduler

    app, port = logprob_server
    V = app.vocab_size
    logits = mx.random.normal((3, V), key=mx.random.key(0))
    rows = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(rows)  # made on this thread, read on the worker's
    eos = app.tokenizer.eos_token_id
    tokens = [10, 11, eos]

    def cycles(model, tokenizer, prompt, drafter=None, **kwargs):
        yield CycleResponse(
            text=app.tokenizer.decode(tokens[:2]),
            tokens=tokens,
            accepted=2,
            prompt_tokens=len(prompt),
            prompt_tps=1.0,
            generation_tokens=3,
            generation_tps=1.0,
            peak_memory=0.0,
            finish_reason="stop",
            verify_mode="dflash",
            block_size=4,
            logprobs=rows,
        )

    monkeypatch.setattr(scheduler, "stream_cycles", cycles)
    answer = client(port).chat.completions.create(
        model=app.model_id, messages=user("w1"), max_tokens=12, logprobs=True, top_logprobs=2
    )
    content = answer.choices[0].logprobs.content
    table = np.array(rows)
    assert [c.token for c in content] == [app.tokenizer.decode([t]) for t in tokens[:2]]
    assert np.allclose([c.logprob for c in content], [table[0, 10], table[1, 11]], atol=1e-6)
    for c, row in zip(content, table):
        best = np.argsort(-row)[:2]
        assert [t.token for t in c.top_logprobs] == [app.tokenizer.decode([int(i)]) for i in best]
        assert np.allclose([t.logprob for t in c.top_logprobs], row[best], atol=1e-6)
    assert answer.choices[0].finish_reason == "stop"


def test_the_default_pair_through_the_drop_in(smollm2_path, speculating):
    """`load(None)`: the default target with its bundled drafter, remembered for the model; greedy text with mlx-lm's
    processors equal to mlx-lm's own stream_generate on that model, from the speculative loop."""
    model, tokenizer = lm.load(None)
    assert lm.drafter_for(model) is not None
    procs = make_logits_processors(repetition_penalty=1.2)
    prompt = tokenizer.apply_chat_template(user("Name three colors."), add_generation_prompt=True)
    ours = list(
        lm.stream_generate(model, tokenizer, prompt, max_tokens=24, logits_processors=procs, verify_mode="dflash")
    )
    theirs = mlx_lm_responses(model, tokenizer, prompt, max_tokens=24, logits_processors=procs)
    assert [(r.token, r.text) for r in ours] == [(r.token, r.text) for r in theirs]
    np.testing.assert_allclose(logprob_rows(ours), logprob_rows(theirs), atol=1e-4, rtol=0)
    assert speculating and any(r.from_draft for r in ours)
