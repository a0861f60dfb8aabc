"""`dflash2 serve`: an OpenAI- and Anthropic-compatible HTTP server over `stream_cycles` (`dflash2_mlx.server`):
its flags, its signals (SIGINT ends it with 130, SIGTERM with 0) and, for a target sharded over processes, the
other ranks' part.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from mlx_lm.utils import _parse_size as parse_size

from dflash2_apps import common
from dflash2_mlx import distributed
from dflash2_mlx.assets import DEFAULT_TARGET_NAME
from dflash2_mlx.server import GenerationArguments, ServeSettings
from dflash2_mlx.server import build_server as build_app_server
from dflash2_mlx.server.batched_worker import BATCHED_SPECULATION

log = logging.getLogger("dflash2.serve")

API_KEY_VARIABLE = "DFLASH2_API_KEY"  # --api-key's default, where the key stays out of `ps`


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="an OpenAI- and Anthropic-compatible HTTP server (chat, completions, messages, responses)",
        description="Serve the target, speculatively with a DFlash drafter, over OpenAI's and Anthropic's APIs: "
        "POST /v1/chat/completions, /v1/completions, /v1/responses and /v1/messages, GET /v1/models, /health and "
        "/metrics. The generation flags are the defaults of requests that do not set them.",
    )
    common.add_model_args(p)
    common.add_copyspec_args(p)
    common.add_sampling_args(p)
    d = ServeSettings()
    p.add_argument(
        "--host", default=d.host, help="address to bind (anything but loopback exposes the model; default %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=d.port, help="0 picks a free port, printed on stderr (default %(default)s)"
    )
    p.add_argument(
        "--queue-size",
        type=int,
        default=d.queue_size,
        help="requests waiting beyond the running one; more get 503 (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds a request may take, queueing included; past it the generation is stopped (default %(default)s)",
    )
    p.add_argument(
        "--context-length",
        type=int,
        default=d.context_length,
        help="longest prompt + max_tokens accepted (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--prompt-cache",
        action=argparse.BooleanOptionalAction,
        default=d.prompt_cache,
        help="reuse cached sequences (the slots of earlier requests) for the prefix a request shares with one",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=d.prompt_cache_size,
        help="prompt-cache slots: distinct sequences kept, least recently used dropped first, as "
        "mlx_lm.server's flag (default %(default)s)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=byte_size,
        default=d.prompt_cache_bytes,
        help="the slots' byte budget, e.g. 4GB or 512MB, less what a running batch holds, as "
        "mlx_lm.server's flag (default: no bound but --prompt-cache-size)",
    )
    p.add_argument(
        "--decode-concurrency",
        type=int,
        default=d.decode_concurrency,
        help="most requests decoded together in one batch, as mlx_lm.server's flag; 1 serves one request "
        "at a time, always speculatively (default %(default)s)",
    )
    p.add_argument(
        "--batched-speculation",
        choices=BATCHED_SPECULATION,
        default=d.batched_speculation,
        help="concurrent requests draft and verify together: where this machine's measured batched cost curve "
        "says it pays (auto), always where they can (on: an error where they cannot), or never (off: mlx-lm's "
        "batch, plain steps) (default %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_VARIABLE) or None,
        help="a key every client must send ('Authorization: Bearer KEY' or 'x-api-key: KEY'; else 401), "
        f"on every route but /health (default: ${API_KEY_VARIABLE}, else none; the variable keeps the key "
        "out of the process list)",
    )
    p.add_argument(
        "--allowed-origins",
        type=origins,
        default=d.allowed_origins,
        metavar="ORIGIN,...",
        help="browser origins given CORS headers, comma-separated, e.g. http://localhost:3000, or '*' for "
        "any (default: none, so no web page can call the server)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=byte_size,
        default=d.max_body_bytes,
        help="longest request body, in bytes or e.g. 16MB; longer ones get 413 (default %(default)s)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        help="seconds a client has to send a request's headers and body; past it the connection is "
        "dropped (default %(default)s)",
    )
    p.add_argument(
        "--chat-template-args",
        type=template_args,
        default=None,
        metavar="JSON",
        help="keyword arguments for the chat template, as mlx_lm.server's flag, e.g. "
        "'{\"enable_thinking\": false}'; a request's chat_template_kwargs update them",
    )
    p.add_argument("--model-id", help="the name clients use in 'model' (default: --model, or the default target's)")
    p.add_argument(
        "--served-model-name",
        action="append",
        default=[],
        metavar="NAME",
        help="another name clients may use in 'model', besides --model-id (repeatable or comma-separated, "
        "as vLLM's); GET /v1/models lists them all, any other name gets a 404",
    )
    common.add_sharding_args(p)
    p.set_defaults(run=run)


def origins(text: str) -> tuple[str, ...]:
    """An --allowed-origins value: origins (scheme://host[:port]) or '*', comma-separated."""
    found = tuple(o.strip().rstrip("/") for o in text.split(",") if o.strip())
    bad = [o for o in found if o != "*" and "://" not in o]
    if not found or bad:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give origins as scheme://host[:port] (e.g. "
            "http://localhost:3000), comma-separated, or '*' for any"
        )
    return found


def template_args(text: str) -> dict:
    """A --chat-template-args value: a JSON object."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not JSON ({e}): give an object, e.g. '{{\"enable_thinking\": false}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object: give one, e.g. '{{\"enable_thinking\": false}}'"
        )
    return value


def byte_size(text: str) -> int:
    """A --prompt-cache-bytes or --max-body-bytes value: bytes, or a number with M, MB, G or GB (mlx_lm.server's
    reading)."""
    try:
        return parse_size(text)
    except (KeyError, ArithmeticError, ValueError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes, or a number with M, MB, G or GB (e.g. 512MB, 4GB)"
        ) from None


def served_names(flags: list[str]) -> tuple[str, ...]:
    """The names of --served-model-name flags, each a name or a comma-separated list; empty names are refused."""
    names = tuple(name.strip() for flag in flags for name in flag.split(","))
    if any(not name for name in names):
        raise ValueError(f"--served-model-name takes names, separated by commas; got {flags!r}")
    return names


def settings_of(args) -> ServeSettings:
    """The server's settings from parsed `serve` arguments."""
    return ServeSettings(
        host=args.host,
        port=args.port,
        queue_size=args.queue_size,
        request_timeout=args.request_timeout,
        context_length=args.context_length,
        prompt_cache=args.prompt_cache,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        decode_concurrency=args.decode_concurrency,
        batched_speculation=args.batched_speculation,
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        max_body_bytes=args.max_body_bytes,
        read_timeout=args.read_timeout,
        chat_template_args=args.chat_template_args,
    )


def build_server(args, loaded: tuple | None = None):
    """(App, HTTP server) for parsed `serve` arguments; the server is bound but not yet serving. `loaded`:
    (model, tokenizer, drafter) loaded already (rank 0's share of a sharded target)."""
    settings = settings_of(args)
    names = served_names(args.served_model_name)  # before the model loads: a bad flag fails at once
    model, tokenizer, drafter = loaded or common.load_pair(args)
    return build_app_server(
        model,
        tokenizer,
        drafter,
        model_id=args.model_id or args.model or DEFAULT_TARGET_NAME,
        defaults=GenerationArguments.from_kwargs(common.generation_kwargs(args)),
        settings=settings,
        served_names=names,
    )


class Terminated(BaseException):
    """SIGTERM: the server stops as on Ctrl-C, and the command ends with 0. A BaseException, as KeyboardInterrupt is:
    the signal may land while the server's own thread handles a connection, where socketserver reports an Exception
    and serves on."""


def _terminated(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    raise Terminated


def run(args) -> int:
    """Serve until SIGINT (exit 130) or SIGTERM (exit 0). A sharded target (--pipeline, --tensor-parallel, every
    process started by mlx.launch): rank 0 serves, the other ranks follow its forwards (they never bind the port)
    and end when it stops."""
    loaded = None
    if args.pipeline or args.tensor_parallel:
        served_names(args.served_model_name)  # before the model loads: a bad flag fails at once
        loaded = common.load_sharded(args)
        if not loaded[0].leader:
            # Ctrl-C reaches every process of the launch: rank 0 stops, then tells this one (SIGTERM ends it now)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            distributed.follow(loaded[0])
            return 0
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)
    app = server = None
    idle = True
    try:
        app, server = build_server(args, loaded)
        host, port = server.server_address[:2]
        mode = (
            args.verify_mode
            if args.verify_mode == "off"
            else f"{args.verify_mode} with {args.draft_model}, copy drafts {app.defaults.copyspec_mode}"
        )
        also = f", also as {', '.join(app.model_names[1:])}" if len(app.model_names) > 1 else ""
        print(f"[dflash2] serving {app.model_id} ({mode}{also}) on http://{host}:{port}", file=sys.stderr, flush=True)
        if args.api_key is None and host not in ("127.0.0.1", "::1", "localhost"):
            print(
                f"[dflash2] {host} is reachable from other machines and no --api-key is set: anyone who reaches "
                "it can use the model",
                file=sys.stderr,
                flush=True,
            )
        if app.sharded:
            print(
                f"[dflash2] the target is sharded {app.sharded['mode']}-parallel over {app.sharded['processes']} "
                "processes: requests run one at a time (no batched decoding, which would run the model in one "
                "process)",
                file=sys.stderr,
                flush=True,
            )
        server.serve_forever()
    except Terminated:
        return 0
    finally:
        if app is not None:
            idle = app.close()
            server.server_close()
        if loaded is not None:
            _release(loaded[0], idle)
    return 0


def _release(target, idle: bool) -> None:
    """Rank 0 of a sharded target: tell the other ranks to stop following, once no generation runs (one still
    running holds the collectives: the others then end when this process does, their ring broken)."""
    if not idle:
        log.warning("a generation did not stop; the other processes end with this one")
        return
    try:
        distributed.stop(target)
    except RuntimeError as e:  # the others are gone already (the error that ends this process may say why)
        log.warning("could not tell the other processes to stop: %s", e)
