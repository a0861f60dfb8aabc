"""Load a running `dflash2 serve` (or any OpenAI-compatible server): N clients, each sending M conversations of
T turns, streaming, and print throughput and latency percentiles.

    python -m dflash2_apps.load_test --url http://127.0.0.1:8080 --clients 4 --requests 3 --max-tokens 32
    python -m dflash2_apps.load_test --clients 1 --requests 3 --turns 2     # TTFT of a chat's first and second turns

A turn's latency is from sending the request to the last event; TTFT to the first chunk with text. Each later
turn resends the conversation so far (its prompt, the server's reply, a new question), so a server that reuses
the shared prefix answers it faster; `cached` is the prompt tokens the server says it took from its cache.

`--compare` runs the same clients against `dflash2 serve` and `mlx_lm.server` on the same target (`load_compare.py`):

    python -m dflash2_apps.load_test --compare --levels 1,2,4,8 --requests 2 --max-tokens 64 \
        --out runs/smollm2/load-vs-mlx-lm
"""

from __future__ import annotations

import argparse
import statistics
import sys
from urllib.parse import urlparse

from dflash2_apps.load_clients import percentiles, run_clients
from dflash2_apps.load_compare import compare
from dflash2_mlx.prompts import load_suite
from dflash2_mlx.server.batched_worker import BATCHED_SPECULATION


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2_apps.load_test", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (N)")
    p.add_argument("--requests", type=int, default=4, help="conversations per client (M)")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", default="math", help="a prompt suite (math, chat, code) or a JSONL file")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    c = p.add_argument_group("--compare: dflash2 serve against mlx_lm.server")
    c.add_argument(
        "--compare",
        action="store_true",
        help="start both servers on the same target and run the "
        "clients against each alternately at every --levels; write --out .md and .json",
    )
    c.add_argument(
        "--levels",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[1, 2, 4, 8],
        help="concurrent clients, comma-separated (default 1,2,4,8)",
    )
    c.add_argument("--model", help="the target (default: the default target); GGUF is converted for mlx_lm.server")
    c.add_argument("--draft-model", help="dflash2 serve's drafter (default: the bundled one)")
    c.add_argument("--verify-mode", help="dflash2 serve's --verify-mode (default: its own)")
    c.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more argument for dflash2 serve (repeatable, e.g. --serve-arg=--block-size --serve-arg=8)",
    )
    c.add_argument(
        "--batched-speculation",
        type=lambda v: v.split(","),
        default=[],
        metavar="on,off",
        help="start dflash2 serve once per setting given (auto, on, off; comma-separated), each with its "
        "--batched-speculation, and compare them with mlx_lm.server and with each other (on / off)",
    )
    c.add_argument(
        "--trials",
        type=int,
        default=2,
        help="rounds per level, the servers alternating in ABBA order (default %(default)s)",
    )
    c.add_argument("--out", default="load-vs-mlx-lm", help="report path without suffix (default %(default)s)")
    c.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to start")
    args = p.parse_args(argv)
    args.argv = argv
    if args.compare:
        if any(n < 1 for n in args.levels) or args.requests < 1 or args.trials < 1:
            p.error("--levels, --requests and --trials must be positive")
        wrong = [b for b in args.batched_speculation if b not in BATCHED_SPECULATION]
        if wrong or len(set(args.batched_speculation)) < len(args.batched_speculation):
            p.error(
                f"--batched-speculation takes distinct settings among {', '.join(BATCHED_SPECULATION)}; got "
                f"{','.join(args.batched_speculation)}"
            )
        return compare(args)
    prompts = load_suite(args.prompts)
    url = urlparse(args.url)
    host, port = url.hostname, url.port or 80
    turns, wall = run_clients(
        host, port, args.clients, args.requests, args.turns, args.max_tokens, prompts, args.timeout
    )
    done = [r for results in turns for r in results if "error" not in r]
    errors = [r["error"] for results in turns for r in results if "error" in r]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in done)
    print(
        f"{args.clients} clients x {args.requests} conversations x {args.turns} turns, max_tokens "
        f"{args.max_tokens}: {len(done)} requests ok, {len(errors)} failed, {wall:.1f} s"
    )
    print(f"throughput: {len(done) / wall:.2f} requests/s, {tokens / wall:.1f} completion tokens/s")
    print(f"latency: {percentiles([r['latency'] for r in done])}")
    for t, results in enumerate(turns):
        ok = [r for r in results if "error" not in r]
        taus = [r["dflash"]["tau"] for r in ok if r["dflash"].get("tau") is not None]
        modes = sorted({r["dflash"].get("verify_mode") for r in ok})
        cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok]
        prompt = [r["usage"].get("prompt_tokens", 0) for r in ok]
        print(
            f"turn {t + 1}: TTFT {percentiles([r['ttft'] for r in ok if r['ttft'] is not None])}"
            f" (mean {statistics.mean([r['ttft'] for r in ok if r['ttft'] is not None] or [0]) * 1000:.0f} ms);"
            f" prompt {statistics.mean(prompt or [0]):.0f} tokens, cached {statistics.mean(cached or [0]):.0f};"
            f" tau {statistics.mean(taus) if taus else float('nan'):.2f}; verify mode {','.join(map(str, modes))}"
        )
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
