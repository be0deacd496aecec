"""The detokenizer process: `TokenDelta` (scheduler) -> `TextDelta` (api).

One `IncrementalDetokenizer` per request, created from the request's first delta (which carries
its stop strings and the prompt's tail). When a stop string matches, the request is finished to
the api at once (finish_reason "stop") and the scheduler is told to abort it, so generation stops
within a step; the scheduler's own final delta for it is then dropped. A request the scheduler ended
with an error (its output constraint failed) reaches the api as a `RequestRejected` (400 naming the
field), on the same socket as its text, so after all of it.
"""

from __future__ import annotations

import logging

from batchserve.procs.detokenizer.incremental import IncrementalDetokenizer
from batchserve.procs.detokenizer.logprobs import LogprobTexts
from batchserve.procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from batchserve.shared.config import ServerConfig
from batchserve.shared.ipc import ApiInbox, DetokenizerInbox, Receiver, SchedulerInbox, Sender
from batchserve.shared.messages import NO_STOP, AbortRequest, RequestRejected, TextDelta, TokenDelta, Usage
from batchserve.shared.model import ModelSpec
from batchserve.shared.tokenizer_cache import load_decoding_tokenizer

log = logging.getLogger("batchserve.detokenizer")


class Detokenizers:
    """Per-request detokenizer state; `handle` returns the TextDelta to send (if any) and whether to
    abort the request in the scheduler."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self.logprob_texts = LogprobTexts(tokenizer)
        self.active: dict[str, IncrementalDetokenizer] = {}
        self.stopped: set[str] = set()  # finished by a stop string, awaiting the scheduler's last delta

    def fail(self, delta: TokenDelta) -> RequestRejected | None:
        """A request ended with an error: forget it; what the api answers (None: already finished there)."""
        self.active.pop(delta.rid, None)
        if delta.rid in self.stopped:  # finished by a stop string: its answer is complete
            self.stopped.discard(delta.rid)
            return None
        return RequestRejected(rid=delta.rid, status=400, message=delta.error or "failed", param=delta.error_param)

    def handle(self, delta: TokenDelta) -> tuple[TextDelta | None, bool]:
        rid = delta.rid
        if rid in self.stopped:
            if delta.finish_reason is not None:
                self.stopped.discard(rid)
            return None, False
        detok = self.active.get(rid)
        if detok is None:
            stop = delta.stop or NO_STOP  # None: a delta of a request it never saw (an abort)
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_ids=delta.prompt_tail, stop=stop, skip_special_tokens=stop.skip_special_tokens
            )
            self.active[rid] = detok
        text = detok.add(delta.token_ids).text
        finish = delta.finish_reason
        abort = False
        if finish is not None and not detok.stopped:
            text += detok.finish()
        if detok.stopped:
            abort = finish is None  # still generating in the scheduler: stop it there
            if abort:
                self.stopped.add(rid)
            finish = "stop"
        out = TextDelta(rid=rid, text=text, token_ids=list(delta.token_ids))
        if delta.logprobs:
            out.logprobs = self.logprob_texts.convert(delta.logprobs)
        if delta.prompt_ids:
            out.prompt_text, out.prompt_logprobs = self.logprob_texts.prompt(delta.prompt_ids, delta.prompt_logprobs)
        if finish is None:
            return out, False
        del self.active[rid]
        out.finish_reason = finish
        out.pooled = delta.pooled  # a pooling request's vector, as it came
        out.usage = Usage(
            prompt_tokens=delta.prompt_tokens,
            completion_tokens=delta.completion_tokens,
            total_tokens=delta.prompt_tokens + delta.completion_tokens,
            cached_tokens=delta.cached_tokens,
            draft_tokens=delta.draft_tokens,
            accepted_tokens=delta.accepted_tokens,
        )
        return out, abort


def run(config: ServerConfig) -> int:
    with ProcessRuntime("detokenizer", config) as rt:
        inbox: Receiver[DetokenizerInbox] = Receiver(rt.ctx, rt.endpoints.detokenizer, TokenDelta)
        to_api: Sender[ApiInbox] = Sender(rt.ctx, rt.endpoints.api)
        to_scheduler: Sender[SchedulerInbox] = Sender(rt.ctx, rt.endpoints.scheduler)
        detokenizers = Detokenizers(load_decoding_tokenizer(ModelSpec.from_config(config).model_dir))
        rt.ready()
        while not rt.stopping.is_set():
            delta = inbox.recv(POLL_INTERVAL_S)
            if delta is None:
                continue
            if delta.error is not None:
                rejected = detokenizers.fail(delta)
                if rejected is not None:
                    to_api.send(rejected)
                continue
            text_delta, abort = detokenizers.handle(delta)
            if abort:
                to_scheduler.send(AbortRequest(rid=delta.rid))
            if text_delta is not None:
                to_api.send(text_delta)
        return 0
