"""The only interface between the HTTP app and the rest of the server.

The api process's real implementation (`engine_client_zmq.py`) sends `GenerateRequest` /
`AbortRequest` to the tokenizer and routes the detokenizer's `TextDelta`s (and `RequestRejected`s,
`SchedulerStats`) back by request id. Tests use an in-process fake.

Contract, as the app relies on it:
- `generate(request)` returns an async iterator for one request. It yields `TextDelta`s until one
  has `finish_reason` set (that one carries `usage`), or exactly one `RequestRejected`. The app
  validates everything first: nothing invalid is ever passed in.
- When the app stops reading early (client gone, engine error) it calls `await abort(rid)` exactly
  once. Whatever the ending, it then closes the iterator (`aclose()`, when the iterator has one, as
  an async generator does). The iterator itself must not send an abort; on close it only forgets
  its per-request state. A request that ended normally (a finish_reason or a rejection) is never
  aborted. An exception raised by the iterator becomes an HTTP 500 (and an abort).
- `set_stats_listener(listener)`: the app registers one callback at `create_app`; the client calls
  it (on the event loop thread) with every `SchedulerStats` it receives, in order. Push, not pull,
  because each message's `batch_sizes` must be observed exactly once.
- `health_problem()` gates `GET /health` (200 only when None, else 503 with the reason) and new
  requests (503 unless None). Once the engine knows it cannot finish the requests in flight (a
  backend process died or stalled), each of their iterators yields a 503 `RequestRejected`.
- `max_prompt_chars`: the longest prompt text (in characters, `shared.checks.prompt_chars`) that can
  still fit the context, or None when no bound is known. `generate` answers a longer prompt with
  one 400 `RequestRejected` naming `prompt` (or `messages`) and sends nothing on: it cannot fit, and
  tokenizing megabytes would hold up every other request.
- `tokenize(request, ...)` (`/tokenize`): the token ids generation would feed for `request`'s
  prompt or messages (the tokenizer's own path, chat template included), with vLLM's options;
  `detokenize(ids)` (`/detokenize`): their text. Both raise `Refusal` for what the engine refuses
  (the same checks as generation; ids outside the vocabulary name `tokens`), and a 503 `Refusal`
  when the engine cannot answer.
- `update_adapter(update)` (the runtime LoRA endpoints, `lora_api.py`): a LoRA adapter loaded or
  unloaded, sent on the requests' own path, so that a request generated after it returns is not
  planned before it.
- Optional `vocab_size`: token ids below it are in the tokenizer's vocabulary (None or absent: not known
  here); the OpenAPI document bounds token ids by it (`openapi.server_facts`).
- Optional lifecycle: if the client has `async start()` / `async close()`, the app awaits them on
  startup and cleanup, inside the event loop the server runs (so sockets and reader tasks are
  created on that loop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from batchserve.shared.messages import AdapterUpdate, GenerateRequest, RequestRejected, SchedulerStats, TextDelta

EngineEvent = TextDelta | RequestRejected
StatsListener = Callable[[SchedulerStats], None]


@dataclass(frozen=True)
class PromptTokens:
    """What `tokenize` answers: the ids, and each id's vocabulary string when asked for."""

    ids: list[int]
    strs: list[str] | None = None


@runtime_checkable
class EngineClient(Protocol):
    model_name: str  # served model name: GET /v1/models and the "model" field check
    max_context: int  # context length in tokens (prompt + completion)
    max_prompt_chars: int | None  # longer prompt texts cannot fit: refused before tokenizing

    def generate(self, request: GenerateRequest) -> AsyncIterator[EngineEvent]: ...

    async def abort(self, rid: str) -> None: ...

    def health_problem(self) -> str | None: ...

    def set_stats_listener(self, listener: StatsListener) -> None: ...

    async def tokenize(
        self,
        request: GenerateRequest,
        *,
        add_special_tokens: bool | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        return_token_strs: bool,
    ) -> PromptTokens: ...

    async def detokenize(self, token_ids: list[int]) -> str: ...

    async def update_adapter(self, update: AdapterUpdate) -> None: ...
