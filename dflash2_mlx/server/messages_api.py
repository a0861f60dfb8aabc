"""Anthropic's Messages API (POST /v1/messages, and /v1/messages/count_tokens), as the official `anthropic` clients
and Claude Code speak it, over the chat endpoint's request: a body is translated to the chat completions body that
asks for the same generation, which `RequestParser` reads (one set of checks, one chat template call), and the
answer is shaped as Anthropic's message or its stream of events (`MessagesReply`). Every field's fate:

- read: `model`, `messages` (user and assistant turns of text, `tool_use`, `tool_result` and `thinking` blocks),
  `max_tokens` (required, as Anthropic requires it), `system` (a string or text blocks), `stop_sequences`,
  `stream`, `temperature`, `top_p`, `top_k`, `tools` (custom tools: name, description, input_schema),
  `tool_choice` ("auto" or "none"), `thinking` ("enabled" or "adaptive": the template's `enable_thinking` true;
  "disabled": false), `output_config.effort` (the template's `reasoning_effort`).
- refused unless absent: `REFUSED_FIELDS` says why; so are image and document blocks, server tools, tool_choice
  "any" and "tool" (no call can be forced), and a last assistant turn (a prefill to continue).
- accepted and not acted on: `IGNORED_FIELDS`, each with why; `cache_control` and `citations` on blocks,
  `thinking.budget_tokens` and `.display`, `tool_choice.disable_parallel_tool_use`, a tool result's `is_error`
  (the template renders the result's text alone), `redacted_thinking` blocks; headers `anthropic-version` (any
  version is answered in the one shape here) and `anthropic-beta`.
- anything else: ignored, as the chat endpoint ignores what it does not know.
"""

from __future__ import annotations

import json
import logging
import uuid

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
    chat.update(messages=_messages(body), stop=stops, **_tools(body), **_thinking(body))
    if count_only:
        chat.update(max_tokens=1, stream=False)
    try:
        return parser.parse("chat", chat)
    except ApiError as e:
        raise e.renamed(CHAT_NAMES) from None


def count_tokens(parser: RequestParser, body) -> dict:
    """/v1/messages/count_tokens: the prompt's length in tokens, as the chat template renders the request."""
    return {"input_tokens": len(parse(parser, body, count_only=True).prompt)}


def _thinking(body: dict) -> dict:
    """`thinking` and `output_config` as the chat template's keyword arguments."""
    kwargs = {}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "adaptive", "disabled"):
            raise ApiError(400, '\'thinking\' must be {"type": "enabled" | "adaptive" | "disabled"}', param="thinking")
        kwargs["enable_thinking"] = kind != "disabled"
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
    return {"chat_template_kwargs": kwargs} if kwargs else {}


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
            for k, part in enumerate(result):
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
        elif kind == "thinking":
            reasoning += block.get("thinking") or ""
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
    message_stop). Blocks: `thinking` (a thinking model's reasoning; its `signature` empty), `text`, `tool_use`."""

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

    @staticmethod
    def _content(block: dict, whole: bool) -> dict:
        """A block in Anthropic's shape: whole, or as content_block_start opens it (empty)."""
        if block["kind"] == "call":
            call = block["call"]
            arguments = json.loads(call["function"]["arguments"]) if whole else {}
            return {"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": arguments}
        text = block["text"] if whole else ""
        if block["kind"] == "reasoning":
            return {"type": "thinking", "thinking": text, "signature": ""}
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
                delta = (
                    {"type": "thinking_delta", "thinking": value}
                    if kind == "reasoning"
                    else {"type": "text_delta", "text": value}
                )
                events.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
            else:
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
