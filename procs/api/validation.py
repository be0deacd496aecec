"""Check a decoded request and turn it into the `GenerateRequest` the engine runs.

Every refusal is an `ApiError(400, message, param)` naming the field, so nothing invalid reaches
the engine. Defaults (as vLLM's):
- sampling: temperature 1.0, top_p 1.0, top_k -1 (off), min_p 0.0, no seed.
- max_tokens, completions: 16 (the OpenAI legacy default), chat: the context left after the prompt.
  The api does not tokenize, so for a text prompt it sends 16 / `max_context` with
  `clamp_max_tokens=True` and the tokenizer lowers it to `max_context - prompt_len`; for a prompt
  of token ids the api computes the clamp itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from procs.api.errors import ApiError
from procs.api.schemas import ChatCompletionRequest, CompletionRequest, CommonRequestFields
from shared.messages import ChatMessage, GenerateRequest, SamplingParams, StopParams

DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 arrays
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")

# OpenAI (and vLLM) fields this server does not implement yet, with the values that mean "not used":
# any other value is refused with a 400 naming the field, never silently ignored.
# (null is always neutral.)
UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,), "min_tokens": (0,),
    "logit_bias": ({},), "best_of": (1,), "response_format": ({"type": "text"},), "guided_json": (),
    "guided_regex": (), "guided_choice": (), "tools": ([],), "tool_choice": ("none",), "functions": ([],),
    "function_call": ("none",),
}


@dataclass(frozen=True)
class ValidatedRequest:
    generate: GenerateRequest
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with empty choices and usage


def validate_completion(req: CompletionRequest, *, rid: str, model_name: str, max_context: int) -> ValidatedRequest:
    _check_common(req, model_name)
    if req.logprobs is not None:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if req.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if req.suffix is not None:
        raise ApiError(400, "suffix is not supported", "suffix")

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    if isinstance(req.prompt, str):
        if req.prompt == "":
            raise ApiError(400, "prompt must not be empty", "prompt")
        prompt = req.prompt
    else:
        if not req.prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if any(not 0 <= t <= MAX_TOKEN_ID for t in req.prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {MAX_TOKEN_ID}]", "prompt")
        prompt_ids = list(req.prompt)

    max_tokens, clamp = _max_tokens(req.max_tokens, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS,
                                    max_context, len(prompt_ids) if prompt_ids is not None else None)
    generate = GenerateRequest(
        rid=rid, prompt=prompt, prompt_token_ids=prompt_ids,
        sampling=_sampling(req), stop=_stop(req, max_tokens),
        arrival_time=time.time(), clamp_max_tokens=clamp,
    )
    return ValidatedRequest(generate, bool(req.stream), _include_usage(req))


def validate_chat(req: ChatCompletionRequest, *, rid: str, model_name: str, max_context: int) -> ValidatedRequest:
    _check_common(req, model_name)
    if req.logprobs or req.top_logprobs is not None:
        raise ApiError(400, "logprobs are not supported", "logprobs")
    if not req.messages:
        raise ApiError(400, "messages must not be empty", "messages")
    messages = [_chat_message(i, m) for i, m in enumerate(req.messages)]

    given, param = req.max_completion_tokens, "max_completion_tokens"
    if given is None:
        given, param = req.max_tokens, "max_tokens"
    max_tokens, clamp = _max_tokens(given, param, max_context, max_context, None)
    generate = GenerateRequest(
        rid=rid, messages=messages,
        sampling=_sampling(req), stop=_stop(req, max_tokens),
        arrival_time=time.time(), clamp_max_tokens=clamp,
    )
    return ValidatedRequest(generate, bool(req.stream), _include_usage(req))


def _check_common(req: CommonRequestFields, model_name: str) -> None:
    if req.model is not None and req.model != model_name:
        raise ApiError(400, f"The model `{req.model}` does not exist; this server serves `{model_name}`.", "model")
    if req.n is not None and req.n != 1:
        raise ApiError(400, f"n must be 1 (got {req.n}): one choice per request", "n")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    for name, neutral in UNSUPPORTED.items():
        value = getattr(req, name, None)  # chat-only fields are absent from completions
        if value is not None and value not in neutral:
            raise ApiError(400, f"{name} is not supported by this server (yet); leave it out", name)


def _sampling(req: CommonRequestFields) -> SamplingParams:
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = -1 if req.top_k is None else req.top_k
    min_p = 0.0 if req.min_p is None else req.min_p
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise ApiError(400, f"temperature must be in [0, {MAX_TEMPERATURE:g}] (got {temperature})", "temperature")
    if not (0.0 < top_p <= 1.0):
        raise ApiError(400, f"top_p must be in (0, 1] (got {top_p})", "top_p")
    if top_k == 0 or top_k < -1 or top_k > MAX_TOKEN_ID:
        raise ApiError(400, f"top_k must be -1 (off) or >= 1 (got {top_k})", "top_k")
    if not (0.0 <= min_p <= 1.0):
        raise ApiError(400, f"min_p must be in [0, 1] (got {min_p})", "min_p")
    if req.seed is not None and not (0 <= req.seed <= MAX_SEED):
        raise ApiError(400, f"seed must be in [0, 2**63 - 1] (got {req.seed})", "seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=req.seed)


def _stop(req: CommonRequestFields, max_tokens: int) -> StopParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    if any(s == "" for s in stop):
        raise ApiError(400, "stop strings must not be empty", "stop")
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t <= MAX_TOKEN_ID for t in stop_ids):
        raise ApiError(400, f"stop_token_ids must be in [0, {MAX_TOKEN_ID}]", "stop_token_ids")
    return StopParams(max_tokens=max_tokens, ignore_eos=bool(req.ignore_eos), stop_token_ids=stop_ids, stop=stop)


def _max_tokens(given: int | None, param: str, default: int, max_context: int,
                prompt_len: int | None) -> tuple[int, bool]:
    """(max_tokens, clamp_max_tokens). `prompt_len` is known only for a prompt of token ids."""
    if prompt_len is not None and prompt_len >= max_context:
        raise ApiError(400, f"This model's maximum context length is {max_context} tokens; the prompt has "
                            f"{prompt_len} tokens, which leaves no room for a completion.", "prompt")
    if given is None:
        if prompt_len is not None:
            return min(default, max_context - prompt_len), False
        return min(default, max_context), True
    if given < 1:
        raise ApiError(400, f"{param} must be at least 1 (got {given})", param)
    if given > max_context:
        raise ApiError(400, f"{param} ({given}) exceeds this model's maximum context length of "
                            f"{max_context} tokens", param)
    if prompt_len is not None and prompt_len + given > max_context:
        raise ApiError(400, f"This model's maximum context length is {max_context} tokens. However, you "
                            f"requested {prompt_len + given} tokens ({prompt_len} in the prompt, {given} in "
                            f"the completion). Please reduce the prompt or {param}.", param)
    return given, False


def _include_usage(req: CommonRequestFields) -> bool:
    return bool(req.stream and req.stream_options is not None and req.stream_options.include_usage)


def _chat_message(index: int, message) -> ChatMessage:
    role = "system" if message.role == "developer" else message.role
    if role not in CHAT_ROLES:
        raise ApiError(400, f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)} "
                            f"(got {message.role!r})", f"messages[{index}].role")
    content = message.content
    if content is None:
        raise ApiError(400, f"messages[{index}].content is required", f"messages[{index}].content")
    if not isinstance(content, str):
        texts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise ApiError(400, f"messages[{index}].content: only text parts are supported "
                                    f"(got type {part.type!r})", f"messages[{index}].content")
            texts.append(part.text)
        content = "\n".join(texts)
    return ChatMessage(role=role, content=content)
