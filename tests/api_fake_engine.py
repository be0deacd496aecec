"""An in-process `EngineClient` test double for the api tests: scripted tokens, delays, rejections."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable

from batchserve.procs.api.engine_client import PromptTokens
from batchserve.procs.tokenizer.prompts import settle_max_tokens
from batchserve.shared.checks import check_prompt_size
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import (
    GenerateRequest,
    RequestRejected,
    SchedulerStats,
    TextDelta,
    TokenLogprob,
    TopLogprob,
    Usage,
)


class FakeEngine:
    """Answers every request with `tokens` (one TextDelta each, cut at max_tokens), or rejects it.

    Records what the app sent: `requests` (in the order their streams were first read, i.e.
    submitted), `aborts` (rids, in order), `closed` (rids whose iterator was closed) and `log`
    ("submit <rid>" / "event <rid>" in order). `prompt_tokens` of a text prompt is its word count, of
    a chat the words of all messages.

    Logprobs, when asked for, are deterministic: generated token i (id 100 + i) has logprob
    -(i + 1) / 4 and its top k are itself then "alt1".. with logprob 1, 2.. lower. With prompt
    logprobs the first delta carries the prompt's text and tokens: a text prompt's words (with their
    leading spaces; ids 1000 + position), a token prompt's ids as "<id>"; prompt token p > 0 has
    logprob -p and top k " p1".. with logprob -0.5, -1.0..

    `tokenize` answers a prompt's words (ids 1000 + position, as the prompt logprobs), `<s>` (id 1)
    first when special tokens are added; `detokenize` writes id t as "<t>" and refuses ids of
    `vocab_size` and up. Both record their calls in `tokenize_calls` / `detokenize_calls`. A prompt
    longer than `max_prompt_chars` is refused by `generate` and `tokenize`, as the real client does;
    `generate` settles max_tokens as the tokenizer does (its default, or its refusal).
    """

    def __init__(
        self,
        tokens: list[str] | None = None,
        *,
        delay: float = 0.0,
        first_delay: float = 0.0,
        reject: tuple[int, str, str | None] | None = None,
        model_name: str = "fake-model",
        max_context: int = 128,
        fail_with: Exception | None = None,
        fail_after: int | None = None,
        fail_suffix: str = "",
        tokens_of: Callable[[GenerateRequest], list[str]] | None = None,
        max_prompt_chars: int | None = None,
        vocab_size: int = 50_000,
    ) -> None:
        self.tokens = ["Hello", ",", " world", "!"] if tokens is None else tokens
        self.tokens_of = tokens_of  # per request, instead of `tokens`
        self.delay = delay
        self.first_delay = first_delay
        self.reject = reject
        self.fail_with = fail_with
        self.fail_after = fail_after  # tokens streamed before a 503 rejection (a backend that died)
        self.fail_suffix = fail_suffix  # fail_after applies to the rids ending with this
        self.model_name = model_name
        self.max_context = max_context
        self.max_prompt_chars = max_prompt_chars
        self.vocab_size = vocab_size
        self.healthy = True
        self.tokenize_calls: list[tuple[GenerateRequest, dict]] = []
        self.detokenize_calls: list[list[int]] = []
        self.requests: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.adapter_updates: list = []  # AdapterUpdates sent (the runtime LoRA endpoints)
        self.closed: list[str] = []
        self.log: list[str] = []
        self.received = asyncio.Event()  # set when a request arrives
        self.aborted = asyncio.Event()  # set on the first abort
        self._listener = None

    # ---- EngineClient

    def generate(self, request: GenerateRequest) -> AsyncIterator[TextDelta | RequestRejected]:
        return self._run(request)

    async def _run(self, request: GenerateRequest):
        self.requests.append(request)
        self.log.append(f"submit {request.rid}")
        self.received.set()
        try:
            prompt_tokens = self._prompt_tokens(request)
            try:
                check_prompt_size(request, self.max_prompt_chars, self.max_context)
                max_tokens = settle_max_tokens(
                    prompt_tokens,
                    request.params.stop.max_tokens,
                    request.max_tokens_param,
                    self.max_context,
                    chat=request.messages is not None,
                    prompt_param="messages" if request.messages is not None else "prompt",
                    min_tokens=request.params.logits.min_tokens,
                )
            except Refusal as exc:
                yield RequestRejected(rid=request.rid, status=exc.status, message=exc.message, param=exc.param)
                return
            if self.first_delay:
                await asyncio.sleep(self.first_delay)
            if self.fail_with is not None:
                raise self.fail_with
            if self.reject is not None:
                status, message, param = self.reject
                yield RequestRejected(rid=request.rid, status=status, message=message, param=param)
                return
            tokens = self.tokens if self.tokens_of is None else self.tokens_of(request)
            n = min(len(tokens), max_tokens)
            reason = "length" if n < len(tokens) else "stop"
            fail_after = self.fail_after if request.rid.endswith(self.fail_suffix) else None
            for i in range(n):
                if i and self.delay:
                    await asyncio.sleep(self.delay)
                self.log.append(f"event {request.rid}")
                if i == fail_after:
                    yield RequestRejected(rid=request.rid, status=503, message="the worker process exited")
                    return
                last = i == n - 1
                delta = TextDelta(
                    rid=request.rid,
                    text=tokens[i],
                    token_ids=[100 + i],
                    finish_reason=reason if last else None,
                    usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=n, total_tokens=prompt_tokens + n)
                    if last
                    else None,
                    logprobs=[]
                    if request.params.logits.logprobs is None
                    else [self.token_logprob(tokens[i], i, request.params.logits.logprobs)],
                )
                if i == 0 and request.params.logits.prompt_logprobs is not None:
                    words = self.prompt_words(request)
                    delta.prompt_text = "".join(word for word, _ in words)
                    k = request.params.logits.prompt_logprobs
                    delta.prompt_logprobs = [
                        self.prompt_logprob(word, token_id, p, k) for p, (word, token_id) in enumerate(words)
                    ]
                yield delta
        finally:
            self.closed.append(request.rid)

    @staticmethod
    def token_logprob(text: str, i: int, k: int) -> TokenLogprob:
        logprob = -(i + 1) / 4
        top = [TopLogprob(text, 100 + i, logprob)] + [TopLogprob(f"alt{r}", 200 + r, logprob - r) for r in range(1, k)]
        return TokenLogprob(token=text, token_id=100 + i, logprob=logprob, top=top[:k])

    @staticmethod
    def prompt_logprob(text: str, token_id: int, p: int, k: int) -> TokenLogprob:
        if p == 0:
            return TokenLogprob(token=text, token_id=token_id, logprob=None)
        top = [TopLogprob(f" p{r}", 500 + r, -0.5 * r) for r in range(1, k + 1)]
        return TokenLogprob(token=text, token_id=token_id, logprob=-float(p), top=top)

    @staticmethod
    def prompt_words(request: GenerateRequest) -> list[tuple[str, int]]:
        """The prompt's tokens as (text, id): they concatenate to the prompt's text."""
        if request.prompt_token_ids is not None:
            return [(f"<{t}>", t) for t in request.prompt_token_ids]
        return [(word, 1000 + p) for p, word in enumerate(re.findall(r"\s*\S+", request.prompt or ""))]

    async def tokenize(
        self,
        request: GenerateRequest,
        *,
        add_special_tokens: bool | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        return_token_strs: bool,
    ) -> PromptTokens:
        self._check_serving()
        check_prompt_size(request, self.max_prompt_chars, self.max_context)
        self.tokenize_calls.append(
            (
                request,
                {
                    "add_special_tokens": add_special_tokens,
                    "add_generation_prompt": add_generation_prompt,
                    "continue_final_message": continue_final_message,
                    "return_token_strs": return_token_strs,
                },
            )
        )
        if request.messages is not None:
            words = [(w, 1000 + p) for p, w in enumerate(" ".join(m.content or "" for m in request.messages).split())]
        else:
            words = self.prompt_words(request)
        if add_special_tokens if add_special_tokens is not None else request.messages is None:
            words = [("<s>", 1), *words]
        return PromptTokens([t for _, t in words], [w for w, _ in words] if return_token_strs else None)

    async def detokenize(self, token_ids: list[int]) -> str:
        self._check_serving()
        self.detokenize_calls.append(token_ids)
        bad = [t for t in token_ids if t >= self.vocab_size]
        if bad:
            raise Refusal(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})", "tokens")
        return "".join(f"<{t}>" for t in token_ids)

    def _check_serving(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        if not self.healthy:
            raise Refusal("the server cannot take requests now (the fake engine is unhealthy)", status=503)

    async def abort(self, rid: str) -> None:
        self.aborts.append(rid)
        self.aborted.set()

    async def update_adapter(self, update) -> None:
        self.adapter_updates.append(update)

    def health_problem(self) -> str | None:
        return None if self.healthy else "the fake engine is unhealthy"

    def set_stats_listener(self, listener) -> None:
        self._listener = listener

    # ---- test controls

    def push_stats(self, stats: SchedulerStats) -> None:
        self._listener(stats)

    @staticmethod
    def _prompt_tokens(request: GenerateRequest) -> int:
        if request.prompt_token_ids is not None:
            return len(request.prompt_token_ids)
        if request.messages is not None:
            return sum(len((m.content or "").split()) for m in request.messages)
        return len((request.prompt or "").split())
