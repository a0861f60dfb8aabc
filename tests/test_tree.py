"""Tree verification (`--verify-mode ddtree`): the tree pass is each path fed linearly, the best-first tree is
the brute-force most likely prefixes, greedy output is plain decoding's, and at T > 0 the target's distribution."""

from __future__ import annotations

import importlib
import itertools
import json
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    ARCHS,
    N_BROKEN,
    PROMPT,
    SETTINGS,
    N,
    SiblingOracle,
    V,
    chi_square,
    drafter_config,
    exact_distribution,
    make_dflash2_drafter,
    make_drafter,
    make_hybrid,
    make_target,
    prompts,
    run,
)

import dflash2_mlx.decode as decode
from dflash2_mlx import generate
from dflash2_mlx.costs import CostModel
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import probabilities
from dflash2_mlx.target import Target
from dflash2_mlx.tree import Tree, build_tree, default_budget, keep_path_first, tree_attention

generate_module = importlib.import_module("dflash2_mlx.generate")  # the package exports a function of that name

BUDGETS = (1, 4, 16, 32)


# -- the tree pass --------------------------------------------------------------------------------------------

# anchor 0; 1, 2, 3 its children; 4 under 1; 5, 6 under 4; 7 under 2; 8 under 5
HAND_TREE = [-1, 0, 0, 0, 1, 4, 4, 2, 5]


def hand_tree(tokens) -> Tree:
    depths = []
    for p in HAND_TREE:
        depths.append(0 if p < 0 else depths[p] + 1)
    return Tree(list(tokens), list(HAND_TREE), depths)


def path_to(tree: Tree, i: int) -> list[int]:
    path = [i]
    while tree.parents[path[-1]] >= 0:
        path.append(tree.parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("context", [5, 23])  # llama_swa: within its window of 8, and far past it
def test_tree_pass_is_each_path_fed_linearly(arch, context):
    """Every node's logits and features equal those of its path fed after the context as plain tokens (no tree:
    mlx-lm's own causal forward), and after keeping one path the cache continues exactly as plain decoding."""
    model = make_target(arch, seed=4)
    target = Target(model, (1, 3))
    rng = np.random.default_rng(context)
    ctx = rng.integers(6, 250, size=context).tolist()
    tree = hand_tree(rng.integers(6, 250, size=len(HAND_TREE)).tolist())
    with target.capture() as tap:
        cache = target.make_cache()
        tap.prefill(mx.array(ctx), cache)
        with tree_attention(target, cache, tree):
            verified = tap.verify(mx.array(tree.tokens), cache)
        for i in range(tree.size):
            path = [tree.tokens[j] for j in path_to(tree, i)]
            logits, features = tap.forward(mx.array(ctx + path), target.make_cache())
            np.testing.assert_allclose(np.array(verified.logits[i]), np.array(logits[-1]), atol=2e-4, rtol=1e-4)
            np.testing.assert_allclose(np.array(verified.features[i]), np.array(features[-1]), atol=2e-4, rtol=1e-4)
        keep = path_to(tree, 8)  # 0 1 4 5 8: rows out of order in the pass
        keep_path_first(cache, tree.size, keep)
        tap.rollback(cache, verified, len(keep))
        nxt = [7, 9, 11]
        after, _ = tap.forward(mx.array(nxt), cache)
        plain, _ = tap.forward(mx.array(ctx + [tree.tokens[j] for j in keep] + nxt), target.make_cache())
        np.testing.assert_allclose(np.array(after), np.array(plain[-3:]), atol=2e-4, rtol=1e-4)


def test_best_first_tree_is_the_most_likely_prefixes():
    """Brute force: the budget's most probable draft prefixes (products of q along the lattice), ranked over
    every prefix of every length; the tree holds exactly those, each as one node under its parent."""
    rng = np.random.default_rng(0)
    T, k = 4, 3
    candidates = rng.permutation(100)[: T * k].reshape(T, k)  # ids unique in the lattice: a prefix names its nodes
    scores = rng.normal(size=(T, k, k)) * 2
    scores[0] = scores[0, 0]  # row 0: the anchor's row, whatever the predecessor
    logq = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
    prefixes = {}
    for depth in range(1, T + 1):
        for idx in itertools.product(range(k), repeat=depth):
            lp = logq[0, 0, idx[0]] + sum(logq[t, idx[t - 1], idx[t]] for t in range(1, depth))
            prefixes[tuple(int(candidates[t, b]) for t, b in enumerate(idx))] = lp
    ranked = sorted(prefixes, key=prefixes.get, reverse=True)
    for budget in (1, 2, 5, 13, 40, len(ranked), len(ranked) + 10):
        tree = build_tree(99, candidates, logq, budget)
        assert tree.size == 1 + min(budget, len(ranked))
        nodes = {tuple(tree.tokens[j] for j in path_to(tree, i)[1:]) for i in range(1, tree.size)}
        assert nodes == set(ranked[:budget])
        assert all(p < i for i, p in enumerate(tree.parents))
    assert build_tree(99, candidates, logq, 0) == Tree([99], [-1], [0])


def test_walk_follows_the_choices():
    tree = hand_tree([50, 10, 11, 12, 13, 14, 15, 16, 17])
    choices = {0: 10, 1: 13, 4: 15, 6: 99}  # anchor -> 1 -> 4 -> 6 (the second child), then 99 no child holds
    assert tree.walk([choices.get(i, -1) for i in range(9)]) == ([0, 1, 4, 6], 99)
    assert tree.walk([12] + [0] * 8) == ([0, 3], 0)
    assert tree.walk([7] * 9) == ([0], 7)


# -- greedy: plain decoding's tokens ----------------------------------------------------------------------------


def sibling_oracle(model, prompt, block_size, seed, right_for=None):
    oracle = SiblingOracle(drafter_config(model, block_size=block_size), model, prompt, seed, right_for)
    bind_drafter(oracle, model)
    return oracle


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tree_identical_to_plain(arch, tokenizer):
    """Budgets 1, 4, 16, 32 and block sizes 2, 5, 8 (tree depth up to 7), with the sibling oracle (every
    acceptance length, paths through later siblings) and a random DFlash 2 drafter; each pair of budget and
    size on one of two prompts (of different lengths), in turn."""
    model = make_target(arch, seed=ARCHS.index(arch))
    random_drafter = make_dflash2_drafter(model, block_size=8, seed=7)
    for i, prompt in enumerate(prompts(2, seed=10 + ARCHS.index(arch))):
        max_tokens = 25 + 9 * i
        plain, _, _ = run(model, tokenizer, prompt, max_tokens=max_tokens, eos_token_ids=[])
        for budget, B in list(itertools.product(BUDGETS, (2, 5, 8)))[i::2]:
            kw = dict(verify_mode="ddtree", tree_budget=budget, block_size=B, max_tokens=max_tokens, eos_token_ids=[])
            oracle = sibling_oracle(model, prompt, 8, seed=budget * B + i)
            spec, accepted, _ = run(model, tokenizer, prompt, oracle, **kw)
            assert spec == plain, f"{arch} prompt {i} budget {budget} B={B} (oracle)"
            assert all(0 <= a <= min(B - 1, budget) for a in accepted)
            assert oracle.calls == len(accepted)
            spec, _, _ = run(model, tokenizer, prompt, random_drafter, **kw)
            assert spec == plain, f"{arch} prompt {i} budget {budget} B={B} (random DFlash 2)"


def test_siblings_raise_acceptance_over_the_linear_path(tokenizer):
    """An oracle whose every first choice is wrong and every runner-up right: linear mode accepts nothing;
    a tree of 16 holds the runner-up path of depth 3 (log q -6; only 13 prefixes are likelier), so every
    cycle accepts all 3 drafts."""
    model = make_target("qwen3", seed=8)
    prompt = prompts(1, seed=8)[0]
    kw = dict(block_size=4, max_tokens=37, eos_token_ids=[], copyspec_mode="off")  # 9 cycles of 4, or 12 of 3
    linear = generate(model, tokenizer, prompt, sibling_oracle(model, prompt, 4, None, 0), verify_mode="dflash", **kw)
    tree = generate(
        model, tokenizer, prompt, sibling_oracle(model, prompt, 4, None, 0), verify_mode="ddtree", tree_budget=16, **kw
    )
    small = generate(
        model, tokenizer, prompt, sibling_oracle(model, prompt, 4, None, 0), verify_mode="ddtree", tree_budget=13, **kw
    )
    assert tree.tokens == linear.tokens == small.tokens
    assert set(linear.accepted) == {0} and tree.accepted == [3] * 9
    assert small.accepted == [2] * 12  # 13 nodes: the runner-up path up to depth 2 only


def test_eos_inside_an_accepted_branch(tokenizer):
    model = make_target("qwen3", seed=5)
    prompt = prompts(1, seed=5)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=40, eos_token_ids=[])
    for stop_at in (3, 10, 17):
        eos = plain[stop_at]
        expected = plain[: plain.index(eos) + 1]
        spec, _, finish = run(
            model,
            tokenizer,
            prompt,
            sibling_oracle(model, prompt, 8, stop_at),
            verify_mode="ddtree",
            tree_budget=16,
            max_tokens=40,
            eos_token_ids=[eos],
        )
        assert spec == expected and finish == "stop"


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9, 13, 30])
def test_max_tokens_exact_inside_a_tree(max_tokens, tokenizer):
    model = make_target("llama_swa", seed=2)
    prompt = prompts(1, seed=2)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=max_tokens, eos_token_ids=[])
    spec, accepted, finish = run(
        model,
        tokenizer,
        prompt,
        sibling_oracle(model, prompt, 8, 1),
        verify_mode="ddtree",
        tree_budget=32,
        max_tokens=max_tokens,
        eos_token_ids=[],
    )
    assert spec == plain and len(spec) == max_tokens and finish == "length"
    committed = [1 + sum(a + 1 for a in accepted[:k]) for k in range(len(accepted) + 1)]
    assert committed[-1] >= max_tokens and (not accepted or committed[-2] < max_tokens)


def test_non_finite_drafts_commit_the_targets_token(tokenizer):
    model = make_target("qwen3", seed=3)
    drafter = make_drafter(model, block_size=4, output_multiplier=float("nan"))
    prompt = prompts(1, seed=3)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=12, eos_token_ids=[])
    with pytest.warns(RuntimeWarning, match="non-finite"):
        r = generate(model, tokenizer, prompt, drafter, verify_mode="ddtree", max_tokens=12, eos_token_ids=[])
    assert r.tokens == plain and set(r.accepted) == {0} and r.draft_failures == r.cycles


def test_refusals(tokenizer):
    model = make_target("qwen3")
    drafter = make_drafter(model, block_size=4)
    with pytest.raises(ValueError, match="tree_budget must be an integer >= 1"):
        run(model, tokenizer, [7, 8], drafter, verify_mode="ddtree", tree_budget=0)
    with pytest.raises(ValueError, match="applies to verify mode 'ddtree'"):
        run(model, tokenizer, [7, 8], drafter, verify_mode="dflash", tree_budget=4)
    with pytest.raises(ValueError, match="leave the walk"):
        run(model, tokenizer, [7, 8], make_dflash2_drafter(model, block_size=4), verify_mode="ddtree", walk="viterbi")
    hybrid = make_hybrid("qwen3_5")
    with pytest.raises(ValueError, match="does not support hybrid targets.*--verify-mode dflash or adaptive"):
        run(hybrid, tokenizer, [7, 8], make_drafter(hybrid, block_size=4), verify_mode="ddtree")


# -- T > 0: the target's distribution ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    model = make_target("llama", vocab=V, seed=21)
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)  # sharp, often wrong
    return model, drafter, bind_drafter(drafter, model)


def sample_tree_sequences(target, drafter, params, seed, budget, n=N) -> tuple[Counter, list[int]]:
    mx.random.seed(seed)
    counts, accepted = Counter(), []
    for _ in range(n):
        steps = decode.tree_steps(target, drafter, mx.array(PROMPT, dtype=mx.uint32), params, 4, budget, max_tokens=3)
        tokens = []
        for step in steps:
            tokens += step.tokens
            accepted += [] if step.accepted is None else [step.accepted]
            if len(tokens) >= 3:
                break
        steps.close()
        counts[tuple(tokens[:3])] += 1
    return counts, accepted


@pytest.mark.slow
def test_tree_sampling_follows_mlx_lm(pair):
    """One setting through the tree loop: the acceptance is `Tree.walk` of one `sample` per node, and `sample`
    is mlx-lm's sampler at every setting (test_sampling.py)."""
    model, drafter, target = pair
    params = SETTINGS["t0.7-topp0.9"]
    counts, accepted = sample_tree_sequences(target, drafter, params, seed=1, budget=6)
    expected = exact_distribution(model, params)
    stat, critical = chi_square(counts, expected, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not mlx-lm's sampling distribution"
    assert set(counts) <= {k for k, p in expected.items() if p > 0}
    assert 0 < np.mean(accepted) < 2  # drafts both kept and rejected


@pytest.mark.slow
def test_dflash2_tree_sampling_follows_mlx_lm():
    """Trees from the selector's lattice (top-3 of 4 tokens, pair scores shaping the branches)."""
    model = make_target("llama", vocab=V, seed=21)
    drafter = make_dflash2_drafter(model, block_size=4, seed=5, output_multiplier=4.0, selector_top_k=3)
    params = SETTINGS["t0.7-topp0.9"]
    counts, accepted = sample_tree_sequences(bind_drafter(drafter, model), drafter, params, seed=3, budget=5)
    stat, critical = chi_square(counts, exact_distribution(model, params), N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not mlx-lm's sampling distribution"
    assert 0 < np.mean(accepted) < 2


def _siblings_without_residual(tree, target_logits, params):
    """Recursive rejection that forgets to take the rejected siblings out of the residual: sibling i is kept
    with probability p(x_i) (not r_i(x_i)), and the bonus is drawn from the whole p."""
    p = np.array(probabilities(target_logits, params), dtype=np.float64)
    u = np.array(mx.random.uniform(shape=(tree.size, len(tree.tokens) + 1)))
    path = [0]
    while True:
        node = path[-1]
        children = [i for i, parent in enumerate(tree.parents) if parent == node]
        kept = next((c for j, c in enumerate(children) if u[node, j] < p[node, tree.tokens[c]]), None)
        if kept is None:
            bonus = int(np.searchsorted(np.cumsum(p[node]), u[node, -1] * p[node].sum()))
            return path, min(bonus, p.shape[-1] - 1)
        path.append(kept)


@pytest.mark.slow
def test_the_test_catches_a_broken_sibling_rule(pair, monkeypatch):
    model, drafter, target = pair
    params = SETTINGS["t1"]
    monkeypatch.setattr(decode, "accept_tree", _siblings_without_residual)
    counts, _ = sample_tree_sequences(target, drafter, params, seed=1, budget=6, n=N_BROKEN)
    stat, critical = chi_square(counts, exact_distribution(model, params), N_BROKEN)
    assert stat > critical, f"a broken sibling rule passed: chi2 {stat:.1f} < {critical:.1f}"


def test_cli_ddtree(tiny_pair, capsys):
    from dflash2_apps.cli import main

    target, drafter = tiny_pair
    common = ["generate", "--model", str(target), "--prompt", "w1 w2 w3", "--max-tokens", "15"]
    assert main(common + ["--json", "--verify-mode", "off"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert (
        main(common + ["--json", "--draft-model", str(drafter), "--verify-mode", "ddtree", "--tree-budget", "4"]) == 0
    )
    tree = json.loads(capsys.readouterr().out)
    assert tree["tokens"] == plain["tokens"] and tree["verify_mode"] == "ddtree"
    assert tree["tree_budget"] == 4 and tree["block_size"] == 8 and tree["cycles"] > 0
    assert main(common + ["--json", "--draft-model", str(drafter), "--verify-mode", "ddtree"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["tokens"] == plain["tokens"] and 7 <= default["tree_budget"] <= 32  # from the measured costs


# -- the default budget: the cost model's rule ------------------------------------------------------------------


def curve(verify_ms: list[float], draft_ms: float = 10.0, B: int = 8) -> CostModel:
    return CostModel([v / 1000 for v in verify_ms], [draft_ms / 1000] * (B - 1))


@pytest.mark.parametrize(
    "verify_ms, budget",
    [
        ([100.0] * 33, 32),  # a flat curve: the whole 32 nodes
        ([100.0 + 10 * n for n in range(33)], 8),  # each token 10% of a step: one node past the linear block's 7
        ([100.0 + 40 * n for n in range(33)], 7),  # each token 40% of a step: nothing past the linear block's 7
        # linear cycle = 10 + 170 ms, limit 198: 13 tokens (12 nodes) cost 10 + 185, 14 tokens 10 + 200
        ([100.0 + 10 * n for n in range(8)] + [185.0] * 5 + [200.0] * 20, 12),
        ([100.0] * 8, 7),  # a curve measured only to the block: no tree larger than the linear block
    ],
)
def test_default_budget_is_the_most_nodes_within_the_slack(verify_ms, budget):
    assert default_budget(curve(verify_ms), 8) == budget
    # brute force of the rule: most n with draft + verify(n + 1 tokens) <= 1.1 x (draft + verify(8 tokens))
    limit = 1.1 * (10.0 + verify_ms[7])
    assert budget == max([7] + [n for n in range(7, min(33, len(verify_ms))) if 10.0 + verify_ms[n] <= limit + 1e-9])


def test_ddtree_without_a_budget_takes_the_cost_models(tokenizer, monkeypatch):
    """Left unset, the budget is `default_budget` of the costs measured for block B with the verify curve to
    33 tokens; the trees then never exceed it, and the output is still plain decoding's."""
    model = make_target("qwen3", seed=4)
    drafter = make_dflash2_drafter(model, block_size=6, seed=4)
    asked = []

    def costs(target, d, B, verify_max=None):
        asked.append((B, verify_max))
        return curve([100.0 + 5 * n for n in range(6)] + [130.0] * 4 + [400.0] * 23, B=6)  # 9 nodes fit

    monkeypatch.setattr(generate_module, "load_or_measure_costs", costs)
    sizes = []
    build = decode.build_tree
    monkeypatch.setattr(decode, "build_tree", lambda *a: sizes.append(a[-1]) or build(*a))
    prompt = prompts(1, seed=4)[0]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=30, eos_token_ids=[])
    r = generate(model, tokenizer, prompt, drafter, verify_mode="ddtree", max_tokens=30, eos_token_ids=[])
    assert asked == [(6, 33)] and r.tree_budget == 9 and set(sizes) == {9} and r.tokens == plain


# -- teacher-forced simulation --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["v1", "dflash2"])
def test_simulated_acceptance_is_what_decoding_accepts(kind, tokenizer):
    """On a target with 16 tokens (random drafters then accept often, through several siblings), the simulated
    acceptance at each anchor a real generation visits is the real cycle's, for the tree and the linear path."""
    from dflash2_mlx.train.data import Sample
    from dflash2_mlx.train.tree_eval import simulate_tree_acceptance

    model = make_target("qwen3", vocab=16, seed=6)
    make = make_drafter if kind == "v1" else make_dflash2_drafter
    # flat draft logits: wide trees, so acceptance goes through later siblings
    drafter = make(
        model,
        block_size=5,
        seed=2,
        mask_token_id=15,
        output_multiplier=0.05,
        **({} if kind == "v1" else dict(selector_top_k=8)),
    )
    prompt, n = [3, 9, 4, 1, 7], 60
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=n, eos_token_ids=[])
    sample = Sample("s", np.array(prompt + plain, np.int32), len(prompt), True)
    budgets = [1, 4, 16]
    sim = simulate_tree_acceptance(Target(model, drafter.config.target_layer_ids), drafter, [sample], budgets)
    assert sim["blocks"] == n - 5 + 1
    modes = [("linear", dict(verify_mode="dflash"))] + [(b, dict(verify_mode="ddtree", tree_budget=b)) for b in budgets]
    for key, kw in modes:
        spec, accepted, _ = run(
            model, tokenizer, prompt, drafter, block_size=5, max_tokens=n, eos_token_ids=[], copyspec_mode="off", **kw
        )  # the drafter's acceptance alone
        assert spec == plain
        simulated = sim["linear"] if key == "linear" else sim["tree"][key]
        position, checked = 0, 0
        for a in accepted:
            if position < len(simulated):
                assert a == simulated[position], (key, position)
                checked += 1
            position += a + 1
        assert checked >= 8
    taus = [np.mean(sim["tree"][b]) + 1 for b in budgets]
    assert taus[0] < taus[1] < taus[2] and np.mean(sim["linear"]) + 1 < taus[2], taus


@pytest.mark.slow
def test_bench_ddtree_rows_and_tree_sim(tiny_pair, tokenizer, tmp_path, capsys):
    from mlx_lm.utils import load_model

    from dflash2_apps.cli import main
    from dflash2_mlx.train.data import Sample, write_shard

    target, drafter = tiny_pair
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--quick",
                "--block-sizes",
                "4",
                "--tree-budgets",
                "2,8,auto",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    report = json.loads((tmp_path / "b.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    for budget in (2, 8, "auto"):
        row = rows[f"drafter B=4 ddtree {budget}"]
        assert row["kind"] == "ddtree" and row["lossless"] is True and row["cycles"] > 0
    # the auto row's cost curve: verify to 33 tokens, and the budget the rule picks from it
    tree_curve = next(c for c in report["costs"] if c["tree_budget"] is not None)
    steps = tree_curve["verify_steps"]
    assert len(steps) == 33 and tree_curve["block_size"] == 4
    assert tree_curve["tree_budget"] == default_budget(CostModel(steps, tree_curve["draft_steps"]), 4)
    assert "default tree budget at B=4" in capsys.readouterr().out
    # the simulation reads the held-out split of a data folder: greedy responses of this target
    model, _ = load_model(target)
    prompt = [3, 9, 4, 1, 7]
    plain, _, _ = run(model, tokenizer, prompt, max_tokens=30, eos_token_ids=[])
    write_shard(
        tmp_path / "shard-00000.npz",
        [
            Sample("a", np.array(prompt + plain, np.int32), 5, True),
            Sample("b", np.array(prompt + plain, np.int32), 5, False),
        ],
    )
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "--model",
                str(target),
                "--draft-model",
                str(drafter),
                "--tree-sim",
                str(tmp_path),
                "--tree-budgets",
                "1,4",
                "--markdown",
                str(tmp_path / "sim.md"),
            ]
        )
        == 0
    )
    table = (tmp_path / "sim.md").read_text()
    assert table.startswith(f"Made by `dflash2 bench --model {target} ") and "--tree-sim" in table.split("\n")[0]
    assert "teacher-forced tau on 1 held-out samples" in table and "| tree 1 | tree 4 |" in table
    assert "| drafter | 8 | 23 | " in table  # 30 response tokens, anchors with 7 after them


def test_tree_mode_leaves_the_model_as_it_was(tokenizer):
    model = make_target("qwen3", seed=1)
    ropes = [layer.self_attn.rope for layer in model.layers]
    before = model(mx.array([[5, 6, 7]]))
    spec, _, _ = run(
        model,
        tokenizer,
        [5, 6, 7],
        make_drafter(model, block_size=4),
        verify_mode="ddtree",
        max_tokens=10,
        eos_token_ids=[],
    )
    assert len(spec) == 10
    assert all(layer.self_attn.rope is rope for layer, rope in zip(model.layers, ropes))
    assert all("rope" not in layer.self_attn.__dict__ for layer in model.layers)
    np.testing.assert_array_equal(np.array(model(mx.array([[5, 6, 7]]))), np.array(before))


def test_a_model_that_ignores_the_tree_mask_is_refused():
    """A model whose forward never asks its caches for a mask would verify a causal chain: refused, loudly."""
    model = make_target("qwen3", seed=1)
    target = Target(model, (1, 3))
    tree = hand_tree(range(10, 10 + len(HAND_TREE)))
    with target.capture() as tap:
        cache = target.make_cache()
        tap.prefill(mx.array([5, 6, 7]), cache)
        with pytest.raises(RuntimeError, match="did not take the tree mask"):
            with tree_attention(target, cache, tree):
                for c in cache:  # the causal mask such a model builds on its own
                    c.make_mask = lambda N, **kw: "causal"
                tap.verify(mx.array(tree.tokens), cache)
    assert all("make_mask" not in c.__dict__ for c in cache)
