"""Load a running `dflash2 serve` (or any OpenAI-compatible server): N clients, each sending M conversations of
T turns, streaming, and print throughput and latency percentiles.

    python -m dflash2_apps.load --url http://127.0.0.1:8080 --clients 4 --requests 3 --max-tokens 32
    python -m dflash2_apps.load --clients 1 --requests 3 --turns 2     # TTFT of a chat's first and second turns

A turn's latency is from sending the request to the last event; TTFT to the first chunk with text. Each later
turn resends the conversation so far (its prompt, the server's reply, a new question), so a server that reuses
the shared prefix answers it faster; `cached` is the prompt tokens the server says it took from its cache.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlparse

from dflash2_mlx.prompts import load_suite

FOLLOW_UPS = ["Can you say that more briefly?", "Give one more example.", "Why is that?"]


def percentiles(values: list[float], points=(50, 90, 99)) -> str:
    if not values:
        return "n/a"
    ordered = sorted(values)
    pick = lambda p: ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]  # noqa: E731
    return " ".join(f"p{p} {pick(p) * 1000:.0f} ms" for p in points)


def chat_turn(host: str, port: int, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streaming chat request: its reply text and timings, usage and dflash stats."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    tic = time.perf_counter()
    try:
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True, "temperature": 0,
                "stream_options": {"include_usage": True}}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {r.read().decode(errors='replace')[:200]}"}
        text, ttft, usage, stats = "", None, {}, {}
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": event["error"]["message"]}
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - tic
                    text += piece
            usage, stats = event.get("usage") or usage, event.get("dflash") or stats
        return {"text": text, "ttft": ttft, "latency": time.perf_counter() - tic, "usage": usage, "dflash": stats}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        conn.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dflash2_apps.load", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (N)")
    p.add_argument("--requests", type=int, default=4, help="conversations per client (M)")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompts", default="math", help="a prompt suite (math, chat, code) or a JSONL file")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    args = p.parse_args(argv)
    prompts = load_suite(args.prompts)
    url = urlparse(args.url)
    host, port = url.hostname, url.port or 80
    turns: list[list[dict]] = [[] for _ in range(args.turns)]
    lock = threading.Lock()

    def client(c: int) -> None:
        for m in range(args.requests):
            messages = [{"role": "user", "content": prompts[(c * args.requests + m) % len(prompts)]}]
            for t in range(args.turns):
                result = chat_turn(host, port, messages, args.max_tokens, args.timeout)
                with lock:
                    turns[t].append(result)
                if "error" in result:
                    break
                messages += [{"role": "assistant", "content": result["text"]},
                             {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    done = [r for results in turns for r in results if "error" not in r]
    errors = [r["error"] for results in turns for r in results if "error" in r]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in done)
    print(f"{args.clients} clients x {args.requests} conversations x {args.turns} turns, max_tokens "
          f"{args.max_tokens}: {len(done)} requests ok, {len(errors)} failed, {wall:.1f} s")
    print(f"throughput: {len(done) / wall:.2f} requests/s, {tokens / wall:.1f} completion tokens/s")
    print(f"latency: {percentiles([r['latency'] for r in done])}")
    for t, results in enumerate(turns):
        ok = [r for r in results if "error" not in r]
        taus = [r["dflash"]["tau"] for r in ok if r["dflash"].get("tau") is not None]
        modes = sorted({r["dflash"].get("verify_mode") for r in ok})
        cached = [r["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) for r in ok]
        prompt = [r["usage"].get("prompt_tokens", 0) for r in ok]
        print(f"turn {t + 1}: TTFT {percentiles([r['ttft'] for r in ok if r['ttft'] is not None])}"
              f" (mean {statistics.mean([r['ttft'] for r in ok if r['ttft'] is not None] or [0]) * 1000:.0f} ms);"
              f" prompt {statistics.mean(prompt or [0]):.0f} tokens, cached {statistics.mean(cached or [0]):.0f};"
              f" tau {statistics.mean(taus) if taus else float('nan'):.2f}; verify mode {','.join(map(str, modes))}")
    for e in errors[:5]:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
