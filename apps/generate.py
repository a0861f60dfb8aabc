"""`dflash2 generate`: text from the target, speculatively with a DFlash drafter (or plain decoding)."""

from __future__ import annotations

import json
import sys

from dflash2_apps import common
from dflash2_mlx import distributed, generate
from dflash2_mlx.machine import runtime_info
from dflash2_mlx.target import Target


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with DFlash speculative decoding (or plain decoding of the same target)",
        description="Generate text from a target model, speculatively with a DFlash drafter.",
    )
    common.add_model_args(p)
    common.add_copyspec_args(p)
    p.add_argument("--prompt", "-p", default="Hello", help="prompt text ('-' reads stdin)")
    common.add_sampling_args(p)
    common.add_processor_args(p)
    p.add_argument("--ignore-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    common.add_sharding_args(p)
    p.set_defaults(run=run)


def run(args) -> int:
    if args.pipeline or args.tensor_parallel:  # one process of several (mlx.launch): rank 0 generates and prints
        target, tokenizer, drafter = common.load_sharded(args)
        if not target.leader:
            distributed.follow(target)
            return 0
        with distributed.leading(target), distributed.watched(target, args.peer_timeout):
            return _generate(args, target, tokenizer, drafter, target.vocab_size)
    model, tokenizer, drafter = common.load_pair(args)
    return _generate(args, model, tokenizer, drafter, Target(model).vocab_size)


def _generate(args, model, tokenizer, drafter, vocab_size: int) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not args.ignore_chat_template and tokenizer.has_chat_template:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    kwargs = common.generation_kwargs(args, vocab_size)
    result = generate(model, tokenizer, prompt, drafter, verbose=not args.json, **kwargs)
    if args.json:
        vocab = None if drafter is None or drafter.draft_vocab is None else len(drafter.draft_vocab)
        extra = {
            "path": kwargs["walk"],
            "draft_quant": args.draft_quant,
            "draft_vocab": vocab,
            "runtime": runtime_info(args.kernels),
        }
        print(json.dumps({**result.to_dict(), **extra}))
    else:
        print(common.summary(result), file=sys.stderr)
    return 0
