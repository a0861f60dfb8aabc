"""mlx-lm's logits processors inside speculation: with the same processors (`make_logits_processors`: logit bias,
repetition penalty), every verify mode's output is mlx-lm's own plain generation's, token for token at T = 0 and
in law at T > 0. The reference is mlx-lm's `stream_generate` (and its processors), never our own plain mode."""

from __future__ import annotations

import importlib
import io
import itertools
import json
import sys
from collections import Counter

import mlx.core as mx
import pytest
from helpers import (
    COSTS,
    N_BROKEN,
    PROMPT,
    N,
    SiblingOracle,
    V,
    chi_square,
    drafter_config,
    first_tokens,
    make_drafter,
    make_hybrid,
    make_oracle,
    make_target,
    mlx_lm_probabilities,
    prompts,
    request,
    running,
    slow_except,
    user,
)
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.tokenizer_utils import TokenizerWrapper

from dflash2_apps.cli import main
from dflash2_mlx import generate
from dflash2_mlx.adaptive import AdaptiveBlocks, AdaptiveConfig, FixedBlocks
from dflash2_mlx.costs import CostModel
from dflash2_mlx.decode import dflash_steps, plain_steps, tree_steps
from dflash2_mlx.drafter import DFlashDraftModel
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import Processing, SamplingParams

generate_module = importlib.import_module("dflash2_mlx.generate")  # the package exports a function of that name

MAX_TOKENS = 40
BIAS = {17: 2.5, 40: 1.5, 99: -30.0}


def processors():
    return make_logits_processors(logit_bias=BIAS, repetition_penalty=1.3, repetition_context_size=12)


@pytest.fixture(scope="module")
def no_eos(tokenizer):
    """The test tokenizer without EOS ids, so that mlx-lm's stream_generate runs to max_tokens as ours does."""
    wrapper = TokenizerWrapper(tokenizer._tokenizer)
    wrapper.eos_token_ids = []
    return wrapper


def mlx_lm_tokens(model, tokenizer, prompt, procs, max_tokens=MAX_TOKENS, **kw) -> list[int]:
    """mlx-lm's own plain generation (its `generate_step`) with these processors."""
    return [
        r.token
        for r in mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, logits_processors=procs, **kw)
    ]


@pytest.fixture
def measured(monkeypatch):
    """Adaptive mode decides on fixed costs (the tiny models' timings are Python overhead): test_adaptive's."""
    monkeypatch.setattr(generate_module, "load_or_measure_costs", lambda target, drafter, B: COSTS)


class ScriptDrafter(DFlashDraftModel):
    """Proposes the expected output: after the anchor at output position k (counted from the context rows the
    loop hands it), tokens k+1 .. k+B-1 of `script`. It checks nothing (the oracle asserts its context), so a
    loop that goes wrong is seen by the output comparison."""

    def __init__(self, config, prompt_len: int, script: list[int]):
        super().__init__(config)
        self.rows, self.prompt_len, self.script = 0, prompt_len, script
        self.vocab = config.vocab_size

    def draft_rows(self, block, context, cache):
        B = block.shape[1]
        self.rows += context.shape[1]
        k = self.rows - self.prompt_len
        proposal = (self.script[k + 1 : k + B] + [7] * B)[: B - 1]
        return mx.zeros((B - 1, self.config.hidden_size)), mx.eye(self.vocab)[mx.array(proposal)] * 30.0


def script_drafter(model, prompt, script, block_size=8):
    drafter = ScriptDrafter(drafter_config(model, block_size=block_size), len(prompt), script)
    bind_drafter(drafter, model)
    return drafter


TARGETS = {
    "qwen3": lambda: make_target("qwen3", seed=1),
    "llama": lambda: make_target("llama", seed=2),
    "qwen3_5": lambda: make_hybrid("qwen3_5", seed=3),
}


@pytest.mark.parametrize("arch", slow_except(TARGETS, "llama"))
def test_greedy_output_is_mlx_lms_with_the_same_processors(arch, tokenizer, no_eos, measured):
    """off, dflash at block sizes 3 and 8 (an oracle of the processed target, full and spoiled, a random drafter),
    adaptive and, where the target allows, ddtree: all equal mlx-lm's generation with the processors."""
    model = TARGETS[arch]()
    prompt = prompts(1, seed=20 + list(TARGETS).index(arch))[0] * 2  # repeats for the penalty to act on
    procs = processors()
    expected = mlx_lm_tokens(model, no_eos, prompt, procs)
    assert expected != mlx_lm_tokens(model, no_eos, prompt, None), "the processors change nothing: a weak test"
    kw = dict(max_tokens=MAX_TOKENS, eos_token_ids=[], logits_processors=procs)

    assert generate(model, tokenizer, prompt, None, verify_mode="off", **kw).tokens == expected
    accepted = []
    for B in (3, 8):
        for drafter in (
            make_oracle(model, prompt, 8, processors=procs),
            make_oracle(model, prompt, 8, spoil_seed=B, processors=procs),
            make_drafter(model, block_size=8, seed=B),
        ):
            r = generate(model, tokenizer, prompt, drafter, verify_mode="dflash", block_size=B, **kw)
            assert r.tokens == expected, f"{arch} B={B} {type(drafter).__name__}"
            accepted += r.accepted
    assert max(accepted) == 7 and 0 in accepted  # full blocks of 8 accepted, and full rejections

    oracle = make_oracle(model, prompt, 8, right_for=MAX_TOKENS // 2, processors=procs)
    r = generate(model, tokenizer, prompt, oracle, verify_mode="adaptive", **kw)
    assert r.tokens == expected
    assert r.plain_tokens > 0 and max(r.accepted) == 7  # drafting cycles, then plain steps where it turns wrong

    if arch != "qwen3_5":  # trees need attention-only targets
        for budget, B in ((4, 3), (16, 8)):
            sibling = SiblingOracle(drafter_config(model, block_size=8), model, prompt, budget, None, None, procs)
            bind_drafter(sibling, model)
            r = generate(
                model, tokenizer, prompt, sibling, verify_mode="ddtree", tree_budget=budget, block_size=B, **kw
            )
            assert r.tokens == expected, f"{arch} ddtree budget {budget} B={B}"
            assert max(r.accepted) == B - 1


def test_processors_see_the_prompt_and_every_token_before_the_row(tokenizer, no_eos):
    """What mlx-lm hands a processor: the whole prompt, then the tokens generated before the row, in every mode."""
    model = make_target("qwen3", seed=1)
    prompt = prompts(1, seed=5)[0]
    seen = {}

    def spied(mode):
        def spy(tokens, logits):
            seen.setdefault(mode, []).append(tokens.tolist())
            return logits

        return [spy, *make_logits_processors(logit_bias=BIAS)]

    expected = mlx_lm_tokens(model, no_eos, prompt, spied("mlx-lm"), max_tokens=12)
    for mode in ("off", "dflash"):
        drafter = None if mode == "off" else script_drafter(model, prompt, expected)
        r = generate(
            model,
            tokenizer,
            prompt,
            drafter,
            verify_mode=mode,
            block_size=None if mode == "off" else 4,
            max_tokens=12,
            eos_token_ids=[],
            logits_processors=spied(mode),
        )
        assert r.tokens == expected
    for k in range(12):  # the row choosing output token k sees the prompt and output tokens 0..k-1
        assert seen["mlx-lm"][k] == prompt + expected[:k]
        assert seen["off"][k] == prompt + expected[:k]
        assert prompt + expected[:k] in seen["dflash"]
    # a verify row sees the committed tokens and the drafts before it, nothing else
    assert all(t == prompt + expected[: len(t) - len(prompt)] for t in seen["dflash"])


@pytest.mark.parametrize("mode", ["dflash", "adaptive", "ddtree"])
def test_the_test_fails_when_the_rows_do_not_see_the_drafts_before_them(mode, tokenizer, no_eos, monkeypatch, measured):
    """Processors applied to each verify row with the committed tokens only (the drafts before the row left out):
    the output is no longer mlx-lm's, while plain decoding (which never verifies drafts) is unaffected."""
    model = make_target("qwen3", seed=1)
    prompt = prompts(1, seed=20)[0] * 2
    procs = processors()
    expected = mlx_lm_tokens(model, no_eos, prompt, procs)
    kw = dict(max_tokens=MAX_TOKENS, eos_token_ids=[], logits_processors=procs)
    extra = dict(tree_budget=8) if mode == "ddtree" else {}
    drafter = script_drafter(model, prompt, expected)
    r = generate(model, tokenizer, prompt, drafter, verify_mode=mode, **extra, **kw)
    assert r.tokens == expected and sum(r.accepted) >= MAX_TOKENS // 2  # the drafts are accepted

    row = Processing.row
    monkeypatch.setattr(Processing, "row", lambda self, logits, after=None: row(self, logits))
    assert generate(model, tokenizer, prompt, None, verify_mode="off", **kw).tokens == expected
    drafter = script_drafter(model, prompt, expected)
    assert generate(model, tokenizer, prompt, drafter, verify_mode=mode, **extra, **kw).tokens != expected


def test_no_processors_is_the_unprocessed_path(tokenizer, monkeypatch):
    """An empty list (or None) builds no `Processing`: the loops run exactly as without the argument."""
    model = make_target("llama", seed=2)
    prompt = prompts(1, seed=3)[0]
    plain = generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=20, eos_token_ids=[]).tokens
    monkeypatch.setattr(Processing, "__init__", lambda *a: pytest.fail("processing without processors"))
    for procs in (None, []):
        for mode, drafter in (("off", None), ("dflash", make_drafter(model, block_size=4))):
            r = generate(
                model,
                tokenizer,
                prompt,
                drafter,
                verify_mode=mode,
                max_tokens=20,
                eos_token_ids=[],
                logits_processors=procs,
            )
            assert r.tokens == plain
    with pytest.raises(ValueError, match="logits_processors must be a list of callables"):
        generate(model, tokenizer, prompt, None, verify_mode="off", logits_processors=[0.5])


# -- T > 0: the law of the first three tokens -------------------------------------------------------------------

PARAMS = SamplingParams(temperature=0.8)


def small_processors():
    """Prefix-sensitive: the penalty looks back 2 tokens only (the anchor and the draft before a row)."""
    return make_logits_processors(logit_bias={0: 0.7}, repetition_penalty=3.0, repetition_context_size=2)


def exact_law(model, procs, params=PARAMS) -> dict[tuple, float]:
    """P(t0, t1, t2 | PROMPT) when each token is drawn by mlx-lm's sampler from the row processed by mlx-lm's
    processors with PROMPT and the tokens before it (full forwards, no cache)."""

    def probs(prefix):
        logits = model(mx.array([PROMPT + list(prefix)]))[:, -1]
        for proc in procs:
            logits = proc(mx.array(PROMPT + list(prefix)), logits)
        return mlx_lm_probabilities(logits, params)[0]

    p0 = probs(())
    p1 = {a: probs((a,)) for a in range(V)}
    p2 = {(a, b): probs((a, b)) for a, b in itertools.product(range(V), repeat=2)}
    return {(a, b, c): p0[a] * p1[a][b] * p2[a, b][c] for a, b, c in itertools.product(range(V), repeat=3)}


def adaptive_blocks():
    """A plain step after a shadow probe, then cycles (drafting priced cheap): both paths inside 3 tokens."""
    return AdaptiveBlocks(
        CostModel([1.0, 1.5, 1.5], [0.1, 0.1]), AdaptiveConfig(3, prior=[0.0, 0.0], prior_weight=1.0, plain_run=1)
    )


def sampled(model, drafter, mode: str, seed: int, n: int) -> Counter:
    target = bind_drafter(drafter, model)
    prompt = mx.array(PROMPT, dtype=mx.uint32)
    mx.random.seed(seed)
    counts = Counter()
    for _ in range(n):
        procs = small_processors()
        if mode == "off":
            steps = plain_steps(target, prompt, PARAMS, logits_processors=procs)
        elif mode == "ddtree":
            steps = tree_steps(target, drafter, prompt, PARAMS, 4, 6, max_tokens=3, logits_processors=procs)
        else:
            blocks = FixedBlocks(3) if mode == "dflash" else adaptive_blocks()
            steps = dflash_steps(target, drafter, prompt, PARAMS, blocks, max_tokens=3, logits_processors=procs)
        counts[first_tokens(steps, 3)] += 1
    return counts


@pytest.fixture(scope="module")
def small():
    model = make_target("llama", vocab=V, seed=21)
    # sharp, often wrong drafts (test_sampling's pair): rows past a rejection and the residual both matter
    return model, make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "adaptive", "ddtree"])
def test_sampling_follows_mlx_lms_processed_distribution(mode, small):
    model, drafter = small
    counts = sampled(model, drafter, mode, seed=1, n=N)
    law = exact_law(model, small_processors())
    stat, critical = chi_square(counts, law, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not mlx-lm's processed distribution"
    # the processors matter here: the unprocessed law is rejected by the same draws
    stat, critical = chi_square(counts, exact_law(model, []), N)
    assert stat > critical, f"the unprocessed law passed too (chi2 {stat:.1f} < {critical:.1f}): a weak test"


@pytest.mark.slow
def test_the_sampled_test_fails_when_the_rows_do_not_see_the_drafts_before_them(small, monkeypatch):
    model, drafter = small
    row = Processing.row
    monkeypatch.setattr(Processing, "row", lambda self, logits, after=None: row(self, logits))
    counts = sampled(model, drafter, "dflash", seed=1, n=N_BROKEN)
    stat, critical = chi_square(counts, exact_law(model, small_processors()), N_BROKEN)
    assert stat > critical, f"rows processed without their drafts passed: chi2 {stat:.1f} < {critical:.1f}"


# -- the command line and the server ----------------------------------------------------------------------------


def test_cli_flags_are_mlx_lms_processors(tiny_pair, tokenizer, capsys):
    """`dflash2 generate --repetition-penalty --repetition-context-size --logit-bias` equals `generate` with
    mlx-lm's `make_logits_processors` of the same settings (plain decoding of the same target)."""
    target_dir, drafter_dir = tiny_pair
    flags = ["--repetition-penalty", "1.4", "--repetition-context-size", "8", "--logit-bias", "17:2.5, 40:-1e9"]
    base = [
        "generate",
        "--model",
        str(target_dir),
        "--draft-model",
        str(drafter_dir),
        "--prompt",
        "w3 w14 w15",
        "--max-tokens",
        "16",
        "--ignore-chat-template",
        "--json",
    ]
    outputs = {}
    for mode in ("off", "dflash"):
        assert main([*base, "--verify-mode", mode, *flags]) == 0
        outputs[mode] = json.loads(capsys.readouterr().out)["tokens"]
        assert main([*base, "--verify-mode", mode]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] != outputs[mode]
    from_folder = mlx_lm_reference(
        target_dir,
        "w3 w14 w15",
        16,
        make_logits_processors(logit_bias={17: 2.5, 40: -1e9}, repetition_penalty=1.4, repetition_context_size=8),
    )
    assert outputs["off"] == outputs["dflash"] == from_folder
    assert 40 not in outputs["off"]


def mlx_lm_reference(folder, text, max_tokens, procs) -> list[int]:
    """mlx-lm loading the folder and generating from the text, as `mlx_lm.generate` does."""
    model, tok = mlx_lm_load(str(folder))
    return [r.token for r in mlx_lm_stream_generate(model, tok, text, max_tokens=max_tokens, logits_processors=procs)]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--logit-bias", "17=2"], "--logit-bias takes comma-separated TOKEN_ID:BIAS pairs"),
        (["--logit-bias=-3:1"], "--logit-bias token ids are >= 0"),
        (["--logit-bias", "999:1"], "outside the target's vocabulary (256)"),
        (["--repetition-penalty", "-1"], "--repetition-penalty must be >= 0"),
        (["--repetition-context-size", "4"], "--repetition-context-size applies to --repetition-penalty"),
        (["--repetition-penalty", "1.2", "--repetition-context-size", "0"], "must be at least 1"),
    ],
)
def test_cli_processor_flag_errors_are_one_line(tiny_pair, capsys, flags, message):
    assert main(["generate", "--model", str(tiny_pair[0]), "--verify-mode", "off", "--max-tokens", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_chat_takes_the_flags(tiny_pair, tiny_dflash2, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6 w7\nq\n"))
    assert (
        main(
            [
                "chat",
                "--model",
                str(tiny_pair[0]),
                "--draft-model",
                str(tiny_dflash2),
                "--verify-mode",
                "dflash",
                "--max-tokens",
                "8",
                "--repetition-penalty",
                "1.5",
                "--logit-bias",
                "17:3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    model, tokenizer = mlx_lm_load(str(tiny_pair[0]))
    ids = tokenizer.apply_chat_template(user("w5 w6 w7"), add_generation_prompt=True)
    procs = make_logits_processors(logit_bias={17: 3.0}, repetition_penalty=1.5)
    want = generate(model, tokenizer, ids, None, verify_mode="off", max_tokens=8, logits_processors=procs)
    assert want.text != generate(model, tokenizer, ids, None, verify_mode="off", max_tokens=8).text
    assert out == f">> {want.text}\n>> "


def test_server_takes_repetition_penalty_and_logit_bias(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as (app, port):
        ids = app.tokenizer.apply_chat_template(user("w3 w14 w15"), add_generation_prompt=True)
        procs = make_logits_processors(logit_bias={17: 3.0}, repetition_penalty=1.5, repetition_context_size=20)
        want = generate(
            app.worker.model, app.tokenizer, ids, None, verify_mode="off", max_tokens=12, logits_processors=procs
        )
        plain = generate(app.worker.model, app.tokenizer, ids, None, verify_mode="off", max_tokens=12)
        assert want.text != plain.text
        status, _, body = request(
            port,
            "POST",
            "/v1/chat/completions",
            {"messages": user("w3 w14 w15"), "max_tokens": 12, "repetition_penalty": 1.5, "logit_bias": {"17": 3}},
        )
        assert status == 200, body
        assert body["choices"][0]["message"]["content"] == want.text
        for bad in ({"17": "x"}, {"w": 1}, {"4096": 1}):
            status, _, body = request(port, "POST", "/v1/chat/completions", {"messages": user("w1"), "logit_bias": bad})
            assert status == 400 and body["error"]["param"] == "logit_bias", body
        status, _, body = request(
            port, "POST", "/v1/chat/completions", {"messages": user("w1"), "repetition_penalty": -1}
        )
        assert status == 400 and body["error"]["param"] == "repetition_penalty", body
