"""Load a running `dflash2 serve` (or any OpenAI-compatible server): N clients, each sending M conversations of
T turns, streaming, and print throughput and latency percentiles.

    python -m dflash2_apps.load_test --url http://127.0.0.1:8080 --clients 4 --requests 3 --max-tokens 32
    python -m dflash2_apps.load_test --clients 1 --requests 3 --turns 2     # TTFT of a chat's first and second turns

A turn's latency is from sending the request to the last event; TTFT to the first chunk with text. Each later
turn resends the conversation so far (its prompt, the server's reply, a new question), so a server that reuses
the shared prefix answers it faster; `cached` is the prompt tokens the server says it took from its cache.

`--compare` runs the same clients against `dflash2 serve` and `mlx_lm.server` on the same target, both started once
and run alternately at each of `--levels` concurrent clients (`--trials` rounds in ABBA order, so a drift in the
machine's speed weighs on both alike), and writes a markdown and a JSON report (`--out`):

    python -m dflash2_apps.load_test --compare --levels 1,2,4,8 --requests 2 --max-tokens 64 \
        --out runs/smollm2/load-vs-mlx-lm
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from urllib.parse import urlparse

from dflash2_apps.openblas import openblas_library
from dflash2_apps.peer_engines import target_folder
from dflash2_mlx.assets import default_drafter, default_target
from dflash2_mlx.prompts import load_suite

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


# -- dflash2 serve against mlx_lm.server ------------------------------------------------------------------------


# What each server writes once it listens, with the port it listens on. dflash2 serve takes --port 0 (the system
# picks a free port) and prints the one it got; mlx_lm.server prints the port it was given, so it is given a free
# one, and another when a process took that one before it could bind it (`start_server`).
LISTENING = {
    "dflash2 serve": re.compile(r"^\[dflash2\] serving .* on http://\S+:(\d+)$", re.MULTILINE),
    "mlx_lm.server": re.compile(r"Starting httpd at \S+ on port (\d+)"),
}
TAKES_PORT_ZERO = ("dflash2 serve",)
PORT_TRIES = 5


def free_port() -> int:
    """A port free at the time of asking (another process may take it before the server binds it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def listening_port(name: str, log: Path) -> int | None:
    """The port server `name` says in its output (`log`) that it listens on; None before it says so."""
    found = LISTENING[name].search(log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


def healthy(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def start_server(
    name: str, command: Callable[[int], tuple[list[str], dict]], log: Path, timeout: float
) -> tuple[subprocess.Popen, int]:
    """Start server `name` and wait until it says it listens (`LISTENING`) and its /health there answers 200.

    A server that says nothing of its port is never taken for another process answering on the same port. One
    that cannot bind the free port it was given (taken in between) is started again on another, `PORT_TRIES`
    times in all.

    Args:
        name: one of `SERVERS`.
        command: the server's command and environment for a port (0: the system picks one).
        log: where its output goes.
        timeout: seconds each start may take to answer.

    Returns:
        The server's process and the port it listens on.
    """
    for _ in range(PORT_TRIES):
        cmd, env = command(0 if name in TAKES_PORT_ZERO else free_port())
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            port = listening_port(name, log)
            if port is not None and proc.poll() is None and healthy(port):
                return proc, port
            if proc.poll() is not None:
                if "Address already in use" in log.read_text(errors="replace"):
                    break  # its port was taken before it could bind it: another one
                raise RuntimeError(f"{name} exited ({proc.returncode}) before serving; its output: {log}")
            if time.monotonic() > deadline:
                stop_server(proc)
                raise RuntimeError(f"{name} did not answer /health within {timeout:g} s; its output: {log}")
            time.sleep(0.5)
    raise RuntimeError(f"{name} found every port it was given taken, {PORT_TRIES} times; its last output: {log}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def server_command(args, target: str, drafter: str, name: str, port: int) -> tuple[list[str], dict]:
    """(command, environment) of server `name` on `port`, serving `target` (the same folder for both)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    dflash = [
        sys.executable,
        "-m",
        "dflash2_apps.cli",
        "serve",
        "--model",
        target,
        "--draft-model",
        drafter,
        "--port",
        str(port),
        "--queue-size",
        str(2 * max(args.levels)),
        *args.serve_arg,
    ]
    if args.verify_mode:
        dflash += ["--verify-mode", args.verify_mode]
    mlx_env = dict(env)  # the CLI preloads OpenBLAS itself; mlx_lm.server does not
    library = openblas_library() if sys.platform == "linux" and not os.environ.get("DFLASH2_NO_OPENBLAS") else None
    if library:
        mlx_env["LD_PRELOAD"] = f"{library} {env.get('LD_PRELOAD', '')}".strip()
    mlx = [sys.executable, "-m", "mlx_lm.server", "--model", target, "--port", str(port)]
    return {"dflash2 serve": (dflash, env), "mlx_lm.server": (mlx, mlx_env)}[name]


SERVERS = ("dflash2 serve", "mlx_lm.server")


def abba(trials: int) -> list[tuple[str, str]]:
    """The order of the servers in each round: ABBA... (A first in even rounds, B first in odd ones), so a
    drift in the machine's speed within a level weighs on both servers alike."""
    return [SERVERS if t % 2 == 0 else SERVERS[::-1] for t in range(trials)]


def merge_trials(rounds: list[tuple[list[list[dict]], float, float]]) -> dict:
    """One server's row at one level from its interleaved rounds (per round: `run_clients`' results, its wall
    seconds and when it started, in seconds from the first round): throughput as the median of the rounds' (and
    each round's), counts and walls summed, latency percentiles over every request of every round."""
    rows = [{**level_summary(results, wall), "start_s": start} for results, wall, start in rounds]
    pooled = level_summary(
        [[r for results, _, _ in rounds for turn in results for r in turn]], sum(wall for _, wall, _ in rounds)
    )
    return {
        **pooled,
        "tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows),
        "requests_per_s": statistics.median(row["requests_per_s"] for row in rows),
        "tokens_per_s_pooled": pooled["tokens_per_s"],
        "trials": [
            {
                key: row[key]
                for key in ("requests", "failed", "start_s", "wall_s", "completion_tokens", "tokens_per_s", "texts")
            }
            for row in rows
        ],
        "texts": rows[0]["texts"],
    }


def compare(args) -> int:
    """The same clients against both servers, both started once, run alternately (ABBA over `--trials` rounds) at
    each level; a markdown and a JSON report."""
    prompts = load_suite(args.prompts)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "what": "dflash2 serve against mlx_lm.server: the same streaming chat clients, same target and prompts",
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
        "command": " ".join(["python -m dflash2_apps.load_test", *sys.argv[1:]])
        if args.argv is None
        else " ".join(["python -m dflash2_apps.load_test", *args.argv]),
        "settings": {
            "levels": args.levels,
            "requests_per_client": args.requests,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "prompts": args.prompts,
            "verify_mode": args.verify_mode or "default",
            "serve_args": args.serve_arg,
            "trials": args.trials,
            "order": "ABBA",
        },
        "servers": {name: {} for name in SERVERS},
        "rounds": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        target, _ = target_folder(args.model, None, Path(tmp))
        drafter = str(args.draft_model or default_drafter())
        # named as the user gave it (the default: its file name), not by this machine's paths
        source = args.model or f"the default target, {default_target().name}"
        report["target"] = source if source == target else f"{source} (converted once to the mlx-lm folder both load)"
        report["drafter"] = drafter if args.draft_model else f"the bundled {Path(drafter).name}"
        logs = {name: Path(tmp) / f"{name.split()[0]}.log" for name in SERVERS}
        procs: dict[str, subprocess.Popen] = {}
        ports: dict[str, int] = {}
        try:
            for name in SERVERS:
                print(f"[load] starting {name}", file=sys.stderr, flush=True)
                command = partial(server_command, args, target, drafter, name)
                procs[name], ports[name] = start_server(name, command, logs[name], args.start_timeout)
                print(f"[load] {name} listens on port {ports[name]}", file=sys.stderr, flush=True)
            for name in SERVERS:  # warm-up
                chat_turn("127.0.0.1", ports[name], [{"role": "user", "content": prompts[0]}], 8, args.timeout)
            report["load_average"] = {"both servers": {"before": os.getloadavg()}}
            begin = time.perf_counter()
            for level in args.levels:
                rounds: dict[str, list] = {name: [] for name in SERVERS}
                for order in abba(args.trials):
                    for name in order:
                        start = time.perf_counter() - begin
                        results, wall = run_clients(
                            "127.0.0.1", ports[name], level, args.requests, 1, args.max_tokens, prompts, args.timeout
                        )
                        rounds[name].append((results, wall, start))
                        row = level_summary(results, wall)
                        print(
                            f"[load] {name}, {level} clients, round {len(rounds[name])}: "
                            f"{row['tokens_per_s']:.1f} tokens/s, latency p50 {fmt(row['latency_p50_s'])} p99 "
                            f"{fmt(row['latency_p99_s'])}, {row['failed']} failed",
                            file=sys.stderr,
                            flush=True,
                        )
                for name in SERVERS:
                    report["servers"][name][str(level)] = merge_trials(rounds[name])
                report["rounds"][str(level)] = [list(order) for order in abba(args.trials)]
            report["load_average"]["both servers"]["after"] = os.getloadavg()
        finally:
            for proc in procs.values():
                stop_server(proc)
        for name in SERVERS:
            if logs[name].exists():
                report.setdefault("logs_tail", {})[name] = logs[name].read_text()[-2000:]
    report["ratios"] = ratios(report)
    report["agreement"] = agreement(report)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"[load] wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)
    failed = sum(row["failed"] for rows in report["servers"].values() for row in rows.values())
    return 1 if failed else 0


def ratios(report: dict) -> dict:
    """Per level: dflash2 serve's throughput over mlx_lm.server's, from the medians over rounds, and each round's
    (the two servers' runs of one round are adjacent in time)."""
    ours, theirs = (report["servers"].get(name, {}) for name in SERVERS)
    result = {}
    for level, row in ours.items():
        other = theirs.get(level)
        if other is None or not other["tokens_per_s"]:
            continue
        result[level] = {
            "median": row["tokens_per_s"] / other["tokens_per_s"],
            "rounds": [
                a["tokens_per_s"] / b["tokens_per_s"] if b["tokens_per_s"] else None
                for a, b in zip(row.get("trials", []), other.get("trials", []))
            ],
        }
    return result


def fmt(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:.0f} ms"


def fmt_load(values) -> str:
    return "n/a" if values is None else "/".join(f"{v:.1f}" for v in values)


def agreement(report: dict) -> dict:
    """How many answers (same prompt, same level, same round) are the same text from both servers (T = 0, one
    target)."""
    a, b = (report["servers"].get(name, {}) for name in SERVERS)
    same = total = 0
    for level, row in a.items():
        other = b.get(level)
        if other is None:
            continue
        pairs = zip(row["trials"], other["trials"]) if "trials" in row and "trials" in other else [(row, other)]
        for mine, theirs in pairs:
            for prompt, text in mine["texts"].items():
                if prompt in theirs["texts"]:
                    total += 1
                    same += text == theirs["texts"][prompt]
    return {"same": same, "compared": total}


def markdown(report: dict) -> str:
    s = report["settings"]
    trials = s.get("trials", 1)
    lines = [
        f"# {report['what']}",
        "",
        f"Target `{report['target']}`, drafter `{report['drafter']}` (dflash2 serve, verify mode "
        f"{s['verify_mode']}); {s['requests_per_client']} requests per client, max_tokens {s['max_tokens']}, "
        f"T = 0, prompts `{s['prompts']}`; streaming with usage. Machine: {report['machine']}.",
        "",
        f"Both servers started once and run alternately at each level, {trials} rounds in ABBA order (round 1: "
        f"dflash2 serve then mlx_lm.server, round 2 the other way round, ...). Completion tokens/s is the median "
        f"over the rounds (each round's in brackets); counts and latency percentiles are over every request of "
        f"every round.",
        "",
        f"Command: `{report['command']}`",
        "",
        *([report["note"], ""] if report.get("note") else []),
        *(
            [f"Load average (1, 5, 15 min) before and after the runs: {loads}.", ""]
            if (
                loads := "; ".join(
                    f"{name}: {fmt_load(v.get('before'))} -> {fmt_load(v.get('after'))}"
                    for name, v in report.get("load_average", {}).items()
                )
            )
            else []
        ),
        "| clients | server | ok | failed | completion tokens/s | requests/s | latency p50 | latency p99 "
        "| TTFT p50 | largest batch (dflash2) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    servers = report["servers"]
    for level in map(str, s["levels"]):
        for name, rows in servers.items():
            row = rows.get(level)
            if row is None:
                continue
            batch = row["batch_size_max"] if name == "dflash2 serve" else ""
            each = " / ".join(f"{t['tokens_per_s']:.1f}" for t in row.get("trials", []))
            lines.append(
                f"| {level} | {name} | {row['requests']} | {row['failed']} | {row['tokens_per_s']:.1f}"
                f"{f' ({each})' if each else ''} | {row['requests_per_s']:.2f} | "
                f"{fmt(row['latency_p50_s'])} | {fmt(row['latency_p99_s'])} | {fmt(row['ttft_p50_s'])} | "
                f"{batch} |"
            )
    found = report.get("ratios") or ratios(report)
    text = [
        f"{level}: {found[level]['median']:.2f}x"
        + (
            f" ({' / '.join('n/a' if r is None else f'{r:.2f}' for r in found[level]['rounds'])})"
            if found[level]["rounds"]
            else ""
        )
        for level in map(str, s["levels"])
        if level in found
    ]
    lines += [
        "",
        f"Throughput, dflash2 serve / mlx_lm.server, by clients: {', '.join(text) or 'n/a'} (medians; "
        f"each round's in brackets).",
        f"Same answer from both servers (same prompt, level and round): {report['agreement']['same']} of "
        f"{report['agreement']['compared']}.",
        "",
    ]
    return "\n".join(lines)


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
