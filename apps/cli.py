"""The `dflash2` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

KERNELS_HELP = "the hot DFlash 2 ops as fused Metal kernels (auto: where Metal exists) or pure MLX; same results"


def _generate_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with DFlash speculative decoding (or plain decoding of the same target)",
        description="Generate text from a target model, speculatively with a DFlash drafter.",
    )
    _add_model_args(p)
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    _add_sampling_args(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.set_defaults(run=_run_generate)


def _add_model_args(p) -> None:
    """The target, the drafter and how they decode: what generate, serve and chat share."""
    from dflash2_mlx.generate import VERIFY_MODES

    d = _generation_defaults()
    p.add_argument(
        "--model",
        help="target: mlx-lm model folder, hub id or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--draft-model",
                   help="DFlash drafter: local folder or hub id (default target: its bundled DFlash 2 drafter)")
    p.add_argument(
        "--block-size", type=int, default=None,
        help="runtime block size (draft + verify tokens per cycle); dflash mode: default the drafter's, "
        "capped at 5 for DFlash 2 as oMLX does; adaptive mode: the largest it may pick (default the drafter's)",
    )
    p.add_argument(
        "--verify-mode", choices=VERIFY_MODES, default=None,
        help="adaptive (default, as oMLX): each cycle's block size, or plain steps, picked from this machine's "
        "measured costs and the acceptance so far, never slower than plain decoding by design; dflash: every "
        "cycle at --block-size; ddtree: every cycle verifies a tree of drafts (--tree-budget nodes, at most "
        "--block-size - 1 deep) in one target pass; off: plain decoding of the same target through the same loader "
        "(the baseline)",
    )
    p.add_argument("--tree-budget", type=int, metavar="N",
                   help="ddtree mode: draft nodes per tree, built best-first from the drafter's lattice (default: the "
                   "most nodes this machine verifies for at most 10%% more than the linear block, from its measured "
                   "costs)")
    p.add_argument(
        "--path", choices=["greedy", "viterbi"],
        help=f"how a DFlash 2 drafter's path selector walks its candidates at T = 0 (default {d['walk']})",
    )
    p.add_argument(
        "--draft-quant", metavar="SPEC",
        help="quantize the drafter at load, oMLX style: w{bits}a{act}:gs{group}, e.g. w4a16:gs64",
    )
    _add_draft_vocab_args(p)
    p.add_argument(
        "--draft-dtype", choices=["bfloat16", "float32"],
        help="drafter compute dtype (default: float32 on CPU, the stored dtype on Metal; float16 is refused)",
    )
    p.add_argument("--max-context", type=int, help="prompts of at least this many tokens run plain decoding")
    p.add_argument("--omlx-settings", metavar="FILE", help="an oMLX model_settings.json to take DFlash settings from")
    p.add_argument("--omlx-model", metavar="ID", help="the model id of the entry in --omlx-settings to use")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"],
        help="cast the target's weights (GGUF default: float32 on CPU, quantized tensors kept on Metal)",
    )
    p.add_argument("--prefill-step-size", type=int,
                   help=f"prompt tokens per prefill forward (default {d['prefill_step_size']})")
    p.add_argument("--kernels", choices=["auto", "metal", "mlx"], default="auto", help=KERNELS_HELP)


def _generation_defaults() -> dict:
    """`stream_generate`'s own keyword defaults: what a flag left unset means."""
    from inspect import signature

    from dflash2_mlx.generate import stream_generate

    return {k: p.default for k, p in signature(stream_generate).parameters.items() if p.default is not p.empty}


def _add_sampling_args(p) -> None:
    d = _generation_defaults()
    p.add_argument("--max-tokens", "-m", type=int, help=f"default {d['max_tokens']}")
    p.add_argument("--temp", type=float, help=f"sampling temperature (0 = greedy; default {d['temp']})")
    p.add_argument("--top-p", type=float, help=f"1 = off (default {d['top_p']})")
    p.add_argument("--top-k", type=int, help=f"0 = off (default {d['top_k']})")
    p.add_argument("--min-p", type=float, help=f"0 = off (default {d['min_p']}); as in mlx-lm, top-p, min-p and top-k "
                   "filter before temperature applies")
    p.add_argument("--seed", type=int, help="default: MLX's global random state")


def _apply_omlx_settings(args) -> None:
    """Fill what the command line left unset from the oMLX entry; explicit flags win."""
    from dflash2_mlx.settings import from_omlx

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
    args.draft_quant = args.draft_quant or (str(settings.draft_quant) if settings.draft_quant else None)
    for note in settings.notes:
        print(f"[dflash2] oMLX settings: {note}", file=sys.stderr)


def _load_pair(args):
    """(model, tokenizer, drafter) as `_add_model_args`' flags say; drafter None for --verify-mode off."""
    from dflash2_mlx import load
    from dflash2_mlx.kernels import use_metal

    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    _apply_omlx_settings(args)
    args.verify_mode = args.verify_mode or _generation_defaults()["verify_mode"]
    if args.verify_mode != "off" and not args.draft_model:
        if args.model:
            raise ValueError(
                f"--verify-mode {args.verify_mode} needs --draft-model for {args.model} (drafters are bundled only "
                "for the default target); use --verify-mode off for plain decoding"
            )
        from dflash2_mlx.assets import default_drafter

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


def _generation_kwargs(args) -> dict:
    """`stream_generate`'s keyword arguments from the model and sampling flags (its own default where unset)."""
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
    defaults = _generation_defaults()
    return {k: defaults[k] if v is None and k in defaults else v for k, v in given.items()}


def _run_generate(args) -> int:
    from dflash2_mlx import generate
    from dflash2_mlx.runtime import runtime_info

    model, tokenizer, drafter = _load_pair(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.ignore_chat_template and tokenizer.has_chat_template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True
        )
    kwargs = _generation_kwargs(args)
    result = generate(model, tokenizer, prompt, drafter, verbose=not args.json, **kwargs)
    if args.json:
        vocab = None if drafter is None or drafter.draft_vocab is None else len(drafter.draft_vocab)
        extra = {"path": kwargs["walk"], "draft_quant": args.draft_quant, "draft_vocab": vocab,
                 "runtime": runtime_info(args.kernels)}
        print(json.dumps({**result.to_dict(), **extra}))
    else:
        print(_summary(result), file=sys.stderr)
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (chat and text completions, streaming or not)",
        description="Serve the target, speculatively with a DFlash drafter, over OpenAI's API: POST "
        "/v1/chat/completions and /v1/completions, GET /v1/models and /health. The generation flags are the "
        "defaults of requests that do not set them.",
    )
    _add_model_args(p)
    _add_sampling_args(p)
    from dflash2_apps.serve import ServeSettings

    d = ServeSettings()
    p.add_argument("--host", default=d.host, help="address to bind (anything but loopback exposes the model; "
                   "default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="0 picks a free port, printed on stderr (default "
                   "%(default)s)")
    p.add_argument("--queue-size", type=int, default=d.queue_size,
                   help="requests waiting beyond the running one; more get 503 (default %(default)s)")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request may take, queueing included; past it the generation is stopped "
                   "(default %(default)s)")
    p.add_argument("--context-length", type=int, default=d.context_length,
                   help="longest prompt + max_tokens accepted (default: the model's max_position_embeddings)")
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=d.prompt_cache,
                   help="reuse the previous request's caches for the prefix a request shares with it")
    p.add_argument("--model-id", help="the name clients use in 'model' (default: --model, or the default target's)")
    p.set_defaults(run=_run_serve)


def build_server(args):
    """(App, HTTP server) for parsed `serve` arguments; the server is bound but not yet serving."""
    from dflash2_apps.serve import App, ServeSettings, make_server
    from dflash2_mlx.assets import DEFAULT_TARGET_NAME

    settings = ServeSettings(args.host, args.port, args.queue_size, args.request_timeout, args.context_length,
                             args.prompt_cache)
    model, tokenizer, drafter = _load_pair(args)
    app = App(model, tokenizer, drafter, args.model_id or args.model or DEFAULT_TARGET_NAME,
              _generation_kwargs(args), settings)
    try:
        return app, make_server(app)
    except BaseException:
        app.close()
        raise


def _run_serve(args) -> int:
    app, server = build_server(args)
    host, port = server.server_address[:2]
    mode = args.verify_mode if args.verify_mode == "off" else f"{args.verify_mode} with {args.draft_model}"
    print(f"[dflash2] serving {app.model_id} ({mode}) on http://{host}:{port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        app.close()
        server.server_close()
    return 0


def _chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="an interactive chat in the terminal, keeping the conversation and its caches",
        description="Chat with the target, speculatively with a DFlash drafter. Each turn reuses the caches of "
        "the conversation so far and prints its acceptance summary. 'q' quits, 'r' starts a new conversation.",
    )
    _add_model_args(p)
    _add_sampling_args(p)
    p.add_argument("--system-prompt", help="a system message opening the conversation")
    p.add_argument("--prompt-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the conversation's caches from turn to turn")
    p.set_defaults(run=_run_chat)


def _run_chat(args) -> int:
    from dflash2_apps.chat import repl

    model, tokenizer, drafter = _load_pair(args)
    repl(model, tokenizer, drafter, _generation_kwargs(args), args.system_prompt, args.prompt_cache)
    return 0


def _add_draft_vocab_args(p) -> None:
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="draft only among the N most frequent tokens of --draft-vocab-counts (the drafter's LM head "
                   "shrinks to N rows; verification keeps the whole vocabulary, output stays the target's)")
    p.add_argument("--draft-vocab-counts", metavar="PATH",
                   help="frequency table for --draft-vocab: a `dflash2 data` folder of this target or a .npy of "
                   "counts per token id (default: the drafter folder's token_counts.npy)")


def _convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="Hugging Face / CUDA drafter (or GGUF target) -> MLX folder",
        description="Convert a DFlash v1 / DFlash 2 / Muse-style drafter in the Hugging Face layout (the one "
        "the CUDA engines use) to an MLX folder, optionally quantized; or a GGUF target to an mlx-lm folder.",
    )
    p.add_argument("--hf-path", required=True, help="drafter folder, hub id, or a .gguf target file")
    p.add_argument("--mlx-path", required=True, help="output folder")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="weights dtype (drafters: default bfloat16; GGUF: default keeps quantized tensors)")
    p.add_argument("--force-float16", action="store_true", help="allow a float16 drafter (NaN-prone)")
    p.add_argument("-q", "--quantize", action="store_true", help="quantize the drafter (mlx-lm format)")
    from dflash2_mlx.checkpoints.quantize import DraftQuant

    q = DraftQuant()
    p.add_argument("--q-bits", type=int, default=q.bits, choices=[2, 3, 4, 5, 6, 8])
    p.add_argument("--q-group-size", type=int, default=q.group_size, choices=[32, 64, 128])
    p.add_argument("--activation-bits", type=int, default=q.activation_bits, choices=[16, 32],
                   help="compute dtype of the quantized drafter at run time: 16 = bfloat16, 32 = float32")
    _add_draft_vocab_args(p)
    p.set_defaults(run=_run_convert)


def _run_convert(args) -> int:
    from dflash2_mlx.checkpoints.gguf import convert_gguf
    from dflash2_mlx.checkpoints.hf import convert
    from dflash2_mlx.checkpoints.quantize import DraftQuant

    if args.hf_path.endswith(".gguf"):
        if args.quantize:
            raise ValueError("-q applies to drafters; a GGUF target keeps its own quantization (or --dtype)")
        out = convert_gguf(args.hf_path, args.mlx_path, args.dtype)
    else:
        quant = DraftQuant(args.q_bits, args.activation_bits, args.q_group_size) if args.quantize else None
        out = convert(args.hf_path, args.mlx_path, args.dtype or "bfloat16", quant, args.force_float16,
                      draft_vocab=args.draft_vocab, vocab_counts=args.draft_vocab_counts)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _export_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="MLX drafter folder -> Hugging Face layout for the CUDA engines",
        description="Write an MLX drafter back in the Hugging Face layout (names, config, safetensors) that "
        "SGLang, vLLM and the authors' PyTorch code load. Quantized drafters are written dequantized.",
    )
    p.add_argument("--mlx-path", required=True)
    p.add_argument("--hf-path", required=True)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from dflash2_mlx.checkpoints.hf import export

    print(f"wrote {export(args.mlx_path, args.hf_path, args.dtype)}", file=sys.stderr)
    return 0


def _data_parser(sub) -> None:
    p = sub.add_parser(
        "data",
        help="build a drafter training set: ShareGPT prompts, responses regenerated by the target",
        description="Format ShareGPT prompts with the target's chat template, regenerate the responses with the "
        "target (batched), and write resumable shards with a held-out split. Rerun the same command to resume.",
    )
    from dflash2_mlx.train.data import DataSettings

    d = DataSettings(target="")  # the flags' defaults
    p.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num-prompts", type=int, default=d.num_prompts,
                   help="prompts to answer; rerunning with a larger number grows an existing folder")
    p.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longer prompts are skipped")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--temp", type=float, default=d.temperature, help="0 = greedy responses")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help="responses decoded at once (continuous batching; may change between runs)")
    p.set_defaults(run=_run_data)


def _run_data(args) -> int:
    import numpy as np

    from dflash2_mlx.train.data import DataSettings, build, read_shards
    from dflash2_mlx.vocab import COUNTS_FILE, token_counts

    settings = DataSettings(args.model, args.num_prompts, args.max_prompt_tokens, args.max_new_tokens,
                            args.temp, args.seed, args.batch_size)
    out = build(args.out, settings)
    np.save(out / COUNTS_FILE, token_counts(out).astype(np.int32))  # for --draft-vocab
    samples = read_shards(out)
    held = sum(s.heldout for s in samples)
    tokens = sum(len(s.tokens) - s.prompt_len for s in samples)
    print(f"{out}: {len(samples) - held} training + {held} held-out samples, {tokens} response tokens",
          file=sys.stderr)
    return 0


# `dflash2 train` flag -> (TrainSettings field, type, help); each default is the dataclass's, shown in --help.
TRAIN_FLAGS = {
    "--arch": ("architecture", str, "dflash2 or v1 (default dflash2; with --init-from: the folder's, and "
               "dflash2 over a v1 folder warm-starts a DFlash 2 drafter from it)"),
    "--block-size": ("block_size", int, "block size the drafter is trained for"),
    "--layers": ("layers", int, "drafter layers"),
    "--steps": ("steps", int, "optimizer steps (the schedule's length; a longer value on resume stretches it)"),
    "--sequences-per-step": ("sequences_per_step", int, "training sequences per step"),
    "--anchors-per-sequence": ("anchors_per_sequence", int, "blocks drafted from random anchors per sequence"),
    "--lr": ("learning_rate", float, "peak learning rate (warmup 4%%, cosine to 10%%)"),
    "--selector-rank": ("selector_rank", int, "DFlash 2 path selector rank"),
    "--mask-token-id": ("mask_token_id", int, "the block's mask token (default: the last vocabulary id)"),
    "--eval-every": ("eval_every", int, "steps between held-out evaluations (tau, first-draft accuracy)"),
    "--checkpoint-every": ("checkpoint_every", int, "steps between checkpoints"),
    "--seed": ("seed", int, "the batches and the initialization"),
    "--init-from": ("init_from", str, "start from this drafter folder or hub id (its config replaces "
                    "--block-size/--layers)"),
    "--distill": ("distill", float, "weight of the loss to the target's top-8 next-token distribution (cached "
                  "with the features); 0 = hard labels only"),
    "--draft-vocab": ("draft_vocab", int, "train and draft over the N most frequent tokens of the training "
                      "responses (the drafter's draft vocabulary: a smaller LM head in every training step and "
                      "draft; the loss skips drafts of rarer tokens); default: every token of the training data"),
    "--ema": ("ema", float, "decay of an exponential moving average of the weights (e.g. 0.999): the average is "
              "what is evaluated and exported, the raw weights' tau is logged beside it; 0 = off"),
    "--time-budget": ("time_budget", float, "minutes of wall time for this run: it stops there with a checkpoint, "
                      "and rerunning the command continues"),
}


def _train_parser(sub) -> None:
    from dataclasses import fields

    from dflash2_mlx.train.trainer import TrainSettings

    defaults = {f.name: f.default for f in fields(TrainSettings)}
    p = sub.add_parser(
        "train",
        help="train a DFlash v1 or DFlash 2 drafter for a target on `dflash2 data` output",
        description="Train a drafter (resumable: rerun the same command to continue from the last checkpoint). "
        "Writes OUT/checkpoint and OUT/curve.csv (the held-out learning curve), then OUT/drafter (a folder "
        "`--draft-model` and `dflash2 export` take) with its card. Runs unchanged on MLX's CUDA backend.",
    )
    p.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--data", required=True, help="a `dflash2 data` folder")
    p.add_argument("--out", required=True)
    for flag, (name, kind, text) in TRAIN_FLAGS.items():
        default = defaults[name]
        p.add_argument(flag, type=kind, dest=name, choices=["dflash2", "v1"] if name == "architecture" else None,
                       help=text if default is None or name == "architecture" else f"{text} (default {default})")
    p.add_argument("--full-selector", action="store_true", help="V x R codebooks instead of factorised ones")
    p.add_argument("--init-from-target", action="store_true",
                   help="start the drafter's layers and final norm as the target's last layers")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="compute the target's features at every step instead of once into the data folder")
    p.set_defaults(run=_run_train)


def _run_train(args) -> int:
    from dflash2_mlx.loading import load_target
    from dflash2_mlx.train.trainer import Trainer, TrainSettings, write_card

    given = {name: getattr(args, name) for name, _, _ in TRAIN_FLAGS.values() if getattr(args, name) is not None}
    settings = TrainSettings(data=args.data, selector_factorized=not args.full_selector,
                             cache_features=not args.no_feature_cache, init_from_target=args.init_from_target,
                             **given)
    model, _ = load_target(args.model)
    trainer = Trainer(model, args.out, settings)
    result = trainer.run()
    folder = trainer.export(f"{args.out}/drafter")
    write_card(folder, trainer, args.model or "SmolLM2-135M-Instruct")
    tau = next((e["tau"] for e in reversed(trainer.log) if "tau" in e), None)
    print(f"{folder}: step {result['step']}, held-out tau {tau}", file=sys.stderr)
    return 0


def _bench_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="compare tokens/s of every decoding method side by side, in one process, with a lossless check",
        description="Run mlx-lm's generation, plain decoding through our loop, mlx-lm's classic speculative "
        "decoding (--baseline-draft-model) and each DFlash drafter (each block size; DFlash 2 with both walks), "
        "trial by trial after a warm-up, and report tokens/s, speedup, acceptance, memory and a token-hash check.",
    )
    p.add_argument("--model", help="target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft-model", action="append", default=[],
                   help="a DFlash drafter (repeatable; default target: its bundled v1 and DFlash 2 drafters)")
    p.add_argument("--baseline-draft-model", help="a classic draft model for mlx-lm's speculative decoding")
    p.add_argument("--prompts", default="math", help="suites (code, chat, math, long; comma-separated) or a JSONL file")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts taken from each suite")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--block-sizes", help="comma-separated runtime block sizes (default: each drafter's default)")
    p.add_argument("--temp", type=float, action="append", help="temperature (repeatable; default 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--json", metavar="OUT", help="write everything machine-readable here")
    p.add_argument("--markdown", metavar="OUT", help="write the report as markdown here")
    p.add_argument("--walk", action="append", choices=["greedy", "viterbi"],
                   help="DFlash 2 path walks to bench (repeatable; default both)")
    p.add_argument("--quick", action="store_true", help="1 trial, 2 prompts, 24 tokens: a smoke run")
    p.add_argument("--kernels", choices=["auto", "metal", "mlx"], default="auto", help=KERNELS_HELP)
    p.add_argument("--compare", metavar="FILE",
                   help="CUDA-side results to show beside ours: a dflash2-compare/1 JSON, a z-lab benchmark log, "
                   "SGLang responses (JSONL), or 'published'")
    p.add_argument("--tree-sim", metavar="DATA",
                   help="instead of timing: teacher-forced tau of the linear path and of ddtree trees per budget, on "
                   "the held-out samples of this `dflash2 data` folder (greedy responses of this target)")
    p.add_argument("--tree-budgets",
                   help="comma-separated tree budgets: a ddtree row per budget (at each block size; 'auto': the "
                   "default budget from this machine's costs), or the columns of --tree-sim (default there: "
                   "1,2,4,8,16,32)")
    p.add_argument("--tree-sim-samples", type=int, default=8, help="held-out samples --tree-sim reads")
    p.add_argument("--engines", metavar="LIST",
                   help="peer engines to add rows for, each in its own process with the same target, drafters and "
                   "prompts: dflash (the authors' reference), dflash-mlx (oMLX's engine); comma-separated")
    p.add_argument("--peer-python", metavar="PYTHON",
                   help="the interpreter the peer engines are installed in (default: this one), e.g. a venv's "
                   "bin/python, so their pinned dependencies stay out of this environment")
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    from mlx.utils import tree_flatten

    from dflash2_apps.bench import bench, methods_for, peer_methods, render, report_console, report_json
    from dflash2_apps.peers import Peers, check_python, parse_engines

    if args.compare:  # fail on a bad comparison file before spending time on the runs
        from dflash2_apps.compare import load_comparison

        load_comparison(args.compare)
    engines = parse_engines(args.engines)
    if args.peer_python and not engines:
        raise ValueError("--peer-python goes with --engines (the peer engines it runs)")
    peer_python = check_python(args.peer_python) if args.peer_python else sys.executable
    from dflash2_mlx.loading import bind_drafter, load_drafter, load_target
    from dflash2_mlx.kernels import use_metal
    from dflash2_mlx.prompts import SUITES, load_suite
    from dflash2_mlx.runtime import runtime_info

    use_metal(args.kernels)  # a setting this machine cannot run fails here, before any loading
    if args.quick:
        args.trials, args.num_prompts, args.max_tokens = 1, 2, 24
    model, tokenizer = load_target(args.model, args.dtype)
    if not args.model and not args.draft_model:
        from dflash2_mlx.assets import default_drafter

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
    classic = load_target(args.baseline_draft_model, args.dtype)[0] if args.baseline_draft_model else None
    texts = []
    for suite in args.prompts.split(",") if args.prompts.split(",")[0] in SUITES else [args.prompts]:
        texts += load_suite(suite, args.num_prompts)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        if tokenizer.has_chat_template else tokenizer.encode(t) for t in texts
    ]
    if args.tree_sim:
        return _tree_sim(args, model, drafters)
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else None
    budgets = tuple(None if b == "auto" else int(b) for b in args.tree_budgets.split(",")) if args.tree_budgets else ()
    methods = methods_for(drafters, sizes, classic is not None, tuple(args.walk or ("greedy", "viterbi")), budgets)
    peers = Peers()
    try:
        if engines:
            started = peers.start(engines, peer_python, args.model, args.dtype, model,
                                  [(label, d, src) for (label, d), src in zip(drafters, sources)])
            methods += peer_methods(started, drafters, sizes)
        report = bench(model, tokenizer, prompts, methods, args.max_tokens, args.trials, args.temp or [0.0], classic)
    finally:
        peers.close()
    weights = [v for _, v in tree_flatten(model.parameters())]
    report["context"] = {
        "target": args.model or "SmolLM2-135M-Instruct (default)",
        "drafters": [label for label, _ in drafters],
        "dtype": ",".join(sorted({str(w.dtype).split(".")[-1] for w in weights})),
        "prompts": len(prompts), "suites": args.prompts, "trials": args.trials, "max_tokens": args.max_tokens,
        "runtime": runtime_info(args.kernels), "engines": engines, "peer_python": peer_python if engines else None,
    }
    console = report_console()
    markdown = render(report, console)
    if args.compare:
        from dflash2_apps.compare import load_comparison, render_comparison

        report["compare"] = load_comparison(args.compare)
        markdown += render_comparison(report["compare"], report["results"], console)
    if args.json:
        Path(args.json).write_text(report_json(report))
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    return 1 if report["errors"] else 0


def _tree_sim(args, model, drafters) -> int:
    """`bench --tree-sim`: the teacher-forced tau table, one row per drafter (and block size)."""
    from dflash2_mlx.loading import bind_drafter
    from dflash2_mlx.train.data import read_shards
    from dflash2_mlx.train.tree_eval import simulate_tree_acceptance

    samples = read_shards(args.tree_sim, heldout=True)[: args.tree_sim_samples]
    if not samples:
        raise ValueError(f"{args.tree_sim} holds no held-out samples: give a `dflash2 data` folder of this target")
    budgets = [int(b) for b in (args.tree_budgets or "1,2,4,8,16,32").split(",")]
    sizes = [int(b) for b in args.block_sizes.split(",")] if args.block_sizes else [None]
    lines = [f"teacher-forced tau on {len(samples)} held-out samples of {args.tree_sim}", "",
             "| drafter | B | blocks | linear | " + " | ".join(f"tree {b}" for b in budgets) + " |",
             "|---|---|---|---|" + "---|" * len(budgets)]
    for label, drafter in drafters:
        for B in sizes:
            sim = simulate_tree_acceptance(bind_drafter(drafter, model), drafter, samples, budgets, B)
            taus = [sum(sim["tree"][b]) / sim["blocks"] + 1 for b in budgets]
            lines.append(f"| {label} | {B or drafter.config.block_size} | {sim['blocks']} | "
                         f"{sum(sim['linear']) / sim['blocks'] + 1:.2f} | " + " | ".join(f"{t:.2f}" for t in taus) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return 0


def _info_parser(sub) -> None:
    p = sub.add_parser(
        "info",
        help="a drafter's config and parameter counts per component",
        description="Show a drafter's configuration and where its parameters are.",
    )
    p.add_argument("path", help="drafter folder or hub id")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_run_info)


def _run_info(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from dflash2_mlx.info import drafter_info

    info = drafter_info(args.path)
    if args.json:
        print(json.dumps(info))
        return 0
    console = Console()
    cfg = info["config"]
    console.print(f"[bold]{info['path']}[/]  {cfg['architecture']}")
    for key in ("num_hidden_layers", "hidden_size", "block_size", "target_layer_ids", "mask_token_id",
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "dtype",
                "quantization"):
        if cfg.get(key) not in (None, 0):
            console.print(f"  {key}: {cfg[key]}")
    table = Table("component", "parameters", "share", title="parameters")
    for name, count in info["parameters"].items():
        if name != "total":
            table.add_row(name, f"{count:,}", f"{count / info['parameters']['total']:.1%}")
    table.add_row("[bold]total[/]", f"[bold]{info['parameters']['total']:,}[/]", "100.0%")
    console.print(table)
    return 0


def _summary(r) -> str:
    mode = {"dflash": f"dflash B={r.block_size}", "adaptive": f"adaptive B<={r.block_size}",
            "ddtree": f"ddtree B<={r.block_size} budget {r.tree_budget}"}.get(r.verify_mode, "plain")
    parts = [
        f"[{mode}] {r.generation_tokens} tokens at {r.generation_tps:.1f} tok/s",
        f"prompt {r.prompt_tokens} tokens at {r.prompt_tps:.1f} tok/s",
    ]
    if r.verify_mode != "off":
        parts.append(f"tau {r.tau:.2f} over {r.cycles} cycles" if r.cycles else "no cycles")
    if r.verify_mode == "adaptive":
        histogram = " ".join(f"B{b}:{n}" for b, n in r.block_sizes.items()) or "none"
        parts.append(f"blocks {histogram}, {r.plain_tokens} tokens by plain steps")
    if r.draft_failures:
        parts.append(f"{r.draft_failures} cycles fell back to plain decoding (non-finite draft logits)")
    parts += [f"peak {r.peak_memory_gb:.2f} GB", f"finish: {r.finish_reason}"]
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from dflash2_apps.openblas import restart_with_openblas

        restart_with_openblas(["-m", "dflash2_apps.cli", *sys.argv[1:]])
    args = make_parser().parse_args(argv)
    # the library's notices (logging, never print): a download, a measurement, a dtype it had to change
    logging.basicConfig(level=logging.INFO, format="[dflash2] %(message)s")
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"dflash2 {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash2", description="DFlash / DFlash 2 speculative decoding on MLX"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _chat_parser(sub)
    _convert_parser(sub)
    _export_parser(sub)
    _data_parser(sub)
    _train_parser(sub)
    _bench_parser(sub)
    _info_parser(sub)
    return parser


if __name__ == "__main__":
    sys.exit(main())
