"""`python -m dflash2_apps.load_test --compare`: both servers started on the tiny pair (real processes, real HTTP on
127.0.0.1), the same streaming clients at two levels run alternately against each (ABBA rounds), and the
report; the interleaving and the merging of rounds on their own; how each server's port is found (dflash2 serve on
port 0, mlx_lm.server started again when its free port was taken), with stand-in servers."""

from __future__ import annotations

import argparse
import http.server
import json
import socket
import statistics
import sys
import threading

import numpy as np
import pytest

from dflash2_apps import load_compare as load
from dflash2_apps import load_test

# Stand-ins for the two servers: each binds the port it is given (0: the system picks), answers /health with
# 200, and then says where it listens as the real one does; a taken port makes it exit with Python's
# "Address already in use".
FAKE_SERVER = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health)
port = server.server_address[1]
print({"dflash2 serve": f"[dflash2] serving tiny (dflash) on http://127.0.0.1:{port}",
       "mlx_lm.server": f"Starting httpd at 127.0.0.1 on port {port}..."}[sys.argv[1]], file=sys.stderr, flush=True)
server.serve_forever()
"""


def fake_server(name: str, ports: list[int]):
    """The stand-in's command for a port, noting each port it is given in `ports`."""

    def command(port: int):
        ports.append(port)
        return [sys.executable, "-c", FAKE_SERVER, name, str(port)], None

    return command


@pytest.fixture
def another_server():
    """Another process's server on a port of its own, answering /health with 200 as ours do."""

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_dflash2_serve_takes_port_0_and_is_found_where_it_says(tmp_path):
    ports = []
    proc, port = load.start_server("dflash2 serve", fake_server("dflash2 serve", ports), tmp_path / "log", 30)
    try:
        assert ports == [0] and port > 0 and load.healthy(port)
        with socket.socket() as sock:  # the port is the process's own: nothing else can bind it
            with pytest.raises(OSError):
                sock.bind(("127.0.0.1", port))
    finally:
        load.stop_server(proc)
    assert proc.returncode is not None


def test_a_server_whose_port_was_taken_starts_again_on_another(tmp_path, monkeypatch, another_server):
    """mlx_lm.server is given a free port; when another process took it in between (here a server that also
    answers /health), it is not taken for ours: ours exits, and starts again on the next free port."""
    given = iter([another_server])
    real_free_port = load.free_port
    monkeypatch.setattr(load, "free_port", lambda: next(given, None) or real_free_port())
    ports = []
    proc, port = load.start_server("mlx_lm.server", fake_server("mlx_lm.server", ports), tmp_path / "log", 30)
    try:
        assert ports[0] == another_server and len(ports) == 2 and port == ports[1] != another_server
        assert proc.poll() is None and load.healthy(port)
    finally:
        load.stop_server(proc)


def test_a_server_that_never_gets_a_port_is_an_error(tmp_path, monkeypatch, another_server):
    monkeypatch.setattr(load, "free_port", lambda: another_server)
    monkeypatch.setattr(load, "PORT_TRIES", 2)
    ports = []
    with pytest.raises(RuntimeError, match=r"mlx_lm.server found every port it was given taken, 2 times"):
        load.start_server("mlx_lm.server", fake_server("mlx_lm.server", ports), tmp_path / "log", 30)
    assert ports == [another_server, another_server]


def _result(tokens: int, latency: float, prompt: int, text: str) -> dict:
    return {
        "text": text,
        "ttft": latency / 2,
        "latency": latency,
        "usage": {"completion_tokens": tokens},
        "dflash": {},
        "prompt_index": prompt,
    }


def test_abba_alternates_which_server_goes_first():
    a, b = "dflash2 serve", "mlx_lm.server"
    assert load.abba(1) == [(a, b)]
    assert [x for order in load.abba(4) for x in order] == [a, b, b, a, a, b, b, a]
    on, off = "dflash2 serve (batched on)", "dflash2 serve (batched off)"
    names = load.server_names(["on", "off"])
    assert names == (on, off, b) and load.server_names([]) == (a, b)
    assert [x for order in load.abba(2, names) for x in order] == [on, off, b, b, off, on]
    assert load.compared(names) == [(on, b), (off, b), (on, off)] and load.compared((a, b)) == [(a, b)]


def test_each_dflash2_serve_gets_its_batched_speculation():
    args = argparse.Namespace(levels=[2], serve_arg=[], verify_mode=None)
    off, _ = load.server_command(args, "T", "D", "dflash2 serve (batched off)", 0)
    plain, _ = load.server_command(args, "T", "D", "dflash2 serve", 0)
    theirs, _ = load.server_command(args, "T", "D", "mlx_lm.server", 1234)
    assert off[3] == "serve" and off[-2:] == ["--batched-speculation", "off"] and off[:-2] == plain
    assert theirs[1:3] == ["-m", "mlx_lm.server"] and "--batched-speculation" not in plain + theirs


def test_merge_trials_takes_medians_of_rounds_and_pools_requests():
    rounds = [
        ([[_result(10, 1.0, 0, "x"), _result(10, 2.0, 1, "y")]], 4.0, 0.0),  # 20 tokens in 4 s: 5/s
        ([[_result(30, 3.0, 0, "x"), _result(30, 4.0, 1, "y")]], 2.0, 9.0),  # 60 tokens in 2 s: 30/s
        ([[_result(5, 5.0, 0, "x"), _result(5, 6.0, 1, "z")]], 1.0, 20.0),
    ]  # 10 tokens in 1 s: 10/s
    row = load.merge_trials(rounds)
    assert row["tokens_per_s"] == statistics.median([5.0, 30.0, 10.0]) == 10.0
    assert row["requests_per_s"] == statistics.median([2 / 4, 2 / 2, 2 / 1])
    assert (row["requests"], row["completion_tokens"], row["wall_s"]) == (6, 90, 7.0)
    assert row["tokens_per_s_pooled"] == 90 / 7.0
    latencies = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # nearest rank over all six requests of the three rounds
    assert (row["latency_p50_s"], row["latency_p99_s"]) == tuple(
        float(np.percentile(latencies, p, method="nearest")) for p in (50, 99)
    )
    assert [t["tokens_per_s"] for t in row["trials"]] == [5.0, 30.0, 10.0]
    assert [t["start_s"] for t in row["trials"]] == [0.0, 9.0, 20.0]
    assert [t["texts"] for t in row["trials"]][2] == {"0": "x", "1": "z"}


def test_ratios_and_agreement_pair_the_rounds():
    ours = load.merge_trials([([[_result(10, 1.0, 0, "x")]], 1.0, 0.0), ([[_result(10, 1.0, 0, "x")]], 2.0, 3.0)])
    theirs = load.merge_trials([([[_result(10, 1.0, 0, "x")]], 2.0, 1.0), ([[_result(10, 1.0, 0, "w")]], 1.0, 2.0)])
    report = {"servers": {"dflash2 serve": {"1": ours}, "mlx_lm.server": {"1": theirs}}}
    found = load.ratios(report)["1"]
    assert found["rounds"] == [10 / 5, 5 / 10]
    assert found["median"] == statistics.median([10, 5]) / statistics.median([5, 10]) == 1.0
    assert load.agreement(report) == {"same": 1, "compared": 2}
    assert load.ratios(report, "mlx_lm.server", "dflash2 serve")["1"]["rounds"] == [5 / 10, 10 / 5]


@pytest.mark.slow
def test_compare_runs_every_server_and_writes_the_report(tiny_pair, tiny_dflash2, tmp_path):
    """dflash2 serve with batched speculation on and off, and mlx_lm.server: three servers, ABBA rounds, one
    report with each pair's throughput and answers compared."""
    out = tmp_path / "load-vs-mlx-lm"
    argv = [
        "--compare",
        "--model",
        str(tiny_pair[0]),
        "--draft-model",
        str(tiny_dflash2),
        "--levels",
        "1,2",
        "--requests",
        "2",
        "--max-tokens",
        "6",
        "--verify-mode",
        "dflash",
        "--serve-arg=--block-size",
        "--serve-arg=4",
        "--trials",
        "2",
        "--batched-speculation",
        "on,off",
        "--out",
        str(out),
        "--timeout",
        "60",
        "--start-timeout",
        "120",
    ]
    assert load_test.main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    on, off, theirs = "dflash2 serve (batched on)", "dflash2 serve (batched off)", "mlx_lm.server"
    assert report["context"]["version"] and "commit" in report["context"]
    assert list(report["servers"]) == [on, off, theirs]
    for name, rows in report["servers"].items():
        assert list(rows) == ["1", "2"]
        for level, row in rows.items():
            assert (row["requests"], row["failed"]) == (2 * 2 * int(level), 0), (name, level, row)
            assert [(t["requests"], t["failed"]) for t in row["trials"]] == [(2 * int(level), 0)] * 2
            assert row["completion_tokens"] > 0 and row["tokens_per_s"] > 0
            assert 0 < row["latency_p50_s"] <= row["latency_p99_s"] <= max(t["wall_s"] for t in row["trials"])
    # interleaved, ABBA at each level: ours, theirs, theirs, ours, by their start times
    for level in ("1", "2"):
        starts = sorted((t["start_s"], name) for name, rows in report["servers"].items() for t in rows[level]["trials"])
        assert [name for _, name in starts] == [on, off, theirs, theirs, off, on]
    for name in (on, off):
        assert report["servers"][name]["1"]["verify_modes"] == ["dflash"]  # a lone client: speculative
    # T = 0 on one target: every answer the same text from both servers (1 x 2 and 2 x 2 answers, two rounds)
    texts = [t["texts"] for rows in report["servers"].values() for r in rows.values() for t in r["trials"]]
    assert all(t for t in texts)
    pairs = [f"{on} / {theirs}", f"{off} / {theirs}", f"{on} / {off}"]
    assert list(report["agreement"]) == list(report["ratios"]) == pairs
    assert all(a == {"same": 12, "compared": 2 * (2 + 4)} for a in report["agreement"].values())
    batch = report["batch"]  # /health at the end: the speculative batch ran with on (this curve: plain steps)
    assert batch[on]["speculative"] and batch[on]["reason"].startswith("--batched-speculation on")
    assert not batch[off]["speculative"] and batch[off]["reason"].startswith("--batched-speculation off")
    assert batch[on]["batched_steps"] > 0 and batch[off]["batched_steps"] > 0
    md = out.with_suffix(".md").read_text()
    assert all(md.count(f"| {name} |") == 2 for name in (on, off, theirs))
    assert f"{on}, /health at the end: " in md
    assert all(f"Throughput, {pair}, by clients: 1: " in md for pair in pairs)
    assert "2 rounds in ABBA order" in md
