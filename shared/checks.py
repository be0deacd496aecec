"""Request checks made in more than one place, written once: the api and `batchserve generate` check
sampling parameters with `check_sampling`; the tokenizer settles `max_tokens` with
`settle_max_tokens` (the api calls it too, with what it knows before tokenizing, to refuse early).

A refusal is a `Refusal` (400) naming the request field.
"""

from __future__ import annotations

from shared.errors import Refusal

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range
MAX_TOKEN_ID = 2**31 - 1  # token ids travel as int32 arrays
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's legacy completions default; chat: the context left


def check_sampling(temperature: float, top_p: float, top_k: int, min_p: float, seed: int | None,
                   flag: str = "") -> None:
    """vLLM's ranges; `flag` prefixes the names in messages (`--` for the CLI's flags)."""
    if not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise Refusal(f"{flag}temperature must be in [0, {MAX_TEMPERATURE:g}] (got {temperature})", "temperature")
    if not (0.0 < top_p <= 1.0):
        raise Refusal(f"{flag}top_p must be in (0, 1] (got {top_p})", "top_p")
    if top_k == 0 or top_k < -1 or top_k > MAX_TOKEN_ID:
        raise Refusal(f"{flag}top_k must be -1 (off) or >= 1 (got {top_k})", "top_k")
    if not (0.0 <= min_p <= 1.0):
        raise Refusal(f"{flag}min_p must be in [0, 1] (got {min_p})", "min_p")
    if seed is not None and not (0 <= seed <= MAX_SEED):
        raise Refusal(f"{flag}seed must be in [0, 2**63 - 1] (got {seed})", "seed")


def settle_max_tokens(prompt_len: int, given: int | None, param: str, max_context: int, *, chat: bool,
                      prompt_param: str = "prompt") -> int:
    """The request's max_tokens: the client's (`given`, from field `param`) if it fits the context
    beside a `prompt_len`-token prompt, else a `Refusal`; not given: 16 for a completion, the
    context left for a chat, either lowered to what the prompt leaves."""
    if prompt_len >= max_context:
        raise Refusal(f"This model's maximum context length is {max_context} tokens; the prompt has "
                         f"{prompt_len} tokens, which leaves no room for a completion.", prompt_param)
    room = max_context - prompt_len
    if given is None:
        return room if chat else min(DEFAULT_COMPLETION_MAX_TOKENS, room)
    if given < 1:
        raise Refusal(f"{param} must be at least 1 (got {given})", param)
    if given > room:
        if prompt_len == 0:  # the api's early check of a text prompt: its length is not known yet
            raise Refusal(f"{param} ({given}) exceeds this model's maximum context length of "
                             f"{max_context} tokens", param)
        raise Refusal(f"This model's maximum context length is {max_context} tokens. However, you requested "
                         f"{prompt_len + given} tokens ({prompt_len} in the prompt, {given} in the completion). "
                         f"Please reduce the prompt or {param}.", param)
    return given
