"""An OpenAI- and Anthropic-compatible HTTP server over `stream_cycles` (the library behind `dflash2 serve`).

POST /v1/chat/completions and /v1/completions (server-sent events with `"stream": true`), Anthropic's
/v1/messages (and /v1/messages/count_tokens), OpenAI's /v1/responses, GET /v1/models, GET /health and GET
/metrics (Prometheus' text format). An API key, CORS origins, a body limit and a read timeout are the server's
settings (`ServeSettings`). Request fields are OpenAI's and mlx_lm.server's; every response carries `usage` and a
`dflash` object (verify mode that ran, tau, cycles, accepted drafts, reused prompt tokens), non-streaming ones also
`X-DFlash-*` headers, so a fallback to plain decoding is visible. `logprobs` come in OpenAI's shapes (chat:
`logprobs` true and `top_logprobs` N; completions: `logprobs` N), streamed with the text too.

One module per job:

- `protocol`: the JSON body parsed and validated into a `CompletionRequest` and its `GenerationArguments`.
- `scheduler`: the one worker thread that owns the model (`Worker`): a lone request decodes speculatively,
  concurrent ones together in mlx-lm's `BatchGenerator`, each from the cached sequence sharing the longest
  prefix with it (`PromptCaches`).
- `batched_worker`: the worker whose batches speculate (`BatchedWorker`): each request verifies its own block in
  one forward per step, where the batched cost curve measured at startup says a batched cycle pays.
- `responses`: stop strings, reasoning and tool calls split off the text, logprobs, and `Reply`, one answer's
  shape: OpenAI's completions and their streamed chunks (`ChatReply`).
- `messages_api`, `responses_api`: Anthropic's Messages API and OpenAI's Responses API, each body translated to
  the chat request for the same conversation and each answer shaped as that API's (`MessagesReply`,
  `ResponsesReply`).
- `http`: the handler and the server (the standard library's ThreadingHTTPServer, one thread per connection).
- `app`: what the handlers share (`App`), the server's settings (`ServeSettings`) and `build_server`.

Example:
    app, server = build_server(model, tokenizer, drafter, model_id="my-model",
                               settings=ServeSettings(port=8080))
    server.serve_forever()
"""

from .app import App, ServeSettings, build_server, warm_start
from .http import make_server
from .protocol import ApiError, CompletionRequest, GenerationArguments, RequestParser
from .scheduler import Job, Worker

__all__ = [
    "ApiError",
    "App",
    "CompletionRequest",
    "GenerationArguments",
    "Job",
    "RequestParser",
    "ServeSettings",
    "Worker",
    "build_server",
    "make_server",
    "warm_start",
]
