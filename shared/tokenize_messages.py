"""The api's side path to the tokenizer process for vLLM's `/tokenize` and `/detokenize` (`procs/api/
tokenize_api.py`): a query and its answer, or a `RequestRejected`, on the requests' own sockets."""

from __future__ import annotations

import msgspec

from batchserve.shared.messages import GenerateRequest


class TokenizeQuery(msgspec.Struct, tag=True, kw_only=True):
    """api -> tokenizer (`/tokenize`): the prompt ids of `request`'s prompt or messages (with its tools
    and chat_template_kwargs), as generation would feed them; answered by a `TokenizeAnswer` or a
    `RequestRejected`. The options are vLLM's; `add_special_tokens` None: the form's default (a text
    gets the tokenizer's special tokens, a chat only what its template writes)."""

    rid: str
    request: GenerateRequest
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class TokenizeAnswer(msgspec.Struct, tag=True, kw_only=True):
    """tokenizer -> api: a `TokenizeQuery`'s ids (and their vocabulary strings, when asked for)."""

    rid: str
    token_ids: list[int]
    token_strs: list[str] | None = None


class DetokenizeQuery(msgspec.Struct, tag=True, kw_only=True):
    """api -> tokenizer (`/detokenize`): the text of `token_ids`; a `DetokenizeAnswer` or a `RequestRejected`."""

    rid: str
    token_ids: list[int]


class DetokenizeAnswer(msgspec.Struct, tag=True, kw_only=True):
    rid: str
    text: str
