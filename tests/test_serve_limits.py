"""`dflash2 serve`'s key and limits over real HTTP on 127.0.0.1 (the port the OS binds for --port 0): --api-key,
--allowed-origins (CORS), --max-body-bytes, --read-timeout (half-sent requests dropped, their threads freed, while
other clients are served), and GET /metrics in Prometheus' text format, its numbers checked against the answers'
own `usage` and `dflash` counts."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from helpers import GOOD, TIMEOUT, call, parse_metrics, request, running, user, wait_for

import dflash2_apps.serve as serve
from dflash2_apps.cli import make_parser
from dflash2_mlx.server import ServeSettings

KEY = "s3cret-key"


def handler_threads() -> int:
    """Connection threads of the servers in this process (socketserver names them after their target)."""
    return sum("process_request_thread" in t.name for t in threading.enumerate())


# -- the key ---------------------------------------------------------------------------------------------------


def test_the_api_key_is_required(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--api-key", KEY) as (_, port):
        chat = {"messages": GOOD, "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": KEY[:-1]}, {"Authorization": KEY}):
            status, got, text = call(port, "POST", "/v1/chat/completions", chat, headers)
            error = json.loads(text)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and "--api-key" in error["message"], text
            assert got["www-authenticate"] == "Bearer"
            assert call(port, "GET", "/v1/models", headers=headers)[0] == 401
            assert call(port, "GET", "/metrics", headers=headers)[0] == 401
        for headers in ({"Authorization": f"Bearer {KEY}"}, {"authorization": f"bearer {KEY}"}, {"X-API-Key": KEY}):
            status, _, text = call(port, "POST", "/v1/chat/completions", chat, headers)
            assert status == 200, text
            assert call(port, "GET", "/v1/models", headers=headers)[0] == 200
        assert call(port, "GET", "/health")[0] == 200  # probes need no key


def test_no_key_serves_everyone(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as (_, port):
        assert call(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 2})[0] == 200


def test_the_key_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(serve.API_KEY_VARIABLE, KEY)
    args = make_parser().parse_args(["serve"])
    assert serve.settings_of(args).api_key == KEY
    assert KEY not in repr(serve.settings_of(args))  # never logged with the settings
    monkeypatch.delenv(serve.API_KEY_VARIABLE)
    assert serve.settings_of(make_parser().parse_args(["serve"])).api_key is None


# -- CORS ------------------------------------------------------------------------------------------------------

ORIGIN = "http://localhost:3000"


def test_cors_headers_go_to_allowed_origins_only(tiny_pair, tiny_dflash2):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    with running(tiny_pair[0], tiny_dflash2) as (_, port):  # none by default
        status, got, _ = call(port, "GET", "/v1/models", headers={"Origin": ORIGIN})
        assert status == 200 and "access-control-allow-origin" not in got
        status, got, _ = call(port, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 204 and not any(k.startswith("access-control") for k in got)
    with running(tiny_pair[0], tiny_dflash2, "--allowed-origins", f"{ORIGIN},https://app.example") as (_, port):
        status, got, _ = call(port, "OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 204 and got["access-control-allow-origin"] == ORIGIN
        assert "POST" in got["access-control-allow-methods"]
        assert {"authorization", "content-type"} <= set(got["access-control-allow-headers"].lower().split(", "))
        status, got, _ = call(
            port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 2}, {"Origin": ORIGIN}
        )
        assert status == 200 and got["access-control-allow-origin"] == ORIGIN and got["vary"] == "Origin"
        assert "x-dflash-tau" in got["access-control-expose-headers"].lower()
        for other in ("http://evil.example", "http://localhost:3001"):
            status, got, _ = call(port, "OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": other})
            assert status == 204 and not any(k.startswith("access-control") for k in got)
            assert "access-control-allow-origin" not in call(port, "GET", "/v1/models", headers={"Origin": other})[1]
    with running(tiny_pair[0], tiny_dflash2, "--allowed-origins", "*") as (_, port):
        assert call(port, "GET", "/v1/models", headers={"Origin": ORIGIN})[1]["access-control-allow-origin"] == "*"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--allowed-origins", "localhost:3000"], "scheme://host"),
        (["--chat-template-args", "{bad"], "not JSON"),
        (["--chat-template-args", "[1]"], "not a JSON object"),
        (["--max-body-bytes", "lots"], "is not a size"),
    ],
)
def test_bad_flags_say_what_to_give(flags, message, capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["serve", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(read_timeout=0), "--read-timeout must be > 0"),
        (dict(max_body_bytes=0), "--max-body-bytes must be"),
        (dict(api_key=" "), "--api-key is empty"),
        (dict(batched_speculation="yes"), "--batched-speculation takes auto, on, off; got 'yes'"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        ServeSettings(**settings)


# -- the body limit and the read timeout -----------------------------------------------------------------------


def test_the_body_limit_is_a_flag(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2, "--max-body-bytes", 600) as (_, port):
        body = {"messages": user("w1 " * 250), "max_tokens": 2}
        assert len(json.dumps(body)) > 600
        status, _, body = request(port, "POST", "/v1/chat/completions", body)
        assert status == 413 and "--max-body-bytes" in body["error"]["message"] and "600" in body["error"]["message"]
        status, _, _ = request(port, "POST", "/v1/chat/completions", {"messages": user("w1 " * 10), "max_tokens": 2})
        assert status == 200


def half_sent(port: int, i: int) -> socket.socket:
    """A connection that sends part of a request and then nothing: headers cut short, or a body cut short."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
    if i % 2:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Len")
    else:
        sock.sendall(b'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"messa')
    return sock


def answer(sock: socket.socket) -> bytes:
    """What the server sends before it closes the connection."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def test_half_sent_requests_are_dropped_after_the_read_timeout(tiny_pair, tiny_dflash2):
    """200 connections that send half a request hold 200 threads until --read-timeout (3 s) passes, then none;
    another client is served meanwhile, while they are all held. A body cut short gets 408, headers cut short a
    closed connection."""
    timeout, n = 3.0, 200
    with running(tiny_pair[0], tiny_dflash2, "--read-timeout", timeout) as (_, port):
        before = handler_threads()
        started = time.monotonic()
        socks = [half_sent(port, i) for i in range(n)]
        wait_for(lambda: handler_threads() >= before + n, f"{n} connection threads")
        status, _, body = request(port, "POST", "/v1/chat/completions", {"messages": GOOD, "max_tokens": 4})
        assert status == 200, body
        assert handler_threads() >= before + n, "served only once the half-sent requests were dropped: a weak test"
        wait_for(lambda: handler_threads() <= before, "the half-sent requests' threads to end")
        answers = [answer(s) for s in socks]
        dropped = time.monotonic() - started
        for s in socks:
            s.close()
        assert dropped >= timeout  # not before the timeout
        assert all(a.startswith(b"HTTP/1.0 408") and b"--read-timeout" in a for a in answers[0::2]), answers[0]
        assert all(a == b"" for a in answers[1::2]), answers[1]


def test_the_timeout_covers_the_whole_request_not_each_read(tiny_pair, tiny_dflash2):
    """A client that trickles its headers a byte every 0.1 s, each read well within the timeout, is still dropped
    once the timeout has passed since the request began."""
    timeout = 1.0
    with running(tiny_pair[0], tiny_dflash2, "--read-timeout", timeout) as (_, port):
        sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Pad: ")
        started, closed = time.monotonic(), False
        for _ in range(100):  # 10 s of trickling, were the connection never dropped
            try:
                closed = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:  # nothing to read: still open
                pass
            except ConnectionResetError:
                closed = True
            if closed:
                break
            sock.sendall(b"a")
            time.sleep(0.1)
        elapsed = time.monotonic() - started
        sock.close()
    assert closed and timeout <= elapsed < timeout + 3, elapsed


# -- /metrics ----------------------------------------------------------------------------------------------------


def test_metrics_count_what_the_answers_say(tiny_pair, tiny_dflash2):
    with running(tiny_pair[0], tiny_dflash2) as (_, port):
        before = parse_metrics(call(port, "GET", "/metrics")[2])
        assert before["dflash2_requests_finished_total"] == 0 and before["dflash2_queue_length"] == 0
        answers = []
        for _ in range(2):  # the second starts from the first's cached prompt
            status, _, body = request(
                port, "POST", "/v1/chat/completions", {"messages": user("w3 w14 w15 w92"), "max_tokens": 12}
            )
            assert status == 200, body
            answers.append(body)
        assert request(port, "POST", "/v1/chat/completions", {"messages": "x"})[0] == 400
        status, headers, text = call(port, "GET", "/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        m = parse_metrics(text)
    assert m["dflash2_requests_finished_total"] == 2
    assert m["dflash2_generation_tokens_total"] == sum(a["usage"]["completion_tokens"] for a in answers)
    assert m["dflash2_prompt_tokens_total"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert m["dflash2_accepted_tokens_total"] == sum(a["dflash"]["accepted"] for a in answers)
    assert m["dflash2_cycles_total"] == sum(a["dflash"]["cycles"] for a in answers)
    cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[1] > 0 and m["dflash2_prompt_cache_hits_total"] == sum(c > 0 for c in cached)
    assert m["dflash2_cached_tokens_total"] == sum(cached)
    assert m['dflash2_http_responses_total{code="200"}'] == 3  # two answers and the first /metrics
    assert m['dflash2_http_responses_total{code="400"}'] == 1
    assert m["dflash2_queue_length"] == 0 and m["dflash2_active_requests"] == 0 and m["dflash2_batch_size"] == 0
    assert m["dflash2_prompt_cache_slots"] >= 1 and m["dflash2_prompt_cache_bytes"] > 0


def test_the_metrics_parser_rejects_what_prometheus_would():
    with pytest.raises(AssertionError, match="no # TYPE"):
        parse_metrics("dflash2_x 1\n")
    with pytest.raises(AssertionError, match="not a sample"):
        parse_metrics("# TYPE dflash2_x counter\ndflash2_x one two\n")
