"""A Locust user that streams chat completions and reports TTFT and ITL as their own entries.

    locust -f loadtests/locustfile.py --host http://127.0.0.1:8000

Besides the request itself ("chat stream", timed to the end of the stream), every request fires a
"TTFT" entry (send to first token chunk) and one "ITL" entry per gap between token chunks, so
Locust's tables and charts show their percentiles. Settings (environment variables):
BATCHSERVE_LOCUST_MODEL (default: the default model alias), BATCHSERVE_LOCUST_MAX_TOKENS (64),
BATCHSERVE_LOCUST_PROMPT_WORDS (32), BATCHSERVE_LOCUST_WAIT_S (0: the next request right away),
BATCHSERVE_LOCUST_MAX_REQUESTS (0: no limit; else the run stops once this many streams have ended).
"""

from __future__ import annotations

import os
import random
import time

from locust import HttpUser, constant, events, task

from batchserve.loadtests.sse import StreamReader
from batchserve.loadtests.workload import WORDS
from batchserve.shared.config import DEFAULT_MODEL

MODEL = os.environ.get("BATCHSERVE_LOCUST_MODEL", DEFAULT_MODEL)
MAX_TOKENS = int(os.environ.get("BATCHSERVE_LOCUST_MAX_TOKENS", "64"))
PROMPT_WORDS = int(os.environ.get("BATCHSERVE_LOCUST_PROMPT_WORDS", "32"))
WAIT_S = float(os.environ.get("BATCHSERVE_LOCUST_WAIT_S", "0"))
MAX_REQUESTS = int(os.environ.get("BATCHSERVE_LOCUST_MAX_REQUESTS", "0"))
STREAM_NAME = "chat stream"


def _report(name: str, seconds: float) -> None:
    events.request.fire(
        request_type="SSE", name=name, response_time=seconds * 1000.0, response_length=0, exception=None, context={}
    )


class StreamingChatUser(HttpUser):
    wait_time = constant(WAIT_S)
    finished_requests = 0  # shared by all users of this process

    @task
    def stream_chat(self) -> None:
        try:
            self._stream_once()
        finally:
            StreamingChatUser.finished_requests += 1
            if MAX_REQUESTS and StreamingChatUser.finished_requests >= MAX_REQUESTS and self.environment.runner:
                self.environment.runner.quit()

    def _stream_once(self) -> None:
        prompt = " ".join(random.choice(WORDS) for _ in range(PROMPT_WORDS))
        payload = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        start = time.perf_counter()
        reader = StreamReader()
        with self.client.post(
            "/v1/chat/completions", json=payload, stream=True, catch_response=True, name=STREAM_NAME
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            size = 0
            for raw in resp.iter_lines():
                size += len(raw)
                if not reader.feed(raw):
                    break
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000.0  # the whole stream
            resp.request_meta["response_length"] = size
            if failure := reader.failure():
                resp.failure(failure)
                return
            resp.success()
        chunk_times = reader.chunk_times
        _report("TTFT", chunk_times[0] - start)
        for a, b in zip(chunk_times, chunk_times[1:]):
            _report("ITL", b - a)
