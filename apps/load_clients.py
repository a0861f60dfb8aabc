"""The load test's clients: N streaming chat clients, each sending M conversations of T turns to an
OpenAI-compatible server, and the throughput and latency percentiles of what they got (`load_test.py`,
`load_compare.py`)."""

from __future__ import annotations

import http.client
import json
import threading
import time

FOLLOW_UPS = ["Can you say that more briefly?", "Give one more example.", "Why is that?"]


def percentiles(values: list[float], points=(50, 90, 99)) -> str:
    if not values:
        return "n/a"
    return " ".join(f"p{p} {percentile(values, p) * 1000:.0f} ms" for p in points)


def chat_turn(host: str, port: int, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    """One streaming chat request: its reply text and timings, usage and dflash stats."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    tic = time.perf_counter()
    try:
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": True,
            "temperature": 0,
            "stream_options": {"include_usage": True},
        }
        conn.request(
            "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
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


def run_clients(
    host: str, port: int, clients: int, requests: int, turns: int, max_tokens: int, prompts: list[str], timeout: float
) -> tuple[list[list[dict]], float]:
    """`clients` threads, each sending `requests` conversations of `turns` turns: (the results of each turn, in
    order of completion; wall seconds)."""
    results: list[list[dict]] = [[] for _ in range(turns)]
    lock = threading.Lock()

    def client(c: int) -> None:
        for m in range(requests):
            messages = [{"role": "user", "content": prompts[(c * requests + m) % len(prompts)]}]
            for t in range(turns):
                result = chat_turn(host, port, messages, max_tokens, timeout)
                result["prompt_index"] = (c * requests + m) % len(prompts)
                with lock:
                    results[t].append(result)
                if "error" in result:
                    break
                messages += [
                    {"role": "assistant", "content": result["text"]},
                    {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]},
                ]

    tic = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - tic


def percentile(values: list[float], p: float) -> float | None:
    """The nearest-rank percentile (as `percentiles` prints), None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def level_summary(results: list[list[dict]], wall: float) -> dict:
    """Throughput and latency of one run of `run_clients`."""
    done = [r for turn in results for r in turn if "error" not in r]
    errors = [r["error"] for turn in results for r in turn if "error" in r]
    tokens = sum(r["usage"].get("completion_tokens", 0) for r in done)
    latency = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in done if r["ttft"] is not None]
    return {
        "requests": len(done),
        "failed": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "requests_per_s": len(done) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": percentile(latency, 50),
        "latency_p99_s": percentile(latency, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "batch_size_max": max((r["dflash"].get("batch_size", 0) for r in done), default=0),
        "verify_modes": sorted({str(r["dflash"].get("verify_mode")) for r in done if r["dflash"]}),
        "texts": {str(r["prompt_index"]): r["text"] for r in done},
    }
