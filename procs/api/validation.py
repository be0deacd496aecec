"""Check a decoded request and turn it into the `GenerateRequest`s the engine runs.

Every refusal is a `Refusal(message, param)` (HTTP 400) naming the field, so nothing invalid reaches
the engine. Defaults (as vLLM's):
- sampling: temperature 1.0, top_p 1.0, top_k -1 (off), min_p 0.0, no seed.
- max_tokens: sent only when the client gave it (with the field it came from: `max_tokens` or
  `max_completion_tokens`); the tokenizer, which knows the prompt's length, settles it alone: the
  default (completions: 16, the OpenAI legacy default; chat: the context left after the prompt), the
  range and the context check (`procs.tokenizer.prompts.settle_max_tokens`). Its refusal reaches the
  client as the same 400 naming the field, before any SSE starts (`app.py` waits for it).
- logits: no penalties, biases or logprobs (`PLAIN_LOGITS`). logit_bias token ids are checked
  against the vocabulary by the tokenizer process, which knows it.
A completion may carry a batch of prompts: one `GenerateRequest` each, `n` choices each (the app
fans them out).

Structured output (both endpoints, as vLLM): `response_format` (json_object, json_schema) or one of
vLLM's `guided_json`/`guided_regex`/`guided_choice`/`guided_grammar` becomes an `OutputConstraint`
naming the field it came from; the tokenizer compiles it (and answers a bad schema or regex with a
400 naming that field). Tools (chat): `tools` become `ToolFunction`s; `tool_choice` "required" or a
named function (`forced_tool`) makes the tokenizer force one call by grammar, so neither goes with
a structured-output constraint.

Limits (`shared.checks`, docs/api.md's "Limits"): stop sequences (count, length) and stop_token_ids;
a constraint's source size and repetition bounds, and those of a forced tool call's schema
(`shared.grammar`), checked here before the tokenizer compiles anything. A prompt text too long to
fit the context is refused by the engine client before it is sent (`engine_client.py`).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from batchserve.procs.api.prompt_fields import prompt_inputs
from batchserve.procs.api.schemas import (
    ChatCompletionRequest,
    ChatMessageIn,
    CommonRequestFields,
    CompletionRequest,
    ToolIn,
)
from batchserve.procs.api.served_models import ServedModels
from batchserve.shared.checks import MAX_TOKEN_ID, check_priority, check_sampling, check_stop
from batchserve.shared.errors import Refusal
from batchserve.shared.grammar import check_constraint_source, check_json_schema
from batchserve.shared.messages import (
    TOOL_CHOICES,
    ChatMessage,
    GenerateRequest,
    LogitsParams,
    OutputConstraint,
    RequestParams,
    SamplingParams,
    StopParams,
    ToolCall,
    ToolFunction,
)

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
TOOL_NAME_RE = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for function names
RESPONSE_FORMATS = ("text", "json_object", "json_schema")

# OpenAI (and vLLM) fields this server does not implement yet, with the values that mean "not used":
# any other value is refused with a 400 naming the field, never silently ignored.
# (null is always neutral.)
# (best_of is the same kind of refusal, but its neutral values depend on n: see `_choices_per_prompt`.)
UNSUPPORTED: dict[str, tuple[object, ...]] = {"functions": ([],), "function_call": ("none",)}


@dataclass(frozen=True)
class ValidatedRequest:
    requests: list[GenerateRequest]  # one per prompt, each with the HTTP request's rid
    n: int  # choices per prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with empty choices and usage
    logprobs: bool = False  # the answer reports logprobs
    echo: bool = False  # completions: each choice's text starts with its prompt's (and its logprobs)
    # echo with max_tokens 0: the engine is asked for 1 token (it returns the prompt's text and
    # logprobs only along with a generation), which the answer leaves out.
    drop_generated: bool = False
    # chat: the functions whose calls the answer parses out of the text (tools given, tool_choice
    # not "none"); empty: the text is the content
    tool_names: frozenset[str] = frozenset()


def validate_completion(req: CompletionRequest, *, rid: str, model_name: str | ServedModels) -> ValidatedRequest:
    adapter = _check_common(req, model_name)
    n = _choices_per_prompt(req)
    if req.suffix is not None:
        raise Refusal("suffix is not supported", "suffix")
    echo = bool(req.echo)
    drop_generated = echo and req.max_tokens == 0
    sampling = _sampling(req)
    max_tokens = 1 if drop_generated else req.max_tokens
    prompts = [(prompt, prompt_ids) for _, prompt, prompt_ids in prompt_inputs(req.prompt)]
    # The engine returns a prompt's text only with its logprobs, so echo always asks for them.
    prompt_logprobs = (0 if req.logprobs is None else req.logprobs) if echo else None
    logits = _logits(req, logprobs=req.logprobs, prompt_logprobs=prompt_logprobs)
    if drop_generated and logits.min_tokens:
        raise Refusal(
            f"min_tokens ({logits.min_tokens}) must be 0 with echo and max_tokens 0 (nothing is generated)",
            "min_tokens",
        )
    params = _params(req, sampling, logits, _stop(req, max_tokens), constraint_of(req), adapter)
    requests = [
        GenerateRequest(rid=rid, prompt=prompt, prompt_token_ids=prompt_ids, params=params, arrival_time=time.time())
        for prompt, prompt_ids in prompts
    ]
    return ValidatedRequest(
        requests,
        n,
        bool(req.stream),
        _include_usage(req),
        logprobs=req.logprobs is not None,
        echo=echo,
        drop_generated=drop_generated,
    )


def validate_chat(req: ChatCompletionRequest, *, rid: str, model_name: str | ServedModels) -> ValidatedRequest:
    adapter = _check_common(req, model_name)
    n = _choices_per_prompt(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise Refusal("top_logprobs is only allowed when logprobs is true", "top_logprobs")
    if not req.messages:
        raise Refusal("messages must not be empty", "messages")
    messages = [_chat_message(i, m) for i, m in enumerate(req.messages)]
    constraint = constraint_of(req)
    tools = _tools(req.tools or [])
    tool_choice, forced_tool = _tool_choice(req, tools)
    if constraint is not None and tool_choice == "required":
        raise Refusal(
            f"tool_choice {'naming a function' if forced_tool else 'required'} forces a tool call, "
            f"which cannot go with {constraint.param}: use one or the other",
            "tool_choice",
        )
    if tool_choice == "required":  # the forced call's arguments are compiled into a grammar
        for i, tool in enumerate(tools):
            if forced_tool is None or tool.name == forced_tool:
                check_json_schema(tool.parameters, f"tools[{i}].function.parameters")
    template_kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)

    given, param = req.max_completion_tokens, "max_completion_tokens"
    if given is None:
        given, param = req.max_tokens, "max_tokens"
    logits = _logits(req, logprobs=(req.top_logprobs or 0) if req.logprobs else None, prompt_logprobs=None)
    generate = GenerateRequest(
        rid=rid,
        messages=messages,
        params=_params(req, _sampling(req), logits, _stop(req, given), constraint, adapter),
        max_tokens_param=param,
        arrival_time=time.time(),
        tools=tools,
        tool_choice=tool_choice,
        forced_tool=forced_tool,
        chat_template_kwargs=template_kwargs,
    )
    tool_names = frozenset(t.name for t in tools) if tool_choice != "none" else frozenset()
    return ValidatedRequest(
        [generate], n, bool(req.stream), _include_usage(req), logprobs=bool(req.logprobs), tool_names=tool_names
    )


def _params(
    req: CommonRequestFields,
    sampling: SamplingParams,
    logits: LogitsParams,
    stop: StopParams,
    constraint: OutputConstraint | None,
    adapter: int,
) -> RequestParams:
    return RequestParams(
        sampling=sampling,
        stop=stop,
        logits=logits,
        constraint=constraint,
        priority=req.priority or 0,
        speculative=req.speculative is not False,
        adapter=adapter,
    )


def check_model(model: str | None, model_name: str | ServedModels) -> int:
    """A request's `model`: absent, the served model's name, or one of its LoRA adapters' (its index; 0: the
    base model); else 404 model_not_found, as OpenAI answers it."""
    served = model_name if isinstance(model_name, ServedModels) else ServedModels(model_name)
    return served.adapter(model)


def _check_common(req: CommonRequestFields, model_name: str | ServedModels) -> int:
    adapter = check_model(req.model, model_name)
    if req.priority is not None:
        check_priority(req.priority)
    if req.stream_options is not None and not req.stream:
        raise Refusal("stream_options is only allowed when stream is true", "stream_options")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(req, name, None)  # chat-only fields are absent from completions
        if value is not None and value not in neutral:
            raise Refusal(f"{name} is not supported by this server (yet); leave it out", name)
    return adapter


# ---- structured output and tools


def constraint_of(req: CommonRequestFields) -> OutputConstraint | None:
    """The request's structured-output constraint: from `response_format` or one `guided_*` field."""
    found: list[OutputConstraint] = []
    if req.response_format is not None:
        constraint = _response_format(req.response_format)
        if constraint is not None:
            found.append(constraint)
    if req.guided_json is not None:
        found.append(
            OutputConstraint(kind="json_schema", spec=_schema_text(req.guided_json, "guided_json"), param="guided_json")
        )
    if req.guided_regex is not None:
        if req.guided_regex == "":
            raise Refusal("guided_regex must not be empty", "guided_regex")
        found.append(OutputConstraint(kind="regex", spec=req.guided_regex, param="guided_regex"))
    if req.guided_choice is not None:
        if not req.guided_choice:
            raise Refusal("guided_choice must be a non-empty list of strings", "guided_choice")
        found.append(OutputConstraint(kind="choice", spec=json.dumps(req.guided_choice), param="guided_choice"))
    if req.guided_grammar is not None:
        if not req.guided_grammar.strip():
            raise Refusal("guided_grammar must be a non-empty Lark grammar", "guided_grammar")
        found.append(OutputConstraint(kind="lark", spec=req.guided_grammar, param="guided_grammar"))
    if len(found) > 1:
        raise Refusal(f"{found[0].param} and {found[1].param} both constrain the output; give only one", found[1].param)
    if not found:
        return None
    # size and repetition bounds, before the tokenizer compiles it
    check_constraint_source(found[0].kind, found[0].spec, found[0].param)
    return found[0]


def _response_format(value: dict[str, object]) -> OutputConstraint | None:
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise Refusal(
            f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)} (got {kind!r})", "response_format"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputConstraint(kind="json_object", param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise Refusal(
            "response_format of type json_schema needs json_schema.schema, a JSON schema object", "response_format"
        )
    return OutputConstraint(kind="json_schema", spec=json.dumps(spec["schema"]), param="response_format")


def _schema_text(value: object, param: str) -> str:
    """A JSON schema given as an object or as JSON text, as JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise Refusal(f"{param} is not valid JSON: {exc}", param) from None
    if not isinstance(value, dict):
        raise Refusal(f"{param} must be a JSON schema object (got {type(value).__name__})", param)
    return json.dumps(value)


def _tools(tools: list[ToolIn]) -> list[ToolFunction]:
    out: list[ToolFunction] = []
    names: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise Refusal(f"tools[{i}].type must be 'function' (got {tool.type!r})", f"tools[{i}].type")
        function = tool.function
        param = f"tools[{i}].function.name"
        if not TOOL_NAME_RE.fullmatch(function.name):
            raise Refusal(f"{param} must be 1-64 letters, digits, underscores or dashes (got {function.name!r})", param)
        if function.name in names:
            raise Refusal(f"{param}: two tools are named {function.name!r}", param)
        names.add(function.name)
        kwargs = {} if function.parameters is None else {"parameters": dict(function.parameters)}
        out.append(ToolFunction(name=function.name, description=function.description, **kwargs))
    return out


def _tool_choice(req: ChatCompletionRequest, tools: list[ToolFunction]) -> tuple[str, str | None]:
    """(tool_choice, forced_tool) of the GenerateRequest: "auto" by default when there are tools."""
    choice = req.tool_choice
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise Refusal(
                f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                f'{{"type": "function", "function": {{"name": ...}}}} (got {choice!r})',
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise Refusal(f"tool_choice {choice!r} needs tools", "tool_choice")
        return choice, None
    if choice.type != "function":
        raise Refusal(f"tool_choice.type must be 'function' (got {choice.type!r})", "tool_choice")
    names = [t.name for t in tools]
    if choice.function.name not in names:
        known = f"one of {', '.join(names)}" if names else "a tool of the request, which has none"
        raise Refusal(f"tool_choice names {choice.function.name!r}, which must be {known}", "tool_choice")
    return "required", choice.function.name


def _choices_per_prompt(req: CommonRequestFields) -> int:
    n = 1 if req.n is None else req.n  # in [1, MAX_N] (field_types.Choices)
    # best_of > n means "sample best_of, answer the n most likely": not implemented.
    if req.best_of is not None and req.best_of not in (1, n):
        raise Refusal(
            f"best_of is not supported by this server (yet) unless it equals n (got best_of "
            f"{req.best_of}, n {n}); leave it out",
            "best_of",
        )
    return n


def _logits(req: CommonRequestFields, *, logprobs: int | None, prompt_logprobs: int | None) -> LogitsParams:
    """Penalties, logit_bias and min_tokens as vLLM checks them (min_tokens against max_tokens: the
    tokenizer, which settles max_tokens)."""
    presence = 0.0 if req.presence_penalty is None else req.presence_penalty
    frequency = 0.0 if req.frequency_penalty is None else req.frequency_penalty
    # Their ranges were checked while decoding (field_types).
    repetition = 1.0 if req.repetition_penalty is None else req.repetition_penalty
    min_tokens = 0 if req.min_tokens is None else req.min_tokens
    return LogitsParams(
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        min_tokens=min_tokens,
        logit_bias=_logit_bias(req.logit_bias),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():  # keys of 1-10 digits, values in range (field_types.LogitBias)
        if int(key) > MAX_TOKEN_ID:
            raise Refusal(f"logit_bias keys must be token ids in [0, {MAX_TOKEN_ID}] (got {key!r})", "logit_bias")
        out[int(key)] = value
    return out


def _sampling(req: CommonRequestFields) -> SamplingParams:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = -1 if req.top_k is None else req.top_k
    min_p = 0.0 if req.min_p is None else req.min_p
    check_sampling(temperature, top_p, top_k, min_p, req.seed)
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=req.seed)


def _stop(req: CommonRequestFields, max_tokens: int | None) -> StopParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    stop_ids = tuple(req.stop_token_ids or ())
    check_stop(stop, stop_ids)
    return StopParams(
        max_tokens=max_tokens,
        ignore_eos=bool(req.ignore_eos),
        stop_token_ids=stop_ids,
        stop=stop,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=req.skip_special_tokens is not False,
    )


def _include_usage(req: CommonRequestFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def _chat_message(index: int, message: ChatMessageIn) -> ChatMessage:
    role = "system" if message.role == "developer" else message.role
    if role not in CHAT_ROLES:
        raise Refusal(
            f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)} (got {message.role!r})",
            f"messages[{index}].role",
        )
    calls = _message_tool_calls(index, role, message.tool_calls or [])
    if role == "tool" and not message.tool_call_id:
        raise Refusal(
            f"messages[{index}].tool_call_id is required in a tool message (the id of the call it answers)",
            f"messages[{index}].tool_call_id",
        )
    content = message.content
    if content is None:
        if calls:  # an assistant message that only calls tools
            return ChatMessage(role=role, content=None, tool_calls=calls, name=message.name)
        raise Refusal(f"messages[{index}].content is required", f"messages[{index}].content")
    if not isinstance(content, str):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise Refusal(
                    f"messages[{index}].content: only text parts are supported (got type {part.type!r})",
                    f"messages[{index}].content",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    return ChatMessage(
        role=role,
        content=content,
        tool_calls=calls,
        name=message.name,
        tool_call_id=message.tool_call_id if role == "tool" else None,
    )


def _message_tool_calls(index: int, role: str, calls) -> list[ToolCall]:
    if calls and role != "assistant":
        raise Refusal(
            f"messages[{index}].tool_calls: only assistant messages make tool calls", f"messages[{index}].tool_calls"
        )
    out = []
    for j, call in enumerate(calls):
        param = f"messages[{index}].tool_calls[{j}]"
        if call.type != "function":
            raise Refusal(f"{param}.type must be 'function' (got {call.type!r})", f"{param}.type")
        arguments = call.function.arguments
        out.append(
            ToolCall(
                id=call.id,
                name=call.function.name,
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
    return out
