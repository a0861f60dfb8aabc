"""What the server answers, in OpenAI's shapes: the generated text cut at stop strings (`StopText`), tool calls
split off it (`ToolCalls`), per-token logprobs (`Logprobs`), and the bodies of completions and their streamed
chunks, with `usage` and the `dflash` statistics of the generation that ran."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from mlx_lm.generate import TextStateMachine
from mlx_lm.server import ToolCallFormatter

from ..generate import CycleResponse, summarize
from .protocol import CompletionRequest


class StopText:
    """Cuts streamed text at the first stop string, holding back a tail that may be the start of one.

    Args:
        stops: the stop strings (empty ones are left out).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops, self.held = [s for s in stops if s], ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text that can be sent, whether a stop string was met)."""
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The tail held back, at the generation's end."""
        held, self.held = self.held, ""
        return held


class ToolCalls:
    """Splits tool calls off the generated text the way mlx_lm.server does for the same tokenizer: text between
    its wrapper's `tool_call_start` and `tool_call_end` markers (matched on text by mlx-lm's TextStateMachine) is
    one call, parsed by the wrapper's `tool_parser` with the request's tools and formatted by mlx-lm's
    ToolCallFormatter (id, type "function", function name and JSON arguments string; an index when streaming);
    the rest is content. A call that does not parse (cut short by max_tokens) is dropped with mlx-lm's warning.

    Args:
        tokenizer: mlx-lm's `TokenizerWrapper` of a model with a tool-call format (`has_tool_calling`).
        tools: the request's tools.
        streaming: whether the calls go out in streamed chunks (each then has an index).
    """

    def __init__(self, tokenizer, tools: list, streaming: bool):
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end
        machine = TextStateMachine({"normal": [(start, "tool")], "tool": [(end, "normal")] if end else []})
        self.state, self.previous, self.tool_text, self.made = machine.make_state("normal"), "normal", "", False
        self.format = ToolCallFormatter(tokenizer.tool_parser, tools, streaming)

    def _take(self, segments) -> tuple[str, list[dict]]:
        content, calls = "", []
        for state, text in segments:
            if state == "tool":
                self.tool_text += text
            else:
                if self.previous == "tool":  # a call's end marker was met
                    calls.append(self.tool_text)
                    self.tool_text, self.made = "", True
                content += text
            self.previous = state
        return content, self.format(calls)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content that can be sent, the calls completed by `text`)."""
        self.state, segments = TextStateMachine.split(self.state, text)
        return self._take(segments)

    def finish(self) -> tuple[str, list[dict]]:
        """What the generation's end leaves: held-back text, and a call whose end marker never came."""
        self.state, held, state = TextStateMachine.flush(self.state)
        content, calls = self._take([(state, held)])
        if self.previous == "tool" and self.tool_text:
            calls += self.format([self.tool_text])
            self.tool_text, self.made = "", True
        return content, calls


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
            return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]}
                                for t, lp, top, _ in entries]}
        return {"tokens": [self._piece(t) for t, *_ in entries], "token_logprobs": [lp for _, lp, *_ in entries],
                "top_logprobs": [{**{self._piece(i): v for i, v in top}, self._piece(t): lp}
                                 for t, lp, top, _ in entries],
                "text_offset": [offset for *_, offset in entries]}


def tool_calls_of(request: CompletionRequest, tokenizer, streaming: bool) -> ToolCalls | None:
    """The request's tool-call splitter; None when it has no tools."""
    return ToolCalls(tokenizer, request.tools, streaming) if request.tools is not None else None


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


def finish_reason(finish: str | None, tools: ToolCalls | None) -> str | None:
    """finish_reason "tool_calls" for a generation that stopped (EOS or a stop string) after a call."""
    return "tool_calls" if finish == "stop" and tools is not None and tools.made else finish


def choice(request: CompletionRequest, text: str | None, finish: str | None, chunk: bool, first: bool = False,
           calls: list | None = None, logprobs: Logprobs | None = None) -> dict:
    """The answer's one choice, or a streamed chunk's (`chunk`: a delta; `first`: the chunk that carries the role).

    Args:
        request: the request answered.
        text: the content this choice (or chunk) carries.
        finish: its finish_reason (None but in the last).
        chunk: whether it goes out in a streamed chunk.
        first: whether it is the first chunk, which carries the assistant's role.
        calls: tool calls it carries (chat).
        logprobs: the request's logprobs: the tokens gathered since the last choice go with it.
    """
    body = _choice_body(request, text, finish, chunk, first, calls)
    if logprobs is not None:
        body["logprobs"] = logprobs.take()
    return body


def _choice_body(request: CompletionRequest, text: str | None, finish: str | None, chunk: bool, first: bool,
                 calls: list | None) -> dict:
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


def usage_and_stats(records: list[CycleResponse], cached: int, drafter, block_size: int | None,
                    batch_size: int = 0) -> tuple[dict, dict]:
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
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
             "prompt_tokens_details": {"cached_tokens": cached}}
    if not records:
        return usage, {"cached_tokens": cached}
    result = summarize(records, drafter, block_size)
    stats = {"verify_mode": result.verify_mode, "tau": result.tau, "cycles": result.cycles,
             "accepted": sum(result.accepted), "block_size": result.block_size,
             "plain_tokens": result.plain_tokens, "draft_failures": result.draft_failures,
             "cached_tokens": cached, "prompt_tps": result.prompt_tps, "generation_tps": result.generation_tps,
             "batch_size": batch_size}
    return usage, stats


def stats_headers(stats: dict) -> dict:
    """The `X-DFlash-*` headers of a non-streaming answer: the verify mode that ran, its cycles and tau."""
    return {"X-DFlash-Verify-Mode": stats.get("verify_mode"), "X-DFlash-Cycles": stats.get("cycles"),
            "X-DFlash-Tau": "" if stats.get("tau") is None else f"{stats['tau']:.3f}"}
