"""The server's HTTP transport: the standard library's ThreadingHTTPServer, one thread per connection.

A handler thread reads and parses a request (`App.parser`), queues its job on the worker (a full queue answers
503 with Retry-After), then relays the job's records as they come: one JSON answer, or server-sent events with
`"stream": true`. It polls its client while it waits: a client that leaves cancels its job.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import struct
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx

from ..generate import CycleResponse
from . import responses
from .protocol import ApiError, CompletionRequest
from .responses import Logprobs, StopText
from .scheduler import Job

log = logging.getLogger("dflash2.serve")

MAX_BODY_BYTES = 16 << 20
GRACE_SECONDS = 30.0  # past a job's deadline, how long its client waits for the worker to notice
POLL_SECONDS = 0.2  # how often a waiting client connection is checked
SEND_TIMEOUT_SECONDS = 60  # a write to a client that reads nothing for this long fails (and cancels its job)


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


class Handler(BaseHTTPRequestHandler):
    """POST /v1/chat/completions and /v1/completions, GET /v1/models and /health, for the `app` that
    `make_server` sets on its subclass (an `App`: its worker, parser, names and settings)."""

    server_version = "dflash2"
    app = None  # the App, set on the subclass `make_server` builds

    def setup(self):
        super().setup()
        # a client that stops reading cannot hold its thread (and the server's shutdown) for long
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_SECONDS, 0))

    def log_message(self, format, *args):  # noqa: A002 -- the standard library's name
        log.info("%s %s", self.address_string(), format % args)

    # -- plumbing ----------------------------------------------------------------------------------------
    def _send_json(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: ApiError) -> None:
        self._send_json(e.status, e.body(), e.headers)

    def _client_gone(self) -> bool:
        """The client closed its side (HTTP/1.0 clients send nothing more: readable means EOF or reset)."""
        try:
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:  # nothing to read: still there
            return False
        except OSError:
            return True

    def _events(self, job: Job):
        """The job's events while its client is there; raises ClientGone or a 504 ApiError otherwise."""
        while True:
            try:
                event = job.events.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if self._client_gone():
                    raise ClientGone from None
                if time.monotonic() > job.deadline + GRACE_SECONDS:
                    raise ApiError(504, "the generation did not stop at its timeout", kind="server_error") from None
                continue
            if event[0] == "record" and self._client_gone():
                raise ClientGone
            yield event
            if event[0] != "record":
                return

    # -- routes --------------------------------------------------------------------------------------------
    def do_GET(self):
        app = self.app
        if self.path.rstrip("/") == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": name, "object": "model", "created": app.created, "owned_by": "dflash2"}
                for name in app.model_names]})
        elif self.path == "/health":
            self._send_health()
        else:
            self._send_error(ApiError(404, f"no route GET {self.path}", code="not_found"))

    def _send_health(self) -> None:
        """The server's state: up (its worker alive), what it serves, requests waiting and running, memory."""
        app = self.app
        worker = app.worker
        alive = worker.thread.is_alive()
        self._send_json(200 if alive else 503, {
            "status": "ok" if alive else "unavailable", "model": app.model_id,
            "served_model_names": app.model_names,
            "verify_mode": app.defaults.verify_mode, "queued": worker.jobs.qsize(),
            "running": worker.running is not None, "active": len(worker.active),
            "batch": {"size": worker.batch_size, "max_size": worker.batch_size_max,
                      "batched_steps": worker.batched_steps, "decode_concurrency": worker.decode_concurrency},
            "prompt_cache": worker.cache_info, "sharded": app.sharded,
            "memory": {"active_gb": round(mx.get_active_memory() / 1e9, 4),
                       "peak_gb": round(mx.get_peak_memory() / 1e9, 4)}})

    def do_POST(self):
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "text"}.get(self.path.rstrip("/"))
        job = None
        try:
            if kind is None:
                raise ApiError(404, f"no route POST {self.path}", code="not_found")
            request = self.app.parser.parse(kind, self._read_json())
            job = Job(request.prompt, request.generation, time.monotonic() + self.app.request_timeout)
            if not self.app.worker.submit(job):
                wait = self.app.worker.retry_after()
                raise ApiError(503, f"the server is busy: its queue ({self.app.worker.jobs.maxsize} requests) is "
                               f"full; retry in {wait} s", kind="server_error", code="queue_full",
                               headers={"Retry-After": wait})
            (self._stream if request.stream else self._complete)(request, job)
        except ApiError as e:
            self._send_error(e)
        except ClientGone:
            log.info("client went away; its generation was cancelled")
        except (BrokenPipeError, ConnectionResetError):
            log.info("client went away mid-response; its generation was cancelled")
        finally:
            if job is not None:
                job.cancelled.set()  # whatever happened here, the worker stops this job at its next cycle

    def _read_json(self):
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise ApiError(411, "a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    # -- answers -------------------------------------------------------------------------------------------
    def _run(self, request: CompletionRequest, job: Job, on_text, logprobs: Logprobs | None = None):
        """Relay the job's text to `on_text` (cut at stop strings), its tokens' logprobs to `logprobs`; returns
        (finish reason, records, cached)."""
        stops, records, finish = StopText(request.stop), [], None
        for event in self._events(job):
            if event[0] == "error":
                e = event[1]
                raise ApiError(400 if isinstance(e, ValueError) else 500, f"generation failed: {e}",
                               kind="invalid_request_error" if isinstance(e, ValueError) else "server_error")
            if event[0] == "end":
                if event[1] == "timeout":
                    raise ApiError(504, f"the request ran past its timeout ({self.app.request_timeout:g} s) and "
                                   f"was stopped after {sum(len(r.tokens) for r in records)} tokens",
                                   kind="server_error", code="timeout")
                if event[1] == "cancelled" and finish is None:  # neither a stop string nor this client: shutdown
                    raise ApiError(503, "the server is shutting down", kind="server_error", code="shutdown")
                return finish, records, event[2]
            record: CycleResponse = event[1]
            if finish == "stop" and job.cancelled.is_set():
                continue  # generated past a stop string before the worker saw the cancel: not part of the answer
            records.append(record)
            if logprobs is not None:
                logprobs.add(record)
            text, stopped = stops.feed(record.text)
            if record.finish_reason and not stopped:
                text += stops.flush()
            on_text(text)
            if stopped:
                job.cancelled.set()
                finish = "stop"
            elif record.finish_reason:
                finish = record.finish_reason
        raise ClientGone  # not reached: _events ends with an "end" or "error" event

    def _usage_and_stats(self, records, cached: int, batch_size: int) -> tuple[dict, dict]:
        return responses.usage_and_stats(records, cached, self.app.worker.drafter, self.app.defaults.block_size,
                                         batch_size)

    def _complete(self, request: CompletionRequest, job: Job) -> None:
        parts, calls = [], []
        tools = responses.tool_calls_of(request, self.app.tokenizer, False)
        logprobs = responses.logprobs_of(request, self.app.tokenizer)

        def on_text(text: str) -> None:
            if tools is not None:
                text, done = tools.feed(text)
                calls.extend(done)
            parts.append(text)

        finish, records, cached = self._run(request, job, on_text, logprobs)
        if tools is not None:
            text, done = tools.finish()
            parts.append(text)
            calls.extend(done)
        usage, stats = self._usage_and_stats(records, cached, job.batch_size)
        choice = responses.choice(request, "".join(parts), responses.finish_reason(finish, tools), False,
                                  calls=calls, logprobs=logprobs)
        body = {**responses.base(request, responses.response_id(request), False),
                "choices": [choice], "usage": usage, "dflash": stats}
        self._send_json(200, body, responses.stats_headers(stats))

    def _stream(self, request: CompletionRequest, job: Job) -> None:
        rid = responses.response_id(request)
        started = False

        def send(body: dict) -> None:
            nonlocal started
            if not started:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                started = True
            self.wfile.write(f"data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()

        first = [True]
        tools = responses.tool_calls_of(request, self.app.tokenizer, True)
        logprobs = responses.logprobs_of(request, self.app.tokenizer)

        def on_text(text: str) -> None:
            calls = []
            if tools is not None:
                text, calls = tools.feed(text)
            if text or calls or first[0]:
                send({**responses.base(request, rid, True),
                      "choices": [responses.choice(request, text, None, True, first[0], calls, logprobs)]})
                first[0] = False

        try:
            finish, records, cached = self._run(request, job, on_text, logprobs)
        except ApiError as e:
            if not started:
                raise
            send(e.body())
            self.wfile.write(b"data: [DONE]\n\n")
            return
        usage, stats = self._usage_and_stats(records, cached, job.batch_size)
        text, calls = tools.finish() if tools is not None else (None, [])
        send({**responses.base(request, rid, True),
              "choices": [responses.choice(request, text, responses.finish_reason(finish, tools), True, first[0],
                                           calls, logprobs)],
              "dflash": stats})
        if request.include_usage:
            send({**responses.base(request, rid, True), "choices": [], "usage": usage, "dflash": stats})
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def make_server(app) -> ThreadingHTTPServer:
    """The HTTP server for `app`, bound to its settings' host and port (not yet serving: call serve_forever).

    Stop it with `shutdown()`, then `app.close()` (which ends every job), then `server_close()` (which joins the
    connection threads: none is left running Python, and freeing MLX arrays, while the interpreter exits).

    Args:
        app: the `App` its handlers share.
    """
    handler = type("DFlashHandler", (Handler,), {"app": app})
    server = ThreadingHTTPServer((app.settings.host, app.settings.port), handler)
    server.daemon_threads = False
    return server
