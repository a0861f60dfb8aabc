"""What the server answers: the generated text cut at stop strings (`StopText`), reasoning and tool calls split off
it (`TextStates`) and grouped into blocks (`Blocks`), per-token logprobs (`Logprobs`), and `Reply`, the shape of
one answer: OpenAI's completions and their streamed chunks here (`ChatReply`), with `usage` and the `dflash`
statistics of the generation that ran; the Anthropic and Responses APIs' in `messages_api` and `responses_api`."""

from __future__ import annotations

import json
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_lm.generate import TextStateMachine
from mlx_lm.server import ToolCallFormatter

from ..generate import CycleResponse, summarize
from .protocol import ApiError, CompletionRequest
from .schema import violation


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may be the start of one.

    Args:
        stops: the stop strings (empty ones are left out).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held = [s for s in stops if s], ""
        self.matched: str | None = None  # the stop string met (the earliest in the text)

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that can be sent, whether a stop string was met)."""
        buf = self.held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The tail held back, at the generation's end."""
        held, self.held = self.held, ""
        return held


def initial_state(tokenizer, prompt: Sequence[int]) -> str:
    """The state a chat answer starts in, as mlx_lm.server picks it: "reasoning" when the prompt's last think-start
    marker comes after its last think-end marker (a template that opens the thinking itself), else "normal"; the
    tokenizer's response format may name another."""
    state = "normal"
    if tokenizer.has_thinking and tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        state = "reasoning"
    return getattr(tokenizer, "response_initial_state", None) or state


class TextStates:
    """Splits the generated text the way mlx_lm.server does for the same tokenizer: text between the think markers
    mlx-lm found in the vocabulary (`think_start`, `think_end`) is reasoning; text between its `tool_call_start` and
    `tool_call_end` markers is one tool call, parsed by the wrapper's `tool_parser` with the request's tools and
    formatted by mlx-lm's ToolCallFormatter (id, type "function", function name and JSON arguments string; an index
    when streaming); the rest is content. Markers are matched on text (mlx-lm's TextStateMachine), however the
    text is cut. A call that does not parse (cut short by max_tokens) is dropped with mlx-lm's warning. Each call
    goes through `check` before it is given (`strict_check`: a strict tool's arguments against its schema); with
    `single`, the first call ends the answer: what follows it (later calls, text) is dropped and `complete` is set.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper`.
        tools: the request's tools (None: tool-call markup stays content).
        streaming: whether the calls go out in streamed chunks (each then has an index).
        prompt: the prompt's token ids, which say whether the answer starts in its reasoning (`initial_state`).
        thinking: whether reasoning is split off (chat answers; completions' text is left whole).
        check: called with each call before it is given; raises to refuse it.
        single: whether the answer ends after its first call (`parallel_tool_calls` false).
    """

    def __init__(
        self,
        tokenizer,
        tools: list | None,
        streaming: bool,
        prompt: Sequence[int] = (),
        thinking: bool = True,
        check: Callable[[dict], None] | None = None,
        single: bool = False,
    ):
        transitions = {}
        thinking = thinking and tokenizer.has_thinking
        if thinking:  # as mlx-lm's make_text_state_machine
            transitions = {
                "normal": [(tokenizer.think_start, "reasoning")],
                "reasoning": [(tokenizer.think_end, "normal")],
            }
        if tools is not None:
            start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
            transitions.setdefault("normal", []).append((start, "tool"))
            if thinking:
                transitions["reasoning"].append((start, "tool"))
            transitions["tool"] = [(end, "normal")] if end else []
        initial = initial_state(tokenizer, prompt) if thinking else "normal"
        self.state = TextStateMachine(transitions or None).make_state(initial)
        self.previous, self.tool_text, self.made = initial, "", False
        self.check, self.single, self.complete = check, single, False
        self.format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming) if tools is not None else None

    def _take(self, parts) -> list[tuple[str, object]]:
        out = []

        def put(kind: str, value) -> None:
            if kind != "call" and out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + value)
            elif kind == "call" or value:
                out.append((kind, value))

        for state, text in parts:
            if self.complete:  # the one call was made: the answer ends there
                break
            if state == "tool":
                self.tool_text += text
            else:
                if self.previous == "tool":  # a call's end marker was met
                    self._call(put)
                if self.complete:
                    break
                put("reasoning" if state == "reasoning" else "content", text)
            self.previous = state
        return out

    def _call(self, put) -> None:
        calls = self.format([self.tool_text])
        for call in calls[:1] if self.single else calls:
            if self.check is not None:
                self.check(call)
            put("call", call)
        self.tool_text, self.made, self.complete = "", True, self.single and bool(calls)

    def feed(self, text: str) -> list[tuple[str, object]]:
        """The segments `text` completes, in order: ("reasoning", text), ("content", text), ("call", call)."""
        self.state, parts = TextStateMachine.split(self.state, text)
        return self._take(parts)

    def finish(self) -> list[tuple[str, object]]:
        """What the generation's end leaves: held-back text, and a call whose end marker never came."""
        self.state, held, state = TextStateMachine.flush(self.state)
        out = self._take([(state, held)])
        if self.previous == "tool" and self.tool_text and not self.complete:
            self._call(lambda kind, call: out.append((kind, call)))
        return out


def strict_check(request: CompletionRequest) -> Callable[[dict], None] | None:
    """The check of a request's tool calls against its strict tools' schemas (`CompletionRequest.strict`); None
    without strict tools. A call that does not match is refused with a 500 naming the tool and the mismatch, marked
    not to be retried (`x-should-retry`) where a retry would generate it again (temperature 0, or a seed)."""
    if not request.strict:
        return None
    g = request.generation
    headers = {"x-should-retry": "false"} if g.temp == 0 or g.seed is not None else {}

    def check(call: dict) -> None:
        function = call["function"]
        schema = request.strict.get(function["name"])
        found = None if schema is None else violation(json.loads(function["arguments"]), schema)
        if found:
            raise ApiError(
                500,
                f"the model called the strict tool {function['name']!r} with arguments that do not match its "
                f"parameters: {found} (arguments: {function['arguments']}); nothing constrains the generation here, "
                "the arguments are checked once generated: retry at a temperature above 0, or send strict false "
                "to get the arguments as generated",
                kind="server_error",
                code="tool_arguments_mismatch",
                headers=headers,
            )

    return check


def gathered(segments) -> tuple[str, str, list[dict]]:
    """Segments as (reasoning, content, calls), each kind's in order."""
    texts = {"reasoning": "", "content": ""}
    calls = []
    for kind, value in segments:
        if kind == "call":
            calls.append(value)
        else:
            texts[kind] += value
    return texts["reasoning"], texts["content"], calls


class ToolCalls(TextStates):
    """`TextStates` without reasoning, whose `feed` and `finish` give (content, calls).

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` of a model with a tool-call format (`has_tool_calling`).
        tools: the request's tools.
        streaming: whether the calls go out in streamed chunks (each then has an index).
    """

    def __init__(self, tokenizer, tools: list, streaming: bool):
        super().__init__(tokenizer, tools, streaming, thinking=False)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        return gathered(super().feed(text))[1:]

    def finish(self) -> tuple[str, list[dict]]:
        return gathered(super().finish())[1:]


class Logprobs:
    """A request's per-token logprobs (`Record.token_logprobs`) in OpenAI's shapes: chat `{"content": [{token,
    logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`, completions `{tokens, token_logprobs,
    top_logprobs: [{token: logprob}], text_offset}`. A token is its own decoded text; the EOS that stops a
    generation adds no text and is not listed. `take` hands over the tokens gathered since the last call (a
    streamed chunk carries those of the records it relays); text_offset is where the generated text stood
    (as the tokenizer's streaming detokenizer had rendered it) when each token came.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` of the target.
        kind: the request's kind, "chat" or "text".
    """

    def __init__(self, tokenizer, kind: str):
        self.tokenizer, self.kind, self.detokenizer, self.pending = tokenizer, kind, tokenizer.detokenizer, []

    def add(self, record) -> None:
        """Gather the numbers of a record's tokens (none when the worker read none for it)."""
        numbers = getattr(record, "token_logprobs", None)
        if numbers is None:
            return
        tokens = record.tokens[:-1] if record.finish_reason == "stop" else record.tokens
        for token, (logprob, top) in zip(tokens, numbers):
            self.pending.append((token, logprob, top, len(self.detokenizer.text)))
            self.detokenizer.add_token(token)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def take(self) -> dict:
        """The tokens gathered since the last call, in the request kind's shape."""
        entries, self.pending = self.pending, []
        if self.kind == "chat":

            def item(token, logprob):
                text = self._piece(token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {
                "content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top, _ in entries]
            }
        return {
            "tokens": [self._piece(t) for t, *_ in entries],
            "token_logprobs": [lp for _, lp, *_ in entries],
            "top_logprobs": [{**{self._piece(i): v for i, v in top}, self._piece(t): lp} for t, lp, top, _ in entries],
            "text_offset": [offset for *_, offset in entries],
        }


def logprobs_of(request: CompletionRequest, tokenizer) -> Logprobs | None:
    """The request's logprobs, to be gathered; None when it asks for none."""
    return Logprobs(tokenizer, request.kind) if request.generation.logprobs is not None else None


def response_id(request: CompletionRequest) -> str:
    return f"{'chatcmpl' if request.kind == 'chat' else 'cmpl'}-{uuid.uuid4()}"


def base(request: CompletionRequest, rid: str, chunk: bool) -> dict:
    """The fields every answer and chunk starts with: id, object, created and the model name the request used."""
    kind = "text_completion"
    if request.kind == "chat":
        kind = "chat.completion.chunk" if chunk else "chat.completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": request.model}


def finish_reason(finish: str | None, states: TextStates | None) -> str | None:
    """finish_reason "tool_calls" for a generation that stopped (EOS or a stop string) after a call."""
    return "tool_calls" if finish == "stop" and states is not None and states.made else finish


def choice(
    request: CompletionRequest,
    text: str | None,
    finish: str | None,
    chunk: bool,
    first: bool = False,
    calls: list | None = None,
    logprobs: Logprobs | None = None,
    reasoning: str = "",
) -> dict:
    """The answer's one choice, or a streamed chunk's (`chunk`: a delta; `first`: the chunk that carries the role).

    Args:
        request: the request answered.
        text: the content this choice (or chunk) carries.
        finish: its finish_reason (None but in the last).
        chunk: whether it goes out in a streamed chunk.
        first: whether it is the first chunk, which carries the assistant's role.
        calls: tool calls it carries (chat).
        logprobs: the request's logprobs: the tokens gathered since the last choice go with it.
        reasoning: the reasoning it carries (chat, thinking models): `reasoning_content`, and `reasoning` as
            mlx_lm.server names it, where there is any.
    """
    body = _choice_body(request, text, finish, chunk, first, calls)
    if reasoning:
        body["delta" if chunk else "message"].update(reasoning_content=reasoning, reasoning=reasoning)
    if logprobs is not None:
        body["logprobs"] = logprobs.take()
    return body


def _choice_body(
    request: CompletionRequest, text: str | None, finish: str | None, chunk: bool, first: bool, calls: list | None
) -> dict:
    if request.kind == "text":
        return {"index": 0, "text": text or "", "finish_reason": finish}
    if chunk:
        delta = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if calls:
            delta["tool_calls"] = calls
        return {"index": 0, "delta": delta, "finish_reason": finish}
    message = {"role": "assistant", "content": text}
    if request.tools is not None:  # as mlx_lm.server: no text is null content, calls under tool_calls
        message["content"] = text or None
        if calls:
            message["tool_calls"] = calls
    return {"index": 0, "message": message, "finish_reason": finish}


@dataclass(frozen=True)
class Outcome:
    """How a generation ended, for its answer: its finish reason ("stop": EOS or a stop string; "length"), the stop
    string met (None: none), OpenAI's `usage` and the `dflash` statistics."""

    finish: str | None
    stop: str | None
    usage: dict
    stats: dict


class Reply(ABC):
    """One answer in an API's shapes, built as the text comes: the handler feeds it the generated text (cut at
    stop strings) and, streaming, sends the events it returns ((event name or None, JSON body) pairs), else the
    body it makes at the end. Subclasses shape it; this class splits the text (`TextStates`).

    Args:
        request: the request answered.
        tokenizer: the target's tokenizer.
    """

    stream_end = b""  # written after a stream's last event
    logprobs: Logprobs | None = None  # the tokens' logprobs, gathered by the handler where asked for

    def __init__(self, request: CompletionRequest, tokenizer):
        self.request, self.tokenizer = request, tokenizer
        self.states = TextStates(
            tokenizer,
            request.tools,
            request.stream,
            request.prompt,
            thinking=request.kind == "chat",
            check=strict_check(request),
            single=not request.parallel_tool_calls,
        )

    @property
    def complete(self) -> bool:
        """Whether the answer holds all it may: its one call made (`parallel_tool_calls` false); the generation
        then stops, as at a stop string."""
        return self.states.complete

    def start(self) -> list:
        """A stream's first events, sent before the first text's."""
        return []

    @abstractmethod
    def feed(self, text: str) -> list:
        """Take the next text; the events to send now (none unless streaming)."""

    @abstractmethod
    def end(self, outcome: Outcome) -> list:
        """A stream's last events."""

    @abstractmethod
    def body(self, outcome: Outcome) -> dict:
        """The answer's body, not streamed."""

    @staticmethod
    def error_body(e) -> dict:
        """The body of an error (an `ApiError`) in the API's shape."""
        return e.body()

    def stream_error(self, e) -> list:
        """The events that end a stream an error cut short."""
        return [(None, self.error_body(e))]


class ChatReply(Reply):
    """An answer of /v1/chat/completions or /v1/completions: OpenAI's completion, or its chunks (server-sent
    `data:` lines, then `[DONE]`), with the reasoning apart (`reasoning_content`) for thinking models."""

    stream_end = b"data: [DONE]\n\n"

    def __init__(self, request: CompletionRequest, tokenizer):
        super().__init__(request, tokenizer)
        self.logprobs = logprobs_of(request, tokenizer)
        self.rid, self.first, self.parts = response_id(request), True, ([], [], [])

    def _chunk(self, segments, finish: str | None = None, **extra) -> dict:
        reasoning, text, calls = gathered(segments)
        body = {
            **base(self.request, self.rid, True),
            "choices": [choice(self.request, text, finish, True, self.first, calls, self.logprobs, reasoning)],
            **extra,
        }
        self.first = False
        return body

    def feed(self, text: str) -> list:
        segments = self.states.feed(text)
        if not self.request.stream:
            for part, got in zip(self.parts, gathered(segments)):
                part.extend([got] if isinstance(got, str) else got)
            return []
        return [(None, self._chunk(segments))] if segments or self.first else []

    def end(self, outcome: Outcome) -> list:
        finish = finish_reason(outcome.finish, self.states)
        events = [(None, self._chunk(self.states.finish(), finish, dflash=outcome.stats))]
        if self.request.include_usage:
            events.append(
                (
                    None,
                    {
                        **base(self.request, self.rid, True),
                        "choices": [],
                        "usage": outcome.usage,
                        "dflash": outcome.stats,
                    },
                )
            )
        return events

    def body(self, outcome: Outcome) -> dict:
        for part, got in zip(self.parts, gathered(self.states.finish())):
            part.extend([got] if isinstance(got, str) else got)
        reasoning, text, calls = self.parts
        body = choice(
            self.request,
            "".join(text),
            finish_reason(outcome.finish, self.states),
            False,
            calls=calls,
            logprobs=self.logprobs,
            reasoning="".join(reasoning),
        )
        return {
            **base(self.request, self.rid, False),
            "choices": [body],
            "usage": outcome.usage,
            "dflash": outcome.stats,
        }


class Blocks:
    """A reply's segments (`TextStates`) grouped into blocks, in the order they were generated: reasoning, text,
    and one block per tool call; a kind's next segments extend its open block. What the Anthropic and Responses
    APIs' answers are made of, streamed (the changes `add` returns) or whole (`blocks`)."""

    def __init__(self):
        self.blocks: list[dict] = []  # {"kind": "reasoning" | "content", "text": ...} or {"kind": "call", "call": ...}
        self.open = False  # whether the last block may still grow

    def add(self, segments) -> list[tuple[str, int, object]]:
        """The changes `segments` make: ("start", index, block), ("delta", index, text), ("stop", index, block)."""
        changes = []
        for kind, value in segments:
            last = self.blocks[-1] if self.open else None
            if last is not None and last["kind"] == kind and kind != "call":
                last["text"] += value
                changes.append(("delta", len(self.blocks) - 1, value))
                continue
            changes += self.close()
            block = {"kind": kind, "call": value} if kind == "call" else {"kind": kind, "text": ""}
            self.blocks.append(block)
            self.open = kind != "call"
            i = len(self.blocks) - 1
            changes.append(("start", i, block))
            if kind == "call":
                changes.append(("stop", i, block))
            else:
                block["text"] = value
                changes.append(("delta", i, value))
        return changes

    def close(self) -> list[tuple[str, int, object]]:
        """The open block's end (none: nothing)."""
        if not self.open:
            return []
        self.open = False
        return [("stop", len(self.blocks) - 1, self.blocks[-1])]


def usage_and_stats(
    records: list[CycleResponse], cached: int, drafter, block_size: int | None, batch_size: int = 0
) -> tuple[dict, dict]:
    """OpenAI's `usage` of a generation and its `dflash` statistics (what ran, and how fast).

    Args:
        records: the generation's records, as the worker relayed them.
        cached: prompt tokens taken from the prompt cache.
        drafter: the server's drafter (None: plain decoding only).
        block_size: the server's --block-size (None: the drafter's default).
        batch_size: the most requests the generation was decoded together with (0: it ran alone).
    """
    completion = sum(len(r.tokens) for r in records)
    prompt = records[0].prompt_tokens if records else 0
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    if not records:
        return usage, {"cached_tokens": cached}
    result = summarize(records, drafter, block_size)
    stats = {
        "verify_mode": result.verify_mode,
        "tau": result.tau,
        "cycles": result.cycles,
        "accepted": sum(result.accepted),
        "lookup_cycles": result.lookup_cycles,
        "lookup_tokens": result.lookup_tokens,
        "block_size": result.block_size,
        "plain_tokens": result.plain_tokens,
        "draft_failures": result.draft_failures,
        "cached_tokens": cached,
        "prompt_tps": result.prompt_tps,
        "generation_tps": result.generation_tps,
        "batch_size": batch_size,
    }
    return usage, stats


def stats_headers(stats: dict) -> dict:
    """The `X-DFlash-*` headers of a non-streaming answer: the verify mode that ran, its cycles and tau."""
    return {
        "X-DFlash-Verify-Mode": stats.get("verify_mode"),
        "X-DFlash-Cycles": stats.get("cycles"),
        "X-DFlash-Tau": "" if stats.get("tau") is None else f"{stats['tau']:.3f}",
    }
