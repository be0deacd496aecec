"""A pooling request's token ids (the pooling runner: `/v1/embeddings`, `/v1/score`, `/v1/rerank`), and
`truncate_prompt_tokens` (k) applied as vLLM applies it:
- a text keeps its last k tokens, its special tokens included (the tokenizer cuts on the left before adding
  them, so an encoder keeps its [CLS]); token ids keep their last k;
- a cross-encoder's pair (`prompt` and `prompt_pair`) is joined by the tokenizer, the second text cut at its
  end to fit k (a first text that leaves it no room is a 400 naming `truncate_prompt_tokens`);
- a decoder reranker's pair (a "query" and a "document" message, rendered by the chat template) cuts the
  document's end until the rendering fits k.
An embedder whose sentence-transformers folder lists the `message` modality (`shared.pooling.ChatInput`)
embeds a text as sentence-transformers does: one user message rendered by the chat template, tokenized
without special tokens; k then cuts the text's start until the rendering fits (the template's tokens
kept, as a plain text keeps its special tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from batchserve.shared.errors import Refusal
from batchserve.shared.messages import GenerateRequest
from batchserve.shared.pooling import ChatInput

PromptIds = Callable[..., tuple[list[int], str]]  # `PromptTokenizer.prompt_ids`
CHAT_CUT_ROUNDS = 4  # a cut text re-tokenizes to about as many tokens: a few rounds settle its length


def pooling_ids(
    tokenizer: Any, prompt_ids: PromptIds, request: GenerateRequest, keep: int | None, chat: ChatInput | None = None
) -> tuple[list[int], str]:
    """(ids, the field they came from) of a pooling request, at most `keep` tokens when given; `chat`: how
    the model's folder says a text is embedded (None: as it is tokenized)."""
    if request.prompt_pair is not None:
        ids, field = _pair_ids(tokenizer, request.prompt or "", request.prompt_pair, keep), "prompt"
    elif request.messages is not None:
        ids, field = _chat_pair_ids(tokenizer, prompt_ids, request, keep), "messages"
    elif chat is not None and request.prompt:
        ids, field = _chat_text_ids(tokenizer, prompt_ids, request, chat, keep), "prompt"
    elif keep is not None and request.prompt:
        ids, field = _last_tokens(tokenizer, request.prompt, keep), "prompt"
    else:
        ids, field = prompt_ids(request)
        ids = ids if keep is None else ids[-keep:]
    if keep is not None and len(ids) > keep:
        raise Refusal(
            f"truncate_prompt_tokens {keep} is fewer than the tokens this input keeps whatever is cut "
            f"({len(ids)}: the special tokens, or the first text of a pair)",
            "truncate_prompt_tokens",
        )
    return ids, field


def _last_tokens(tokenizer: Any, text: str, keep: int) -> list[int]:
    """The text's last `keep` tokens with its special tokens (cut on the left before they are added)."""
    side = tokenizer.truncation_side
    tokenizer.truncation_side = "left"  # the tokenizer process runs one request at a time
    try:
        return list(tokenizer(text, truncation=True, max_length=keep)["input_ids"])
    finally:
        tokenizer.truncation_side = side


def _pair_ids(tokenizer: Any, first: str, second: str, keep: int | None) -> list[int]:
    cut = {} if keep is None else {"truncation": "only_second", "max_length": keep}
    try:
        return list(tokenizer(first, second, **cut)["input_ids"])
    except Exception as exc:  # the tokenizers library: the first text leaves the second no room
        raise Refusal(
            f"truncate_prompt_tokens {keep} leaves no room for the second text ({exc})", "truncate_prompt_tokens"
        ) from None


def _chat_pair_ids(tokenizer: Any, prompt_ids: PromptIds, request: GenerateRequest, keep: int | None) -> list[int]:
    """A decoder reranker's pair as its chat template renders it (no generation prompt: as
    sentence-transformers renders it), the document's end cut until it fits `keep`."""
    ids, _ = prompt_ids(request, add_generation_prompt=False)
    if keep is None or len(ids) <= keep:
        return ids
    *others, document = request.messages or []
    document_ids = tokenizer.encode(document.content or "", add_special_tokens=False)
    for _ in range(CHAT_CUT_ROUNDS):
        over = len(ids) - keep
        if over <= 0:
            return ids
        if over >= len(document_ids):
            break
        document_ids = document_ids[: len(document_ids) - over]
        cut = msgspec.structs.replace(document, content=tokenizer.decode(document_ids))
        ids, _ = prompt_ids(msgspec.structs.replace(request, messages=[*others, cut]), add_generation_prompt=False)
    return ids  # still over: `pooling_ids` refuses it


def _chat_text_ids(
    tokenizer: Any, prompt_ids: PromptIds, request: GenerateRequest, chat: ChatInput, keep: int | None
) -> list[int]:
    """A text as the user message `chat` renders, its start cut until the rendering fits `keep`."""
    text = request.prompt or ""
    ids = _rendered_ids(tokenizer, prompt_ids, request, chat, text)
    if keep is None or len(ids) <= keep:
        return ids
    text_ids = tokenizer.encode(text, add_special_tokens=False)
    for _ in range(CHAT_CUT_ROUNDS):
        over = len(ids) - keep
        if over <= 0:
            return ids
        if over >= len(text_ids):
            break
        text_ids = text_ids[over:]
        ids = _rendered_ids(tokenizer, prompt_ids, request, chat, tokenizer.decode(text_ids))
    return ids  # still over: `pooling_ids` refuses it


def _rendered_ids(
    tokenizer: Any, prompt_ids: PromptIds, request: GenerateRequest, chat: ChatInput, text: str
) -> list[int]:
    """The ids of `text` rendered as `chat`'s message: as sentence-transformers' apply_chat_template
    tokenizes it (no special tokens added), with the prompt's length checks (`prompt_ids`)."""
    try:
        rendered = tokenizer.apply_chat_template(chat.message(text), tokenize=False, **chat.template_kwargs)
    except Exception as exc:  # jinja raises for what a template does not accept
        raise Refusal(f"the chat template cannot render this input: {exc}", "prompt") from None
    ids, _ = prompt_ids(msgspec.structs.replace(request, prompt=rendered), add_special_tokens=False)
    return ids
