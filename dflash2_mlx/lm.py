"""A drop-in for mlx-lm's generation API: switch the import, keep the code.

    from mlx_lm import load, generate, stream_generate                       # before
    from mlx_lm.sample_utils import make_sampler, make_logits_processors
    from dflash2_mlx.lm import (load, generate, stream_generate,              # after
                                make_sampler, make_logits_processors)

`load`, `generate`, `stream_generate`, `make_sampler`, `make_logits_processors` and `make_prompt_cache` take
mlx-lm 0.32's arguments and return what it returns: `load` gives (model, tokenizer), `generate` the text,
`stream_generate` one `GenerationResponse` per token (text, token, logprobs, from_draft, prompt and generation
tokens/s, peak memory, finish_reason; then the fields of the DFlash cycle that committed the token). The
output is the target's, as mlx-lm's own: token for token at temperature 0, the same distribution at T > 0.

The drafter: `load(path, draft_model=DRAFTER)` (a DFlash drafter folder or hub id) remembers it for the model it
returns; so does `load(path)` with the environment variable DFLASH2_DRAFT_MODEL set (how a script that says only
`load(path)` speculates, unchanged), and the default target (`load(None)`) comes with its bundled one.
`stream_generate(..., draft_model=)` takes one too (a folder, a hub id or a loaded `DFlashDraftModel`). A model
with none decodes plainly, as mlx-lm does.
mlx-lm's own draft models (small causal LMs) are refused with what to pass instead.

Sampling: `make_sampler` here is mlx-lm's with its parameters attached, which speculative decoding needs (its
acceptance test compares the draft and target distributions). Any other sampler callable (mlx-lm's
`make_sampler` at T > 0 included) runs plain decoding with that very sampler, with one warning: the output is
still exactly mlx-lm's, only not faster. mlx-lm's arguments this module cannot honour (`max_kv_size`,
`kv_bits`, `input_embeddings`, another `stream`) are refused with a clear error, never ignored.

Beyond mlx-lm's arguments, `stream_generate` and `generate` take this package's own (`verify_mode`,
`block_size`, `tree_budget`, `walk`, `max_context`, `costs`, `copyspec_mode`; see `generate.stream_cycles`).
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import utils as mlx_lm_utils
from mlx_lm.generate import DEFAULT_QUANTIZED_KV_START, generation_stream
from mlx_lm.sample_utils import make_logits_processors  # the same processors: they run unchanged in every mode
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .assets import default_drafter
from .drafter import DFlashDraftModel
from .generate import GenerationResponse, encode_text
from .generate import stream_generate as _stream_generate
from .loading import bind_drafter, load_drafter, load_target
from .prompt_cache import PromptCache as _PromptCache
from .sampling import make_sampler

__all__ = [
    "GenerationResponse",
    "generate",
    "load",
    "make_logits_processors",
    "make_prompt_cache",
    "make_sampler",
    "stream_generate",
]

DRAFT_MODEL_ENV = "DFLASH2_DRAFT_MODEL"  # the drafter `load` takes when given none

# this package's own options, accepted beside mlx-lm's
OWN_OPTIONS = ("verify_mode", "block_size", "tree_budget", "walk", "max_context", "costs", "copyspec_mode")

# the drafter `load` gave each model it returned, kept as long as the model lives (id -> (weak ref, drafter))
_drafters: dict[int, tuple[weakref.ref, DFlashDraftModel]] = {}


def _remember(model: nn.Module, drafter: DFlashDraftModel) -> None:
    key = id(model)
    _drafters[key] = (weakref.ref(model, lambda _: _drafters.pop(key, None)), drafter)


def drafter_for(model: nn.Module) -> DFlashDraftModel | None:
    """The drafter `load` loaded with `model`, or None."""
    entry = _drafters.get(id(model))
    return entry[1] if entry is not None and entry[0]() is model else None


def load(
    path_or_hf_repo: str | None,
    tokenizer_config: dict[str, Any] | None = None,
    model_config: dict[str, Any] | None = None,
    adapter_path: str | None = None,
    lazy: bool = False,
    return_config: bool = False,
    revision: str | None = None,
    trust_remote_code: bool = False,
    *,
    draft_model: str | None = None,
    **drafter_options,
):
    """mlx-lm's `load` (same arguments, same return: (model, tokenizer), or (model, tokenizer, config) with
    `return_config`), which also loads a DFlash drafter for the model: `draft_model` (a drafter folder or hub id;
    `drafter_options` are `loading.load_drafter`'s: dtype, quant, draft_vocab, vocab_counts, kernels), else the
    one $DFLASH2_DRAFT_MODEL names, else, for the default target (`path_or_hf_repo` None:
    SmolLM2-135M-Instruct), its bundled drafter. `generate` and
    `stream_generate` then speculate with it whenever they get this model. A `.gguf` path loads through this
    package's GGUF reader (llama and qwen2), which takes none of mlx-lm's model options."""
    config, from_env = None, draft_model is None and bool(os.environ.get(DRAFT_MODEL_ENV))
    if from_env:
        draft_model = os.environ[DRAFT_MODEL_ENV]
    if path_or_hf_repo is None or str(path_or_hf_repo).endswith(".gguf"):
        extra = {
            k: v
            for k, v in dict(
                model_config=model_config,
                adapter_path=adapter_path,
                revision=revision,
                return_config=return_config or None,
            ).items()
            if v
        }
        if extra:
            raise ValueError(
                f"{', '.join(extra)}: not available for GGUF targets (this package reads them itself); "
                "convert the model to an mlx-lm folder to use them"
            )
        model, tokenizer = load_target(path_or_hf_repo, tokenizer_config=tokenizer_config)
        if path_or_hf_repo is None and draft_model is None:
            draft_model = str(default_drafter())
    else:
        loaded = mlx_lm_utils.load(
            path_or_hf_repo, tokenizer_config, model_config, adapter_path, lazy, True, revision, trust_remote_code
        )
        model, tokenizer, config = loaded
    if draft_model is not None:
        drafter = load_drafter(str(draft_model), **drafter_options)
        try:
            bind_drafter(drafter, model)  # a drafter trained for another target fails here, at load
        except ValueError as e:
            if from_env:
                raise ValueError(f"${DRAFT_MODEL_ENV} ({draft_model}) does not fit {path_or_hf_repo}: {e}") from None
            raise
        _remember(model, drafter)
    elif drafter_options:
        raise ValueError(f"{', '.join(drafter_options)}: drafter options, given without draft_model")
    return (model, tokenizer, config) if return_config else (model, tokenizer)


class PromptCache(_PromptCache):
    """`make_prompt_cache`'s cache, used as mlx-lm's: each call passes only the new tokens (the next turn), the
    cache holding the conversation so far (the prompts and the tokens generated from them)."""

    def __init__(self):
        super().__init__()
        self.history: list[int] = []

    def clear(self) -> None:
        super().clear()
        self.history = []


def make_prompt_cache(model: nn.Module, max_kv_size: int | None = None) -> PromptCache:
    """mlx-lm's `make_prompt_cache`: a cache to pass to consecutive generations (`prompt_cache=`), each given only
    its new tokens, as with mlx-lm's. It holds the drafter's context too, so speculation goes on across turns.
    `max_kv_size` (a rotating cache) is refused: the drafter's context would lose its rows."""
    if max_kv_size is not None:
        raise ValueError(
            "max_kv_size: rotating prompt caches are not supported (the drafter's context must match "
            "the target's cache row for row); leave it unset"
        )
    return PromptCache()


def _drafter(model: nn.Module, draft_model) -> DFlashDraftModel | None:
    if draft_model is None:
        return drafter_for(model)
    if isinstance(draft_model, DFlashDraftModel):
        return draft_model
    if isinstance(draft_model, (str, Path)):
        return load_drafter(str(draft_model))
    raise ValueError(
        f"draft_model is a {type(draft_model).__module__}.{type(draft_model).__name__}: this package speculates "
        "with a DFlash drafter (a block-diffusion model conditioned on the target's features), not with a small "
        "causal LM as mlx-lm does. Pass a DFlash drafter (a folder or hub id, or "
        "dflash2_mlx.load_drafter(path)), or load(path, draft_model=DRAFTER); for mlx-lm's own draft-model "
        "speculation, use mlx_lm.stream_generate"
    )


def _options(model, draft_model, max_tokens: int, stream, kwargs: dict) -> tuple[DFlashDraftModel | None, dict]:
    """(drafter, `generate.stream_generate` keyword arguments) from mlx-lm's arguments; refuses what cannot be
    honoured."""
    if stream is not generation_stream:
        raise ValueError("stream: generation runs on mlx-lm's generation_stream here; leave it unset")
    if max_tokens == 0:
        raise ValueError("Maximum number of tokens must be non-zero (use -1 for no limit).")
    kwargs = dict(kwargs)
    for name, why in (
        (
            "max_kv_size",
            "rotating KV caches are not supported (the drafter's context must match the target's cache row for row)",
        ),
        ("kv_bits", "quantized KV caches are not supported while speculating"),
        ("input_embeddings", "generation starts from token ids here"),
    ):
        if kwargs.pop(name, None) is not None:
            raise ValueError(f"{name}: {why}; leave it unset")
    kwargs.pop("kv_group_size", None)  # mlx-lm's KV quantization settings: they do nothing without kv_bits
    kwargs.pop("quantized_kv_start", DEFAULT_QUANTIZED_KV_START)
    drafter = _drafter(model, draft_model)
    num_draft = kwargs.pop("num_draft_tokens", None)
    options = {}
    if num_draft is not None and drafter is not None:  # mlx-lm drafts exactly that many per cycle
        if not isinstance(num_draft, int) or num_draft < 1:
            raise ValueError(f"num_draft_tokens must be an integer >= 1, got {num_draft!r}")
        options.update(verify_mode="dflash", block_size=num_draft + 1)
    for name in ("sampler", "logits_processors", "prompt_cache", "prefill_step_size", "prompt_progress_callback"):
        if name in kwargs:
            options[name] = kwargs.pop(name)
    for name in OWN_OPTIONS:
        if name in kwargs:
            options[name] = kwargs.pop(name)
    if kwargs:
        raise TypeError(
            f"stream_generate() got unexpected keyword arguments {sorted(kwargs)}: it takes mlx-lm's "
            f"(sampler, logits_processors, prompt_cache, prefill_step_size, num_draft_tokens, ...) and "
            f"{', '.join(OWN_OPTIONS)}"
        )
    if "verify_mode" not in options:
        options["verify_mode"] = "off" if drafter is None else "adaptive"
    if options.get("prefill_step_size") is None:
        options.pop("prefill_step_size", None)
    options["max_tokens"] = max_tokens if max_tokens > 0 else 1 << 62
    return drafter, options


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | mx.array | Sequence[int],
    max_tokens: int = 256,
    draft_model: DFlashDraftModel | str | None = None,
    stream=generation_stream,
    **kwargs,
) -> Iterator[GenerationResponse]:
    """mlx-lm's `stream_generate`: one `GenerationResponse` per token, as it yields them (the last with the finish
    reason; at EOS its token is the EOS token), speculatively with the model's DFlash drafter (`draft_model`, or
    the one `load` gave the model). kwargs: mlx-lm's `sampler`, `logits_processors`, `prompt_cache` (from this
    module's `make_prompt_cache`; a `dflash2_mlx.PromptCache` keeps its own use: each call passes the whole
    conversation), `prefill_step_size`, `prompt_progress_callback` (called before the prefill and
    once it is done), `num_draft_tokens` (with a drafter: exactly that many drafts per cycle, verify mode
    "dflash"; without one it is ignored, as mlx-lm does), the KV-quantization settings while `kv_bits` is unset,
    and this package's own (module note). `max_tokens` -1 has no limit."""
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    drafter, options = _options(model, draft_model, max_tokens, stream, kwargs)
    cache = options.pop("prompt_cache", None)
    progress: Callable[[int, int], None] | None = options.pop("prompt_progress_callback", None)
    if isinstance(cache, list):
        raise ValueError(
            "prompt_cache: an mlx-lm cache list holds the target's rows only, and speculation needs "
            "the drafter's context beside them: use dflash2_mlx.lm.make_prompt_cache(model) (used the "
            "same way: each call passes its new tokens)"
        )
    if cache is not None and not isinstance(cache, _PromptCache):
        raise ValueError(f"prompt_cache must come from make_prompt_cache(model), got {type(cache).__name__}")
    ids = encode_text(tokenizer, prompt) if isinstance(prompt, str) else mx.array(prompt).reshape(-1).tolist()
    history = cache.history if isinstance(cache, PromptCache) else []
    full = history + ids
    if progress is not None:
        progress(0, len(ids))
    responses = _stream_generate(model, tokenizer, full, drafter, prompt_cache=cache, **options)
    try:
        for r in responses:
            if progress is not None and r.generation_tokens == 1:
                progress(len(ids), len(ids))
            if isinstance(cache, PromptCache):
                full.append(r.token)  # mlx-lm's cache covers every token it yields
                cache.history = full
            r.prompt_tokens = len(ids)
            yield r
    finally:
        responses.close()


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int],
    verbose: bool = False,
    **kwargs,
) -> str:
    """mlx-lm's `generate`: the generated text (`stream_generate`'s, kwargs its); with `verbose`, the text as it
    comes and mlx-lm's summary lines, on stdout as mlx-lm prints them."""
    if verbose:
        print("=" * 10)
    text = ""
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if len(text) == 0:
            print("No text generated for this prompt")
            return
        print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
