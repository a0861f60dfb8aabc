"""The server's HTTP transport: the standard library's ThreadingHTTPServer, one thread per connection.

A handler thread reads and parses a request (`App.parser`), queues its job on the worker (a full queue answers
503 with Retry-After), then relays the job's records as they come: one JSON answer, or server-sent events with
`"stream": true`. It polls its client while it waits: a client that leaves cancels its job.

Limits, from the server's settings (`ServeSettings`): a client has `read_timeout` seconds to send a request's
headers and body (then its connection is dropped, its thread freed), a body over `max_body_bytes` gets 413; with
an `api_key`, every route but /health and CORS preflights needs it (`Authorization: Bearer KEY` or
`x-api-key: KEY`), else 401; browsers from `allowed_origins` get CORS headers, others none.
"""

from __future__ import annotations

import hmac
import io
import json
import logging
import queue
import socket
import struct
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx

from ..generate import CycleResponse
from . import messages_api, responses, responses_api
from .protocol import ApiError, CompletionRequest
from .responses import ChatReply, Logprobs, Outcome, Reply, StopText
from .scheduler import Job

log = logging.getLogger("dflash2.serve")

CORS_HEADERS = "Authorization, Content-Type, X-API-Key, Anthropic-Version"  # what a browser's request may send
EXPOSED_HEADERS = "Retry-After, X-DFlash-Verify-Mode, X-DFlash-Tau, X-DFlash-Cycles"  # what its script may read
GRACE_SECONDS = 30.0  # past a job's deadline, how long its client waits for the worker to notice
POLL_SECONDS = 0.2  # how often a waiting client connection is checked
SEND_TIMEOUT_SECONDS = 60  # a write to a client that reads nothing for this long fails (and cancels its job)
LISTEN_BACKLOG = 128  # connections the kernel queues for accept

# POST routes that generate: how a body becomes a request (with the app's `RequestParser`), and what answers it
ENDPOINTS = {
    "/v1/chat/completions": (lambda parser, body: parser.parse("chat", body), ChatReply),
    "/v1/completions": (lambda parser, body: parser.parse("text", body), ChatReply),
    "/v1/messages": (messages_api.parse, messages_api.MessagesReply),
    "/v1/responses": (responses_api.parse, responses_api.ResponsesReply),
}
COUNT_TOKENS = "/v1/messages/count_tokens"  # Anthropic's: the prompt's length, nothing generated


class ClientGone(Exception):
    """The client closed its connection while its request ran."""


class DeadlineReader(io.RawIOBase):
    """A connection's reads, each failing with TimeoutError once `deadline` (time.monotonic()) has passed: the
    whole request (headers and body) must arrive by then, however slowly it trickles in. None: no deadline, the
    socket left as it is.

    Args:
        sock: the connection.
    """

    def __init__(self, sock: socket.socket):
        super().__init__()
        self.sock, self.deadline = sock, None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive within the read timeout")
            self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class Handler(BaseHTTPRequestHandler):
    """POST /v1/chat/completions, /v1/completions, /v1/messages (and its count_tokens) and /v1/responses, GET
    /v1/models, /health and /metrics, for the `app` that `make_server` sets on its subclass (an `App`: its worker,
    parser, names and settings)."""

    server_version = "dflash2"
    app = None  # the App, set on the subclass `make_server` builds
    reply_class = Reply  # the route's answer shape, whose errors it speaks (OpenAI's but on Anthropic's route)

    def setup(self):
        super().setup()
        # a client that stops reading cannot hold its thread (and the server's shutdown) for long
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", SEND_TIMEOUT_SECONDS, 0))
        # nor can one that sends half a request: reads fail past the read timeout (`handle_one_request`)
        self.reader = DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self.reader)

    def handle_one_request(self):
        """One request, whose headers and body must arrive within --read-timeout: past it the standard library's
        handler (headers) or `_read_json` (body) gives up, and the connection closes."""
        self.reader.deadline = time.monotonic() + self.app.settings.read_timeout
        super().handle_one_request()

    def _reading_done(self) -> None:
        """The request is read: the socket blocks again (its send timeout applies; the client polls need it)."""
        if self.reader.deadline is not None:
            self.reader.deadline = None
            self.connection.settimeout(None)

    def send_response(self, code, message=None):
        self._reading_done()
        self.app.count_response(code)
        super().send_response(code, message)

    def end_headers(self):
        """Every answer's headers end here: CORS headers go on those to an allowed origin."""
        origin = self._allowed_origin()
        if origin is not None:
            self.send_header("Access-Control-Allow-Origin", origin)
            self.send_header("Access-Control-Expose-Headers", EXPOSED_HEADERS)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def _allowed_origin(self) -> str | None:
        """The Access-Control-Allow-Origin a request's Origin gets ("*" when any is allowed), None for none."""
        headers = getattr(self, "headers", None)  # unset when the request line itself was bad
        origin = headers.get("Origin") if headers is not None else None
        allowed = self.app.settings.allowed_origins
        if origin is None or not allowed:
            return None
        return "*" if "*" in allowed else origin if origin in allowed else None

    def _check_key(self) -> None:
        """A 401 unless the request carries the server's API key (none set: every request passes)."""
        key = self.app.settings.api_key
        if key is None:
            return
        bearer = self.headers.get("Authorization", "")
        given = [bearer[7:].strip() if bearer[:7].lower() == "bearer " else "", self.headers.get("x-api-key", "")]
        # compare_digest on bytes: its time does not depend on where a guess first differs
        if not any(hmac.compare_digest(g.encode(), key.encode()) for g in given):
            self.close_connection = True
            raise ApiError(
                401,
                "a valid API key is required: send 'Authorization: Bearer KEY' (or 'x-api-key: "
                "KEY') with the key the server was started with (--api-key)",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

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
        self._send_json(e.status, self.reply_class.error_body(e), e.headers)

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
    def do_OPTIONS(self):
        """A CORS preflight: an allowed origin gets the methods and headers it may use; others nothing more."""
        self.send_response(204)
        self.send_header("Allow", "GET, POST, OPTIONS")
        if self._allowed_origin() is not None:
            self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            self.send_header("Access-Control-Allow-Headers", CORS_HEADERS)
            self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):
        app = self.app
        if self.path != "/health":
            try:
                self._check_key()
            except ApiError as e:
                return self._send_error(e)
        if self.path == "/metrics":
            data = app.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path.rstrip("/") == "/v1/models":
            self._send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {"id": name, "object": "model", "created": app.created, "owned_by": "dflash2"}
                        for name in app.model_names
                    ],
                },
            )
        elif self.path == "/health":
            self._send_health()
        else:
            self._send_error(ApiError(404, f"no route GET {self.path}", code="not_found"))

    def _send_health(self) -> None:
        """The server's state: up (its worker alive), what it serves, requests waiting and running, the tokens
        speculative cycles accepted (from lookups too), memory."""
        app = self.app
        worker = app.worker
        alive = worker.thread.is_alive()
        self._send_json(
            200 if alive else 503,
            {
                "status": "ok" if alive else "unavailable",
                "model": app.model_id,
                "served_model_names": app.model_names,
                "verify_mode": app.defaults.verify_mode,
                "queued": worker.jobs.qsize(),
                "running": worker.running is not None,
                "active": len(worker.active),
                "batch": {
                    "size": worker.batch_size,
                    "max_size": worker.batch_size_max,
                    "batched_steps": worker.batched_steps,
                    # tokens a second that steps serving more than one request committed, over all of them
                    "tokens_per_s": round(worker.batched_tokens / worker.batched_seconds, 2)
                    if worker.batched_seconds
                    else None,
                    "decode_concurrency": worker.decode_concurrency,
                    **app.batch_speculation(),
                },
                "prompt_cache": worker.cache_info,
                "decoding": app.decoding_counts(),
                "sharded": app.sharded,
                "memory": {
                    "active_gb": round(mx.get_active_memory() / 1e9, 4),
                    "peak_gb": round(mx.get_peak_memory() / 1e9, 4),
                },
            },
        )

    def do_POST(self):
        path = self.path.rstrip("/")
        parse, self.reply_class = ENDPOINTS.get(
            path, (None, messages_api.MessagesReply if path == COUNT_TOKENS else Reply)
        )
        job = None
        try:
            self._check_key()
            if path == COUNT_TOKENS:
                return self._send_json(200, messages_api.count_tokens(self.app.parser, self._read_json()))
            if parse is None:
                raise ApiError(404, f"no route POST {self.path}", code="not_found")
            request = parse(self.app.parser, self._read_json())
            job = Job(request.prompt, request.generation, time.monotonic() + self.app.request_timeout)
            if not self.app.worker.submit(job):
                wait = self.app.worker.retry_after()
                raise ApiError(
                    503,
                    f"the server is busy: its queue ({self.app.worker.jobs.maxsize} requests) is "
                    f"full; retry in {wait} s",
                    kind="server_error",
                    code="queue_full",
                    headers={"Retry-After": wait},
                )
            self._answer(self.reply_class(request, self.app.tokenizer), job)
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
        limit = self.app.settings.max_body_bytes
        if int(length) > limit:
            self.close_connection = True
            raise ApiError(
                413, f"the request body ({length} bytes) is over the server's limit of {limit} bytes (--max-body-bytes)"
            )
        try:
            raw = self.rfile.read(int(length))
        except TimeoutError:
            self.close_connection = True
            raise ApiError(
                408,
                f"the request body did not arrive within {self.app.settings.read_timeout:g} s (--read-timeout)",
                code="timeout",
            ) from None
        self._reading_done()
        if len(raw) < int(length):
            self.close_connection = True
            raise ApiError(400, f"the request body ended after {len(raw)} of its {length} bytes (Content-Length)")
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, f"the request body is not valid JSON: {e}") from None

    # -- answers -------------------------------------------------------------------------------------------
    def _run(self, request: CompletionRequest, job: Job, on_text, logprobs: Logprobs | None = None) -> Outcome:
        """Relay the job's text to `on_text` (cut at stop strings; it returns true once the answer is complete,
        which stops the generation as a stop string does), its tokens' logprobs to `logprobs`; returns how the
        generation ended."""
        stops, records, finish = StopText(request.stop), [], None
        for event in self._events(job):
            if event[0] == "error":
                e = event[1]
                raise ApiError(
                    400 if isinstance(e, ValueError) else 500,
                    f"generation failed: {e}",
                    kind="invalid_request_error" if isinstance(e, ValueError) else "server_error",
                )
            if event[0] == "end":
                if event[1] == "timeout":
                    raise ApiError(
                        504,
                        f"the request ran past its timeout ({self.app.request_timeout:g} s) and "
                        f"was stopped after {sum(len(r.tokens) for r in records)} tokens",
                        kind="server_error",
                        code="timeout",
                    )
                if event[1] == "cancelled" and finish is None:  # neither a stop string nor this client: shutdown
                    raise ApiError(503, "the server is shutting down", kind="server_error", code="shutdown")
                usage, stats = self._usage_and_stats(records, event[2], job.batch_size)
                return Outcome(finish, stops.matched, usage, stats)
            record: CycleResponse = event[1]
            if finish == "stop" and job.cancelled.is_set():
                continue  # generated past a stop string before the worker saw the cancel: not part of the answer
            records.append(record)
            if logprobs is not None:
                logprobs.add(record)
            text, stopped = stops.feed(record.text)
            if record.finish_reason and not stopped:
                text += stops.flush()
            if on_text(text) or stopped:
                job.cancelled.set()
                finish = "stop"
            elif record.finish_reason:
                finish = record.finish_reason
        raise ClientGone  # not reached: _events ends with an "end" or "error" event

    def _usage_and_stats(self, records, cached: int, batch_size: int) -> tuple[dict, dict]:
        return responses.usage_and_stats(
            records, cached, self.app.worker.drafter, self.app.defaults.block_size, batch_size
        )

    def _answer(self, reply: Reply, job: Job) -> None:
        """Generate the job and answer with `reply`: one JSON body, or server-sent events as the text comes (the
        stream's headers go with its first event: an error before it gets its own status)."""
        started, first = False, reply.start() if reply.request.stream else []

        def send(events: list) -> None:
            nonlocal started
            if not started:
                events = first + events
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Cache-Control", "no-cache")
                self.end_headers()
                started = True
            for name, body in events:  # OpenAI's chunks are unnamed, Anthropic's and Responses' events named
                head = f"event: {name}\n" if name else ""
                self.wfile.write(f"{head}data: {json.dumps(body)}\n\n".encode())
            self.wfile.flush()

        def on_text(text: str) -> bool:
            events = reply.feed(text)
            if events:
                send(events)
            return reply.complete

        try:
            outcome = self._run(reply.request, job, on_text, reply.logprobs)
            last = reply.end(outcome) if reply.request.stream else []  # its checks may refuse the last call
        except ApiError as e:
            if not started:
                raise
            send(reply.stream_error(e))
            self.wfile.write(reply.stream_end)
            return
        if not reply.request.stream:
            return self._send_json(200, reply.body(outcome), responses.stats_headers(outcome.stats))
        send(last)
        self.wfile.write(reply.stream_end)
        self.wfile.flush()


def make_server(app) -> ThreadingHTTPServer:
    """The HTTP server for `app`, bound to its settings' host and port (not yet serving: call serve_forever).

    Stop it with `shutdown()`, then `app.close()` (which ends every job), then `server_close()` (which joins the
    connection threads: none is left running Python, and freeing MLX arrays, while the interpreter exits).

    Args:
        app: the `App` its handlers share.
    """
    handler = type("DFlashHandler", (Handler,), {"app": app})
    # connections the kernel queues before they are accepted (the standard library's 5 makes a burst of clients
    # wait for SYN retries, seconds each)
    server_class = type("DFlashHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": LISTEN_BACKLOG})
    server = server_class((app.settings.host, app.settings.port), handler)
    server.daemon_threads = False
    return server
