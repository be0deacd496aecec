"""A prompt field (a completion's `prompt`, an embedding's `input`) as the engine's inputs: a text, a list
of token ids, or a batch of either, each checked and named by the field it came from."""

from __future__ import annotations

from typing import cast

from batchserve.shared.checks import MAX_TOKEN_ID
from batchserve.shared.errors import Refusal


def prompt_inputs(
    value: str | list[int | str | list[int]], field: str = "prompt"
) -> list[tuple[str, str | None, list[int] | None]]:
    """(param, text, token ids) of each prompt in `field` (a completion's `prompt`, an embedding's `input`):
    a text, a list of token ids, or a list of either."""
    if isinstance(value, str):
        return [(field, _text_prompt(value, field), None)]
    if not value:
        raise Refusal(f"{field} must not be empty", field)
    kind = type(value[0])
    for i, item in enumerate(value):
        if type(item) is not kind:
            raise Refusal(
                f"{field} must be a text, a list of token ids, or a list of texts or of token-id lists, not a mix",
                f"{field}[{i}]",
            )
    # The loop above checked that every item is of `kind`.
    if kind is int:
        return [(field, None, _token_prompt(cast(list[int], value), field))]
    if kind is str:
        texts = cast(list[str], value)
        return [(f"{field}[{i}]", _text_prompt(p, f"{field}[{i}]"), None) for i, p in enumerate(texts)]
    id_lists = cast(list[list[int]], value)
    return [(f"{field}[{i}]", None, _token_prompt(p, f"{field}[{i}]")) for i, p in enumerate(id_lists)]


def _text_prompt(text: str, param: str) -> str:
    if text == "":
        raise Refusal(f"{param} must not be empty", param)
    return text


def _token_prompt(ids: list[int], param: str) -> list[int]:
    if not ids:
        raise Refusal(f"{param} must not be empty", param)
    if any(not 0 <= t <= MAX_TOKEN_ID for t in ids):
        raise Refusal(f"{param} token ids must be in [0, {MAX_TOKEN_ID}]", param)
    return list(ids)
