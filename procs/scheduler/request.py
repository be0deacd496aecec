"""One request as the scheduler sees it (token-level state lives in the request table's row)."""

from __future__ import annotations

import numpy as np

from shared.messages import SamplingParams, StopParams


class Request:
    __slots__ = ("rid", "prompt", "prompt_len", "sampling", "stop", "max_tokens", "stop_ids", "slot", "prefilled")

    def __init__(self, rid: str, prompt: np.ndarray, sampling: SamplingParams, stop: StopParams) -> None:
        self.rid = rid
        self.prompt = prompt  # int32 [prompt_len]
        self.prompt_len = int(prompt.shape[0])
        self.sampling = sampling
        self.stop = stop
        self.max_tokens = stop.max_tokens
        self.stop_ids = frozenset(stop.stop_token_ids)
        self.slot = -1  # request-table row once admitted
        self.prefilled = 0  # prompt tokens whose KV has been computed

    def __repr__(self) -> str:
        return f"Request({self.rid!r}, prompt_len={self.prompt_len}, slot={self.slot}, prefilled={self.prefilled})"
