"""The tokenizer process: `GenerateRequest` -> `TokenizedRequest` (prompt ids in shared memory), and
the api's `/tokenize` and `/detokenize` queries (answered to the api, in turn with the requests).

Aborts are forwarded on the same socket as requests, so an abort never overtakes its request.
Rejections (empty prompt, too long for the context) go straight back to the api.
"""

from __future__ import annotations

import logging

from procs.runtime import POLL_INTERVAL_S, ProcessRuntime
from procs.tokenizer.prompts import PromptTokenizer
from shared.config import ServerConfig
from shared.errors import Refusal
from shared.ipc import ApiInbox, Receiver, SchedulerInbox, Sender, TokenizerInbox
from shared.messages import (AbortRequest, DetokenizeAnswer, DetokenizeQuery, GenerateRequest, RequestRejected,
                             TokenizeAnswer, TokenizeQuery)
from shared.shm import SharedRing

log = logging.getLogger("batchserve.tokenizer")


def run(config: ServerConfig) -> int:
    rt = ProcessRuntime("tokenizer", config)
    rt.install_signal_handlers()
    rt.start_heartbeat()
    ring = SharedRing("prompts")
    inbox: Receiver[TokenizerInbox] = Receiver(rt.ctx, rt.endpoints.tokenizer, TokenizerInbox)
    to_scheduler: Sender[SchedulerInbox] = Sender(rt.ctx, rt.endpoints.scheduler, writer=ring)
    to_api: Sender[ApiInbox] = Sender(rt.ctx, rt.endpoints.api)
    try:
        prompts = PromptTokenizer.load(config)
        rt.ready()
        while not rt.stopping.is_set():
            message = inbox.recv(POLL_INTERVAL_S)
            if isinstance(message, (GenerateRequest, TokenizeQuery, DetokenizeQuery)):
                try:
                    if isinstance(message, GenerateRequest):
                        to_scheduler.send(prompts.tokenize(message))
                    else:
                        to_api.send(_answer(prompts, message))
                except Refusal as exc:
                    to_api.send(RequestRejected(rid=message.rid, status=exc.status, message=exc.message,
                                                param=exc.param))
                except Exception as exc:  # one odd request must not take the process down
                    log.exception("tokenizing %s failed", message.rid)
                    to_api.send(RequestRejected(rid=message.rid, status=500, message=f"tokenizer error: {exc}"))
            elif isinstance(message, AbortRequest):
                to_scheduler.send(message)
        return 0
    finally:
        rt.close()
        ring.close()


def _answer(prompts: PromptTokenizer, query: TokenizeQuery | DetokenizeQuery) -> TokenizeAnswer | DetokenizeAnswer:
    if isinstance(query, DetokenizeQuery):
        return DetokenizeAnswer(rid=query.rid, text=prompts.detokenize(query.token_ids))
    ids = prompts.inspect_ids(query.request, add_special_tokens=query.add_special_tokens,
                              add_generation_prompt=query.add_generation_prompt,
                              continue_final_message=query.continue_final_message)
    return TokenizeAnswer(rid=query.rid, token_ids=ids,
                          token_strs=prompts.token_strs(ids) if query.return_token_strs else None)
