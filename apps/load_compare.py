"""`python -m dflash2_apps.load_test --compare`: the same streaming clients against `dflash2 serve` and
`mlx_lm.server` on the same target, both started once and run alternately at each of `--levels` concurrent clients
(`--trials` rounds in ABBA order, so a drift in the machine's speed weighs on every server alike), and a markdown
and a JSON report (`--out`). `--batched-speculation on,off` starts `dflash2 serve` once per setting, so speculation
inside the batch is measured on and off against mlx_lm.server in one run."""

from __future__ import annotations

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
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from dflash2_apps.bench_report import report_context
from dflash2_apps.load_clients import chat_turn, level_summary, run_clients
from dflash2_apps.openblas import openblas_library
from dflash2_apps.peer_engines import target_folder
from dflash2_mlx.assets import default_drafter, default_target
from dflash2_mlx.prompts import load_suite

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


def kind(name: str) -> str:
    """Which server `name` is: "dflash2 serve" (under any of its settings) or "mlx_lm.server"."""
    return "dflash2 serve" if name.startswith("dflash2 serve") else name


def listening_port(name: str, log: Path) -> int | None:
    """The port server `name` says in its output (`log`) that it listens on; None before it says so."""
    found = LISTENING[kind(name)].search(log.read_text(errors="replace")) if log.exists() else None
    return int(found.group(1)) if found else None


def healthy(port: int) -> bool:
    return health(port) is not None


def health(port: int) -> dict | None:
    """The server's /health answer (an empty dict where it is not JSON); None where it does not answer 200."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        if response.status != 200:
            return None
        try:
            return json.loads(response.read())
        except ValueError:
            return {}
    except OSError:
        return None
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
        name: one of `server_names`' names.
        command: the server's command and environment for a port (0: the system picks one).
        log: where its output goes.
        timeout: seconds each start may take to answer.

    Returns:
        The server's process and the port it listens on.
    """
    for _ in range(PORT_TRIES):
        cmd, env = command(0 if kind(name) in TAKES_PORT_ZERO else free_port())
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
    """(command, environment) of server `name` on `port`, serving `target` (the same folder for all)."""
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
    batched = re.fullmatch(r"dflash2 serve \(batched (\w+)\)", name)
    if batched:
        dflash += ["--batched-speculation", batched.group(1)]
    if args.verify_mode:
        dflash += ["--verify-mode", args.verify_mode]
    mlx_env = dict(env)  # the CLI preloads OpenBLAS itself; mlx_lm.server does not
    library = openblas_library() if sys.platform == "linux" and not os.environ.get("DFLASH2_NO_OPENBLAS") else None
    if library:
        mlx_env["LD_PRELOAD"] = f"{library} {env.get('LD_PRELOAD', '')}".strip()
    mlx = [sys.executable, "-m", "mlx_lm.server", "--model", target, "--port", str(port)]
    return {"dflash2 serve": (dflash, env), "mlx_lm.server": (mlx, mlx_env)}[kind(name)]


SERVERS = ("dflash2 serve", "mlx_lm.server")
THEIRS = "mlx_lm.server"


def server_names(batched_speculation: list[str]) -> tuple[str, ...]:
    """The servers compared: dflash2 serve, once per `--batched-speculation` setting given, then mlx_lm.server."""
    return (*[f"dflash2 serve (batched {b})" for b in batched_speculation], THEIRS) if batched_speculation else SERVERS


def compared(names: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """The pairs of servers a report compares: each dflash2 serve with mlx_lm.server, and each with batched
    speculation against it off, where that ran."""
    pairs = [(name, THEIRS) for name in names if name != THEIRS]
    if "dflash2 serve (batched off)" in names:
        pairs += [(name, "dflash2 serve (batched off)") for name, _ in pairs if name != "dflash2 serve (batched off)"]
    return pairs


def abba(trials: int, names: tuple[str, ...] = SERVERS) -> list[tuple[str, ...]]:
    """The order of the servers in each round: ABBA... (in order in even rounds, reversed in odd ones), so a
    drift in the machine's speed within a level weighs on every server alike."""
    return [names if t % 2 == 0 else names[::-1] for t in range(trials)]


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
    names = server_names(args.batched_speculation)
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
        "context": report_context(),
        "servers": {name: {} for name in names},
        "rounds": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        target, _ = target_folder(args.model, None, Path(tmp))
        drafter = str(args.draft_model or default_drafter())
        # named as the user gave it (the default: its file name), not by this machine's paths
        source = args.model or f"the default target, {default_target().name}"
        report["target"] = source if source == target else f"{source} (converted once to the mlx-lm folder both load)"
        report["drafter"] = drafter if args.draft_model else f"the bundled {Path(drafter).name}"
        logs = {name: Path(tmp) / f"server-{i}.log" for i, name in enumerate(names)}
        procs: dict[str, subprocess.Popen] = {}
        ports: dict[str, int] = {}
        try:
            for name in names:
                print(f"[load] starting {name}", file=sys.stderr, flush=True)
                command = partial(server_command, args, target, drafter, name)
                procs[name], ports[name] = start_server(name, command, logs[name], args.start_timeout)
                print(f"[load] {name} listens on port {ports[name]}", file=sys.stderr, flush=True)
            for name in names:  # warm-up
                chat_turn("127.0.0.1", ports[name], [{"role": "user", "content": prompts[0]}], 8, args.timeout)
            report["load_average"] = {"all servers": {"before": os.getloadavg()}}
            begin = time.perf_counter()
            for level in args.levels:
                rounds: dict[str, list] = {name: [] for name in names}
                for order in abba(args.trials, names):
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
                for name in names:
                    report["servers"][name][str(level)] = merge_trials(rounds[name])
                report["rounds"][str(level)] = [list(order) for order in abba(args.trials, names)]
            report["load_average"]["all servers"]["after"] = os.getloadavg()
            report["batch"] = {name: (health(ports[name]) or {}).get("batch") for name in names if name != THEIRS}
        finally:
            for proc in procs.values():
                stop_server(proc)
        for name in names:
            if logs[name].exists():
                report.setdefault("logs_tail", {})[name] = logs[name].read_text()[-2000:]
    report["ratios"] = {f"{a} / {b}": ratios(report, a, b) for a, b in compared(names)}
    report["agreement"] = {f"{a} / {b}": agreement(report, a, b) for a, b in compared(names)}
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(f"[load] wrote {out.with_suffix('.md')} and {out.with_suffix('.json')}", file=sys.stderr)
    failed = sum(row["failed"] for rows in report["servers"].values() for row in rows.values())
    return 1 if failed else 0


def ratios(report: dict, name: str = "dflash2 serve", other: str = THEIRS) -> dict:
    """Per level: server `name`'s throughput over server `other`'s, from the medians over rounds, and each round's
    (the servers' runs of one round are adjacent in time)."""
    ours, theirs = report["servers"].get(name, {}), report["servers"].get(other, {})
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


def agreement(report: dict, name: str = "dflash2 serve", other: str = THEIRS) -> dict:
    """How many answers (same prompt, same level, same round) are the same text from servers `name` and `other`
    (T = 0, one target)."""
    a, b = report["servers"].get(name, {}), report["servers"].get(other, {})
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
        f"The servers started once each and run alternately at each level, {trials} rounds in ABBA order (round 1: "
        f"{', then '.join(report['servers'])}; round 2 the other way round, ...). Completion tokens/s is the median "
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
            batch = row["batch_size_max"] if kind(name) == "dflash2 serve" else ""
            each = " / ".join(f"{t['tokens_per_s']:.1f}" for t in row.get("trials", []))
            lines.append(
                f"| {level} | {name} | {row['requests']} | {row['failed']} | {row['tokens_per_s']:.1f}"
                f"{f' ({each})' if each else ''} | {row['requests_per_s']:.2f} | "
                f"{fmt(row['latency_p50_s'])} | {fmt(row['latency_p99_s'])} | {fmt(row['ttft_p50_s'])} | "
                f"{batch} |"
            )
    lines.append("")
    for name, batch in (report.get("batch") or {}).items():
        if batch:
            lines.append(
                f"{name}, /health at the end: {batch.get('batched_cycles', 0)} batched cycles, "
                f"{batch.get('batched_steps', 0)} batched steps; {batch.get('reason', '')}."
            )
    for mine, other in compared(list(servers)):
        found = ratios(report, mine, other)
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
        lines.append(
            f"Throughput, {mine} / {other}, by clients: {', '.join(text) or 'n/a'} (medians; each round's in brackets)."
        )
    for mine, other in compared(list(servers)):
        same = agreement(report, mine, other)
        lines.append(
            f"Same answer from {mine} and {other} (same prompt, level and round): {same['same']} of {same['compared']}."
        )
    return "\n".join([*lines, ""])
