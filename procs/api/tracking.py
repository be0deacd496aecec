"""Per-request timing at the api: feeds the latency metrics and writes the request log line.

One line per request on logger `batchserve.requests` when it ends, with fields
rid, endpoint, stream, status, finish_reason, prompt_tokens, completion_tokens, ttft_s, latency_s
(and error for a refused request). Format (text key=value or JSON) is `shared.logs.setup_logging`'s.
"""

from __future__ import annotations

import logging
import time

from batchserve.procs.api.metrics import ApiMetrics
from batchserve.shared.logs import log_event
from batchserve.shared.messages import TextDelta, Usage

request_logger = logging.getLogger("batchserve.requests")


class RequestTracker:
    def __init__(self, rid: str, endpoint: str, stream: bool, metrics: ApiMetrics) -> None:
        self.rid = rid
        self.endpoint = endpoint
        self.stream = stream
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.timed_tokens = 0  # of those, the ones timed (choice 0's)
        self.completion_tokens = 0  # tokens delivered so far
        self.ended = False  # finished, gone or refused: recorded once
        self.adapter = ""  # the LoRA adapter it ran ("": the base model), counted apart

    def on_delta(self, delta: TextDelta, *, timed: bool = True) -> None:
        """`timed`: the delta feeds TTFT and inter-token latency (with n choices, only choice 0's do:
        the gaps between different choices' tokens are not inter-token latencies)."""
        if not delta.token_ids:
            return
        self.completion_tokens += len(delta.token_ids)
        self.metrics.tokens_delivered += len(delta.token_ids)
        if not timed:
            return
        self.timed_tokens += len(delta.token_ids)
        now, last = time.monotonic(), self.last_token_at  # None until the first token, as first_token_at
        if last is None:
            self.first_token_at = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - last)
        self.last_token_at = now

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival

    def finished(self, finish_reason: str, usage: Usage) -> None:
        if self.ended:
            return
        latency = time.monotonic() - self.arrival
        self.metrics.e2e.observe(latency)
        self.metrics.prompt_tokens.inc(usage.prompt_tokens)
        self.metrics.generation_tokens.inc(usage.completion_tokens)
        self.metrics.success.labels(finish_reason=finish_reason).inc()
        if self.adapter:
            self.metrics.lora.requests.labels(adapter=self.adapter).inc()
            self.metrics.lora.tokens.labels(adapter=self.adapter).inc(usage.completion_tokens)
        first, last = self.first_token_at, self.last_token_at  # both set at the first token
        if self.metrics.slo is not None and first is not None and last is not None:
            # TPOT as vLLM's benchmark has it: the time after the first token, per later token
            later = self.timed_tokens - 1
            tpot = (last - first) / later if later > 0 else None
            self.metrics.slo.observe(first - self.arrival, tpot, latency)
        self._log(200, finish_reason, usage.prompt_tokens, usage.completion_tokens, latency)

    def client_gone(self) -> None:
        """The client disconnected (or the stream broke) before the end: counted as an abort."""
        if self.ended:
            return
        self.metrics.generation_tokens.inc(self.completion_tokens)
        self.metrics.success.labels(finish_reason="abort").inc()
        self._log(499, "abort", None, self.completion_tokens, time.monotonic() - self.arrival)

    def refused(self, status: int, message: str) -> None:
        if self.ended:
            return
        self.metrics.rejected.labels(status=str(status)).inc()
        self._log(status, None, None, self.completion_tokens, time.monotonic() - self.arrival, error=message)

    def _log(
        self,
        status: int,
        finish_reason: str | None,
        prompt_tokens: int | None,
        completion_tokens: int,
        latency: float,
        error: str | None = None,
    ) -> None:
        self.ended = True
        fields = {
            "rid": self.rid,
            "endpoint": self.endpoint,
            "stream": self.stream,
            "status": status,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 6),
            "latency_s": round(latency, 6),
        }
        if error is not None:
            fields["error"] = error
        log_event(request_logger, "request", logging.INFO, **fields)
