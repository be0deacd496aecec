"""The tokenizer process: `GenerateRequest` -> `TokenizedRequest` (prompt ids in shared memory), and
the api's `/tokenize` and `/detokenize` queries (answered to the api, in turn with the requests).

Aborts are forwarded on the same socket as requests, so an abort never overtakes its request.
Rejections (empty prompt, too long for the context) go straight back to the api.
"""

from __future__ import annotations

import logging

from batchserve.procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.ipc import ApiInbox, Receiver, SchedulerInbox, Sender, TokenizerInbox
from batchserve.shared.messages import AbortRequest, AdapterUpdate, GenerateRequest, RequestRejected
from batchserve.shared.shm import SharedRing
from batchserve.shared.tokenize_messages import DetokenizeAnswer, DetokenizeQuery, TokenizeAnswer, TokenizeQuery

log = logging.getLogger("batchserve.tokenizer")


def run(config: ServerConfig) -> int:
    ring = SharedRing("prompts")
    try:
        with ProcessRuntime("tokenizer", config) as rt:  # closed before the ring: no send reads it after
            inbox: Receiver[TokenizerInbox] = Receiver(rt.ctx, rt.endpoints.tokenizer, TokenizerInbox)
            to_scheduler: Sender[SchedulerInbox] = Sender(rt.ctx, rt.endpoints.scheduler, writer=ring)
            to_api: Sender[ApiInbox] = Sender(rt.ctx, rt.endpoints.api)
            prompts = PromptTokenizer.load(config)
            rt.ready()
            while not rt.stopping.is_set():
                message = inbox.recv(POLL_INTERVAL_S)
                if isinstance(message, (GenerateRequest, TokenizeQuery, DetokenizeQuery)):
                    _handle(message, prompts, to_scheduler, to_api)
                elif isinstance(message, (AbortRequest, AdapterUpdate)):  # in order with the requests
                    to_scheduler.send(message)
            return 0
    finally:
        ring.close()


def _handle(
    message: GenerateRequest | TokenizeQuery | DetokenizeQuery,
    prompts: PromptTokenizer,
    to_scheduler: Sender[SchedulerInbox],
    to_api: Sender[ApiInbox],
) -> None:
    """A request to the scheduler, a query answered to the api, or its refusal to the api."""
    try:
        if isinstance(message, GenerateRequest):
            to_scheduler.send(prompts.tokenize(message))
        else:
            to_api.send(_answer(prompts, message))
    except Refusal as exc:
        to_api.send(RequestRejected(rid=message.rid, status=exc.status, message=exc.message, param=exc.param))
    except Exception as exc:  # one odd request must not take the process down
        log.exception("tokenizing %s failed", message.rid)
        to_api.send(RequestRejected(rid=message.rid, status=500, message=f"tokenizer error: {exc}"))


def _answer(prompts: PromptTokenizer, query: TokenizeQuery | DetokenizeQuery) -> TokenizeAnswer | DetokenizeAnswer:
    if isinstance(query, DetokenizeQuery):
        return DetokenizeAnswer(rid=query.rid, text=prompts.detokenize(query.token_ids))
    ids = prompts.inspect_ids(
        query.request,
        add_special_tokens=query.add_special_tokens,
        add_generation_prompt=query.add_generation_prompt,
        continue_final_message=query.continue_final_message,
    )
    return TokenizeAnswer(
        rid=query.rid, token_ids=ids, token_strs=prompts.token_strs(ids) if query.return_token_strs else None
    )
