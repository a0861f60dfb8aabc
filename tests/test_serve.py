"""`dflash2 serve` over real HTTP on 127.0.0.1: a tiny real target and DFlash 2 drafter loaded from folders, a
real tokenizer, the standard library's HTTP client with a timeout on every call. Expected texts come from
`generate()` of the same prompt by plain decoding (the target's own greedy output), run while the server idles.

Timing-dependent cases (a client leaving mid-stream, a full queue, a timeout) hold the generation at a gate
after its first record, so what the test observes happens at a known point, not after a sleep."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import CONTEXT, GOOD, TIMEOUT, chat_ids, expected, request, running, user, wait_for

import dflash2_apps.serve as serve
from dflash2_apps.cli import main
from dflash2_mlx import generate
from dflash2_mlx.server import scheduler


@pytest.fixture(scope="module")
def served(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--queue-size", 8, "--max-tokens", 16) as s:
        yield s


def stream(port, path, body) -> list:
    """The SSE events of a streaming request, parsed; '[DONE]' last."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=json.dumps({**body, "stream": True}))
        r = conn.getresponse()
        assert r.status == 200 and r.getheader("Content-Type") == "text/event-stream"
        events = [line[len(b"data: ") :].decode() for line in r.read().split(b"\n\n") if line]
        return [e if e == "[DONE]" else json.loads(e) for e in events]
    finally:
        conn.close()


def test_chat_equals_generate_with_usage(served):
    app, port = served
    messages = user("w3 w14 w15 w92")
    want = expected(app, chat_ids(app, messages), 12)
    status, headers, body = request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12})
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == want.finish_reason
    assert body["object"] == "chat.completion" and body["model"] == str(app.model_id)
    n = len(chat_ids(app, messages))
    assert body["usage"]["prompt_tokens"] == n and body["usage"]["completion_tokens"] == len(want.tokens)
    assert body["usage"]["total_tokens"] == n + len(want.tokens)
    stats = body["dflash"]
    assert stats["verify_mode"] == headers["X-DFlash-Verify-Mode"] == "dflash" and stats["block_size"] == 4
    assert stats["cycles"] >= 1 and int(headers["X-DFlash-Cycles"]) == stats["cycles"]
    assert stats["tau"] == pytest.approx((stats["accepted"] + stats["cycles"]) / stats["cycles"])
    # 1 prefill token + each cycle's accepted drafts and bonus cover the completion
    assert 1 + stats["accepted"] + stats["cycles"] >= len(want.tokens)


def test_streaming_chat_equals_generate(served):
    app, port = served
    messages = user("w7 w8 w9")
    want = expected(app, chat_ids(app, messages), 14)
    events = stream(
        port,
        "/v1/chat/completions",
        {"messages": messages, "max_completion_tokens": 14, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want.text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == want.finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["dflash"]["verify_mode"] == "dflash"
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(want.tokens)
    assert usage["usage"]["prompt_tokens"] == len(chat_ids(app, messages))


def test_text_completions(served):
    app, port = served
    want = expected(app, "w1 w2 w3 w4 w5", 10)
    status, _, body = request(port, "POST", "/v1/completions", {"prompt": "w1 w2 w3 w4 w5", "max_tokens": 10})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["text"] == want.text and body["usage"]["completion_tokens"] == len(want.tokens)
    events = stream(port, "/v1/completions", {"prompt": "w1 w2 w3 w4 w5", "max_tokens": 10})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want.text


def test_stop_strings_cut_the_text(served):
    app, port = served
    messages = user("w3 w14 w15 w92")
    want = expected(app, chat_ids(app, messages), 12).text
    words = want.split()
    assert len(words) >= 4, want  # the prompt must give a text to cut
    stop = " ".join(words[2:4])
    status, _, body = request(
        port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 12, "stop": [stop, "never"]}
    )
    assert status == 200
    assert body["choices"][0]["message"]["content"] == want[: want.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_second_turn_reuses_the_conversation(served):
    app, port = served
    first = user("w40 w41 w42 w43 w44 w45")
    status, _, body = request(port, "POST", "/v1/chat/completions", {"messages": first, "max_tokens": 12})
    reply = body["choices"][0]["message"]["content"]
    turn2 = first + [{"role": "assistant", "content": reply}] + user("w50 w51")
    want = expected(app, chat_ids(app, turn2), 12)
    status, _, body = request(port, "POST", "/v1/chat/completions", {"messages": turn2, "max_tokens": 12})
    assert status == 200 and body["choices"][0]["message"]["content"] == want.text
    # the whole first turn (its prompt and all but perhaps the last reply token) came from the cache
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(chat_ids(app, first)) + len(reply.split()) - 1


@pytest.mark.parametrize(
    "raw, status, param, fragment",
    [
        (b'{"messages": [', 400, None, "not valid JSON"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        ({"messages": GOOD, "max_tokens": "ten"}, 400, "max_tokens", "'max_tokens' must be an integer >= 1"),
        ({"messages": GOOD, "temperature": "hot"}, 400, "temperature", "'temperature' must be a number"),
        ({"messages": GOOD, "stream": "yes"}, 400, "stream", "'stream' must be true or false"),
        ({"messages": GOOD, "top_p": 2}, 400, None, "top_p must be in (0, 1]"),
        ({"messages": GOOD, "stop": [1]}, 400, "stop", "'stop' must be a string or a list of strings"),
        ({"messages": "w1 w2"}, 400, "messages", "'messages' must be a list"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages", "messages[0].content must be a string"),
        ({"messages": []}, 400, "messages", "'messages' is empty"),
        ({"messages": GOOD, "max_tokens": 0}, 400, "max_tokens", "'max_tokens' must be an integer >= 1, got 0"),
        ({"messages": GOOD, "max_completion_tokens": -3}, 400, "max_completion_tokens", "must be an integer >= 1"),
        ({"messages": user(" ".join(["w9"] * CONTEXT))}, 400, "messages", f"this model's context is {CONTEXT} tokens"),
        ({"messages": GOOD, "max_tokens": CONTEXT}, 400, "max_tokens", "lower max_tokens to"),
        ({"prompt": ""}, 400, "prompt", "'prompt' must be a non-empty string"),
        ({"messages": GOOD, "n": 2}, 400, "n", "'n' must be 1"),
        ({"messages": GOOD, "top_logprobs": 3}, 400, "top_logprobs", "'top_logprobs' needs 'logprobs': true"),
        ({"messages": GOOD, "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs", "an integer in 0..20, got 50"),
        ({"prompt": "w1", "logprobs": 21}, 400, "logprobs", "'logprobs' must be an integer in 0..20, got 21"),
        ({"messages": GOOD, "model": "gpt-4o"}, 404, "model", "the model 'gpt-4o' does not exist here"),
    ],
)
def test_bad_input_gets_an_openai_error(served, raw, status, param, fragment):
    app, port = served
    path = "/v1/completions" if isinstance(raw, dict) and "prompt" in raw else "/v1/chat/completions"
    got, _, body = request(port, "POST", path, raw=raw if isinstance(raw, bytes) else json.dumps(raw).encode())
    assert got == status, body
    assert set(body) == {"error"} and fragment in body["error"]["message"], body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"
    if status == 404:
        assert body["error"]["code"] == "model_not_found"
    if "context is" in fragment or "lower max_tokens" in fragment:
        assert body["error"]["code"] == "context_length_exceeded"
    health = request(port, "GET", "/health")[2]
    assert (health["status"], health["queued"], health["running"]) == ("ok", 0, False)


def test_models_health_and_unknown_routes(served):
    app, port = served
    status, _, body = request(port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in body["data"]] == [str(app.model_id)]
    assert request(port, "GET", "/nowhere")[0] == 404
    assert request(port, "POST", "/v1/embeddings", {"input": "x"})[0] == 404
    # the served name and mlx_lm.server's "default_model" are both accepted
    for name in (str(app.model_id), "default_model"):
        body = {"messages": GOOD, "model": name, "max_tokens": 2}
        assert request(port, "POST", "/v1/chat/completions", body)[0] == 200


@contextmanager
def gated(monkeypatch):
    """Generations hold after their first record until the gate opens; `counts` has the records each
    generation gave the worker."""
    gate, counts, real = threading.Event(), [], scheduler.relayed_cycles

    def held(*args, **kwargs):
        counts.append(0)
        for i, record in enumerate(real(*args, **kwargs)):
            if i == 1:
                assert gate.wait(TIMEOUT), "the test never opened the gate"
            counts[-1] += 1
            yield record

    monkeypatch.setattr(scheduler, "relayed_cycles", held)
    try:
        yield gate, counts
    finally:
        gate.set()


def captured(app) -> bool:
    from dflash2_mlx.target import Target

    return any("_dflash_tap" in layer.__dict__ for layer in Target(app.worker.model).layers)


@pytest.mark.slow
def test_client_disconnect_cancels_at_the_next_cycle(served, monkeypatch):
    app, port = served
    messages = user("w60 w61 w62")
    want = expected(app, chat_ids(app, messages), 200)
    assert want.finish_reason == "length"  # without the disconnect it would run 200 tokens
    with gated(monkeypatch) as (gate, counts):
        body = json.dumps({"messages": messages, "max_tokens": 200, "stream": True}).encode()
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        received = b""
        while b"data: " not in received:  # the first chunk
            received += sock.recv(4096)
        sock.close()
        wait_for(
            lambda: app.worker.running is not None and app.worker.running.cancelled.is_set(),
            "the server to notice the client left",
        )
        gate.set()
        wait_for(lambda: app.worker.running is None, "the generation to stop")
    assert counts == [2]  # the held record and one more: it stopped at the next cycle
    assert not captured(app)
    status, _, reply = request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 200})
    assert status == 200 and reply["choices"][0]["message"]["content"] == want.text


def test_eight_concurrent_clients(served):
    app, port = served
    prompts = [user(" ".join(f"w{10 * i + j}" for j in range(1 + i % 4))) for i in range(8)]
    wants = [expected(app, chat_ids(app, p), 16) for p in prompts]
    results: list = [None] * 8

    def client(i):
        body = {"messages": prompts[i], "max_tokens": 16}
        if i % 2:
            events = stream(port, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
            results[i] = (text, events[-2]["usage"]["completion_tokens"], events[-3]["choices"][0]["finish_reason"])
        else:
            status, _, reply = request(port, "POST", "/v1/chat/completions", body)
            assert status == 200, reply
            results[i] = (
                reply["choices"][0]["message"]["content"],
                reply["usage"]["completion_tokens"],
                reply["choices"][0]["finish_reason"],
            )

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert results == [(w.text, len(w.tokens), w.finish_reason) for w in wants]


def test_full_queue_answers_503_with_retry_after(tiny_pair, tiny_dflash2, monkeypatch):
    with running(tiny_pair[0], tiny_dflash2, "--queue-size", 1) as (app, port), gated(monkeypatch) as (gate, counts):
        answers = {}

        def client(name):
            answers[name] = request(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 4})

        first = threading.Thread(target=client, args=("first",))
        first.start()
        wait_for(lambda: app.worker.running is not None, "the first request to run")
        # held at the gate: a request queued before that could be taken into a batch at the first cycle boundary
        wait_for(lambda: counts == [1], "the first request to reach the gate")
        second = threading.Thread(target=client, args=("second",))
        second.start()
        wait_for(lambda: app.worker.jobs.qsize() == 1, "the second request to queue")
        status, headers, body = request(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 4})
        assert status == 503 and int(headers["Retry-After"]) >= 1
        assert body["error"]["code"] == "queue_full" and "queue (1 requests) is full" in body["error"]["message"]
        health = request(port, "GET", "/health")[2]
        assert health["queued"] == 1 and health["running"] is True
        gate.set()
        first.join(TIMEOUT)
        second.join(TIMEOUT)
        assert answers["first"][0] == answers["second"][0] == 200
        assert answers["first"][2]["choices"] == answers["second"][2]["choices"]


def test_a_request_past_its_timeout_is_stopped(tiny_pair, tiny_dflash2, monkeypatch):
    with (
        running(tiny_pair[0], tiny_dflash2, "--request-timeout", 0.5) as (app, port),
        gated(monkeypatch) as (gate, counts),
    ):
        answer = {}
        client = threading.Thread(
            target=lambda: answer.update(
                r=request(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 50})
            )
        )
        client.start()
        wait_for(lambda: app.worker.running is not None, "the request to run")
        job = app.worker.running
        wait_for(lambda: time.monotonic() > job.deadline, "the deadline")
        gate.set()
        client.join(TIMEOUT)
        status, _, body = answer["r"]
        assert status == 504 and body["error"]["code"] == "timeout", body
        assert counts == [2] and not captured(app)


@pytest.mark.slow
def test_the_cli_serves_on_loopback_and_stops_on_interrupt(tiny_pair, tiny_dflash2, terminal_sigint):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path]), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dflash2_apps.cli",
            "serve",
            "--model",
            str(tiny_pair[0]),
            "--draft-model",
            str(tiny_dflash2),
            "--port",
            "0",
        ],
        cwd=root,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        deadline = time.monotonic() + TIMEOUT
        while "serving" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, line
            line = proc.stderr.readline()
        address = line.rsplit(" ", 1)[-1].strip()
        assert address.startswith("http://127.0.0.1:")
        port = int(address.rsplit(":", 1)[-1])
        assert request(port, "GET", "/health")[0] == 200
        status, _, body = request(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 3})
        assert status == 200 and body["dflash"]["verify_mode"] == "adaptive"
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(TIMEOUT)
        except subprocess.TimeoutExpired:  # say where it is stuck: faulthandler prints every thread's stack
            proc.send_signal(signal.SIGABRT)
            _, err = proc.communicate(timeout=TIMEOUT)
            pytest.fail(f"`dflash2 serve` did not stop within {TIMEOUT} s of SIGINT; its threads:\n{err[-8000:]}")
        assert code == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
        proc.stderr.close()


def test_chat_repl_keeps_the_conversation(tiny_pair, tiny_dflash2, monkeypatch, capsys):
    import io

    from dflash2_mlx import load

    monkeypatch.setattr(sys, "stdin", io.StringIO("w5 w6 w7\nw8 w9\nq\n"))
    code = main(
        [
            "chat",
            "--model",
            str(tiny_pair[0]),
            "--draft-model",
            str(tiny_dflash2),
            "--verify-mode",
            "dflash",
            "--max-tokens",
            "8",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0
    model, tokenizer, _ = load(str(tiny_pair[0]))
    turn1 = [{"role": "user", "content": "w5 w6 w7"}]
    a1 = generate(
        model,
        tokenizer,
        tokenizer.apply_chat_template(turn1, add_generation_prompt=True),
        None,
        verify_mode="off",
        max_tokens=8,
    )
    turn2 = turn1 + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "w8 w9"}]
    a2 = generate(
        model,
        tokenizer,
        tokenizer.apply_chat_template(turn2, add_generation_prompt=True),
        None,
        verify_mode="off",
        max_tokens=8,
    )
    assert f">> {a1.text}\n>> {a2.text}\n>> " == out
    summaries = [line for line in err.splitlines() if "[dflash B=" in line]
    assert len(summaries) == 2 and all("tau" in s and "TTFT" in s for s in summaries)
    assert "0 of" in summaries[0] and "0 of" not in summaries[1]  # the second turn reused the first's caches


def test_a_sigterm_landing_while_a_connection_is_taken_stops_the_server():
    """SIGTERM raises `serve.Terminated` in the server's thread wherever it is, also inside socketserver's handling of
    a new connection, which reports any Exception and serves on: there it must still reach `serve_forever`'s caller
    (a two-process server once kept serving after its SIGTERM landed there)."""
    import socketserver

    class Server(socketserver.TCPServer):
        def process_request(self, request, client_address):
            raise serve.Terminated

    with Server(("127.0.0.1", 0), socketserver.BaseRequestHandler) as server:
        with socket.create_connection(server.server_address, timeout=10):
            with pytest.raises(serve.Terminated):
                server.handle_request()
