"""Draft vocabularies: drafts come only from the stored token ids, the head over them is the full head's
columns, sampling stays the target's, and the vocabulary travels with the drafter through convert/export."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    SETTINGS,
    V,
    assert_follows_mlx_lm,
    make_dflash2_drafter,
    make_drafter,
    make_target,
    sample_sequences,
    synthetic_checkpoint,
)

from dflash2_mlx import generate, load_drafter
from dflash2_mlx.convert import convert, export
from dflash2_mlx.formats.vocab import DRAFT_VOCAB_FILE, most_frequent, read_draft_vocab, write_draft_vocab
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams

IDS = np.array([2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 200, 233], np.int32)


def with_vocab(drafter, model, ids=IDS):
    drafter.draft_vocab = ids
    bind_drafter(drafter, model)
    return drafter


@pytest.mark.parametrize("make", [make_drafter, make_dflash2_drafter], ids=["v1", "dflash2"])
def test_drafts_come_from_the_draft_vocabulary(make):
    model = make_target("qwen3", seed=4)
    full = make(model, block_size=6)
    h = mx.random.normal((5, 64))
    restricted = with_vocab(make(model, block_size=6), model)
    # the restricted head is the full head's columns at those ids (an independent slice of the full logits)
    np.testing.assert_allclose(
        np.array(restricted.draft_logits(h)), np.array(full.draft_logits(h))[:, IDS], atol=1e-5, rtol=1e-5
    )
    block, context = mx.array([[7] + [restricted.config.mask_token_id] * 5]), mx.random.normal((1, 9, 128))
    for params in (SamplingParams(), SamplingParams(temperature=1.0)):
        for seed in range(4):
            mx.random.seed(seed)
            proposal = restricted.propose(block, context, restricted.make_cache(), params)
            assert set(np.array(proposal.tokens).tolist()) <= set(IDS.tolist())
            if proposal.candidates is not None:
                assert set(np.array(proposal.candidates).ravel().tolist()) <= set(IDS.tolist())
    # greedy: the argmax within the draft vocabulary, found from the full logits by NumPy
    logits = np.array(full.draft_logits(h))[:, IDS] if not full.config.is_dflash2 else None
    if logits is not None:
        hidden = restricted.hidden(block, context, restricted.make_cache())[0, 1:]
        expected = IDS[np.argmax(np.array(full.draft_logits(hidden))[:, IDS], axis=-1)]
        got = restricted.choose(hidden, restricted.draft_logits(hidden), block[0, 0], SamplingParams()).tokens
        assert np.array(got).tolist() == expected.tolist()


@pytest.mark.parametrize("make", [make_drafter, make_dflash2_drafter], ids=["v1", "dflash2"])
def test_greedy_identical_with_a_draft_vocabulary(make, tokenizer):
    model = make_target("llama", seed=2)
    drafter = with_vocab(make(model, block_size=8), model, np.arange(0, 256, 2, dtype=np.int32))
    for prompt in ([5, 9, 11], [40, 41, 42, 43, 44, 45]):
        plain = generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=30, eos_token_ids=[])
        for mode in ("dflash", "adaptive"):
            spec = generate(model, tokenizer, prompt, drafter, verify_mode=mode, max_tokens=30, eos_token_ids=[])
            assert spec.tokens == plain.tokens


@pytest.mark.slow
@pytest.mark.parametrize("make", [make_drafter, make_dflash2_drafter], ids=["v1", "dflash2-walk"])
def test_sampling_with_a_draft_vocabulary_follows_mlx_lm(make):
    """q is zero outside the draft vocabulary (token 1 can never be drafted) and the acceptance test uses that
    same q: the output is still mlx-lm's distribution."""
    model = make_target("llama", vocab=V, seed=21)
    drafter = with_vocab(make(model, block_size=4, seed=5, output_multiplier=4.0), model, np.array([0, 2, 3], np.int32))
    target = bind_drafter(drafter, model)
    params = SETTINGS["t0.7-topp0.9"]
    assert_follows_mlx_lm(model, sample_sequences(target, drafter, params, seed=7), params)


def test_most_frequent_against_a_sort():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 50, size=300)
    got = most_frequent(counts, 40, 300, always=[299])
    by_count = sorted(range(300), key=lambda t: (-counts[t], t))[:40]
    assert got.tolist() == sorted(set(by_count) | {299})
    with pytest.raises(ValueError, match="between 1 and the target's vocabulary"):
        most_frequent(counts, 0, 300)


def test_the_vocabulary_travels_through_convert_and_export(tmp_path):
    source = synthetic_checkpoint(tmp_path / "hf", "dflash2")
    assert load_drafter(str(source)).draft_vocab is None  # published folders draft over every token
    counts = np.zeros(256, np.int64)
    counts[[7, 9, 11, 13, 200]] = [50, 40, 30, 20, 10]
    np.save(tmp_path / "counts.npy", counts)
    mlx_folder = convert(str(source), tmp_path / "mlx", "float32", draft_vocab=3, vocab_counts=tmp_path / "counts.npy")
    assert read_draft_vocab(mlx_folder).tolist() == [7, 9, 11]
    assert load_drafter(str(mlx_folder)).draft_vocab.tolist() == [7, 9, 11]
    back = export(str(mlx_folder), tmp_path / "back", "float32")
    assert read_draft_vocab(back).tolist() == [7, 9, 11]
    assert DRAFT_VOCAB_FILE not in json.dumps(sorted(p.name for p in back.glob("model*.safetensors")))
    with pytest.raises(FileNotFoundError, match="--draft-vocab-counts"):
        load_drafter(str(source), draft_vocab=3)


def test_bad_vocabularies_are_named(tmp_path):
    model = make_target("qwen3")
    with pytest.raises(ValueError, match="outside the target's 256"):
        with_vocab(make_drafter(model), model, np.array([3, 300], np.int32))
    with pytest.raises(ValueError, match="sorted, unique"):
        write_draft_vocab(tmp_path, [5, 3])
