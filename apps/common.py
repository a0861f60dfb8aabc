"""What several commands share: the target and drafter flags (and loading them), the sampling flags, the
one-line summary of a generation, and the command line a report says it was made by."""

from __future__ import annotations

import shlex
import sys
from inspect import signature
from pathlib import Path

from mlx_lm.sample_utils import make_logits_processors

from dflash2_mlx import distributed, load, process_group
from dflash2_mlx.assets import default_drafter
from dflash2_mlx.generate import VERIFY_MODES, stream_cycles
from dflash2_mlx.kernels import use_metal
from dflash2_mlx.loading import bind_drafter, load_drafter, load_target
from dflash2_mlx.lookup import COPYSPEC_MODES, MODES
from dflash2_mlx.omlx_settings import from_omlx
from dflash2_mlx.prompts import SUITES, load_suite

KERNELS_HELP = "the hot DFlash 2 ops as fused Metal kernels (auto: where Metal exists) or pure MLX; same results"


def add_model_args(p) -> None:
    """The target, the drafter and how they decode: what generate, serve and chat share."""
    d = generation_defaults()
    p.add_argument(
        "--model",
        help="target: mlx-lm model folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--draft-model", help="DFlash drafter: local folder or hub id (default target: its bundled DFlash 2 drafter)"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="runtime block size (draft + verify tokens per cycle); dflash mode: default the drafter's, "
        "capped at 5 for DFlash 2 as oMLX does; adaptive mode: the largest it may pick (default the drafter's)",
    )
    p.add_argument(
        "--verify-mode",
        choices=VERIFY_MODES,
        default=None,
        help="adaptive (default, as oMLX): each cycle's block size, or plain steps, picked from this machine's "
        "measured costs and the acceptance so far, drafting only where those predict more tokens/s than plain "
        "decoding (the bundled drafters on a 2-core x86 CPU: 95-97%% plain steps, within a few percent of plain); "
        "dflash: every cycle at --block-size (there 0.88-0.92x of mlx-lm at tau ~1.55); ddtree: every cycle "
        "verifies a tree of drafts (--tree-budget nodes, at most --block-size - 1 deep) in one target pass; off: "
        "plain decoding of the same target through the same loader (the baseline)",
    )
    p.add_argument(
        "--tree-budget",
        type=int,
        metavar="N",
        help="ddtree mode: draft nodes per tree, built best-first from the drafter's lattice (default: the "
        "most nodes this machine verifies for at most 10%% more than the linear block, from its measured "
        "costs)",
    )
    p.add_argument(
        "--path",
        choices=["greedy", "viterbi"],
        help=f"how a DFlash 2 drafter's path selector walks its candidates at T = 0 (default {d['walk']})",
    )
    p.add_argument(
        "--draft-quant",
        metavar="SPEC",
        help="quantize the drafter at load, oMLX style: w{bits}a{act}:gs{group}, e.g. w4a16:gs64",
    )
    add_draft_vocab_args(p)
    p.add_argument(
        "--draft-dtype",
        choices=["bfloat16", "float32"],
        help="drafter compute dtype (default: float32 on CPU, the stored dtype on Metal; float16 is refused)",
    )
    p.add_argument("--max-context", type=int, help="prompts of at least this many tokens run plain decoding")
    p.add_argument("--omlx-settings", metavar="FILE", help="an oMLX model_settings.json to take DFlash settings from")
    p.add_argument("--omlx-model", metavar="ID", help="the model id of the entry in --omlx-settings to use")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="cast the target's weights (GGUF default: float32 on CPU, quantized tensors kept on Metal)",
    )
    p.add_argument(
        "--prefill-step-size", type=int, help=f"prompt tokens per prefill forward (default {d['prefill_step_size']})"
    )
    p.add_argument("--kernels", choices=["auto", "metal", "mlx"], default="auto", help=KERNELS_HELP)


def add_copyspec_args(p) -> None:
    """Copy drafts (`dflash2_mlx.lookup`): what generate, chat and bench share."""
    modes = ", ".join(f"{m}: matches of {c.min_match}+ tokens, up to {c.max_draft} copied" for m, c in MODES.items())
    p.add_argument(
        "--copyspec-mode",
        choices=COPYSPEC_MODES,
        default=None,
        help="look the continuation of the last tokens up in the context (prompt and answer so far) and "
        f"verify it beside the drafter's block in the same target pass ({modes}; off: no lookups; "
        "default auto); the output is the same",
    )


def generation_defaults() -> dict:
    """`stream_cycles`' own keyword defaults: what a flag left unset means."""
    return {k: p.default for k, p in signature(stream_cycles).parameters.items() if p.default is not p.empty}


def add_sampling_args(p) -> None:
    d = generation_defaults()
    p.add_argument("--max-tokens", "-m", type=int, help=f"default {d['max_tokens']}")
    p.add_argument("--temp", type=float, help=f"sampling temperature (0 = greedy; default {d['temp']})")
    p.add_argument("--top-p", type=float, help=f"1 = off (default {d['top_p']})")
    p.add_argument("--top-k", type=int, help=f"0 = off (default {d['top_k']})")
    p.add_argument(
        "--min-p",
        type=float,
        help=f"0 = off (default {d['min_p']}); as in mlx-lm, top-p, min-p and top-k filter before temperature applies",
    )
    p.add_argument("--seed", type=int, help="default: MLX's global random state")


def add_processor_args(p) -> None:
    """mlx-lm's logits processors (`make_logits_processors`), named as its server's request fields."""
    p.add_argument(
        "--repetition-penalty",
        type=float,
        metavar="F",
        help="divide (multiply, if negative) the logits of tokens among the last "
        "--repetition-context-size tokens by F, as mlx-lm does (default: off)",
    )
    p.add_argument(
        "--repetition-context-size",
        type=int,
        metavar="N",
        help="tokens the repetition penalty looks back over, prompt included (default 20)",
    )
    p.add_argument(
        "--logit-bias",
        metavar="ID:BIAS,...",
        help="add BIAS to token ID's logit before every choice, e.g. '42:-100,7:2.5'",
    )


def parse_logit_bias(text: str) -> dict[int, float]:
    """'ID:BIAS,...' -> {ID: BIAS}."""
    bias = {}
    for item in text.split(","):
        token, sep, value = item.strip().partition(":")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise ValueError(
                f"--logit-bias takes comma-separated TOKEN_ID:BIAS pairs, e.g. '42:-100,7:2.5'; got {item.strip()!r}"
            ) from None
        if int(token) < 0:
            raise ValueError(f"--logit-bias token ids are >= 0, got {token}")
    return bias


def logits_processors(args, vocab_size: int | None = None) -> list:
    """mlx-lm's processors for --repetition-penalty, --repetition-context-size and --logit-bias (none unset);
    `vocab_size`: refuse bias on token ids the target does not have."""
    penalty, size = getattr(args, "repetition_penalty", None), getattr(args, "repetition_context_size", None)
    text = getattr(args, "logit_bias", None)
    if penalty is not None and not penalty >= 0:
        raise ValueError(
            f"--repetition-penalty must be >= 0 (1 or 0 = off, above 1 discourages repeats), got {penalty}"
        )
    if size is not None and size < 1:
        raise ValueError(f"--repetition-context-size must be at least 1, got {size}")
    if size is not None and not penalty:
        raise ValueError("--repetition-context-size applies to --repetition-penalty: set one")
    bias = parse_logit_bias(text) if text else None
    if bias and vocab_size is not None and max(bias) >= vocab_size:
        raise ValueError(f"--logit-bias token id {max(bias)} is outside the target's vocabulary ({vocab_size})")
    return make_logits_processors(
        logit_bias=bias, repetition_penalty=penalty, repetition_context_size=20 if size is None else size
    )


def apply_omlx_settings(args) -> None:
    """Fill what the command line left unset from the oMLX entry; explicit flags win."""
    if bool(args.omlx_settings) != bool(args.omlx_model):
        raise ValueError("--omlx-settings and --omlx-model go together")
    if not args.omlx_settings:
        return
    settings = from_omlx(args.omlx_settings, args.omlx_model)
    args.model = args.model or args.omlx_model
    args.draft_model = args.draft_model or settings.draft_model
    args.verify_mode = args.verify_mode or settings.verify_mode
    args.block_size = args.block_size or settings.block_size
    args.max_context = args.max_context or settings.max_context
    if hasattr(args, "copyspec_mode"):
        args.copyspec_mode = args.copyspec_mode or settings.copyspec_mode
    args.draft_quant = args.draft_quant or (str(settings.draft_quant) if settings.draft_quant else None)
    for note in settings.notes:
        print(f"[dflash2] oMLX settings: {note}", file=sys.stderr)


def load_pair(args):
    """(model, tokenizer, drafter) as `add_model_args`' flags say; drafter None for --verify-mode off."""
    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    apply_omlx_settings(args)
    args.verify_mode = args.verify_mode or generation_defaults()["verify_mode"]
    if args.verify_mode != "off" and not args.draft_model:
        if args.model:
            raise ValueError(
                f"--verify-mode {args.verify_mode} needs --draft-model for {args.model} (drafters are bundled only "
                "for the default target); use --verify-mode off for plain decoding"
            )
        args.draft_model = str(default_drafter())
    return load(
        args.model,
        args.draft_model if args.verify_mode != "off" else None,
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        draft_vocab_counts=args.draft_vocab_counts,
        kernels=args.kernels,
    )


def add_sharding_args(p) -> None:
    """A target sharded over the processes `mlx.launch` started (one per Mac): rank 0 prints, the others follow."""
    g = p.add_argument_group("a target sharded over several processes (start every one with mlx.launch)")
    how = g.add_mutually_exclusive_group()
    how.add_argument(
        "--pipeline",
        action="store_true",
        help="pipeline parallel: each process runs a run of consecutive layers (mlx-lm's "
        "model.model.pipeline; qwen2, qwen3_5, qwen3_moe, qwen3_next, deepseek, glm4_moe, ...; "
        "qwen3 and llama pipelined by dflash2)",
    )
    how.add_argument(
        "--tensor-parallel",
        action="store_true",
        help="tensor parallel: each process holds a slice of every layer (mlx-lm's model.shard; "
        "qwen3, qwen3_5, llama, qwen2, deepseek, gpt_oss, ...)",
    )
    g.add_argument("--backend", default="any", help="MLX distributed backend: any (default), ring, jaccl, mpi")
    g.add_argument(
        "--peer-timeout",
        type=float,
        default=process_group.DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help="rank 0 ends with an error when the others have not answered for this long while it "
        f"generates: one died or hangs (default {process_group.DEFAULT_TIMEOUT:g})",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=distributed.CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="how long a process waits for the others at the start before it gives up (default "
        f"{distributed.CONNECT_TIMEOUT:g})",
    )


def load_sharded(args):
    """(this process's `distributed.ShardedTarget`, tokenizer, drafter or None) as `add_model_args`' and
    `add_sharding_args`' flags say."""
    use_metal(args.kernels)
    apply_omlx_settings(args)
    args.verify_mode = args.verify_mode or generation_defaults()["verify_mode"]
    if args.verify_mode == "ddtree":
        raise ValueError(
            "--verify-mode ddtree runs in one process; a sharded target verifies linear blocks "
            "(--verify-mode adaptive or dflash)"
        )
    if not args.model:
        raise ValueError("a sharded target needs --model (an mlx-lm model folder or hub id)")
    if args.verify_mode != "off" and not args.draft_model:
        raise ValueError(
            f"--verify-mode {args.verify_mode} needs --draft-model; use --verify-mode off for plain decoding"
        )
    group = distributed.init_group(args.backend, args.connect_timeout)
    return distributed.load(
        args.model,
        args.draft_model if args.verify_mode != "off" else None,
        group,
        "pipeline" if args.pipeline else "tensor",
        dtype=args.dtype,
        draft_dtype=args.draft_dtype,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        draft_vocab_counts=args.draft_vocab_counts,
        kernels=args.kernels,
        timeout=args.connect_timeout,
    )


def generation_kwargs(args, vocab_size: int | None = None) -> dict:
    """`stream_cycles`' keyword arguments from the model and sampling flags (its own default where unset), and
    the logits processors of `add_processor_args`' flags, if the command has them (`vocab_size`: the target's)."""
    given = dict(
        max_tokens=args.max_tokens,
        temp=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        block_size=args.block_size,
        verify_mode=args.verify_mode,
        walk=args.path,
        tree_budget=args.tree_budget,
        max_context=args.max_context,
        prefill_step_size=args.prefill_step_size,
    )
    if hasattr(args, "copyspec_mode"):  # the commands that take --copyspec-mode (`add_copyspec_args`)
        given["copyspec_mode"] = args.copyspec_mode
    defaults = generation_defaults()
    kwargs = {k: defaults[k] if v is None and k in defaults else v for k, v in given.items()}
    return {**kwargs, "logits_processors": logits_processors(args, vocab_size) or None}


def add_draft_vocab_args(p) -> None:
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="draft only among the N most frequent tokens of --draft-vocab-counts (the drafter's LM head "
        "shrinks to N rows; verification keeps the whole vocabulary, output stays the target's)",
    )
    p.add_argument(
        "--draft-vocab-counts",
        metavar="PATH",
        help="frequency table for --draft-vocab: a `dflash2 data` folder of this target or a .npy of "
        "counts per token id (default: the drafter folder's token_counts.npy)",
    )


def summary(r) -> str:
    """One line on a generation (a `GenerationResult`): what `generate` and `chat` print on stderr."""
    mode = {
        "dflash": f"dflash B={r.block_size}",
        "adaptive": f"adaptive B<={r.block_size}",
        "ddtree": f"ddtree B<={r.block_size} budget {r.tree_budget}",
    }.get(r.verify_mode, "plain")
    parts = [
        f"[{mode}] {r.generation_tokens} tokens at {r.generation_tps:.1f} tok/s",
        f"prompt {r.prompt_tokens} tokens at {r.prompt_tps:.1f} tok/s",
    ]
    if r.verify_mode != "off":
        parts.append(f"tau {r.tau:.2f} over {r.cycles} cycles" if r.cycles else "no cycles")
    if r.verify_mode == "adaptive":
        histogram = " ".join(f"B{b}:{n}" for b, n in r.block_sizes.items()) or "none"
        parts.append(f"blocks {histogram}, {r.plain_tokens} tokens by plain steps")
    if r.lookup_cycles:
        parts.append(f"{r.lookup_tokens} drafts from lookups ({r.lookup_cycles} cycles)")
    if r.draft_failures:
        parts.append(f"{r.draft_failures} cycles fell back to plain decoding (non-finite draft logits)")
    parts += [f"peak {r.peak_memory_gb:.2f} GB", f"finish: {r.finish_reason}"]
    return " | ".join(parts)


def command_line(args) -> str | None:
    """The command that made `args` (`dflash2 ...`, shell-quoted), None when not run from the command line."""
    words = getattr(args, "argv", None)
    return None if words is None else shlex.join(["dflash2", *words])


def write_markdown(args, text: str) -> None:
    """Write a report's markdown to `--markdown` (when given), opening with the command that made it, so a
    reader can make it again."""
    if not args.markdown:
        return
    command = command_line(args)
    Path(args.markdown).write_text((f"Made by `{command}`.\n\n" if command else "") + text)


def add_bench_model_args(p) -> None:
    """The target and the drafters that bench, replay and tree-sim compare (`load_bench_models`)."""
    p.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument(
        "--draft-model",
        action="append",
        default=[],
        help="a DFlash drafter (repeatable; default target: its bundled v1 and DFlash 2 drafters)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--kernels", choices=["auto", "metal", "mlx"], default="auto", help=KERNELS_HELP)


def load_bench_models(args):
    """The target of `add_bench_model_args`' flags and each drafter bound to it.

    Args:
        args: the parsed flags; without --model and --draft-model, `args.draft_model` is set to the default
            target's bundled v1 and DFlash 2 drafters.

    Returns:
        (model, tokenizer, [(label, drafter)], the drafters' paths): each label is the drafter folder's name,
        with "#n" added to a name already taken.
    """
    model, tokenizer = load_target(args.model, args.dtype)
    if not args.model and not args.draft_model:
        args.draft_model = [str(default_drafter("v1")), str(default_drafter("dflash2"))]
    drafters, sources = [], []
    for path in args.draft_model:
        drafter = load_drafter(path, kernels=args.kernels)
        bind_drafter(drafter, model)
        label = path.rstrip("/").split("/")[-1]
        if label in {name for name, _ in drafters}:
            label = f"{label}#{len(drafters) + 1}"
        drafters.append((label, drafter))
        sources.append(path)
    return model, tokenizer, drafters, sources


def bench_prompts(args, tokenizer) -> tuple[list[str], list[list[int]]]:
    """(the texts, their token ids) of --prompts (suites, comma-separated, or a JSONL file), --num-prompts of each,
    encoded as a user turn of the chat template where the tokenizer has one."""
    texts = []
    for suite in args.prompts.split(",") if args.prompts.split(",")[0] in SUITES else [args.prompts]:
        texts += load_suite(suite, args.num_prompts)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        if tokenizer.has_chat_template
        else tokenizer.encode(t)
        for t in texts
    ]
    return texts, prompts
