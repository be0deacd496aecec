"""`OfflineEngine`: the scheduler core and the worker core in one process, without sockets.

The same `Scheduler` the server's scheduler process runs plans every step, and the `ModelRunner`
the worker process runs executes it directly (it *is* the executor). Prompts are tokenized and
checked by the tokenizer process's `PromptTokenizer`, text comes from the detokenizer's
`IncrementalDetokenizer`, so offline output is what the server would stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from procs.detokenizer.incremental import IncrementalDetokenizer
from procs.scheduler.core import Scheduler
from procs.scheduler.config import scheduler_config_from_server
from procs.tokenizer.prompts import PromptTokenizer
from shared.config import ServerConfig
from shared.messages import GenerateRequest, TokenizedRequest, TokenLogprobs


@dataclass
class Completion:
    """One finished request: the generated ids (stop token included), its text and why it ended."""

    rid: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., when asked for


@dataclass
class _Generating:
    """A request still generating: its completion so far and its detokenizer."""

    completion: Completion
    detokenizer: IncrementalDetokenizer


class OfflineEngine:
    """Loads the model once; `generate()` runs a list of requests to completion as one workload."""

    def __init__(self, config: ServerConfig) -> None:
        from procs.worker.model_runner import ModelRunner

        self.config = config
        self.runner = ModelRunner.from_config(config)
        self.spec = self.runner.spec
        self.tokenizer: Any = self.spec.load_tokenizer()
        self.prompts = PromptTokenizer.of(self.spec, self.tokenizer)
        self.scheduler = Scheduler(scheduler_config_from_server(config, self.runner.worker_info()),
                                   eos_token_ids=self.runner.eos_token_ids)
        self.preemptions = 0  # requests preempted for KV (and recomputed) so far

    def tokenize(self, request: GenerateRequest) -> TokenizedRequest:
        """Tokenize and length-check one request (raises `Refusal` naming the field)."""
        return self.prompts.tokenize(request)

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        """Run every request through the scheduler; completions in the order of `requests`."""
        tokenized = [self.tokenize(r) for r in requests]  # reject bad input before anything runs
        live: dict[str, _Generating] = {}
        for request in tokenized:
            ids = [int(t) for t in request.prompt_ids]
            self.scheduler.add_request(request.rid, request.prompt_ids, request.sampling, request.stop,
                                       request.logits)
            live[request.rid] = _Generating(Completion(request.rid, ids), IncrementalDetokenizer(
                self.tokenizer, prompt_ids=ids, stop=request.stop.stop))
        done = [live[r.rid].completion for r in tokenized]
        while self.scheduler.has_unfinished():
            out = self.scheduler.step(self.runner)
            self.preemptions += len(out.preempted)
            new: dict[str, list[int]] = {}
            for rid, token in out.new_tokens:
                new.setdefault(rid, []).append(int(token))
            for rid, ids in new.items():
                state = live[rid]
                state.completion.token_ids.extend(ids)
                state.completion.logprobs.extend(out.logprobs.get(rid, ()))
                state.completion.prompt_logprobs.extend(out.prompt_logprobs.get(rid, ()))
                piece = state.detokenizer.add(ids)
                state.completion.text += piece.text
                if piece.stopped and rid not in out.finished:
                    # A stop string ended the text: stop generating now, as the server does.
                    self.scheduler.abort(rid)
                    self._finish(live.pop(rid), "stop")
            for rid in out.finished:
                if rid in live:
                    self._finish(live.pop(rid), out.finish_reasons[rid])
        return done

    @staticmethod
    def _finish(state: _Generating, reason: str) -> None:
        state.completion.text += state.detokenizer.finish()
        state.completion.finish_reason = "stop" if state.detokenizer.stopped else reason


def request(rid: str, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None,
            sampling: dict[str, Any] | None = None, stop: dict[str, Any] | None = None,
            logits: dict[str, Any] | None = None, **fields: Any) -> GenerateRequest:
    """Build a `GenerateRequest` from plain values (for the CLI and tests); `fields`: any other of its
    fields (constraint, tools, tool_choice, ...) as plain values too."""
    return msgspec.convert({"rid": rid, "prompt": prompt, "messages": messages, "sampling": sampling or {},
                            "stop": stop or {}, "logits": logits or {}, **fields}, GenerateRequest, strict=False)
