"""`dflash2 chat`: a terminal chat like `mlx_lm.chat`, speculative, keeping the conversation and its caches.

Every turn renders the whole conversation with the chat template and generates from it with one `PromptCache`,
so only the new message is prefilled: the caches of everything before it are reused.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace

from dflash2_apps import common
from dflash2_mlx import PromptCache, stream_cycles
from dflash2_mlx.generate import summarize
from dflash2_mlx.target import Target

HELP = "'q' quits, 'r' starts a new conversation, 'h' shows this"


def repl(
    model, tokenizer, drafter, kwargs: dict, system_prompt: str | None, reuse: bool, read=input, out=None, err=None
) -> list[dict]:
    """Chat until 'q' or end of input; returns the conversation. `kwargs` are `stream_cycles`'; `reuse`
    keeps the conversation's caches from turn to turn (a `PromptCache`). `out`, `err`: default the streams
    `sys` has when the chat starts (not when this module was imported)."""
    out, err = out or sys.stdout, err or sys.stderr
    opening = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages, cache = list(opening), PromptCache() if reuse else None
    print(f"[dflash2] {HELP}", file=err)
    while True:
        try:
            query = read(">> ")
        except EOFError:
            break
        if query.strip() == "q":
            break
        if query.strip() in ("r", "h", ""):
            if query.strip() == "r":
                messages = list(opening)
            print(f"[dflash2] {'new conversation' if query.strip() == 'r' else HELP}", file=err)
            continue
        messages.append({"role": "user", "content": query})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        records, tic, ttft = [], time.perf_counter(), None
        turn = stream_cycles(model, tokenizer, prompt, drafter, prompt_cache=cache, **kwargs)
        try:
            for r in turn:
                ttft = ttft if ttft is not None else time.perf_counter() - tic
                records.append(replace(r, logprobs=None))  # the token rows are not needed
                print(r.text, end="", flush=True, file=out)
        except KeyboardInterrupt:  # ends the turn, not the chat; what was said so far stays
            print(" [interrupted]", end="", file=out)
        finally:
            turn.close()
        print(file=out, flush=True)
        if not records:
            messages.pop()
            continue
        result = summarize(records, drafter, kwargs.get("block_size"))
        messages.append({"role": "assistant", "content": result.text})
        reused = f"{cache.reused} of {result.prompt_tokens} prompt tokens from the cache" if cache else "no cache"
        print(f"{common.summary(result)} | TTFT {ttft * 1000:.0f} ms, {reused}", file=err, flush=True)
    return messages


def add_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="an interactive chat in the terminal, keeping the conversation and its caches",
        description="Chat with the target, speculatively with a DFlash drafter. Each turn reuses the caches of "
        "the conversation so far and prints its acceptance summary. 'q' quits, 'r' starts a new conversation.",
    )
    common.add_model_args(p)
    common.add_copyspec_args(p)
    common.add_sampling_args(p)
    common.add_processor_args(p)
    p.add_argument("--system-prompt", help="a system message opening the conversation")
    p.add_argument(
        "--prompt-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the conversation's caches from turn to turn",
    )
    p.set_defaults(run=run)


def run(args) -> int:
    model, tokenizer, drafter = common.load_pair(args)
    repl(
        model,
        tokenizer,
        drafter,
        common.generation_kwargs(args, Target(model).vocab_size),
        args.system_prompt,
        args.prompt_cache,
    )
    return 0
