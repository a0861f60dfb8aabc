"""OpenAI's Responses API (POST /v1/responses), as the official `openai` client's `responses.create` and Codex CLI
speak it, over the chat endpoint's request: a body is translated to the chat completions body that asks for the
same generation, which `RequestParser` reads, and the answer is shaped as a response object or its stream of
events (`ResponsesReply`). Nothing is kept between requests: a conversation comes whole in `input`. Every field of
`responses.create` (the `openai` client's `ResponseCreateParams`) has its fate:

- read: `model`, `input` (a string, or items: messages with text parts, `function_call`, `function_call_output`
  and `reasoning` items), `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`,
  `stream`, `tools` (function tools; `strict` true: each call's arguments are checked against the tool's
  `parameters`, as the chat endpoint checks them), `tool_choice` ("auto" or "none"), `parallel_tool_calls` (false:
  the answer ends after its first call), `reasoning.effort` (the template's `reasoning_effort`), `text.format`
  ("text" only), `text.verbosity` ("medium" only: no template here takes another). The response object echoes
  them (`ECHOED`).
- refused unless absent: `REFUSED_FIELDS` says why; so are non-function tools, image and file parts,
  `item_reference` items, tool_choice "required" or a named function (no call can be forced), `include`
  "message.output_text.logprobs" and `prompt_cache_options.prewarm` true (an answer with no output).
- accepted and not acted on: `IGNORED_FIELDS`, each with why; `reasoning.summary` (no summary is written: the
  reasoning comes whole, in the reasoning item's `content`, whatever the value; the generation is the same).
  `truncation` "auto" truncates nothing: a conversation over the context gets a 400 that says so.
- anything else: ignored, as the chat endpoint ignores what it does not know.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field, fields

from .protocol import ApiError, CompletionRequest, RequestParser
from .responses import Blocks, Outcome, Reply

log = logging.getLogger("dflash2.serve")

IGNORED_FIELDS = {
    "store": "nothing is stored: a response is never kept, whatever store says",
    "metadata": "nothing is stored to tag",
    "user": "OpenAI's end-user id: nothing here is per user",
    "safety_identifier": "OpenAI's end-user id: nothing here is per user",
    "service_tier": "OpenAI's processing tiers: one here",
    "prompt_cache_key": "prefixes are reused whatever the key (the prompt cache)",
    "prompt_cache_retention": "the prompt cache keeps what its slots hold (--prompt-cache-size)",
    "include": "nothing more is there to include: reasoning comes as text, never encrypted (logprobs get a 400)",
    "truncation": 'nothing is truncated ("auto" only truncates a conversation over the context, which gets a 400 here)',
    "stream_options": "the events carry nothing to obfuscate",
    "access_programs": "OpenAI's access tiers: one model here, served alike to every client",
    "background_options": "options of background responses, which are refused (background)",
    "image": "OpenAI's image compression: images are refused here (text parts only)",
    "prompt_cache_options": "prefixes are reused whatever the breakpoints and lifetimes (the prompt cache); prewarm "
    "gets a 400",
}

REFUSED_FIELDS = {
    "previous_response_id": "this server keeps no responses: send the whole conversation in 'input' (the earlier "
    "output items, then the new ones)",
    "conversation": "this server keeps no conversations: send the whole conversation in 'input'",
    "prompt": "this server keeps no prompt templates: send the text in 'instructions' and 'input'",
    "background": "this server runs no background responses: leave background unset (or false)",
    "top_logprobs": "the Responses API's logprobs are not served here: use /v1/chat/completions with logprobs",
    "max_tool_calls": "the model's template and mlx-lm's parser decide how many calls an answer makes",
    "context_management": "this server compacts no context: send the conversation as it should be read",
    "moderation": "this server runs no moderation model: moderate the input and output client-side",
}

# the request fields the response object echoes, and what it says when a request leaves them unset
ECHOED = {
    "instructions": None,
    "max_output_tokens": None,
    "tools": [],
    "tool_choice": "auto",
    "parallel_tool_calls": True,
    "text": {"format": {"type": "text"}},
    "reasoning": None,
    "metadata": {},
    "user": None,
    "safety_identifier": None,
    "prompt_cache_key": None,
    "truncation": "disabled",
}


@dataclass(frozen=True)
class ResponsesRequest(CompletionRequest):
    """A Responses API request: the chat request it asks for, and the request's fields its response object
    echoes (`ECHOED`, as the request gave them)."""

    echo: dict = field(default_factory=dict)


CHAT_NAMES = {"max_tokens": "max_output_tokens", "messages": "input"}  # chat's names, as this API's errors name them


def parse(parser: RequestParser, body) -> CompletionRequest:
    """The request a Responses API body makes.

    Args:
        parser: the server's request parser.
        body: the body's decoded JSON.

    Raises:
        ApiError: 400 naming the field that does not fit (404: a model not served).
    """
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    ignored = sorted(IGNORED_FIELDS.keys() & body.keys())
    if ignored:
        log.debug("fields not acted on: %s", "; ".join(f"{k}: {IGNORED_FIELDS[k]}" for k in ignored))
    for name, why in REFUSED_FIELDS.items():
        if body.get(name) not in (None, False):
            raise ApiError(400, f"'{name}' cannot be honoured: {why}", param=name)
    _refused_values(body)
    chat = {key: body[key] for key in ("model", "stream", "temperature", "top_p", "parallel_tool_calls") if key in body}
    chat.update(max_tokens=body.get("max_output_tokens"), messages=_messages(body), **_tools(body))
    effort = _reasoning(body)
    if effort is not None:
        chat["reasoning_effort"] = effort
    _text_config(body.get("text"))
    try:
        request = parser.parse("chat", chat)
    except ApiError as e:
        raise _renamed(e, body) from None
    echo = {name: body[name] if body.get(name) is not None else unset for name, unset in ECHOED.items()}
    return ResponsesRequest(**{f.name: getattr(request, f.name) for f in fields(request)}, echo=echo)


def _refused_values(body: dict) -> None:
    """A 400 for values of fields otherwise not acted on that ask for what this server does not do."""
    include = body.get("include")
    if include is not None and not (isinstance(include, list) and all(isinstance(v, str) for v in include)):
        raise ApiError(400, "'include' must be a list of strings", param="include")
    if "message.output_text.logprobs" in (include or []):
        raise ApiError(
            400,
            "'include' cannot have \"message.output_text.logprobs\": the Responses API's logprobs are not served "
            "here: use /v1/chat/completions with logprobs",
            param="include",
        )
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise ApiError(400, '\'truncation\' must be "auto" or "disabled"', param="truncation")
    options = body.get("prompt_cache_options")
    if isinstance(options, dict) and options.get("prewarm"):
        raise ApiError(
            400,
            "'prompt_cache_options.prewarm' cannot be honoured: this server answers every request with its "
            "generation; leave prewarm unset (the prompt cache keeps the prefixes of the requests it answered)",
            param="prompt_cache_options",
        )


def _renamed(e: ApiError, body: dict) -> ApiError:
    """The chat endpoint's error as this API names its fields; a conversation over the context, sent with
    `truncation` "auto", is told that nothing is truncated here."""
    e = e.renamed(CHAT_NAMES)
    if e.code == "context_length_exceeded" and body.get("truncation") == "auto":
        e.message += "; 'truncation': \"auto\" drops nothing here: leave the earliest items out of 'input' yourself"
    return e


def _text_config(text) -> None:
    """A 400 for a `text` this server cannot honour: a format other than "text", a verbosity other than "medium"."""
    if text is None:
        return
    kind = (
        text.get("format", {}).get("type", "text")
        if isinstance(text, dict) and isinstance(text.get("format", {}), dict)
        else None
    )
    if kind != "text":
        raise ApiError(
            400, '\'text.format\' must be {"type": "text"}: the text is not constrained to a schema here', param="text"
        )
    if text.get("verbosity") not in (None, "medium"):
        raise ApiError(
            400,
            f"'text.verbosity' {json.dumps(text['verbosity'])} cannot be honoured: no chat template here takes a "
            "verbosity; leave it unset (or \"medium\") and ask for a shorter or longer answer in 'instructions'",
            param="text",
        )


def _reasoning(body: dict) -> str | None:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise ApiError(400, '\'reasoning\' must be an object, e.g. {"effort": "low"}', param="reasoning")
    for key in ("summary", "generate_summary"):  # no summary is written: the reasoning comes whole
        if reasoning.get(key) not in (None, "auto", "concise", "detailed"):
            raise ApiError(
                400,
                f'\'reasoning.{key}\' must be "auto", "concise" or "detailed", got {json.dumps(reasoning[key])}',
                param="reasoning",
            )
    return reasoning.get("effort")


def _tools(body: dict) -> dict:
    tools, choice = body.get("tools"), body.get("tool_choice")
    out = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise ApiError(400, "'tools' must be a list of function tools", param="tools")
        out["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
                raise ApiError(
                    400,
                    f"tools[{i}] must be {{'type': 'function', 'name': ..., 'parameters': ...}}: "
                    "this server runs no built-in tools",
                    param="tools",
                )
            keys = ("name", "description", "parameters", "strict")  # strict null: unset, as the client sends it
            function = {key: tool[key] for key in keys if tool.get(key) is not None}
            out["tools"].append({"type": "function", "function": function})
    if choice is not None:
        if choice not in ("auto", "none"):
            raise ApiError(
                400,
                f'\'tool_choice\' must be "auto" or "none", got {json.dumps(choice)}: this '
                "server cannot force a tool call",
                param="tool_choice",
            )
        out["tool_choice"] = choice
    return out


def _text(where: str, content) -> str | list:
    """A message's content: a string, or its text parts (input_text, output_text) as the chat endpoint's."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts", param="input")
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise ApiError(
                400,
                f"{where}.content[{j}] is a {kind!r} part: this server takes text parts only (input_text, output_text)",
                param="input",
            )
    return [{"type": "text", "text": part["text"]} for part in content]


def _messages(body: dict) -> list[dict]:
    """`instructions` and `input` as the chat endpoint's messages: function_call items become the assistant's
    tool_calls, function_call_output items "tool" messages (their call's name looked up), reasoning items the
    next assistant turn's `reasoning_content`."""
    items, instructions = body.get("input"), body.get("instructions")
    out = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(400, "'instructions' must be a string", param="instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ApiError(400, "'input' must be a string or a non-empty list of items", param="input")
    names, reasoning = {}, ""  # call_id -> function name; reasoning not yet given to an assistant turn
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ApiError(400, f'{where}.role must be "user", "system", "developer" or "assistant"', param="input")
            message = {"role": "system" if role == "developer" else role, "content": _text(where, item.get("content"))}
            if role == "assistant" and reasoning:
                message["reasoning_content"], reasoning = reasoning, ""
            out.append(message)
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise ApiError(
                    400,
                    f"{where} must be {{'type': 'function_call', 'call_id': ..., 'name': ..., 'arguments': ...}}",
                    param="input",
                )
            names[call_id] = name
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments") or "{}"},
            }
            last = out[-1] if out else None
            if last is None or last["role"] != "assistant":  # calls after a message of its go with it
                last = {"role": "assistant", "content": ""}
                if reasoning:
                    last["reasoning_content"], reasoning = reasoning, ""
                out.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if isinstance(output, list):
                output = _text(where, output)
            if not isinstance(call_id, str) or not isinstance(output, (str, list)):
                raise ApiError(
                    400,
                    f"{where} must be {{'type': 'function_call_output', 'call_id': ..., 'output': text}}",
                    param="input",
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": output,
                    **({"name": names[call_id]} if call_id in names else {}),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ApiError(
                400,
                f"{where} is a {kind!r} item: this server takes messages, function_call, "
                "function_call_output and reasoning items (and keeps nothing to refer to)",
                param="input",
            )
    return out


class ResponsesReply(Reply):
    """An answer of /v1/responses: a response object, or its events in OpenAI's order (response.created,
    response.in_progress; per output item output_item.added, for text and reasoning content_part.added, their
    deltas, .done events and content_part.done, for a call function_call_arguments.delta and .done; then
    output_item.done; at the end response.completed, or response.incomplete at max_output_tokens). Output items:
    `reasoning` (a thinking model's, its text under `content`), `message` (output_text), `function_call`."""

    def __init__(self, request: CompletionRequest, tokenizer):
        super().__init__(request, tokenizer)
        self.id, self.created, self.blocks, self.sequence = f"resp_{uuid.uuid4().hex}", int(time.time()), Blocks(), 0
        self.ids: list[str] = []  # each output item's id

    def stream_error(self, e: ApiError) -> list:
        return [self._event("error", code=e.code, message=e.message, param=e.param)]

    def _event(self, kind: str, **fields) -> tuple[str, dict]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, event

    def _response(self, status: str, outcome: Outcome | None = None) -> dict:
        """The response object: its output and usage once `outcome` is there; the request's fields echoed (the
        sampling ones as they ran: the server's defaults where the request left them unset)."""
        g = self.request.generation
        body = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.request.model,
            "output": [],
            "error": None,
            "incomplete_details": None,
            **self.request.echo,
            "temperature": g.temp,
            "top_p": g.top_p,
            "previous_response_id": None,
            "store": False,  # whatever the request said: nothing is kept
            "background": False,
            "service_tier": "default",
            "usage": None,
        }
        if outcome is not None:
            body["output"] = [self._item(i, block, "completed") for i, block in enumerate(self.blocks.blocks)]
            if status == "incomplete":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            u = outcome.usage
            body["usage"] = {
                "input_tokens": u["prompt_tokens"],
                "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            }
            body["dflash"] = outcome.stats
        return body

    def _item(self, index: int, block: dict, status: str) -> dict:
        """Output item `index` in OpenAI's shape: whole ("completed"), or as output_item.added opens it."""
        done, item_id = status == "completed", self.ids[index]
        if block["kind"] == "call":
            call = block["call"]["function"]
            return {
                "type": "function_call",
                "id": item_id,
                "call_id": block["call"]["id"],
                "name": call["name"],
                "arguments": call["arguments"] if done else "",
                "status": status,
            }
        if block["kind"] == "reasoning":
            content = [{"type": "reasoning_text", "text": block["text"]}] if done else []
            return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}
        content = [self._part(block["text"])] if done else []
        return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}

    @staticmethod
    def _part(text: str, kind: str = "content") -> dict:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _events(self, changes) -> list:
        events = []
        for change, index, value in changes:
            block = self.blocks.blocks[index]
            kind, item_id = block["kind"], None
            if change == "start":
                prefix = {"call": "fc", "reasoning": "rs", "content": "msg"}[kind]
                self.ids.append(f"{prefix}_{uuid.uuid4().hex}")
                item_id = self.ids[index]
                events.append(
                    self._event(
                        "response.output_item.added", output_index=index, item=self._item(index, block, "in_progress")
                    )
                )
                if kind == "call":
                    arguments = block["call"]["function"]["arguments"]
                    events.append(
                        self._event(
                            "response.function_call_arguments.delta",
                            item_id=item_id,
                            output_index=index,
                            delta=arguments,
                        )
                    )
                    events.append(
                        self._event(
                            "response.function_call_arguments.done",
                            item_id=item_id,
                            output_index=index,
                            arguments=arguments,
                            name=block["call"]["function"]["name"],
                        )
                    )
                else:
                    events.append(
                        self._event(
                            "response.content_part.added",
                            item_id=item_id,
                            output_index=index,
                            content_index=0,
                            part=self._part("", kind),
                        )
                    )
                continue
            item_id = self.ids[index]
            text_event = "response.reasoning_text" if kind == "reasoning" else "response.output_text"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            if change == "delta":
                events.append(
                    self._event(
                        f"{text_event}.delta",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        delta=value,
                        **extra,
                    )
                )
                continue
            if kind != "call":
                events.append(
                    self._event(
                        f"{text_event}.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        text=block["text"],
                        **extra,
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done",
                        item_id=item_id,
                        output_index=index,
                        content_index=0,
                        part=self._part(block["text"], kind),
                    )
                )
            events.append(
                self._event("response.output_item.done", output_index=index, item=self._item(index, block, "completed"))
            )
        return events

    def start(self) -> list:
        return [
            self._event("response.created", response=self._response("in_progress")),
            self._event("response.in_progress", response=self._response("in_progress")),
        ]

    def feed(self, text: str) -> list:
        events = self._events(self.blocks.add(self.states.feed(text)))
        return events if self.request.stream else []

    def _status(self, outcome: Outcome) -> str:
        return "incomplete" if outcome.finish == "length" else "completed"

    def end(self, outcome: Outcome) -> list:
        events = self._events(self.blocks.add(self.states.finish()) + self.blocks.close())
        status = self._status(outcome)
        return [*events, self._event(f"response.{status}", response=self._response(status, outcome))]

    def body(self, outcome: Outcome) -> dict:
        self._events(self.blocks.add(self.states.finish()) + self.blocks.close())
        return self._response(self._status(outcome), outcome)
