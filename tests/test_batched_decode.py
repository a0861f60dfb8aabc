"""Speculation inside the batch (`batched.py`): every request of a batch gets, at T = 0, exactly mlx-lm's greedy
tokens for its prompt alone, whatever the others accept; at T > 0 a request inside a batch follows mlx-lm's
sampling law; a rollback of the wrong request's rows is caught; targets whose caches it cannot roll back per row
are refused."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import pytest
from helpers import (
    PROMPT,
    N,
    V,
    assert_follows_mlx_lm,
    make_dflash2_drafter,
    make_drafter,
    make_hybrid,
    make_oracle,
    make_target,
)
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from dflash2_mlx import batched
from dflash2_mlx.batched import BatchedDecoder, batch_refusal
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.lookup import LookupConfig
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target

# prompts of different lengths (1 to 30 tokens), one repeating itself (copy drafts find it)
PROMPTS = [[7, 8, 9], list(range(10, 40)), [50] * 5 + [60, 61], [200], [5, 6, 7, 8] * 4]
N_TOKENS = 20


def alone(model, prompt: list[int], n: int = N_TOKENS) -> list[int]:
    """mlx-lm's greedy tokens for `prompt` alone."""
    return [t for (t, _), _ in zip(generate_step(mx.array(prompt), model), range(n))]


def run_batch(target, requests, block_max=6, joins=None, leaves=None, costs=None, n=N_TOKENS, blocks=None):
    """Decode `requests` ((prompt, kwargs of `add`) ...) together until each has n tokens; request i joins after
    `joins[i]` steps (default: at once), and request i leaves after `leaves[i]` steps (its tokens cut there).
    Returns (tokens per request, each request's steps, the decoder)."""
    joins, leaves = joins or {}, leaves or {}
    out, steps, uids = {}, {}, {}
    with BatchedDecoder(target, None, block_max, costs) as decoder:
        count = 0
        while len(out) < len(requests) or any(len(out[i]) < n for i in uids):
            for i, (prompt, kw) in enumerate(requests):
                if i not in out and joins.get(i, 0) <= count:
                    uids[i], first = decoder.add(prompt, SamplingParams(), **kw)
                    out[i], steps[i] = list(first.tokens), []
            for i in [i for i in uids if leaves.get(i) == count or len(out[i]) >= n]:
                decoder.remove(uids.pop(i))
            if uids:
                by_uid = decoder.step(None if blocks is None else {u: blocks for u in uids.values()})
                for i, uid in uids.items():
                    out[i] += by_uid[uid].tokens
                    steps[i].append(by_uid[uid])
            count += 1
    return {i: t[:n] for i, t in out.items()}, steps, decoder


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return make_target(request.param, seed={"qwen3": 0, "llama": 1}[request.param])


def oracle_requests(model, prompts=PROMPTS[:4]):
    """Each prompt with an oracle drafter of its own, spoiled at random: every acceptance length occurs, and each
    oracle checks that the context it is given is the features of its request's committed tokens."""
    oracles = [make_oracle(model, p, block_size=6, spoil_seed=i) for i, p in enumerate(prompts)]
    return Target(model, oracles[0].config.target_layer_ids), [(p, {"drafter": o}) for p, o in zip(prompts, oracles)]


def test_each_request_gets_its_greedy_tokens_alone(model):
    target, requests = oracle_requests(model)
    got, steps, decoder = run_batch(target, requests)
    for i, (prompt, _) in enumerate(requests):
        assert got[i] == alone(model, prompt), f"request {i} (prompt of {len(prompt)})"
    counts = {s.accepted for mine in steps.values() for s in mine}
    assert {0, 5} <= counts and len(counts) >= 4  # none, all and partial acceptances, in the same batch
    assert decoder.batched_cycles > 0


def test_requests_join_and_leave_between_steps(model):
    """One joins after 3 steps, one after 6, one leaves after 2: the rows of those left are theirs."""
    target, requests = oracle_requests(model)
    got, _, _ = run_batch(target, requests, joins={1: 3, 3: 6}, leaves={2: 2})
    for i, (prompt, _) in enumerate(requests):
        want = alone(model, prompt)
        assert got[i] == want[: len(got[i])] and len(got[i]) >= 2, f"request {i}"
    assert len(got[0]) == len(got[1]) == N_TOKENS


class Rotated:
    """The per-request rollback with each request given the next one's kept rows."""

    def __init__(self, real):
        self.real = real

    def __call__(self, cache, kept, fed):
        return self.real(cache, kept[1:] + kept[:1], fed)


def test_rolling_back_the_wrong_requests_rows_fails(model, monkeypatch):
    target, requests = oracle_requests(model)
    monkeypatch.setattr(batched, "roll_back_rows", Rotated(batched.roll_back_rows))
    with pytest.raises(AssertionError):
        got, _, _ = run_batch(target, requests)
        assert all(got[i] == alone(model, p) for i, (p, _) in enumerate(requests))


def test_a_real_drafter_and_copy_drafts_in_one_batch(model):
    """A DFlash 2 drafter (shared, its passes per request) and copy drafts; the lookups find the generation's
    repetitions, and what they accept changes nothing in the tokens."""
    drafter = make_dflash2_drafter(model, block_size=6)
    target = bind_drafter(drafter, model)
    copy = {"copyspec": LookupConfig(min_match=2, max_draft=5)}
    requests = [(p, {"drafter": drafter, **(copy if i % 2 else {})}) for i, p in enumerate(PROMPTS)]
    got, steps, decoder = run_batch(target, requests, n=32)
    for i, (prompt, _) in enumerate(requests):
        assert got[i] == alone(model, prompt, 32), f"request {i}"
    assert decoder.batched_cycles > 0
    lookups = [s for i in (1, 3) for s in steps[i] if s.branch == "lookup"]
    assert lookups and not any(s.branch == "lookup" for i in (0, 2, 4) for s in steps[i])


def test_a_shared_drafter_drafts_for_every_request_in_one_pass(model, monkeypatch):
    """Requests sharing a drafter draft in one pass per step (`propose_batch`), and each gets the drafts it gets
    from a drafter of its own (the same weights, one pass per request): the batched pass takes each request's own
    context and cache."""

    def drafts(shared: bool) -> tuple[list, int]:
        drafters = [make_dflash2_drafter(model, block_size=6) for _ in PROMPTS[:4]]
        if shared:
            drafters = drafters[:1] * 4
        real, calls = drafters[0].propose_batch, []
        monkeypatch.setattr(
            type(drafters[0]), "propose_batch", lambda self, *a, **kw: calls.append(1) or real(*a, **kw)
        )
        seen, real_propose = [], BatchedDecoder._propose

        def recorded(self, blocks):
            proposals, lookups = real_propose(self, blocks)
            seen.append([None if p is None else p.tokens.tolist() for p in proposals])
            return proposals, lookups

        monkeypatch.setattr(BatchedDecoder, "_propose", recorded)
        requests = [(p, {"drafter": d}) for p, d in zip(PROMPTS[:4], drafters)]
        got, _, _ = run_batch(bind_drafter(drafters[0], model), requests, n=16, blocks=4)
        for i, (prompt, _) in enumerate(requests):
            assert got[i] == alone(model, prompt, 16), f"request {i}"
        monkeypatch.undo()
        return seen, len(calls)

    (together, passes), (apart, none) = drafts(True), drafts(False)
    assert together == apart and passes > 0 and none == 0


def test_copy_drafts_run_cycles_where_drafter_passes_do_not_pay(model):
    """A curve with a costly drafter pass and a forward that grows 5% a token: the drafter's cycles do not pay,
    the lookups' do (no pass), so every block verified is a copy draft."""
    from dflash2_mlx.batched_costs import BatchedCostModel

    costs = BatchedCostModel([[0.1 * k * (1 + 0.05 * (n - 1)) for n in range(1, 7)] for k in range(1, 9)], [0.5] * 5)
    drafter = make_dflash2_drafter(model, block_size=6)
    drafter.acceptance_prior = [0.3] * 5
    target = bind_drafter(drafter, model)
    copy = {"copyspec": LookupConfig(min_match=2, max_draft=5)}
    requests = [(p, {"drafter": drafter, **copy}) for p in PROMPTS]
    got, steps, decoder = run_batch(target, requests, costs=costs, n=32)
    for i, (prompt, _) in enumerate(requests):
        assert got[i] == alone(model, prompt, 32), f"request {i}"
    verified = [s for i in range(len(PROMPTS)) for s in steps[i] if s.block_size > 1]
    assert decoder.batched_cycles > 0 and any(s.accepted for s in verified)
    assert all(s.branch == "lookup" for s in verified)  # no drafter pass paid for


def test_max_tokens_keeps_the_drafts_within_reach(model):
    """No draft past max_tokens is verified (the bonus after the last one may be: the caller cuts it)."""
    target, requests = oracle_requests(model, PROMPTS[:2])
    requests = [(p, {**kw, "max_tokens": 4}) for p, kw in requests]
    with BatchedDecoder(target, None, 6) as decoder:
        firsts = [decoder.add(p, SamplingParams(), **kw)[0] for p, kw in requests]
        made, sizes = dict.fromkeys(firsts, 1), []
        while len(decoder):
            for u, s in decoder.step().items():
                assert s.block_size - 1 <= 4 - made[u]
                made[u] += len(s.tokens)
                sizes.append(s.block_size)
                if made[u] >= 4:  # as a caller ends it
                    decoder.remove(u)
    assert max(sizes) == 4 and max(made.values()) <= 5


def test_an_extracted_request_goes_on_alone(model):
    """`extract` gives the request's cache and tokens: a plain continuation from them is mlx-lm's."""
    target, requests = oracle_requests(model, PROMPTS[:3])
    with BatchedDecoder(target, None, 6) as decoder:
        uids = [decoder.add(p, SamplingParams(), **kw)[0] for p, kw in requests]
        for _ in range(3):
            decoder.step()
        cache, tokens = decoder.extract(uids[1])
        assert len(decoder) == 2
        decoder.step()  # the others go on without it
    prompt = requests[1][0]
    assert tokens[: len(prompt)] == prompt
    assert tokens[len(prompt) :] == alone(model, prompt, len(tokens) - len(prompt))
    assert cache[0].offset == len(tokens) - 1  # every token but the last is in the cache
    logits = model(mx.array(tokens[-1:])[None], cache=cache)
    assert int(mx.argmax(logits[0, -1]).item()) == alone(model, prompt, len(tokens) - len(prompt) + 1)[-1]


def test_a_request_joins_from_a_cached_prefix(model):
    """`add` given the target's cache of the prompt's first 20 tokens (a prompt-cache slot's) prefills the rest:
    the request's tokens are still mlx-lm's, beside another's; a cache as long as the prompt is refused."""
    drafter = make_dflash2_drafter(model, block_size=6)
    target = bind_drafter(drafter, model)
    prompt = PROMPTS[1]
    cache = make_prompt_cache(model)
    model(mx.array(prompt[:20])[None], cache=cache)
    mx.eval([c.state for c in cache])
    with BatchedDecoder(target, drafter, 4) as decoder:
        other, _ = decoder.add(PROMPTS[0], SamplingParams())
        uid, first = decoder.add(prompt, SamplingParams(), cache=cache)
        tokens = list(first.tokens)
        while len(tokens) < N_TOKENS:
            tokens += decoder.step({uid: 4, other: 4})[uid].tokens
        with pytest.raises(ValueError, match="KV caches of one length below it"):
            decoder.add(prompt[:20], SamplingParams(), cache=decoder.extract(uid)[0])
    assert tokens[:N_TOKENS] == alone(model, prompt)
    assert decoder.batched_cycles > 0


@pytest.mark.parametrize("arch", ["llama_swa", "qwen3_5"])
def test_targets_it_cannot_roll_back_are_refused(arch):
    model = make_hybrid(arch) if arch == "qwen3_5" else make_target(arch)
    reason = batch_refusal(Target(model))
    assert reason is not None and "cannot yet be rolled back per request" in reason
    with pytest.raises(ValueError, match="plain batched steps"):
        BatchedDecoder(Target(model), None, 4)


def test_the_rollback_refuses_what_it_cannot_keep(model):
    target, requests = oracle_requests(model, PROMPTS[:2])
    with BatchedDecoder(target, None, 4) as decoder:
        for p, kw in requests:
            decoder.add(p, SamplingParams(), **kw)
        with pytest.raises(ValueError, match="cannot keep"):
            batched.roll_back_rows(decoder.cache, [1, 5], 4)
        with pytest.raises(ValueError, match="cannot keep"):
            batched.roll_back_rows(decoder.cache, [1], 4)


def sample_in_batch(n: int) -> tuple:
    """n draws of the 3 tokens after PROMPT by a request decoded in a batch beside another (prompts of 1 to 6
    tokens), blocks of 3, a drafter with sharp, wrong opinions (rejections and residual draws)."""
    model = make_target("llama", vocab=V, seed=21)
    drafter = make_drafter(model, block_size=4, seed=5, output_multiplier=4.0)
    target = bind_drafter(drafter, model)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    mx.random.seed(3)
    counts = Counter()
    for i in range(n):
        with BatchedDecoder(target, drafter, 3) as decoder:
            other, _ = decoder.add([1, 2, 3, 0, 1, 2][: 1 + i % 6], params)
            uid, first = decoder.add(PROMPT, params)
            tokens = list(first.tokens)
            while len(tokens) < 3:
                tokens += decoder.step({uid: 3, other: 3})[uid].tokens
        counts[tuple(tokens[:3])] += 1
    return model, counts, params


@pytest.mark.slow
def test_sampling_inside_a_batch_follows_mlx_lm():
    model, counts, params = sample_in_batch(N)
    assert_follows_mlx_lm(model, counts, params)
