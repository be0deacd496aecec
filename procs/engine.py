"""`OfflineEngine`: the scheduler core and the worker core in one process, without sockets.

The same `Scheduler` the server's scheduler process runs plans every step, and the `ModelRunner`
the worker process runs executes it directly (it *is* the executor). Prompts are tokenized and
checked by the tokenizer process's `PromptTokenizer`, text comes from the detokenizer's
`IncrementalDetokenizer`, so offline output is what the server would stream.

With `tensor_parallel_size` > 1 the engine is worker rank 0 (in this process) and starts this
machine's other ranks itself (`FollowerRanks`: "spawn" processes that load their share of the model
and follow rank 0's steps); ranks on other machines (`nnodes` > 1) start with `batchserve proc worker
--local-rank I` as under `serve`. `close()` (or leaving a `with` block) stops and reaps them. Rank 0
joins the group once each follower has reached it, so one that dies on the way fails the start at
once; a rank that dies or hangs later fails rank 0's next collective (at once, or after
`step_timeout_s`): `generate` raises `RankFailure` naming it instead of waiting. While `generate` is
not running, a thread sends rank 0's idle ticks, so the followers' waits (bounded by `step_timeout_s`)
do not expire between calls.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from batchserve.procs.detokenizer.incremental import IncrementalDetokenizer
from batchserve.procs.scheduler.config import check_config, scheduler_config_from_server
from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.executor import Executor
from batchserve.procs.scheduler.lora.adapter_updates import AdapterHoldingExecutor, WorkerAdapters
from batchserve.procs.scheduler.step_cost import cost_model_for
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import GenerateRequest, RequestParams, TokenizedRequest, TokenLogprobs
from batchserve.shared.parallel import RankLayout, with_init_addr

if TYPE_CHECKING:
    from batchserve.procs.worker.model_runner import ModelRunner

FOLLOWER_EXIT_S = 10.0  # how long close() waits for a follower to leave after rank 0's stop
FAILURE_WAIT_S = 1.0  # how long a failed collective waits to see which follower exited
IDLE_CHECK_S = 0.25  # how often the idle thread looks whether a tick is due (RankSteps sends one a second)
JOIN_POLL_S = 0.1  # how often rank 0 looks whether its followers reached the group, or exited


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
    pooled: bytes = b""  # a pooling request's vector (float32 bytes, `TokenDelta.pooled`); no tokens then


@dataclass
class _Generating:
    """A request still generating: its completion so far and its detokenizer."""

    completion: Completion
    detokenizer: IncrementalDetokenizer


class RankFailure(RuntimeError):
    """A tensor-parallel worker rank died or hung: the engine cannot run steps any more."""


class FollowerRanks:
    """This machine's worker ranks after the first (local ranks 1..N-1), for a rank 0 running in this
    process: each a "spawn" process (a fresh interpreter: CUDA and torch's threads do not survive a fork)
    that builds its `ModelRunner`, follows rank 0's steps until its stop, then leaves the group. Daemonic:
    they end with this process too. Rank 0 builds its own runner once they are joining (`wait_joining`):
    construction is collective."""

    def __init__(self, config: ServerConfig, local_world_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.first_rank = config.node_rank * local_world_size
        self.joining = [context.Event() for _ in range(1, local_world_size)]  # set as each starts to join
        self.processes = [
            context.Process(
                target=follow_rank, args=(config, i, joining), name=f"batchserve-worker-rank-{i}", daemon=True
            )
            for i, joining in enumerate(self.joining, 1)
        ]
        for process in self.processes:
            process.start()

    def wait_joining(self, timeout: float) -> None:
        """Return once every follower is joining the group; `RankFailure` naming those that exited
        first, or that are not there within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not all(event.is_set() for event in self.joining):
            failures = self.failures()
            if failures:
                raise RankFailure(f"the worker ranks did not start: {'; '.join(failures)}")
            if time.monotonic() > deadline:
                late = [
                    f"worker rank {self.first_rank + i} (pid {p.pid})"
                    for i, (p, event) in enumerate(zip(self.processes, self.joining), 1)
                    if not event.is_set()
                ]
                raise RankFailure(
                    f"the worker ranks did not start: {', '.join(late)} did not reach the group "
                    f"within dist_timeout_s {timeout:g} s"
                )
            waiting = next((event for event in self.joining if not event.is_set()), None)  # None: set just now
            if waiting is not None:
                waiting.wait(JOIN_POLL_S)

    def failures(self, wait_s: float = 0.0) -> list[str]:
        """A line per follower that has exited (each exits only after rank 0's stop, or failing), after
        waiting up to `wait_s` for one to (a broken connection is seen before its process is reaped)."""
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        return [
            f"worker rank {self.first_rank + i} (pid {p.pid}) exited with status {p.exitcode}"
            for i, p in enumerate(self.processes, 1)
            if p.exitcode is not None
        ]

    def close(self, timeout: float = FOLLOWER_EXIT_S) -> None:
        """Wait up to `timeout` for the followers to exit (after rank 0's stop, or its group's end), then
        end stragglers."""
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():  # hung, or stopped (SIGSTOP): SIGKILL ends both
                process.kill()
                process.join()


def follow_rank(config: ServerConfig, local_rank: int, joining: Any = None) -> None:
    """A follower rank's whole life (the target of `FollowerRanks`' processes); `joining`: an Event it
    sets as it starts to join the group. Its errors are one line on stderr: rank 0 reports them too."""
    from batchserve.procs.worker.model_runner import ModelRunner
    from batchserve.procs.worker.parallel import TensorParallelError

    try:
        runner = ModelRunner.from_config(config, local_rank, None if joining is None else joining.set)
    except ValueError as exc:  # a refusal (the model does not split): rank 0 raises the same
        print(f"worker rank {local_rank}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except TensorParallelError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(1) from None
    try:
        runner.follow()
    except RuntimeError as exc:  # rank 0 is gone or hung (a collective failed): it says so itself
        print(f"worker rank {local_rank}: stopped following rank 0 ({type(exc).__name__}: {exc})", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        runner.close()


class OfflineEngine:
    """Loads the model once; `generate()` runs a list of requests to completion as one workload.
    With tensor parallelism it holds processes: `close()` it, or use it as a context manager."""

    def __init__(self, config: ServerConfig) -> None:
        import torch

        from batchserve.procs.worker.devices import resolve_device
        from batchserve.procs.worker.model_runner import ModelRunner
        from batchserve.procs.worker.parallel import TensorParallelError, check_local_devices, rank_device

        check_config(config)  # unworkable settings: one line now, not after loading the model
        config = with_init_addr(config)  # a free loopback port where all ranks are local
        layout = RankLayout.of(config, 0)  # checks the layout before anything starts
        if layout.rank != 0:
            raise ValueError(
                f"node_rank must be 0 for the offline engine (it runs global rank 0), got "
                f"{config.node_rank}; start other machines' ranks with `batchserve proc worker`"
            )
        # A follower refuses these too, but then rank 0 would see only its exit: refuse here, first.
        check_local_devices(rank_device(resolve_device(config.device), layout), layout)
        self.config = config
        self._threads = torch.get_num_threads()  # joining a group sets this process's share of the cores
        self._failure: RankFailure | None = None
        # One thread at a time talks to the ranks: `generate`'s steps, or the idle thread's ticks.
        self._ranks_lock = threading.Lock()
        self._closed = threading.Event()
        self._idle_thread: threading.Thread | None = None
        self.followers = FollowerRanks(config, layout.local_world_size) if layout.local_world_size > 1 else None
        try:
            if self.followers is not None:
                self.followers.wait_joining(config.dist_timeout_s)
            self.runner = ModelRunner.from_config(config)
        except BaseException as exc:
            refusal = isinstance(exc, ValueError)  # every rank refuses alike, naming the setting, and exits
            failures = self._close_followers(FOLLOWER_EXIT_S if refusal else FAILURE_WAIT_S)
            if isinstance(exc, RankFailure):
                raise
            if isinstance(exc, TensorParallelError) or failures and not refusal:
                who = f"{'; '.join(failures)} " if failures else ""
                raise RankFailure(f"the worker ranks did not start: {who}({exc})") from exc
            raise
        if self.runner.tp.world_size > 1:  # from here on the followers wait for ticks (step_timeout_s)
            self._idle_thread = threading.Thread(
                target=self._tick_while_idle, name="batchserve-rank-ticks", daemon=True
            )
            self._idle_thread.start()
        try:
            self.spec = self.runner.spec
            self.tokenizer: Any = self.spec.load_tokenizer()
            self.prompts = PromptTokenizer.of(self.spec, self.tokenizer)
            self.scheduler = self._scheduler(config)
            # with LoRA, each step's adapter loads and unloads (--max-cpu-loras), as the scheduler process decides them
            self.executor: Executor = (
                AdapterHoldingExecutor(self.runner, WorkerAdapters(config), lambda: self.scheduler.requests.values())
                if config.enable_lora
                else self.runner
            )
        except BaseException:
            self.close()
            raise
        self.preemptions = 0  # requests preempted for KV (and recomputed) so far
        self.draft_tokens = 0  # speculative decoding so far: tokens proposed, and those accepted
        self.accepted_tokens = 0

    def _scheduler(self, config: ServerConfig) -> Scheduler:
        """The server's scheduler but for the server's client-facing limits: offline every prompt is in at
        once and only throughput counts, so no step-time bound and no waiting limit. With speculative
        decoding, the worker's probe gives the step-cost model that says which drafts pay, as in `serve`
        (without the server's refits on live steps)."""
        from batchserve.procs.worker.step_probe import probe_step_costs

        speculative = config.speculative != "off"
        info = self.runner.worker_info(probe_step_costs(self.runner) if speculative else None)
        sched_config = msgspec.structs.replace(
            scheduler_config_from_server(config, info), max_step_s=0.0, max_waiting=0
        )
        return Scheduler(sched_config, eos_token_ids=self.runner.eos_token_ids, cost=cost_model_for(sched_config, info))

    def __enter__(self) -> OfflineEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the other ranks (rank 0's stop), reap this machine's followers, leave the group."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._ranks_lock:
            self.runner.close()
        if self._idle_thread is not None:
            self._idle_thread.join()
        self._close_followers()

    @contextmanager
    def direct_runner(self) -> Iterator[ModelRunner]:
        """Rank 0's runner to drive steps on directly (benchmarks, tests), the idle ticks held off meanwhile.
        Its steps write the KV pages they name: pages the scheduler's prefix cache holds, unless it holds
        none (no `generate` yet, or disable_prefix_cache)."""
        with self._ranks_lock:
            if self._closed.is_set():
                raise RuntimeError("the engine is closed")
            if self._failure is not None:
                raise self._failure
            yield self.runner

    def _close_followers(self, wait_s: float | None = None) -> list[str]:
        """Reap the followers (if any), waiting up to `wait_s` for them to leave; what
        `FollowerRanks.failures` said before, and restore this process's torch threads."""
        import torch

        if self.followers is None:
            return []
        failures = self.followers.failures()
        if wait_s is None:  # after a failure the live followers are hung or leaving, else leaving after the stop
            wait_s = FAILURE_WAIT_S if self._failure is not None else FOLLOWER_EXIT_S
        self.followers.close(wait_s)
        torch.set_num_threads(self._threads)
        return failures

    def _tick_while_idle(self) -> None:
        while not self._closed.wait(IDLE_CHECK_S):
            with self._ranks_lock:
                if self._closed.is_set() or self._failure is not None:
                    return
                try:
                    self.runner.rank_steps.tick()
                except RuntimeError as exc:  # the broadcast failed: a rank is gone or hung
                    self._failure = self._rank_failure(exc)
                    return

    def _rank_failure(self, exc: BaseException) -> RankFailure:
        """What broke the group: a follower that exited, a collective that timed out, or rank 0's own step
        (its OOM, say), after which the followers are left inside the step."""
        import torch

        from batchserve.procs.worker.parallel import CollectiveError

        collective = isinstance(exc, (CollectiveError, torch.distributed.DistError))
        # A broken connection is seen before the follower's process is reaped: give it a moment.
        wait_s = FAILURE_WAIT_S if collective else 0.0
        failures = self.followers.failures(wait_s) if self.followers is not None else []
        if failures:
            who = "; ".join(failures)
        elif collective:
            who = (
                f"no rank of this machine exited: a rank hung past step_timeout_s "
                f"{self.config.step_timeout_s:g} s, or another machine's rank failed"
            )
        else:
            who = "rank 0's step failed"
        return RankFailure(f"tensor-parallel worker ranks failed: {who} ({type(exc).__name__}: {exc})")

    def tokenize(self, request: GenerateRequest) -> TokenizedRequest:
        """Tokenize and length-check one request (raises `Refusal` naming the field)."""
        return self.prompts.tokenize(request)

    def generate(self, requests: list[GenerateRequest]) -> list[Completion]:
        """Run every request through the scheduler; completions in the order of `requests`."""
        tokenized = [self.tokenize(r) for r in requests]  # reject bad input before anything runs
        with self._ranks_lock:  # the idle thread's ticks wait meanwhile
            if self._closed.is_set():
                raise RuntimeError("the engine is closed")
            if self._failure is not None:
                raise self._failure
            live: dict[str, _Generating] = {}
            for request in tokenized:
                ids = [int(t) for t in request.prompt_ids]
                try:
                    self.scheduler.add_request(request.rid, request.prompt_ids, request.params)
                except BaseException:  # a refusal (Refusal names the field): this call runs none of them
                    for rid in live:
                        self.scheduler.abort(rid)
                    raise
                live[request.rid] = _Generating(
                    Completion(request.rid, ids),
                    IncrementalDetokenizer(
                        self.tokenizer,
                        prompt_ids=ids,
                        stop=request.params.stop,
                        skip_special_tokens=request.params.stop.skip_special_tokens,
                    ),
                )
            done = [live[r.rid].completion for r in tokenized]
            self._run(live)
        return done

    def _run(self, live: dict[str, _Generating]) -> None:
        while self.scheduler.has_unfinished():
            try:
                out = self.scheduler.step(self.executor)
            except RuntimeError as exc:
                if self.runner.tp.world_size == 1:
                    raise
                # The group is broken (or the followers are stuck in the step rank 0 left): every later call fails too.
                self._failure = self._rank_failure(exc)
                raise self._failure from exc
            self.preemptions += len(out.preempted)
            self.draft_tokens += out.draft_tokens
            self.accepted_tokens += out.accepted_tokens
            new: dict[str, list[int]] = {}
            for rid, vector in out.pooled.items():  # the pooling runner: a vector in place of its token
                live[rid].completion.pooled = vector
            for rid, token in out.new_tokens:
                if rid not in out.pooled:
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

    @staticmethod
    def _finish(state: _Generating, reason: str) -> None:
        state.completion.text += state.detokenizer.finish()
        state.completion.finish_reason = "stop" if state.detokenizer.stopped else reason


def request(
    rid: str, *, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **fields: Any
) -> GenerateRequest:
    """Build a `GenerateRequest` from plain values (for the CLI and tests); `fields`: any field of its
    `RequestParams` (sampling, stop, logits, constraint, priority, ...) or of its own (tools, ...)."""
    params = {name: fields.pop(name) for name in list(fields) if name in RequestParams.__struct_fields__}
    return msgspec.convert(
        {"rid": rid, "prompt": prompt, "messages": messages, "params": params, **fields}, GenerateRequest, strict=False
    )
