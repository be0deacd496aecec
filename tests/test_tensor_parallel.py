"""Tensor parallelism on the CPU (gloo, 2 ranks) through the `OfflineEngine`: rank 0 in this process,
rank 1 a spawned process. Greedy tokens of TP=2 equal TP=1's and transformers' on tiny Llama, Qwen2 and
Qwen3 models (KV heads fewer than the ranks, tied embeddings, a vocabulary that does not divide by 2)
and mixtures of experts (experts split by their intermediate dimension, or whole experts per rank with
expert parallelism, EP=2); every logit of a prefill, a mixed and a decode step within 1e-4 of TP=1's;
seeded sampling gives TP=1's tokens; models and layouts that cannot be split are refused naming the
setting, as are more CUDA ranks than devices; the ranks agree on their attention backend and decode
padding; a follower that dies (before joining, or later) or hangs fails the engine with `RankFailure`
instead of a wait, and rank 0's own step error is not called a hang; `batchserve generate --tp 2` prints
TP=1's tokens.

torch.distributed holds one default group per process, so at most one TP=2 engine lives at a time
(`OneGroup`); each is built once per model and shared by the tests (a spawn costs seconds)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from model_batches import _plan, _Request, step_rows
from test_model_equivalence import transformers_greedy_text

from batchserve.procs.engine import FollowerRanks, OfflineEngine, RankFailure, request
from batchserve.procs.worker.model_runner import ModelRunner
from batchserve.procs.worker.parallel import check_local_devices, join, rank_device
from batchserve.shared.commands import cli_command
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import ForwardBatch
from batchserve.shared.parallel import RankLayout, check_parallel_config, with_init_addr

REPO = Path(__file__).resolve().parents[1]
# 4, 1, 13 and 12 tokens of the byte-level tokenizer (the word-level one does not load as Qwen2's)
PROMPTS = ["the quick brown fox", "Ada", '{"name": "Ada", "age": 36}', "jumps over the lazy dog <tool_call>"]
NEW_TOKENS = 12
MODELS = {
    # 1 KV head for 2 ranks: replicated; 321 rows: the last vocabulary shard is padded
    "llama-kv1-vocab321": dict(arch="llama", num_key_value_heads=1, vocab_size=321),
    "qwen2-tied": dict(arch="qwen2", tie_word_embeddings=True),  # biases on q/k/v; the LM head is the embedding
    "qwen3": dict(arch="qwen3"),  # q/k norms
    # mixtures of experts: every expert's intermediate split (and the shared expert's), or whole experts per
    # rank (expert parallelism); OLMoE's q/k norms over the whole projection summed over the ranks, its one
    # KV head replicated on both
    "qwen2_moe": dict(arch="qwen2_moe"),
    "olmoe-kv1": dict(arch="olmoe", num_key_value_heads=1, clip_qkv=1.5),
    "mixtral-ep": dict(arch="mixtral"),
    "qwen3_moe-ep-fused": dict(arch="qwen3_moe", fused_experts=True, norm_topk_prob=True),
    "qwen3_5-hybrid": dict(arch="qwen3_5"),  # linear layers split by key heads, each rank its heads' states
    "qwen3_next-hybrid-moe": dict(arch="qwen3_next"),
}
EXPERT_PARALLEL = {"mixtral-ep", "qwen3_moe-ep-fused"}
# The hybrid MoE's float32 rounding is amplified more than a plain decoder's: transformers' own float32 logits
# of such tiny models stand up to 3e-3 from its float64 ones (test_hybrid_models), so two ranks' sums may too.
LOGITS_ATOL = {"qwen3_next-hybrid-moe": 1e-3}
# Small steps and prefill chunks: prompts are chunked and requests join others' decodes mid-stream.
# A short step timeout keeps the hung-rank test short (the tiny model's steps take milliseconds).
ENGINE = dict(
    policy="mixed", prefill_budget=8, max_running_requests=3, page_size=4, kv_capacity_tokens=512, step_timeout_s=5.0
)
STEP_KINDS = ("prefill", "mixed", "decode")


def _config(model_dir: Path, tp: int = 1, **fields) -> ServerConfig:
    return ServerConfig(model=str(model_dir), tensor_parallel_size=tp, **{**ENGINE, **fields})


def _greedy() -> list:
    return [
        request(f"g{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": NEW_TOKENS, "ignore_eos": True})
        for i, p in enumerate(PROMPTS)
    ]


def _sampled() -> list:
    return [
        request(
            f"s{i}",
            prompt=p,
            sampling={"temperature": 0.9, "top_p": 0.95, "seed": 11 + i},
            stop={"max_tokens": NEW_TOKENS, "ignore_eos": True},
        )
        for i, p in enumerate(PROMPTS)
    ]


def step_batches(vocab_size: int, page_size: int) -> list[ForwardBatch]:
    """A packed prefill of two prompts, then a mixed step (their decodes beside a third prompt's
    prefill), then a decode step of all three; decode inputs fixed, so both runners get the same steps."""
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in (11, 5, 9)]
    requests = [_Request(prompts[0], 0), _Request(prompts[1], 0), _Request(prompts[2], 1)]
    free_slots, free_pages = [2, 1, 0], list(range(24, 0, -1))
    batches = []
    for step in range(len(STEP_KINDS)):
        rows = step_rows(requests, step, [len(STEP_KINDS)] * len(requests), free_slots)
        batches.append(_plan(step, rows, page_size, free_pages))
        for r, tokens, _ in rows:
            r.fed += len(tokens)
            r.output.append(int(torch.randint(3, vocab_size, (1,), generator=generator)))
    assert [b.extend_lens for b in batches] == [[11, 5], [1, 1, 9], [1, 1, 1]]  # prefill, mixed, decode
    return batches


def step_logits(runner: ModelRunner, batches: list[ForwardBatch]) -> list[torch.Tensor]:
    """Every token's logits of each step, run as `execute` runs it (rank 0 broadcasts it to the others)."""
    out = []
    with torch.inference_mode():
        for batch in batches:
            rows = np.arange(batch.num_tokens, dtype=np.int64)  # every position, not only the sampled ones
            out.append(runner.step_logits(batch, rows)[-batch.num_tokens :].clone())
    return out


class OneGroup:
    """The one TP=2 engine alive in this process, by model name; asking for another closes it first."""

    def __init__(self) -> None:
        self.name: str | None = None
        self.engine: OfflineEngine | None = None
        self.logits: list[torch.Tensor] = []

    def get(self, name: str, model_dir: Path) -> OfflineEngine:
        if name != self.name:
            self.release()
            self.engine = OfflineEngine(_config(model_dir, tp=2, enable_expert_parallel=name in EXPERT_PARALLEL))
            self.name = name
            # Before any generate: the scheduler's prefix cache holds no page these steps could overwrite.
            with self.engine.direct_runner() as runner:
                self.logits = step_logits(runner, step_batches(runner.vocab_size, runner.page_size))
        assert self.engine is not None
        return self.engine

    def release(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.engine, self.name = None, None


@dataclass
class Case:
    model_dir: Path
    reference: list[list[int]]  # transformers' greedy tokens
    tp1: OfflineEngine


@pytest.fixture(scope="module")
def group():
    one = OneGroup()
    yield one
    one.release()


@pytest.fixture(scope="module")
def cases(tiny_model_dir):
    built: dict[str, Case] = {}

    def get(name: str) -> Case:
        if name not in built:
            model_dir = tiny_model_dir(with_tokenizer="bytes", seed=4, **MODELS[name])
            built[name] = Case(
                model_dir, transformers_greedy_text(model_dir, PROMPTS, NEW_TOKENS), OfflineEngine(_config(model_dir))
            )
        return built[name]

    return get


def _followers_exited(engine: OfflineEngine) -> list[int | None]:
    assert engine.followers is not None
    return [p.exitcode for p in engine.followers.processes]


def _no_followers_left() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("batchserve-worker")]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_equal_tp1_and_transformers(cases, group, name):
    case = cases(name)
    engine = group.get(name, case.model_dir)
    assert engine.runner.tp.world_size == 2 and engine.runner.model.heads.num_heads == 2
    moe = engine.runner.model.layers[0].mlp
    if name in EXPERT_PARALLEL:  # rank 0 holds experts 0-3 whole
        assert (moe.experts.first, moe.experts.count, moe.experts.intermediate) == (0, 4, moe.config.intermediate_size)
    elif hasattr(moe, "experts"):  # every expert, half of each
        assert (moe.experts.count, 2 * moe.experts.intermediate) == (8, moe.config.intermediate_size)
    tp2 = [c.token_ids for c in engine.generate(_greedy())]
    assert tp2 == [c.token_ids for c in case.tp1.generate(_greedy())] == case.reference
    # again: the prompts now come from the prefix cache, on both ranks' pages
    assert [c.token_ids for c in engine.generate(_greedy())] == case.reference


@pytest.mark.parametrize("name", list(MODELS))
def test_step_logits_within_1e4_of_tp1(cases, group, name):
    case = cases(name)
    group.get(name, case.model_dir)
    tp1 = ModelRunner(
        case.model_dir,
        device="cpu",
        page_size=ENGINE["page_size"],
        kv_capacity_tokens=512,
        max_running_requests=ENGINE["max_running_requests"],
    )
    expected = step_logits(tp1, step_batches(tp1.vocab_size, tp1.page_size))
    assert [t.shape for t in group.logits] == [t.shape for t in expected]
    assert group.logits[0].shape[-1] == tp1.vocab_size  # the padded shard's rows are cut off
    for kind, got, want in zip(STEP_KINDS, group.logits, expected):
        assert (got - want).abs().max().item() <= LOGITS_ATOL.get(name, 1e-4), kind


@pytest.mark.parametrize("name", list(MODELS))
def test_seeded_sampling_equals_tp1_and_repeats(cases, group, name):
    case = cases(name)
    engine = group.get(name, case.model_dir)
    first = [c.token_ids for c in engine.generate(_sampled())]
    assert first == [c.token_ids for c in engine.generate(_sampled())]
    assert first == [c.token_ids for c in case.tp1.generate(_sampled())]
    assert all(len(t) == NEW_TOKENS for t in first) and first != case.reference  # it did sample


def test_followers_outlive_an_idle_gap_longer_than_the_step_timeout(cases, group):
    """Between generate calls rank 0's idle ticks keep the followers' waits (step_timeout_s) from expiring."""
    case = cases("qwen3")
    engine = group.get("qwen3", case.model_dir)
    time.sleep(engine.config.step_timeout_s + 1.5)
    assert _followers_exited(engine) == [None]
    assert [c.token_ids for c in engine.generate(_greedy())] == case.reference


def test_a_killed_follower_fails_generate_naming_it(cases, group):
    case = cases("qwen3")
    engine = group.get("qwen3", case.model_dir)
    follower = engine.followers.processes[0]
    os.kill(follower.pid, signal.SIGKILL)
    follower.join(10)
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"worker rank 1 \(pid \d+\) exited with status -9"):
        engine.generate(_greedy())
    assert time.monotonic() - started < engine.config.step_timeout_s  # the broken connection, not a timeout
    with pytest.raises(RankFailure):  # the group stays broken
        engine.generate(_greedy())
    group.release()
    assert _followers_exited(engine) == [-9]


def test_rank_0s_own_step_error_is_not_called_a_hang(cases, group, monkeypatch):
    case = cases("qwen3")
    engine = group.get("qwen3", case.model_dir)

    def out_of_memory(batch: ForwardBatch):
        raise torch.OutOfMemoryError("out of memory (injected)")

    monkeypatch.setattr(engine.runner, "execute", out_of_memory)
    try:
        with pytest.raises(
            RankFailure,
            match=r"^tensor-parallel worker ranks failed: rank 0's step failed "
            r"\(OutOfMemoryError: out of memory \(injected\)\)$",
        ):
            engine.generate(_greedy())
    finally:
        group.release()


def test_a_follower_that_dies_before_joining_fails_the_start_at_once(tiny_model_dir, group, monkeypatch):
    group.release()
    model_dir = tiny_model_dir("llama", with_tokenizer=True)
    wait_joining = FollowerRanks.wait_joining

    def kill_first(self: FollowerRanks, timeout: float) -> None:
        os.kill(self.processes[0].pid, signal.SIGKILL)  # it is still starting its interpreter: far from joining
        wait_joining(self, timeout)

    monkeypatch.setattr(FollowerRanks, "wait_joining", kill_first)
    started = time.monotonic()
    with pytest.raises(
        RankFailure,
        match=r"^the worker ranks did not start: worker rank 1 \(pid \d+\) exited with "
        r"status -9$",
    ):
        OfflineEngine(_config(model_dir, tp=2, dist_timeout_s=300))
    assert time.monotonic() - started < 60  # not the 300 s rank 0 would wait in the group for it
    assert _no_followers_left()


def test_a_hung_follower_fails_generate_after_the_step_timeout(cases, group):
    case = cases("llama-kv1-vocab321")
    engine = group.get("llama-kv1-vocab321", case.model_dir)
    follower = engine.followers.processes[0]
    os.kill(follower.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RankFailure, match="no rank of this machine exited: a rank hung past step_timeout_s 5 s"):
            engine.generate(_greedy())
    finally:
        group.release()  # kills the stopped follower
    assert _followers_exited(engine) == [-9]


# -- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, message",
    [
        (
            dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=3),
            r"num_attention_heads \(3\) is not divisible by tensor_parallel_size 2",
        ),
        (
            dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
            "num_key_value_heads 3 and tensor_parallel_size 2: one must divide the other",
        ),
    ],
)
def test_models_that_do_not_split_are_refused(tiny_model_dir, config, message):
    from batchserve.procs.worker.loader import load_model
    from batchserve.procs.worker.parallel import TensorParallel
    from batchserve.shared.model import ModelSpec

    spec = ModelSpec.resolve(tiny_model_dir("llama", **config))
    for rank in (0, 1):  # checked from the config, before any collective
        tp = TensorParallel(RankLayout(rank=rank, world_size=2, local_rank=rank, local_world_size=2))
        with pytest.raises(ValueError, match=message):
            load_model(spec, dtype=torch.float32, device=torch.device("cpu"), quantization="none", tp=tp)


def test_engine_refuses_an_intermediate_size_that_does_not_split_and_reaps_its_follower(tiny_model_dir, group):
    group.release()
    model_dir = tiny_model_dir("llama", with_tokenizer=True, intermediate_size=129)
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"intermediate_size \(129\) is not divisible by tensor_parallel_size 2"):
        OfflineEngine(_config(model_dir, tp=2))
    assert time.monotonic() - started < 60  # every rank refused on its own: nobody waited for the others
    assert _no_followers_left()


def test_more_cuda_ranks_than_devices_are_refused_by_every_rank_before_joining(tiny_model_dir, monkeypatch):
    """`generate --tp 2` on a one-GPU machine: each rank refuses before it waits for the others."""
    config = ServerConfig(
        model=str(tiny_model_dir("llama", with_tokenizer=True)), tensor_parallel_size=2, device="cuda"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    message = (
        r"^tensor_parallel_size 2 over nnodes 1 runs 2 worker ranks on this machine, on cuda:0\.\.cuda:1, "
        r"but it has 1 CUDA device\(s\)$"
    )
    joining = []
    for local_rank in (0, 1):
        layout = RankLayout.of(config, local_rank)
        with pytest.raises(ValueError, match=message):
            join(
                config,
                layout,
                rank_device(torch.device("cuda"), layout),
                lambda local_rank=local_rank: joining.append(local_rank),
            )
    assert joining == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match=message):  # the engine refuses before it starts a follower
        OfflineEngine(config)
    assert _no_followers_left()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # ranks on cuda:2 and cuda:3 fit
    check_local_devices(rank_device(torch.device("cuda", 2), RankLayout.of(config, 1)), RankLayout.of(config, 1))


def build_runners(config: ServerConfig, local_rank: int, runs: list[dict], results) -> None:
    """Rank `local_rank` of `config` (on the CPU) builds one runner per `runs` entry (its own ModelRunner
    arguments) in one group, and puts (rank, what came of each) on `results`: ("refused", message) or
    ("built", backend class, padded). Run in this process and in a spawned one (the target)."""
    threads = torch.get_num_threads()
    tp = join(config, RankLayout.of(config, local_rank), torch.device("cpu"))
    out = []
    try:
        for kwargs in runs:
            try:
                runner = ModelRunner(config.model, device="cpu", page_size=4, kv_capacity_tokens=64, tp=tp, **kwargs)
            except ValueError as exc:
                out.append(("refused", str(exc)))
            else:
                out.append(("built", type(runner.attention).__name__, runner.graph_runner is not None))
    finally:
        tp.close()
        torch.set_num_threads(threads)
        results.put((local_rank, out))


def test_ranks_agree_on_the_attention_backend_and_decode_padding(tiny_model_dir, group):
    """Both change what a step runs (padding: the collectives' shapes), so one rank's choice, say
    flashinfer importing on its machine only, must not differ from the others'."""
    group.release()
    config = with_init_addr(_config(tiny_model_dir("llama", with_tokenizer=True), tp=2, dist_timeout_s=120))
    runs = {
        0: [dict(attention_backend="torch"), dict(attention_backend="torch")],
        1: [dict(attention_backend="cpu"), dict(attention_backend="torch", pad_decode=True)],
    }
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    follower = context.Process(target=build_runners, args=(config, 1, runs[1], results), daemon=True)
    follower.start()
    try:
        build_runners(config, 0, runs[0], results)
        got = dict(results.get(timeout=120) for _ in range(2))
        follower.join(30)
    finally:
        if follower.is_alive():
            follower.kill()
    assert follower.exitcode == 0
    for rank, name in ((0, "torch"), (1, "cpu")):
        assert got[rank][0] == (
            "refused",
            f"attention_backend {name}: the worker ranks resolved it differently "
            f"(cpu on some, torch on others); set the same backend on every machine",
        )
        assert got[rank][1] == ("built", "TorchAttentionBackend", False)  # rank 1 asked to pad; rank 0 did not


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(tensor_parallel_size=2, nnodes=3), "nnodes must be >= 1 and divide tensor_parallel_size 2, got 3"),
        (
            dict(tensor_parallel_size=2, nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:29500"),
            r"node_rank must be in \[0, nnodes=2\), got 2",
        ),
        (dict(tensor_parallel_size=2, nnodes=2), "dist_init_addr HOST:PORT is required with nnodes > 1"),
        (dict(tensor_parallel_size=2, dist_init_addr="localhost"), "dist_init_addr must be HOST:PORT, got 'localhost'"),
        (dict(tensor_parallel_size=2, dist_init_addr="127.0.0.1:70000"), "dist_init_addr must be HOST:PORT"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be >= 1, got 0"),
        (dict(step_timeout_s=0), "step_timeout_s must be > 0, got 0"),
        # rank 0 ticks after 1 s of idle: a 2 s wait would end an idle follower's
        (
            dict(tensor_parallel_size=2, step_timeout_s=2),
            r"step_timeout_s must be > 2 with tensor_parallel_size > 1 \(it bounds the other ranks' wait",
        ),
    ],
)
def test_bad_layouts_are_refused_naming_the_setting(tiny_model_dir, fields, message):
    config = ServerConfig(model=str(tiny_model_dir("llama", with_tokenizer=True)), **fields)
    with pytest.raises(ValueError, match=message):
        check_parallel_config(config)
    with pytest.raises(ValueError, match=message):  # before any process starts
        OfflineEngine(config)


def test_engine_runs_global_rank_0_only(tiny_model_dir):
    config = ServerConfig(
        model=str(tiny_model_dir("llama", with_tokenizer=True)),
        tensor_parallel_size=2,
        nnodes=2,
        node_rank=1,
        dist_init_addr="127.0.0.1:29500",
    )
    with pytest.raises(ValueError, match="node_rank must be 0 for the offline engine"):
        OfflineEngine(config)


# -- the CLI ----------------------------------------------------------------------------------------


def test_generate_cli_tp2_prints_tp1_tokens(cases, group):
    group.release()  # the CLI's ranks are other processes; this one's group is not needed meanwhile
    case = cases("llama-kv1-vocab321")
    args = [
        *cli_command("generate"),
        "--model",
        str(case.model_dir),
        "--tp",
        "2",
        "--temperature",
        "0",
        "--max-tokens",
        str(NEW_TOKENS),
        "--ignore-eos",
        "--json",
        "--page-size",
        "4",
        "--kv-capacity-tokens",
        "512",
        "--prefill-budget",
        "8",
        "--max-running-requests",
        "3",
        "--policy",
        "mixed",
    ]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["token_ids"] for line in lines] == [c.token_ids for c in case.tp1.generate(_greedy())]
    assert [line["token_ids"] for line in lines] == case.reference
