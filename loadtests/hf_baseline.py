"""The static-batching baseline: `transformers` `generate` in-process, measured like a server.

Requests queue as they arrive. Whenever the generator is idle it takes whatever has arrived, up
to `batch_size`, pads the prompts on the left and runs one `generate` call for the whole batch
until its longest request is done; nothing joins a running batch. A streamer hook timestamps
every decoding step and passes each request's new token through the servers' incremental
detokenizer, so a request's chunks are what a streaming client of a static-batching server would
see: TTFT is when its batch's first token is ready, and its ITLs are the step gaps between chunks
with text (a token that ends inside a UTF-8 character has none: its text goes out with the next
one's, as on the servers, whose ITLs are measured the same way). Requests use `min_new_tokens =
max_new_tokens` (EOS ignored), so output lengths are as asked, as with `ignore_eos` on the servers.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchserve.loadtests.client import Endpoint, RequestResult
from batchserve.loadtests.workload import RequestSpec
from batchserve.procs.detokenizer.incremental import IncrementalDetokenizer
from batchserve.shared.gguf_convert import transformers_source


@dataclass
class _Pending:
    spec: RequestSpec
    result: RequestResult
    done: asyncio.Future
    loop: asyncio.AbstractEventLoop
    finished: bool = False

    def finish(self) -> None:
        """Wake the waiting `send` (once; called from the generator thread)."""
        if not self.finished:
            self.finished = True
            self.loop.call_soon_threadsafe(lambda: self.done.done() or self.done.set_result(None))


class _StepTimer:
    """A `generate` streamer that records, per request, when each decoding step gave it a token, and its text."""

    def __init__(self, batch: list[_Pending], tokenizer: Any, prompts: list[list[int]]):
        self.batch = batch
        self.detokenizers = [IncrementalDetokenizer(tokenizer, prompt_ids=ids) for ids in prompts]
        self.step = 0
        self.prompt_seen = False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate first hands the streamer the prompt ids
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.step += 1
        for p, detokenizer, token in zip(self.batch, self.detokenizers, value.reshape(-1).tolist()):
            if self.step > p.spec.output_len:
                continue
            p.result.output_tokens = self.step
            text = detokenizer.add([token]).text
            if self.step == p.spec.output_len:
                text += detokenizer.finish()
            p.result.text += text
            p.result.chunk_times.append(now)  # a chunk per token, as a streaming server sends them
            if self.step == p.spec.output_len:
                p.result.end_time = now
                p.result.success = True
                p.finish()  # a streaming static server would end this response here

    def end(self) -> None:
        pass


def resolve_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class TransformersStaticBatcher:
    """`async send(spec) -> RequestResult`, backed by a generator thread doing static batching."""

    def __init__(self, model_dir: Path, batch_size: int, endpoint: Endpoint, device: str = "auto"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {batch_size}")
        self.batch_size, self.endpoint = batch_size, endpoint
        self.device = resolve_device(device)
        dtype = torch.bfloat16 if self.device.startswith("cuda") else torch.float32  # as the server's dtype=auto
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        source, kwargs = transformers_source(Path(model_dir))
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs).to(self.device).eval()
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._serve, name="hf-static-batcher", daemon=True)
        self._thread.start()

    async def send(self, spec: RequestSpec) -> RequestResult:
        loop = asyncio.get_running_loop()
        pending = _Pending(spec, RequestResult(send_time=time.perf_counter()), loop.create_future(), loop)
        self._queue.put(pending)
        await pending.done
        return pending.result

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            while len(batch) < self.batch_size:  # whatever has arrived, up to the batch size
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
            self._run_batch(batch)

    def _prompts(self, batch: list[_Pending]) -> Any:
        texts = [p.spec.prompt for p in batch]
        if self.endpoint == "chat":
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
            return self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return self.tokenizer(texts, return_tensors="pt", padding=True)

    def _run_batch(self, batch: list[_Pending]) -> None:
        import torch

        try:
            enc = self._prompts(batch).to(self.device)
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(enc["input_ids"], enc["attention_mask"])]
            for p, ids in zip(batch, prompts):
                p.result.prompt_tokens = len(ids)
            longest = max(p.spec.output_len for p in batch)
            with torch.inference_mode():
                self.model.generate(
                    **enc,
                    max_new_tokens=longest,
                    min_new_tokens=longest,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                    streamer=_StepTimer(batch, self.tokenizer, prompts),
                )
        except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, not the benchmark
            for p in batch:
                if not p.result.success:
                    p.result.error = f"{type(exc).__name__}: {exc}"
                    p.result.end_time = time.perf_counter()
        for p in batch:
            if not p.result.success and not p.result.error:
                p.result.error = f"generate stopped after {p.result.output_tokens} of {p.spec.output_len} tokens"
                p.result.end_time = time.perf_counter()
            p.finish()
