"""Copy drafts (`lookup.py`, `--copyspec-mode`): the index against a brute-force search, the branch trees, and
lossless decoding with lookups firing in every verify mode."""

from __future__ import annotations

import random
from collections import Counter

import mlx.core as mx
import pytest
from helpers import (
    COSTS,
    N_BROKEN,
    PROMPT,
    SETTINGS,
    N,
    V,
    assert_follows_mlx_lm,
    chi_square,
    decide_on,
    exact_distribution,
    make_drafter,
    make_hybrid,
    make_oracle,
    make_target,
    prompts,
)
from mlx_lm.generate import generate_step

from dflash2_mlx import decode, generate, stream_cycles
from dflash2_mlx.adaptive import FixedBlocks
from dflash2_mlx.decode import dflash_steps
from dflash2_mlx.generate import summarize
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.lookup import (
    MODES,
    CopySpec,
    LookupConfig,
    LookupIndex,
    Match,
    branch_tree,
    copyspec_config,
    graft,
    leading_matches,
    match_bucket,
)
from dflash2_mlx.sampling import Proposal
from dflash2_mlx.tree import Tree


def brute_force(tokens: list[int], min_match: int, max_draft: int) -> Match | None:
    """The longest suffix that also occurs ending before the last token, its first such occurrence, and the tokens
    after it, by trying every length and start."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length :]
        for start in range(0, n - length):  # ends at start + length - 1 <= n - 2
            if tokens[start : start + length] == suffix:
                if length < min_match:
                    return None
                return Match(tokens[start + length : start + length + max_draft], length)
    return None


@pytest.mark.parametrize("alphabet", [2, 3, 8, 50])
def test_index_is_the_brute_force_search(alphabet):
    """After every token of random sequences (small alphabets: long, nested repeats), the proposal is the brute
    force's, also when the tokens come in chunks."""
    rng = random.Random(alphabet)
    checked = fired = 0
    for trial in range(12):
        config = LookupConfig(min_match=rng.choice([1, 2, 3]), max_draft=rng.choice([1, 4, 9]))
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 120))]
        if trial % 3 == 0:  # a copied stretch, as in an edit
            seq += seq[: rng.randrange(1, len(seq) + 1)]
        split = rng.randrange(0, len(seq) + 1)
        index = LookupIndex(config, seq[:split])
        for i in range(split, len(seq) + 1):
            if i > split:
                index.extend(seq[i - 1 : i])
            if i == 0:
                continue
            expected = brute_force(seq[:i], config.min_match, config.max_draft)
            assert index.propose() == expected, (seq[:i], config)
            checked += 1
            fired += expected is not None
    assert 20 < fired < checked  # both outcomes were tested


def test_proposal_is_limited_and_states_stay_linear():
    index = LookupIndex(LookupConfig(min_match=2, max_draft=10), [5, 6, 7, 8, 9, 5, 6])
    assert index.propose() == Match([7, 8, 9, 5, 6], 2)  # only what is known after the match
    assert index.propose(limit=2) == Match([7, 8], 2)
    assert index.propose(limit=0) is None
    index.extend([7, 8, 9])
    assert index.propose() == Match([5, 6, 7, 8, 9], 5)  # the match grew with the copy
    long = LookupIndex(LookupConfig(1, 4), [random.Random(0).randrange(4) for _ in range(5000)])
    assert len(long.length) <= 2 * 5000  # a suffix automaton has fewer than 2n states


def test_modes_and_bad_settings():
    assert copyspec_config("off") is None and copyspec_config(None) is None
    assert copyspec_config("auto") == MODES["auto"]
    assert MODES["conservative"].min_match > MODES["auto"].min_match > MODES["aggressive"].min_match
    with pytest.raises(ValueError, match="copyspec mode must be one of"):
        copyspec_config("always")
    with pytest.raises(ValueError, match="min_match must be an integer >= 1"):
        LookupConfig(0, 4)
    with pytest.raises(ValueError, match="max_draft must be an integer >= 1"):
        LookupConfig(2, 0)


def test_branch_tree_shares_the_common_prefix():
    tree = branch_tree(100, [1, 2, 3, 4], [1, 2, 9, 8])
    assert tree.tokens == [100, 1, 2, 3, 4, 9, 8]
    assert tree.parents == [-1, 0, 1, 2, 3, 2, 5]
    assert tree.depths == [0, 1, 2, 3, 4, 3, 4]
    assert branch_tree(100, [1, 2], [1, 2]).tokens == [100, 1, 2]  # the same path: nothing added
    assert branch_tree(100, [1], [7, 1]).parents == [-1, 0, 0, 2]
    grafted, path = graft(Tree([0, 5, 6], [-1, 0, 0], [0, 1, 1]), [6, 7])
    assert path == [2, 3] and grafted.parents == [-1, 0, 0, 2]
    # the walk follows the lookup branch where the target's choices do
    assert tree.walk([1, 2, 9, 0, 0, 8, 42]) == ([0, 1, 2, 5, 6], 42)


def test_acceptance_is_tracked_by_match_length():
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 16, 31, 32, 1000)] == [0, 1, 1, 2, 2, 3, 4, 4, 5, 5]
    assert leading_matches([1, 2, 3], [1, 2, 4, 5]) == 2
    spec = CopySpec(LookupConfig(2, 4), [], trees=True)
    long, short = Match([1, 2, 3, 4], 20), Match([1, 2, 3, 4], 2)
    assert spec.acceptance(long) == spec.acceptance(short) == [0.5] * 4  # neutral, nothing seen
    for _ in range(10):
        spec.observe(long, [1, 2, 3, 4, 5], [1, 9, 9])
        spec.observe(short, [7, 7], [7, 9, 9])
    # the long class (16-31): 10 full acceptances, decayed by 0.8, shrunk by one observation toward the first
    # position of the class below it (8-15, unseen: 2-3's, 1 of ~5.5 seen accepted) and then the position before
    seen = sum(0.8**k for k in range(10))
    first_short = 0.5 / (seen + 1.0)  # 2-3: every first draft rejected, shrunk toward the neutral 0.5
    want, previous = [], first_short
    for _ in range(4):
        previous = (seen + previous) / (seen + 1.0)
        want.append(previous)
    assert spec.acceptance(short)[0] == pytest.approx(first_short)
    assert spec.acceptance(long) == pytest.approx(want)
    assert spec.expected(long) > 3.5 and spec.expected(short) < 1.2
    assert spec.lookup_wins(long) and not spec.lookup_wins(short)
    assert spec.drafter_tokens == pytest.approx(1.5 * 0.8**20 + 2.0 * (1 - 0.8**20))  # 1 draft and the bonus
    # a class not yet seen (32 and more) starts where the next shorter seen one is
    assert spec.acceptance(Match([1], 40)) == pytest.approx(want)


def test_a_match_left_unverified_is_scored_by_the_tokens_committed():
    """`watch`: the tokens committed after a match score its drafts as a cycle verifying it would have, one match
    at a time; a verified lookup's outcome replaces the watched one's."""
    spec = CopySpec(LookupConfig(2, 8), [1, 2, 3, 4, 5, 6, 1, 2], trees=True)
    match = spec.propose()
    assert match == Match([3, 4, 5, 6, 1, 2], 2)
    spec.watch(match)
    spec.watch(Match([9, 9], 2))  # one at a time: ignored
    spec.commit([3])
    spec.commit([4, 7, 8])  # 3 and 4 accepted, 5 rejected: the rest of the commit is not scored
    counts = spec.lookups[match_bucket(2)]
    assert counts.seen[:4] == [1.0, 1.0, 1.0, 0.0] and counts.hits[:4] == [1.0, 1.0, 0.0, 0.0]
    assert spec.shadow is None and spec.index.tokens[-4:] == [3, 4, 7, 8]  # indexed all the same
    spec.watch(Match([5, 6], 2))
    spec.observe(Match([5, 9], 2), [5, 6], None)  # a lookup verified: the watched one is dropped
    spec.commit([5, 6])
    assert spec.shadow is None and counts.seen[:2] == [1.8, 1.8] and counts.hits[:2] == [1.8, 0.8]


# -- lossless with lookups firing ---------------------------------------------------------------------------------


def repeating_prompts(model, tokenizer, n: int = 3) -> list[list[int]]:
    """Prompts that repeat themselves: p, the target's own greedy answer to p, then p again; the lookup of the last
    p proposes that answer (which the target, in its new context, may or may not give again)."""
    out = []
    for p in prompts(n, seed=5):
        answer = generate(model, tokenizer, p, None, verify_mode="off", max_tokens=40, eos_token_ids=[]).tokens
        out.append(p + answer + p)
    return out


MODELS = {
    "qwen3": lambda: make_target("qwen3", seed=1),
    "llama": lambda: make_target("llama", seed=1),
    "hybrid": lambda: make_hybrid("qwen3_5"),
}


@pytest.mark.parametrize("arch", list(MODELS))
def test_greedy_identical_to_mlx_lm_with_lookups(arch, tokenizer, monkeypatch):
    """Every verify mode the target runs, copy drafts on (from matches of one token: they fire most), is token for token
    mlx-lm's greedy generation; lookups were verified in each mode, and won cycles. The spoiled oracle checks on every
    pass that the drafter is given the features of exactly the tokens committed since its last pass (a lookup
    verified alone skips the drafter)."""
    decide_on(monkeypatch, COSTS)
    model = MODELS[arch]()
    modes = ["dflash", "adaptive"] + ([] if arch == "hybrid" else ["ddtree"])
    fired, won = dict.fromkeys(modes, 0), 0
    for i, prompt in enumerate(repeating_prompts(model, tokenizer)):
        theirs = [t for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(40))]
        for mode in modes:
            drafter = (
                make_oracle(model, prompt, block_size=8, spoil_seed=i)
                if mode != "ddtree"
                else make_drafter(model, block_size=8, seed=7)
            )
            records = list(
                stream_cycles(
                    model,
                    tokenizer,
                    prompt,
                    drafter,
                    verify_mode=mode,
                    max_tokens=40,
                    eos_token_ids=[],
                    copyspec_mode=LookupConfig(1, 8),
                    **({"tree_budget": 4} if mode == "ddtree" else {}),
                )
            )
            assert [t for r in records for t in r.tokens] == theirs, f"{arch} prompt {i} {mode}"
            result = summarize(records, drafter)
            assert result.lookup_tokens == sum(r.accepted for r in records if r.branch == "lookup")
            fired[mode] += sum(r.branch is not None for r in records)
            won += result.lookup_tokens
    assert all(fired.values()) and won > 0, (fired, won)


def test_lookup_off_is_todays_cycle(tokenizer):
    model = make_target("qwen3", seed=1)
    prompt = repeating_prompts(model, tokenizer, 1)[0]
    oracle = make_oracle(model, prompt, block_size=8, spoil_seed=3)
    records = list(
        stream_cycles(
            model, tokenizer, prompt, oracle, verify_mode="dflash", max_tokens=30, eos_token_ids=[], copyspec_mode="off"
        )
    )
    assert all(r.branch is None for r in records) and oracle.calls == len(records) - 1
    with pytest.raises(ValueError, match="copyspec mode must be one of"):
        generate(model, tokenizer, prompt, oracle, copyspec_mode="on")


# -- T > 0: the target's distribution with lookup branches ------------------------------------------------------


def sample_with_lookups(target, drafter, params, seed, n=N):
    """n draws of the 3 tokens after PROMPT from `dflash_steps` (block 3), looking up matches of one token (on 4
    token ids nearly every cycle has one); also the cycles' branches."""
    mx.random.seed(seed)
    counts, branches = Counter(), Counter()
    for _ in range(n):
        steps = dflash_steps(
            target,
            drafter,
            mx.array(PROMPT, mx.uint32),
            params,
            FixedBlocks(3),
            max_tokens=3,
            copyspec=LookupConfig(min_match=1, max_draft=2),
        )
        tokens = []
        for step in steps:
            tokens += step.tokens
            branches[step.branch] += 1
            if len(tokens) >= 3:
                break
        steps.close()
        counts[tuple(tokens[:3])] += 1
    return counts, branches


@pytest.fixture(scope="module")
def sampling_pairs():
    llama = make_target("llama", vocab=V, seed=21)
    hybrid = make_hybrid("qwen3_5", vocab=V, seed=21)
    return {
        name: (model, make_drafter(model, block_size=4, seed=5, output_multiplier=4.0))
        for name, model in (("llama", llama), ("hybrid", hybrid))
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "hybrid"])
def test_sampling_with_lookups_follows_mlx_lm(name, sampling_pairs):
    """Two branches in one tree pass (llama) and a lookup verified alone as a one-hot proposal (the hybrid)."""
    model, drafter = sampling_pairs[name]
    params = SETTINGS["t0.7-topp0.9"]
    counts, branches = sample_with_lookups(bind_drafter(drafter, model), drafter, params, seed=2)
    assert_follows_mlx_lm(model, counts, params)
    assert branches["lookup"] > N // 10, branches  # lookups were verified, and won
    assert name == "hybrid" or branches["drafter"] > 0


def _lookup_as_sampled(tokens):
    """The mutation: a lookup's drafts taken as drawn from a spread distribution (uniform over the vocabulary)
    instead of the point mass they are."""
    ids = mx.array(list(tokens), dtype=mx.uint32)
    return Proposal(
        ids,
        mx.broadcast_to(mx.arange(V, dtype=mx.uint32), (ids.size, V)),
        mx.full((ids.size, V), 1.0 / V),
        mx.array(True),
    )


@pytest.mark.slow
def test_the_test_catches_a_lookup_taken_as_sampled(sampling_pairs, monkeypatch):
    model, drafter = sampling_pairs["hybrid"]
    params = SETTINGS["t1"]
    monkeypatch.setattr(decode, "one_hot_proposal", _lookup_as_sampled)
    counts, _ = sample_with_lookups(bind_drafter(drafter, model), drafter, params, seed=2, n=N_BROKEN)
    stat, critical = chi_square(counts, exact_distribution(model, params), N_BROKEN)
    assert stat > critical, f"a lookup taken as sampled passed: chi2 {stat:.1f} < {critical:.1f}"


def test_cli_copyspec_mode(tiny_pair, capsys):
    """`dflash2 generate --copyspec-mode`: every mode gives plain decoding's tokens, on a prompt that repeats
    itself; the JSON counts the drafts lookups gave."""
    import json

    from dflash2_apps.cli import main

    target, drafter = tiny_pair
    words = " ".join(f"w{i}" for i in (5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 7, 5, 9))
    common = ["generate", "--model", str(target), "--prompt", words, "--max-tokens", "20", "--json"]
    assert main(common + ["--verify-mode", "off"]) == 0
    plain = json.loads(capsys.readouterr().out)["tokens"]
    for mode in ("auto", "conservative", "aggressive", "off"):
        assert main(common + ["--draft-model", str(drafter), "--verify-mode", "dflash", "--copyspec-mode", mode]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["tokens"] == plain, mode
        assert out["lookup_tokens"] <= sum(out["accepted"]) and (mode != "off" or out["lookup_cycles"] == 0)
