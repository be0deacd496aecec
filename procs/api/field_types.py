"""The value ranges of the request fields, declared once as annotated types.

msgspec checks them while it decodes a body, so a value out of range is a 400 naming the field and its
range ("Expected `int` <= 2147483647 - at `$.max_tokens`") before anything else reads it, and nothing out of
range reaches a message encoder; the OpenAPI document (`openapi.py`) shows the same bounds. What depends
on other fields or on the model (n against best_of, max_tokens against the context, logit_bias ids
against the vocabulary) is checked after decoding, in `validation.py` and the tokenizer.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from batchserve.shared.checks import (
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    PRIORITY_RANGE,
)

INT32_MAX = 2**31 - 1
MAX_N = 128  # choices per prompt (vLLM has no cap; the api's in-flight cap bounds n x prompts too)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's legacy completions
MAX_TOP_LOGPROBS = 20  # OpenAI's chat

# Token counts (max_tokens, min_tokens, ...): the engine's messages carry them as 32-bit integers.
TokenCount = Annotated[int, Meta(ge=0, le=INT32_MAX)]
TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
Seed = Annotated[int, Meta(ge=0, le=MAX_SEED)]
Priority = Annotated[int, Meta(ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])]
Choices = Annotated[int, Meta(ge=1, le=MAX_N)]
CompletionLogprobs = Annotated[int, Meta(ge=0, le=MAX_COMPLETION_LOGPROBS)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
TopK = Annotated[int, Meta(ge=-1, le=MAX_TOKEN_ID)]  # -1: off; 0 is refused by `check_sampling`
# truncate_prompt_tokens: -1 keeps the context's worth; 0 is refused after decoding
TruncateTokens = Annotated[int, Meta(ge=-1, le=INT32_MAX)]

# Floats: JSON has no NaN, but 1e400 decodes to infinity, which the finite bounds refuse.
Temperature = Annotated[float, Meta(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
MinP = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]  # presence and frequency: OpenAI's range
FLOAT32_MAX = 3.4028234663852886e38  # the worker keeps penalties in float32 tensors
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=FLOAT32_MAX)]  # vLLM's: > 0 (and a float32)
LogitBias = dict[
    Annotated[str, Meta(pattern=r"^[0-9]{1,10}$")],  # token ids in decimal (JSON keys are strings)
    Annotated[float, Meta(ge=-100.0, le=100.0)],  # OpenAI's range
]

StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]
StopStrings = Annotated[list[StopString], Meta(max_length=MAX_STOP_SEQUENCES)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)]
