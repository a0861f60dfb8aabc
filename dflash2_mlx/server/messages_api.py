"""Anthropic's Messages API (POST /v1/messages, and /v1/messages/count_tokens), as the official `anthropic` clients
and Claude Code speak it, over the chat endpoint's request: a body is translated to the chat completions body that
asks for the same generation, which `RequestParser` reads (one set of checks, one chat template call), and the
answer is shaped as Anthropic's message or its stream of events (`MessagesReply`). Every field's fate:

- read: `model`, `messages` (user and assistant turns of text, `tool_use`, `tool_result` and `thinking` blocks),
  `max_tokens` (required, as Anthropic requires it), `system` (a string or text blocks), `stop_sequences`,
  `stream`, `temperature`, `top_p`, `top_k`, `tools` (custom tools: name, description, input_schema; `strict`
  true: each call's input is checked against the schema, as the chat endpoint checks it), `tool_choice` ("auto"
  or "none"; `disable_parallel_tool_use` true: the answer ends after its first call), `thinking` ("enabled" or
  "adaptive": the template's `enable_thinking` true; "disabled": false; `budget_tokens`: the thinking section ends
  once it holds that many tokens, `thinking_budget`; `display` "omitted": thinking blocks come with their text left
  out, kept in their `signature`),
  `output_config.effort` (the template's `reasoning_effort`).
- refused unless absent: `REFUSED_FIELDS` says why; so are image and document blocks, server tools, tool_choice
  "any" and "tool" (no call can be forced), and a last assistant turn (a prefill to continue).
- accepted and not acted on: `IGNORED_FIELDS`, each with why; `cache_control` and `citations` on blocks,
  a tool result's `is_error` (the template renders the result's text
  alone), `redacted_thinking` blocks, a thinking block's `signature` when its text is given (the text is rendered
  as sent: nothing is verified); headers `anthropic-version` (any version is answered in the one shape here) and
  `anthropic-beta`.
- anything else: ignored, as the chat endpoint ignores what it does not know.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import uuid
import zlib
from dataclasses import dataclass, fields, replace

import mlx.core as mx

from .protocol import ApiError, CompletionRequest, RequestParser
from .responses import Blocks, Outcome, Reply

log = logging.getLogger("dflash2.serve")

IGNORED_FIELDS = {
    "metadata": "Anthropic's end-user id: nothing here is per user",
    "service_tier": "Anthropic's capacity tiers: one here",
    "cache_control": "prefixes are reused whether marked or not (the prompt cache)",
    "inference_geo": "one machine here",
    "speed": "one speed here",
}

REFUSED_FIELDS = {
    "container": "this server runs no code-execution containers",
    "mcp_servers": "this server calls no MCP servers: run the tools client-side and send their tool_result blocks",
    "context_management": "this server edits no context: send the conversation as it should be read",
}

# Anthropic's error types, by HTTP status
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}

CHAT_NAMES = {"stop": "stop_sequences"}  # chat's field names, as this API names them in errors
SIGNATURE_PREFIX = "dflash2:"  # what starts the `signature` of a thinking block this server made
MAX_SIGNED_BYTES = 16 << 20  # the longest thinking text a signature may unpack to


@dataclass(frozen=True)
class MessagesRequest(CompletionRequest):
    """A Messages API request: the chat request it asks for, and whether its thinking blocks leave their text
    out (`thinking.display` "omitted")."""

    omit_thinking: bool = False


def thinking_budget(tokenizer, budget: int):
    """mlx-lm's kind of logits processor (`proc(tokens, logits) -> logits`) that ends a thinking section once it
    holds `budget` tokens: past them, while the section is open (the last think-start marker after the last
    think-end one, in the prompt or the generated tokens), every token but the next of the think-end marker gets
    -inf, so the marker's tokens come next, however the model would have gone on, and the answer follows. It
    reads only `tokens` (the prompt and the tokens before the row), so every verify mode and batched decoding
    apply it as plain decoding does (`sampling.Processing`), and stays lazy (no host read).

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` of a thinking model (`has_thinking`): its think markers' tokens.
        budget: the most tokens a thinking section holds (its markers not counted).
    """
    start, end = tuple(tokenizer.think_start_tokens), tuple(tokenizer.think_end_tokens)

    def after(tokens: mx.array, marker: tuple) -> mx.array:
        """The index just past the marker's last occurrence in `tokens`; -1 for none."""
        n, m = tokens.size, len(marker)
        if n < m:
            return mx.array(-1)
        hit = tokens[: n - m + 1] == marker[0]
        for k in range(1, m):
            hit = hit & (tokens[k : n - m + 1 + k] == marker[k])
        return mx.max(mx.where(hit, mx.arange(m, n + 1), -1))

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        tokens = tokens.reshape(-1)
        n = tokens.size
        opened = after(tokens, start)
        over = (opened > after(tokens, end)) & (n - opened >= budget)
        forced = mx.array(end[0])
        for k in range(1, min(len(end), n + 1)):  # past the part of the marker forced already
            done = mx.all(tokens[n - k :] == mx.array(end[:k], dtype=tokens.dtype))
            forced = mx.where(done, end[k], forced)
        keep = mx.logical_not(over) | (mx.arange(logits.shape[-1]) == forced)
        return mx.where(keep, logits, -mx.inf)

    return process


def signature(thinking: str) -> str:
    """A thinking block's `signature`: its text, compressed and base64-encoded, so that the block sent back without
    its text (shown with `display` "omitted") still gives the template its reasoning. Nothing is secret or
    verified: the block's text, when sent, is what is rendered."""
    return SIGNATURE_PREFIX + base64.urlsafe_b64encode(zlib.compress(thinking.encode())).decode()


def signed_text(value, where: str = "a thinking block") -> str | None:
    """The thinking text a `signature` made by this server carries; None for another (Anthropic's, or none).

    Args:
        value: the block's `signature`.
        where: the block, as an error names it (`messages[i].content[j]`).

    Raises:
        ApiError: 400 for a signature of this server's that does not unpack.
    """
    if not isinstance(value, str) or not value.startswith(SIGNATURE_PREFIX):
        return None
    unpack = zlib.decompressobj()
    try:
        text = unpack.decompress(base64.urlsafe_b64decode(value[len(SIGNATURE_PREFIX) :]), MAX_SIGNED_BYTES)
        if unpack.unconsumed_tail or not unpack.eof:
            raise ValueError("cut short or over the limit")
        return text.decode()
    except (ValueError, binascii.Error, zlib.error) as e:
        raise ApiError(
            400,
            f"{where}.signature does not unpack ({e}): send the thinking block back as it was answered",
            param="messages",
        ) from None


def parse(parser: RequestParser, body, count_only: bool = False) -> CompletionRequest:
    """The request a Messages API body makes.

    Args:
        parser: the server's request parser.
        body: the body's decoded JSON.
        count_only: read for /v1/messages/count_tokens (max_tokens not required).

    Raises:
        ApiError: 400 naming the field that does not fit (404: a model not served).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    ignored = sorted(IGNORED_FIELDS.keys() & body.keys())
    if ignored:
        log.debug("fields not acted on: %s", "; ".join(f"{k}: {IGNORED_FIELDS[k]}" for k in ignored))
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) is not None:
            raise ApiError(400, f"'{name}' cannot be honoured: {why}", param=name)
    if body.get("max_tokens") is None and not count_only:
        raise ApiError(400, "'max_tokens' is required: the most tokens to generate", param="max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise ApiError(400, "'stop_sequences' must be a list of strings", param="stop_sequences")
    chat = {key: body[key] for key in ("model", "max_tokens", "stream", "temperature", "top_p", "top_k") if key in body}
    kwargs, budget, omit = _thinking(body)
    chat.update(messages=_messages(body), stop=stops, **_tools(body), **kwargs)
    if count_only:
        chat.update(max_tokens=1, stream=False)
    try:
        request = parser.parse("chat", chat)
    except ApiError as e:
        raise e.renamed(CHAT_NAMES) from None
    request = MessagesRequest(**{f.name: getattr(request, f.name) for f in fields(request)}, omit_thinking=omit)
    if budget is not None and parser.tokenizer.has_thinking:  # a model that never thinks has nothing to end
        g = request.generation
        processors = [*(g.logits_processors or ()), thinking_budget(parser.tokenizer, budget)]
        request = replace(request, generation=replace(g, logits_processors=processors))
    return request


def count_tokens(parser: RequestParser, body) -> dict:
    """/v1/messages/count_tokens: the prompt's length in tokens, as the chat template renders the request."""
    return {"input_tokens": len(parse(parser, body, count_only=True).prompt)}


def _thinking(body: dict) -> tuple[dict, int | None, bool]:
    """`thinking` and `output_config`: the chat request's `chat_template_kwargs` (as a dict of it), the thinking
    budget in tokens (None: none) and whether thinking blocks leave their text out."""
    kwargs, budget, omit = {}, None, False
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise ApiError(400, '\'thinking\' must be {"type": "enabled" | "adaptive" | "disabled"}', param="thinking")
        kwargs["enable_thinking"] = kind != "disabled"
        budget = thinking.get("budget_tokens") if kind == "enabled" else None
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 1):
            raise ApiError(
                400,
                f"'thinking.budget_tokens' must be an integer >= 1 (the most tokens the thinking may take), got "
                f"{json.dumps(budget)}",
                param="thinking",
            )
        display = thinking.get("display")
        if display not in (None, "summarized", "omitted"):
            raise ApiError(
                400,
                f'\'thinking.display\' must be "summarized" or "omitted", got {json.dumps(display)}',
                param="thinking",
            )
        omit = display == "omitted" and kind != "disabled"
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise ApiError(400, "'output_config' must be an object", param="output_config")
        if config.get("format") is not None:
            raise ApiError(
                400,
                "'output_config.format' cannot be honoured: the text is not constrained to a schema here",
                param="output_config",
            )
        if config.get("effort") is not None:
            kwargs["reasoning_effort"] = config["effort"]
    return ({"chat_template_kwargs": kwargs} if kwargs else {}), budget, omit


def _tools(body: dict) -> dict:
    """`tools` and `tool_choice` as the chat endpoint's."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    out = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(
                400, "'tools' must be a list of {'name', 'description', 'input_schema'} objects", param="tools"
            )
        out["tools"] = [_tool(i, tool) for i, tool in enumerate(tools)]
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none"):
            raise ApiError(
                400,
                f'\'tool_choice\' must be {{"type": "auto"}} or {{"type": "none"}}, got '
                f"{json.dumps(choice)}: this server cannot force a tool call",
                param="tool_choice",
            )
        out["tool_choice"] = kind
        single = choice.get("disable_parallel_tool_use")
        if not isinstance(single, (bool, type(None))):
            raise ApiError(400, "'tool_choice.disable_parallel_tool_use' must be true or false", param="tool_choice")
        if single:
            out["parallel_tool_calls"] = False
    return out


def _tool(i: int, tool) -> dict:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise ApiError(
            400, f"tools[{i}] must be {{'name': ..., 'description': ..., 'input_schema': ...}}", param="tools"
        )
    if tool.get("type") not in (None, "custom"):
        raise ApiError(
            400,
            f"tools[{i}] is Anthropic's server tool {tool['type']!r}, which this server does not "
            "run: define it as a custom tool (name, description, input_schema)",
            param="tools",
        )
    function = {"name": tool["name"], "parameters": tool.get("input_schema", {"type": "object"})}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _messages(body: dict) -> list[dict]:
    """`system` and `messages` as the chat endpoint's messages: tool_use blocks become the assistant's tool_calls,
    each tool_result a "tool" message (its call's name looked up), thinking blocks `reasoning_content`."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list of {'role', 'content'} objects", param="messages")
    system = body.get("system")
    out = []
    if system is not None:
        if not isinstance(system, (str, list)):
            raise ApiError(400, "'system' must be a string or a list of text blocks", param="system")
        out.append({"role": "system", "content": system})  # text blocks: the chat endpoint's text parts
    names = {}  # tool_use id -> tool name
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise ApiError(400, f'messages[{i}].role must be "user" or "assistant"', param="messages")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of blocks", param="messages")
        out += _assistant(i, content, names) if role == "assistant" else _user(i, content, names)
    if messages[-1].get("role") == "assistant":
        raise ApiError(
            400,
            "'messages' ends with the assistant's turn: this server does not continue a "
            "prefilled answer; end with a user message",
            param="messages",
        )
    return out


def _block(i: int, j: int, block, kinds: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in kinds:
        raise ApiError(
            400,
            f"messages[{i}].content[{j}] is a {kind!r} block: this server takes "
            f"{', '.join(kinds)} blocks here (text only, no images or documents)",
            param="messages",
        )
    return kind


def _user(i: int, content: list, names: dict) -> list[dict]:
    results, texts = [], []
    for j, block in enumerate(content):
        if _block(i, j, block, ("text", "tool_result")) == "text":
            texts.append(block)
            continue
        result = block.get("content", "")
        if isinstance(result, list):
            for part in result:
                _block(i, j, part, ("text",))
            result = "".join(part.get("text", "") for part in result)
        call = block.get("tool_use_id")
        if not isinstance(result, str) or not isinstance(call, str):
            raise ApiError(
                400,
                f"messages[{i}].content[{j}] must be {{'type': 'tool_result', 'tool_use_id': ..., 'content': text}}",
                param="messages",
            )
        results.append(
            {
                "role": "tool",
                "tool_call_id": call,
                "content": result,
                **({"name": names[call]} if call in names else {}),
            }
        )
    return results + ([{"role": "user", "content": texts}] if texts or not results else [])


def _assistant(i: int, content: list, names: dict) -> list[dict]:
    message, texts, calls, reasoning = {"role": "assistant"}, [], [], ""
    for j, block in enumerate(content):
        kind = _block(i, j, block, ("text", "tool_use", "thinking", "redacted_thinking"))
        if kind == "text":
            texts.append(block)
        elif kind == "thinking":  # its text as sent, else the one its signature carries (display "omitted")
            reasoning += (
                block.get("thinking") or signed_text(block.get("signature"), f"messages[{i}].content[{j}]") or ""
            )
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
                raise ApiError(
                    400,
                    f"messages[{i}].content[{j}] must be {{'type': 'tool_use', 'id': ..., 'name': "
                    "..., 'input': {...}}",
                    param="messages",
                )
            names[block["id"]] = block["name"]
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})},
                }
            )
    message["content"] = texts
    if calls:
        message["tool_calls"] = calls
    if reasoning:
        message["reasoning_content"] = reasoning
    return [message]


class MessagesReply(Reply):
    """An answer of /v1/messages: Anthropic's message, or its events (message_start; per block
    content_block_start, its deltas, content_block_stop; message_delta with the stop reason and usage;
    message_stop). Blocks: `thinking` (a thinking model's reasoning, its text carried by its `signature` too, which
    comes last in a stream, in a signature_delta; with `display` "omitted" its text is left out), `text`,
    `tool_use`."""

    def __init__(self, request: CompletionRequest, tokenizer):
        super().__init__(request, tokenizer)
        self.id, self.blocks = f"msg_{uuid.uuid4().hex}", Blocks()

    @staticmethod
    def error_body(e: ApiError) -> dict:
        kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": e.message}}

    def stream_error(self, e: ApiError) -> list:
        return [("error", self.error_body(e))]

    def _message(self, content: list, stop_reason: str | None, stop: str | None, output_tokens: int) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.request.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop,
            "usage": {"input_tokens": len(self.request.prompt), "output_tokens": output_tokens},
        }

    def _stop_reason(self, outcome: Outcome) -> str:
        if outcome.finish == "length":
            return "max_tokens"
        if self.states.made:
            return "tool_use"
        return "stop_sequence" if outcome.stop is not None else "end_turn"

    def _content(self, block: dict, whole: bool) -> dict:
        """A block in Anthropic's shape: whole, or as content_block_start opens it (empty)."""
        if block["kind"] == "call":
            call = block["call"]
            arguments = json.loads(call["function"]["arguments"]) if whole else {}
            return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}
        text = block["text"] if whole else ""
        if block["kind"] == "reasoning":
            shown = "" if self.request.omit_thinking else text
            return {"type": "thinking", "thinking": shown, "signature": signature(text) if whole else ""}
        return {"type": "text", "text": text}

    def _events(self, changes) -> list:
        events = []
        for change, index, value in changes:
            if change == "start":
                events.append(
                    (
                        "content_block_start",
                        {"type": "content_block_start", "index": index, "content_block": self._content(value, False)},
                    )
                )
                if value["kind"] == "call":
                    delta = {"type": "input_json_delta", "partial_json": value["call"]["function"]["arguments"]}
                    events.append(
                        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                    )
            elif change == "delta":
                kind = self.blocks.blocks[index]["kind"]
                if kind == "reasoning" and self.request.omit_thinking:
                    continue
                delta = (
                    {"type": "thinking_delta", "thinking": value}
                    if kind == "reasoning"
                    else {"type": "text_delta", "text": value}
                )
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            else:
                if value["kind"] == "reasoning":  # the signature, just before the block's stop (as Anthropic's)
                    delta = {"type": "signature_delta", "signature": signature(value["text"])}
                    events.append(
                        ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})
                    )
                events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
        return events

    def start(self) -> list:
        return [("message_start", {"type": "message_start", "message": self._message([], None, None, 0)})]

    def feed(self, text: str) -> list:
        changes = self.blocks.add(self.states.feed(text))
        return self._events(changes) if self.request.stream else []

    def end(self, outcome: Outcome) -> list:
        events = self._events(self.blocks.add(self.states.finish()) + self.blocks.close())
        delta = {"stop_reason": self._stop_reason(outcome), "stop_sequence": outcome.stop}
        usage = {"output_tokens": outcome.usage["completion_tokens"]}
        return [
            *events,
            ("message_delta", {"type": "message_delta", "delta": delta, "usage": usage, "dflash": outcome.stats}),
            ("message_stop", {"type": "message_stop"}),
        ]

    def body(self, outcome: Outcome) -> dict:
        self.blocks.add(self.states.finish())
        content = [self._content(block, True) for block in self.blocks.blocks]
        return {
            **self._message(content, self._stop_reason(outcome), outcome.stop, outcome.usage["completion_tokens"]),
            "dflash": outcome.stats,
        }
