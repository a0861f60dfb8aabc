"""OpenAI's request protocol, as the server reads it: a JSON body parsed and validated into typed requests.

`RequestParser.parse` turns the body of POST /v1/chat/completions ("chat") or /v1/completions ("text") into a
`CompletionRequest`, whose `GenerationArguments` (`stream_cycles`' keyword arguments, the server's flags filling
what the request leaves unset) travel unchanged to the worker. A body that does not fit gets an `ApiError`
naming the field and what it must be. Every field's fate:

- read: `model`, `stream`, `stream_options.include_usage`, `n` (must be 1), `max_tokens`,
  `max_completion_tokens` (the later wins), `temperature`, `top_p`, `top_k`, `min_p`, `seed`, `stop`,
  `logprobs`, `top_logprobs`, and mlx_lm.server's `repetition_penalty`, `repetition_context_size`,
  `presence_penalty`, `presence_context_size`, `frequency_penalty`, `frequency_context_size`, `logit_bias`
  (its logits processors), `xtc_probability`, `xtc_threshold` (its XTC sampler, run by plain decoding),
  `chat_template_kwargs`; chat: `messages` (an assistant's `reasoning_content` goes to the template, which may
  render it), `tools` (a function's `strict` true: its calls' arguments are checked against its `parameters`
  once whole, `schema.py`), `tool_choice`, `parallel_tool_calls` (false: the answer ends after its first call),
  `reasoning_effort` (to the template); text: `prompt`.
- read and refused unless they ask for what this server does: `draft_model` (its one drafter),
  `num_draft_tokens` (its draft length), `adapters` (none): `REFUSED_FIELDS` says why.
- accepted and not acted on: `IGNORED_FIELDS`, each with why (logged at debug level when sent); mlx_lm.server
  does not act on them either.
- anything else: ignored, as mlx_lm.server ignores what it does not know (OpenAI's clients send fields of
  other servers through `extra_body`).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Literal

from mlx_lm.sample_utils import make_logits_processors, make_sampler

from ..adaptive import CostModel
from ..generate import encode_text
from ..lookup import LookupConfig, copyspec_config
from ..sampling import SamplingParams
from .schema import check_schema

log = logging.getLogger("dflash2.serve")

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs

IGNORED_FIELDS = {
    "user": "OpenAI's end-user id: nothing here is per user",
    "metadata": "OpenAI's stored-completion tags: nothing is stored",
    "store": "OpenAI's stored completions: nothing is stored",
    "service_tier": "OpenAI's processing tiers: one here",
    "role_mapping": "mlx_lm.server's prompt format for templateless models, which it ignores where the tokenizer "
    "has a chat template: chat here needs one (a templateless model serves /v1/completions)",
    "response_format": "OpenAI's structured output: the text is not constrained (mlx_lm.server does not read it)",
}

REFUSED_FIELDS = {
    "draft_model": "this server drafts with the drafter it was started with (--draft-model): leave draft_model "
    'unset (or "default_model")',
    "num_draft_tokens": "the draft length is the server's --block-size (B drafts B - 1 tokens per cycle): leave "
    "num_draft_tokens unset (or give that length)",
    "adapters": "this server loads no adapters per request: fuse the adapter into the model (mlx_lm.fuse) and "
    "serve the fused model",
}

# keys the server gives the chat template itself: a request's chat_template_kwargs may not set them
TEMPLATE_OWN_KWARGS = ("add_generation_prompt", "tools", "tokenize", "return_dict", "conversation", "messages")


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def renamed(self, names: Mapping[str, str]) -> ApiError:
        """This error as another API names its fields (`names`: chat's field name -> that API's), in `param` and
        in the message's quoted names."""
        message = self.message
        for old, new in names.items():
            message = message.replace(f"'{old}'", f"'{new}'").replace(f" {old} (", f" {new} (")
        return ApiError(self.status, message, names.get(self.param, self.param), self.code, self.kind, self.headers)


@dataclass(frozen=True)
class GenerationArguments:
    """How one request is generated: `stream_cycles`' keyword arguments (its defaults; see there), typed, and
    the logprobs the worker reads for it. The server's flags give its defaults (`App.defaults`); a request's
    fields replace those it sets."""

    max_tokens: int = 256
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None  # a seeded request never shares a batch: its draws are the seed's alone
    block_size: int | None = None
    verify_mode: str = "adaptive"
    walk: str = "greedy"
    tree_budget: int | None = None
    max_context: int | None = None
    prefill_step_size: int = 2048
    # copy drafts (`lookup.py`): continuations looked up in the context, verified beside the drafter's block; on
    # by default, as tool loops and edits repeat what the context holds
    copyspec_mode: str | LookupConfig = "auto"
    eos_token_ids: Sequence[int] | None = None  # None: the tokenizer's
    logits_processors: Sequence | None = None
    costs: CostModel | None = None  # adaptive mode's cost model, measured once at startup (`warm_start`)
    # mlx-lm's own sampler, drawn from by plain decoding instead of temp/top_p/top_k/min_p (which then only say
    # what it was made with): a request's XTC, whose distribution no draft can be verified against
    sampler: Callable | None = None
    logprobs: int | None = None  # per token, its logprob and this many top ones; None: no logprobs

    def __post_init__(self):
        copyspec_config(self.copyspec_mode)  # an unknown mode fails when the server starts, naming the known ones

    @classmethod
    def from_kwargs(cls, kwargs: Mapping) -> GenerationArguments:
        """From `stream_cycles`' keyword arguments (and `logprobs`), as a mapping.

        Args:
            kwargs: keyword arguments named as `stream_cycles` names them.

        Raises:
            TypeError: a name that is not one of this class's fields.
        """
        unknown = sorted(set(kwargs) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(
                f"{', '.join(unknown)}: not generation arguments (stream_cycles' keyword arguments "
                f"and logprobs: {', '.join(f.name for f in fields(cls))})"
            )
        return cls(**kwargs)

    def cycle_kwargs(self) -> dict:
        """`stream_cycles`' keyword arguments (all but `logprobs`, which the worker reads itself; with a `sampler`,
        which `stream_cycles` takes instead of them, temp/top_p/top_k/min_p neither)."""
        left_out = {"logprobs", *(("temp", "top_p", "top_k", "min_p") if self.sampler is not None else ())}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in left_out}


@dataclass(frozen=True)
class CompletionRequest:
    """A parsed and validated request, from its handler to the worker (`generation`) and back into its answer."""

    kind: Literal["chat", "text"]
    model: str  # the served name the request used, echoed in the answer
    prompt: list[int]  # token ids: the chat template's rendering of the messages, or the text's encoding
    generation: GenerationArguments
    stream: bool = False
    include_usage: bool = False  # streaming: a last chunk with `usage`
    stop: tuple[str, ...] = ()
    tools: list | None = None  # chat requests with tools: the answer's tool calls are parsed out of its text
    strict: Mapping[str, dict] | None = None  # the `parameters` of the strict tools, by name: their calls are checked
    parallel_tool_calls: bool = True  # false: the answer ends after its first tool call


class RequestParser:
    """Reads request bodies against what the server serves.

    Args:
        tokenizer: the target's tokenizer (mlx-lm's `TokenizerWrapper`): chat template, tool-call format, encoding.
        defaults: the generation arguments of the server's flags, for what a request leaves unset.
        model_names: the names clients may use in 'model', the model's id first.
        vocab_size: the target's vocabulary size, which token ids and `logit_bias` keys must be below.
        context_length: longest prompt + max_tokens accepted; None: unchecked.
        draft_tokens: the drafts per cycle the server's block size makes (B - 1), the one `num_draft_tokens`
            a request may name; None: no drafter (plain decoding).
        chat_template_args: keyword arguments for every chat template call (--chat-template-args), which a
            request's `chat_template_kwargs` update.
    """

    def __init__(
        self,
        tokenizer,
        defaults: GenerationArguments,
        model_names: Sequence[str],
        vocab_size: int,
        context_length: int | None,
        draft_tokens: int | None = None,
        chat_template_args: Mapping | None = None,
    ):
        self.tokenizer, self.defaults, self.model_names = tokenizer, defaults, list(model_names)
        self.vocab_size, self.context_length, self.draft_tokens = vocab_size, context_length, draft_tokens
        self.chat_template_args = dict(chat_template_args or {})

    def parse(self, kind: Literal["chat", "text"], body) -> CompletionRequest:
        """The request a body makes.

        Args:
            kind: "chat" (/v1/chat/completions) or "text" (/v1/completions).
            body: the body's decoded JSON.

        Raises:
            ApiError: 400 for a field that does not fit (named in `param`), 404 for a model not served.
        """
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        ignored = sorted(IGNORED_FIELDS.keys() & body.keys())
        if ignored:
            log.debug("fields not acted on: %s", "; ".join(f"{k}: {IGNORED_FIELDS[k]}" for k in ignored))
        model = self.served_name(_field(body, "model", str, expect="a string"))
        stream = _field(body, "stream", bool, False, expect="true or false")
        options = _field(body, "stream_options", dict, {}, expect="an object")
        include_usage = _field(options, "include_usage", bool, False, expect="true or false")
        if _field(body, "n", int, 1, expect="an integer") != 1:
            raise ApiError(400, "'n' must be 1: this server generates one choice per request", param="n")
        logprobs = _logprobs(kind, body)
        limit = None
        for name in ("max_tokens", "max_completion_tokens"):
            limit = _field(body, name, int, limit, lambda v: v >= 1, expect="an integer >= 1")
        d, number = self.defaults, (int, float)
        temp = _field(body, "temperature", number, d.temp, expect="a number")
        top_p = _field(body, "top_p", number, d.top_p, expect="a number")
        top_k = _field(body, "top_k", int, d.top_k, expect="an integer")
        min_p = _field(body, "min_p", number, d.min_p, expect="a number")
        try:
            SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        except ValueError as e:
            raise ApiError(400, str(e).replace("temperature", "'temperature'")) from None
        seed = _field(body, "seed", int, d.seed, expect="an integer")
        processors = self._processors(body) or d.logits_processors
        sampler = self._xtc_sampler(body, temp, top_p, top_k, min_p)
        self._refused(body)
        stop = _field(body, "stop", (str, list), [], expect="a string or a list of strings")
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) for s in stop):
            raise ApiError(400, "'stop' must be a string or a list of strings", param="stop")
        tools, strict = _request_tools(body, self.tokenizer) if kind == "chat" else (None, None)
        parallel = _field(body, "parallel_tool_calls", bool, True, expect="true or false")
        prompt = self._prompt(kind, body, tools)
        n, context = len(prompt), self.context_length
        if context is not None and n >= context:
            raise ApiError(
                400,
                f"the prompt is {n} tokens, and this model's context is {context} tokens: shorten the prompt",
                param="messages" if kind == "chat" else "prompt",
                code="context_length_exceeded",
            )
        if context is not None and limit is not None and n + limit > context:
            raise ApiError(
                400,
                f"the prompt ({n} tokens) plus max_tokens ({limit}) exceed this model's context "
                f"({context} tokens): lower max_tokens to {context - n} or less",
                param="max_tokens",
                code="context_length_exceeded",
            )
        if limit is None:
            limit = d.max_tokens if context is None else min(d.max_tokens, context - n)
        generation = replace(
            d,
            max_tokens=limit,
            temp=temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            logits_processors=processors,
            logprobs=logprobs,
        )
        if sampler is not None:  # mlx-lm's XTC sampler, drawn from as mlx-lm draws: plain decoding
            generation = replace(generation, sampler=sampler, verify_mode="off")
        return CompletionRequest(
            kind, model, prompt, generation, stream, include_usage, tuple(stop), tools, strict, parallel
        )

    def served_name(self, model: str | None) -> str:
        """The name a request's 'model' picks, echoed in its answer: one of the served names (the model's id, the
        --served-model-name ones), or the id when unset or mlx_lm.server's "default_model"; others get a 404."""
        if model is None or model == "default_model":
            return self.model_names[0]
        if model not in self.model_names:
            served = ", ".join(repr(name) for name in self.model_names)
            raise ApiError(
                404,
                f"the model {model!r} does not exist here: this server serves {served} (GET /v1/models)",
                param="model",
                code="model_not_found",
            )
        return model

    def _processors(self, body: dict) -> list:
        """mlx-lm's logits processors from the request's `repetition_penalty`, `presence_penalty`,
        `frequency_penalty` (each with its `_context_size`, default 20) and `logit_bias` ({"token id": bias},
        OpenAI's shape), as mlx_lm.server reads them (0 = no penalty) and builds them (`make_logits_processors`)."""
        penalty = _field(body, "repetition_penalty", (int, float), 0.0, lambda v: v >= 0, expect="a number >= 0")
        size = _field(body, "repetition_context_size", int, 20, lambda v: v >= 1, expect="an integer >= 1")
        presence = _field(body, "presence_penalty", (int, float), 0.0, math.isfinite, expect="a number")
        presence_size = _field(body, "presence_context_size", int, 20, lambda v: v >= 1, expect="an integer >= 1")
        frequency = _field(body, "frequency_penalty", (int, float), 0.0, math.isfinite, expect="a number")
        frequency_size = _field(body, "frequency_context_size", int, 20, lambda v: v >= 1, expect="an integer >= 1")
        bias = _field(body, "logit_bias", dict, None, expect="an object of token id to bias")
        if bias:
            ids = [int(k) if isinstance(k, str) and k.strip().isdigit() else -1 for k in bias]
            numbers = [isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()]
            if not all(numbers) or not all(0 <= i < self.vocab_size for i in ids):
                raise ApiError(
                    400,
                    "'logit_bias' must map token ids (as strings, each below the vocabulary size "
                    f'{self.vocab_size}) to numbers, e.g. {{"42": -100}}',
                    param="logit_bias",
                )
            bias = {i: float(v) for i, v in zip(ids, bias.values())}
        return make_logits_processors(
            logit_bias=bias,
            repetition_penalty=penalty,
            repetition_context_size=size,
            presence_penalty=presence,
            presence_context_size=presence_size,
            frequency_penalty=frequency,
            frequency_context_size=frequency_size,
        )

    def _xtc_sampler(self, body: dict, temp, top_p, top_k, min_p):
        """mlx_lm.server's sampler for a request with `xtc_probability` > 0 (and `xtc_threshold`, default 0.1),
        made as it makes it; None without XTC, or at temperature 0, where mlx-lm's sampler is greedy and XTC
        changes nothing."""
        probability = _field(
            body, "xtc_probability", (int, float), 0.0, lambda v: 0 <= v <= 1, expect="a number in 0..1"
        )
        threshold = _field(body, "xtc_threshold", (int, float), 0.1, lambda v: 0 <= v <= 1, expect="a number in 0..1")
        if probability == 0 or temp == 0:
            return None
        special = list(self.tokenizer.encode("\n")) + list(self.tokenizer.eos_token_ids)  # mlx_lm.server's
        return make_sampler(
            temp,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            xtc_probability=float(probability),
            xtc_threshold=float(threshold),
            xtc_special_tokens=special,
        )

    def _refused(self, body: dict) -> None:
        """A 400 for `REFUSED_FIELDS` that ask for what this server does not do."""
        asked = {
            "draft_model": body.get("draft_model") not in (None, "default_model"),
            "num_draft_tokens": body.get("num_draft_tokens") not in (None, self.draft_tokens),
            "adapters": body.get("adapters") is not None,
        }
        for name, refused in asked.items():
            if refused:
                raise ApiError(
                    400, f"'{name}' ({json.dumps(body[name])}) cannot be honoured: {REFUSED_FIELDS[name]}", param=name
                )

    def _template_kwargs(self, body: dict) -> dict:
        """The chat template's keyword arguments: --chat-template-args, updated by the request's
        `chat_template_kwargs` (e.g. {"enable_thinking": false}), as mlx_lm.server merges them. OpenAI's
        `reasoning_effort` goes to the template as the variable of that name (templates that take one, such as
        gpt-oss's, read it; others ignore it); "none" also turns thinking off (`enable_thinking` false, which
        mlx-lm's wrapper renames for templates that call it otherwise). `chat_template_kwargs` has the last word."""
        asked = _field(body, "chat_template_kwargs", dict, {}, expect="an object of keyword arguments")
        own = sorted(set(asked) & set(TEMPLATE_OWN_KWARGS))
        if own:
            raise ApiError(
                400,
                f"'chat_template_kwargs' may not set {', '.join(own)}: the server passes "
                f"{', '.join(TEMPLATE_OWN_KWARGS)} itself",
                param="chat_template_kwargs",
            )
        effort = _field(body, "reasoning_effort", str, None, expect='a string ("none", "low", "medium", "high", ...)')
        effort = (
            {}
            if effort is None
            else {"reasoning_effort": effort, **({"enable_thinking": False} if effort == "none" else {})}
        )
        return {**self.chat_template_args, **effort, **asked}

    def _prompt(self, kind: str, body: dict, tools: list | None = None) -> list[int]:
        if kind == "chat":
            messages = body.get("messages")
            if not isinstance(messages, list):
                raise ApiError(400, "'messages' must be a list of {'role', 'content'} objects", param="messages")
            if not messages:
                raise ApiError(400, "'messages' is empty: send at least one message", param="messages")
            messages = [_chat_message(i, m) for i, m in enumerate(messages)]
            if not self.tokenizer.has_chat_template:
                raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions")
            kwargs = self._template_kwargs(body)
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **kwargs)
            except Exception as e:  # the template's own checks (role order, ...) speak for themselves
                raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
            return list(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(0 <= t < self.vocab_size for t in prompt):
                raise ApiError(400, f"'prompt' token ids must be in 0..{self.vocab_size - 1}", param="prompt")
            return prompt
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "'prompt' must be a non-empty string (or a list of token ids)", param="prompt")
        return encode_text(self.tokenizer, prompt)


def _field(body: dict, name: str, types, default=None, check=None, expect: str = ""):
    """body[name] if present and not null, of `types` (bools are never numbers), passing `check`."""
    value = body.get(name)
    if value is None:
        return default
    numeric = types in (int, float, (int, float))
    if isinstance(value, bool) and numeric or not isinstance(value, types):
        wanted = expect or (types.__name__ if isinstance(types, type) else "a number")
        raise ApiError(400, f"'{name}' must be {wanted}, got {json.dumps(value)}", param=name)
    if check is not None and not check(value):
        raise ApiError(400, f"'{name}' must be {expect}, got {json.dumps(value)}", param=name)
    return value


def _logprobs(kind: str, body: dict) -> int | None:
    """How many top tokens each generated token's logprobs list (0: its own logprob only), None for none. Chat:
    OpenAI's `logprobs` (true or false) and `top_logprobs` (0..20, with logprobs true); completions: `logprobs` N
    (0..20; true, as mlx_lm.server takes it, is `top_logprobs` or 0)."""
    top = _field(
        body,
        "top_logprobs",
        int,
        None,
        lambda v: 0 <= v <= MAX_TOP_LOGPROBS,
        expect=f"an integer in 0..{MAX_TOP_LOGPROBS}",
    )
    if kind == "chat":
        wanted = _field(body, "logprobs", bool, False, expect="true or false")
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None
    wanted = _field(body, "logprobs", (bool, int), None, expect=f"an integer in 0..{MAX_TOP_LOGPROBS}")
    if isinstance(wanted, bool):
        return (top or 0) if wanted else None
    if wanted is not None and not 0 <= wanted <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'logprobs' must be an integer in 0..{MAX_TOP_LOGPROBS}, got {wanted}", param="logprobs")
    return wanted


def _request_tools(body: dict, tokenizer) -> tuple[list | None, dict | None]:
    """The request's `tools`, for the chat template and the tool parser, and the `parameters` of those whose
    `strict` is true, by name; (None, None) when it has none, or says tool_choice "none" (the template then
    renders no tools and the answer's text stays content)."""
    tools = _field(body, "tools", list, None, expect="a list of {'type': 'function', 'function': ...} objects")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ApiError(
            400,
            f'\'tool_choice\' must be "auto" or "none", got {json.dumps(choice)}: this server cannot force a tool call',
            param="tool_choice",
        )
    if not tools or choice == "none":
        return None, None
    strict = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        named = isinstance(function, dict) and isinstance(function.get("name"), str)
        if not named or tool.get("type") != "function":
            raise ApiError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                param="tools",
            )
        if not isinstance(function.get("strict"), (bool, type(None))):
            raise ApiError(400, f"tools[{i}]: 'strict' must be true or false", param="tools")
        if function.get("strict"):
            strict[function["name"]] = _strict_schema(i, function.get("parameters", {}))
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ApiError(
            400,
            "this model's chat template does not support tools (mlx-lm knows no tool-call format "
            "for it): leave 'tools' unset, or serve a model whose template takes them",
            param="tools",
        )
    return tools, strict or None


def _strict_schema(i: int, parameters) -> dict:
    """A strict tool's `parameters`, once `schema.check_schema` says its calls can be checked against it."""
    try:
        check_schema(parameters)
    except ValueError as e:
        raise ApiError(
            400,
            f"tools[{i}] is strict, and its schema cannot be checked here ({e}): use the keywords OpenAI's strict "
            "mode takes, or send strict false",
            param="tools",
        ) from None
    return parameters


def _message_text(i: int, message) -> tuple[str, str]:
    if not isinstance(message, dict):
        raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content'", param="messages")
    role, content = message.get("role"), message.get("content")
    if not isinstance(role, str):
        raise ApiError(400, f"messages[{i}].role must be a string", param="messages")
    if content is None:
        content = ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise ApiError(
                400,
                f"messages[{i}].content parts must be {{'type': 'text', 'text': ...}} (this server takes text only)",
                param="messages",
            )
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", param="messages")
    return role, content


def _chat_message(i: int, message) -> dict:
    """A request message as chat templates take it: role and text content, and an assistant's `tool_calls` (their
    JSON arguments decoded, as mlx_lm.server does) and `reasoning_content`, a tool result's `tool_call_id` and
    `name` when given."""
    role, content = _message_text(i, message)
    out = {"role": role, "content": content}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", param="messages")
        out["tool_calls"] = [_template_tool_call(i, call) for call in calls]
    out.update(
        {
            key: message[key]
            for key in ("tool_call_id", "name", "reasoning_content")
            if isinstance(message.get(key), str)
        }
    )
    return out


def _template_tool_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(
            400,
            f"messages[{i}].tool_calls entries must be {{'type': 'function', 'function': "
            "{'name': ..., 'arguments': ...}}",
            param="messages",
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ApiError(
                400,
                f"messages[{i}]: the arguments of the call to {function['name']!r} are not valid JSON ({e})",
                param="messages",
            ) from None
    return {**call, "function": {**function, "arguments": arguments}}
