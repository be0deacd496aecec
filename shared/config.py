"""One `ServerConfig`, filled from CLI flags and `BATCHSERVE_*` environment variables, given to every process.

Each field has a CLI flag (`--page-size`) and an environment variable (`BATCHSERVE_PAGE_SIZE`);
a flag given on the command line wins over the environment, which wins over the default.

Beside it: the values a choice setting takes, and the defaults the settings share (`shared.config_choices`);
how a field becomes a flag, a variable and a row of the docs' table (`shared.config_flags`, which
`add_config_arguments`, `config_from_args` and `config_table_markdown` apply to `ServerConfig`); which settings
are the engine's and which the server's alone (`shared.config_scopes`).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from batchserve.shared.config_choices import (  # noqa: F401 (callers import every choice from here)
    DEFAULT_MODEL,
    MIN_PREFILL_SHARE,
    NGRAM_MAX,
    NGRAM_MIN,
    NUM_SPECULATIVE_TOKENS,
    POLICIES,
    QUANTIZATIONS,
    ROUTER_POLICIES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    OverlapSchedule,
    Policy,
    PoolingOverride,
    Quantization,
    Router,
    RouterPolicy,
    Runner,
    SchedulingPolicy,
    Speculative,
)
from batchserve.shared.config_flags import (  # noqa: F401 (how a field is spelt, imported from here by callers)
    add_struct_arguments,
    env_var,
    field_default,
    field_descriptions,
    flag_name,
    settings_table,
    struct_from_args,
)
from batchserve.shared.config_scopes import engine_fields
from batchserve.shared.lora import parse_lora_modules
from batchserve.shared.slo import Slo


def _doc(text: str) -> msgspec.Meta:
    """A config field's help: the one text `--help`, the systemd env file and docs/configuration.md's table show."""
    return msgspec.Meta(description=" ".join(text.split()))


class ServerConfig(msgspec.Struct, kw_only=True):
    # model
    model: Annotated[
        str,
        _doc("""Model: a known name (smollm2-135m-instruct), a Hugging Face folder or a
        .gguf file (of a split model: any shard)."""),
    ] = DEFAULT_MODEL
    dtype: Annotated[
        str,
        _doc("""Weights and activations dtype: auto (float32 on CPU, bfloat16 on CUDA),
        float32, float16, bfloat16."""),
    ] = "auto"
    quantization: Annotated[
        Quantization,
        _doc("""Weights of the linear layers and the LM head: auto or none (as the checkpoint has them:
        a GGUF file's quantized blocks, or an AWQ / GPTQ / FP8 folder's repacked into them, on the CPU;
        docs/models.md), int8 (CPU,
        float32 only: weights rounded to int8 per output channel, fp32 arithmetic; docs/performance.md), or
        q8_0, q4_0, q4_k (CPU, float32 only: quantized at load into GGUF's blocks, as llama-quantize would,
        the LM head in Q6_K under q4_0 and q4_k; docs/models.md)."""),
    ] = "auto"
    device: Annotated[str, _doc("Device of the worker: auto (cuda when available, else cpu), cuda, cuda:N, cpu.")] = (
        "auto"
    )
    runner: Annotated[
        Runner,
        _doc("""What the model serves: generate (text: completions, chat, responses),
        pooling (a vector per input: /v1/embeddings; each request one prefill, no KV kept, no prefix
        cache), or auto: pooling for a sentence-transformers folder (modules.json) or a decoder without an
        LM head (Qwen3Model, LlamaModel, ...), else generate."""),
    ] = "auto"
    pooling: Annotated[
        PoolingOverride,
        _doc("""The pooling runner's pooling, over the model's own (its
        sentence-transformers files; without them a decoder pools its last token): last, mean or cls.
        Empty = the model's."""),
    ] = ""
    max_context: Annotated[int, _doc("Longest prompt + completion in tokens; 0 = the model's own context length.")] = 0
    # KV cache
    page_size: Annotated[int, _doc("Tokens per KV-cache page.")] = 16
    kv_capacity_tokens: Annotated[int, _doc("KV-cache capacity in tokens; 0 = derived from kv_memory_gb.")] = 0
    kv_memory_gb: Annotated[
        float,
        _doc("""GiB of device memory for the KV cache when kv_capacity_tokens is 0,
        per worker rank (each caches its share of the KV heads); 0 = on CUDA kv_memory_fraction of the
        memory free after loading the weights, on CPU 1 GiB."""),
    ] = 0.0
    kv_memory_fraction: Annotated[
        float,
        _doc("""Share of the device memory free after loading the weights that
        the KV cache takes (CUDA, when neither kv_capacity_tokens nor kv_memory_gb is set); the rest is
        headroom for activations and CUDA graphs, as the peers' defaults leave."""),
    ] = 0.85
    # scheduler
    policy: Annotated[Policy, _doc("Scheduling policy: " + ", ".join(POLICIES) + ".")] = "mixed"
    scheduling_policy: Annotated[
        SchedulingPolicy,
        _doc("""Which waiting request runs first: fcfs (arrival order; a
        request's priority must then be 0), or priority (a request's `priority`, lower first, then arrival; a
        waiting request may preempt running ones of a lower priority to be admitted; vLLM's convention)."""),
    ] = "fcfs"
    max_running_requests: Annotated[int, _doc("Most requests decoded together (request-table slots).")] = 64
    prefill_budget: Annotated[int, _doc("Most prompt tokens prefilled in one step (longer prompts are chunked).")] = (
        2048
    )
    max_waiting: Annotated[
        int,
        _doc("""Most requests queued before new ones are refused (at most
        max_running_requests + max_waiting requests are in the server at once; more get 503 and
        Retry-After); 0 = no limit."""),
    ] = 1024
    kv_reserve_ratio: Annotated[
        float,
        _doc("""Share of a request's remaining max_tokens reserved in the KV cache
        at admission (0.01-1, whole percents; rho of procs/scheduler/SCHEDULING.md); below 1 more requests run
        at once, and the newest is preempted (recomputed later) if KV runs out. The default is the measured
        best for chats without max_tokens (docs/performance.md)."""),
    ] = 0.05
    disable_prefix_cache: Annotated[
        bool,
        _doc("""true: every request computes its whole prompt (no KV shared
        across requests with a common prefix, e.g. a system prompt or the history of a chat)."""),
    ] = False
    full_sliding_kv: Annotated[
        bool,
        _doc("""true: a model that mixes sliding-window and global layers (Gemma 2 / 3,
        gpt-oss) keeps every position's KV in its sliding layers too, and the prefix cache serves it; false:
        its sliding layers keep only a window-sized ring per running request (a fraction of the memory at long
        contexts: more requests at once), and its prefix cache is off."""),
    ] = False
    min_prefill_share: Annotated[
        float,
        _doc("""Least prefill a step carries while requests wait, as a share
        (0-1) of the prompt tokens a step of max_step_ms could prefill with no decodes (never below 32
        tokens): admission never stops, and a step runs past max_step_ms by at most that much; once the
        decodes alone take max_step_ms (a slow or busy machine) steps are not bounded (procs/scheduler/SCHEDULING.md
        6.5)."""),
    ] = MIN_PREFILL_SHARE
    fair_prefill: Annotated[
        bool,
        _doc("""true: while other requests wait, a long prompt's chunk takes at most half
        of a step's prompt tokens, so that short prompts behind it start at once (procs/scheduler/SCHEDULING.md
        section 9); false: the chapter's rule, a prompt's chunks run back to back ahead of every admission."""),
    ] = True
    max_step_ms: Annotated[
        float,
        _doc("""Longest a step carrying prefill should take, in ms, which bounds
        everyone's inter-token latency (a step-cost model sizes each step's prefill to it; prefill_budget
        stays the cap); 0 (default) = slo's tpot objective if set, else the device's suggested target, CPU
        300, CUDA 100; -1 = no time bound. A lower target trades throughput and time to first token for a
        steadier stream (docs/performance.md)."""),
    ] = 0.0
    slo: Annotated[
        list[str],
        _doc("""Service-level objectives the server plans for, spelt as `bench --goodput`
        takes them: ttft:MS tpot:MS (e2el:MS too), or a device's preset, cpu or cuda. The step-time target
        is the tpot objective unless max_step_ms is set; /metrics counts the requests that meet each
        objective (batchserve_slo_*). Empty = none."""),
    ] = []
    overlap_schedule: Annotated[
        OverlapSchedule,
        _doc("""on: the scheduler plans and sends step N+1 while the
        worker runs step N (overlap scheduling, as SGLang), so the worker never waits for the scheduler; a
        request that stops at step N costs one wasted row in step N+1. off: each step is planned once the
        previous step's tokens are back (the chapter's loop). auto: on with a CUDA worker, off on the CPU,
        where the scheduler's work competes with the model for the same cores."""),
    ] = "auto"
    enable_lora: Annotated[
        bool,
        _doc("""Serve LoRA adapters (`lora_modules`) beside the base model: a request
        names one in `model`."""),
    ] = False
    lora_modules: Annotated[
        list[str],
        _doc("""The LoRA adapters to load at start, NAME=PATH (a PEFT folder) or
        vLLM's JSON {"name": ..., "path": ...}; needs enable_lora."""),
    ] = []
    max_loras: Annotated[
        int,
        _doc("""Distinct adapters running at once (so in one step); base-model requests
        do not count. A request of another adapter waits while that many run."""),
    ] = 4
    max_lora_rank: Annotated[int, _doc("An adapter of a higher rank `r` is refused at load.")] = 16
    max_cpu_loras: Annotated[
        int,
        _doc("""Adapters the worker keeps loaded at once (at least max_loras): one more
        that a request needs is loaded from its folder at admission, in place of the least recently used one
        no running request holds; 0 = every adapter stays loaded."""),
    ] = 0
    enable_lora_runtime_updates: Annotated[
        bool,
        _doc("""true: POST /v1/load_lora_adapter {"lora_name", "lora_path"}
        and /v1/unload_lora_adapter {"lora_name"} (vLLM's) load and unload adapters while serving (an unloaded
        adapter's requests in flight finish first); needs enable_lora."""),
    ] = False
    speculative: Annotated[
        Speculative,
        _doc("""Speculative decoding: ngram = prompt lookup (each decode row
        also feeds up to num_speculative_tokens tokens found after the last ngram_max..ngram_min tokens'
        latest earlier occurrence in the prompt and output; the model checks them in the same step and keeps
        what it would have sampled anyway, so the output is unchanged and each step may give several
        tokens); draft = a draft model (draft_model) proposes num_speculative_tokens tokens per row, which
        the model accepts by rejection sampling, so the output is distributed as without it (greedy: the
        same tokens); off: one token per step. Needs overlap_schedule off (auto turns it off). A request
        opts out with "speculative": false."""),
    ] = "off"
    num_speculative_tokens: Annotated[int, _doc("Most tokens one speculative decode row proposes (k).")] = (
        NUM_SPECULATIVE_TOKENS
    )
    draft_model: Annotated[
        str,
        _doc("""With speculative draft: the draft model (a known name, a Hugging Face folder
        or a .gguf file) with the model's tokenizer, run by the worker beside it, its KV in the same pages
        (the KV pool's memory holds both)."""),
    ] = ""
    draft_quantization: Annotated[
        Quantization,
        _doc("""Weights of the draft model: auto, none, int8, q8_0, q4_0 or q4_k (as quantization; int8 of the served
        model itself is a draft that agrees with it on most tokens at a quarter of its weight bytes)."""),
    ] = "auto"
    ngram_min: Annotated[int, _doc("Shortest match (in tokens) that prompt lookup proposes from.")] = NGRAM_MIN
    ngram_max: Annotated[int, _doc("Longest match (in tokens) that prompt lookup tries first.")] = NGRAM_MAX
    step_timeout_s: Annotated[
        float,
        _doc("""Seconds a model step may take before the worker counts as hung:
        every request in flight then fails (503 / an error event) and the scheduler exits for a restart.
        Generous: a long prefill chunk on a CPU takes seconds (and a step the step-cost model predicts
        longer waits three times its prediction). With tensor parallelism, also the ranks' collective
        timeout (then above 2)."""),
    ] = 30.0
    # worker
    attention_backend: Annotated[
        str,
        _doc("""Attention kernels: auto, cpu (C kernels, fp32 CPU), torch or
        flashinfer (CUDA only)."""),
    ] = "auto"
    triton_kernels: Annotated[
        OverlapSchedule,  # auto | on | off
        _doc("Triton kernels for LoRA and Gated DeltaNet: auto (CUDA, triton + fla-core), on (CPU: interpreted), off."),
    ] = "auto"
    disable_cuda_graph: Annotated[bool, _doc("true: run decode steps eagerly instead of replaying CUDA graphs.")] = (
        False
    )
    cuda_graph_max_bs: Annotated[
        int,
        _doc("""Largest decode batch captured as a CUDA graph;
        0 = max_running_requests."""),
    ] = 0
    # tensor parallelism (procs/worker/parallel.py)
    tensor_parallel_size: Annotated[
        int,
        _doc("""Worker ranks the model is split over (tensor parallelism, also
        --tp): each rank is one worker process on one device (cuda:LOCAL_RANK on a GPU box, a share of the
        cores on a CPU), all of them one torch.distributed group (NCCL on CUDA, gloo on the CPU)."""),
    ] = 1
    enable_expert_parallel: Annotated[
        bool,
        _doc("""Mixture-of-experts models: each of the tensor_parallel_size
        ranks holds whole experts, an even share of them, instead of a share of every expert's intermediate
        dimension (attention stays split by heads)."""),
    ] = False
    nnodes: Annotated[
        int,
        _doc("""Machines the tensor_parallel_size ranks span (each runs
        tensor_parallel_size / nnodes of them); the machine of node_rank 0 runs the other processes."""),
    ] = 1
    node_rank: Annotated[
        int,
        _doc("""This machine's place among the nnodes (0: the one serving; on the others
        run only the worker ranks, `batchserve proc worker --local-rank I`)."""),
    ] = 0
    dist_init_addr: Annotated[
        str,
        _doc("""HOST:PORT where the worker ranks meet (global rank 0 listens there);
        required with nnodes > 1. Empty: 127.0.0.1 and a free port chosen by `batchserve serve` (29500
        for worker ranks started on their own, as under systemd)."""),
    ] = ""
    dist_timeout_s: Annotated[
        float,
        _doc("""Seconds the worker ranks wait for each other to join and load the
        model; a rank that does not arrive ends the start with an error. Within a step, the ranks' collectives
        time out after step_timeout_s."""),
    ] = 600.0
    # data parallelism: replicas of the whole server (shared/parallel.py, procs/serve.py, procs/router.py)
    data_parallel_size: Annotated[
        int,
        _doc("""Replicas of the whole server on this machine (data parallelism, also
        --dp): each a complete batchserve server (its own api, tokenizer, scheduler, worker and detokenizer) on its
        own device (cuda:I on a GPU box, a share of the cores on a CPU), its api on port + I, or port + 1 + I
        behind a router. Not with tensor_parallel_size > 1."""),
    ] = 1
    data_parallel_rank: Annotated[
        int,
        _doc("""Which replica a process belongs to (0 .. data_parallel_size - 1):
        it picks the replica's port, device and sockets (runtime_dir/replica-I). Set by `batchserve serve` and
        by the replicas' systemd units (`batchserve-api@I.service`: --data-parallel-rank I), not in the env
        file."""),
    ] = 0
    router: Annotated[
        Router,
        _doc("""A gateway in front of the replicas: smg (the Shepherd Model Gateway, `pip
        install -e '.[router]'`) listens on port and sends each request to a replica (port + 1 ..) by
        router_policy, checking each replica's /health; none: no gateway, the replicas serve on port ..
        port + data_parallel_size - 1."""),
    ] = "none"
    router_policy: Annotated[
        RouterPolicy,
        _doc(
            """The gateway's routing policy: """
            + ", ".join(ROUTER_POLICIES)
            + """ (smg's). cache_aware sends a request to the replica that served the longest prefix of its text (a
        chat's earlier turns: their KV is in that replica's prefix cache) unless the replicas' loads are too
        far apart."""
        ),
    ] = "cache_aware"
    router_args: Annotated[
        str,
        _doc("""More flags for the router, appended to the `smg launch` command that
        `batchserve router` builds (procs/router.py), e.g. '--balance-abs-threshold 8' (smg's defaults suit
        fleets far busier than one machine: cache_aware keeps a request on its prefix's replica until the
        replicas' loads differ by 64 requests)."""),
    ] = ""
    # api
    host: Annotated[str, _doc("Address the HTTP api listens on (0.0.0.0 for every interface).")] = "127.0.0.1"
    port: Annotated[
        int,
        _doc("""HTTP port of the api (below 1024 needs CAP_NET_BIND_SERVICE, see
        batchserve-api.service)."""),
    ] = 8000
    served_model_name: Annotated[
        str,
        _doc("""Model name reported by /v1/models and expected in requests;
        empty = model."""),
    ] = ""
    api_key: Annotated[
        list[str],
        _doc("""API keys: /v1/* (and the live view's /dashboard/snapshot) then needs
        `Authorization: Bearer <key>` (else 401); /health, /metrics and the web pages' files stay open (the
        pages ask for a key). None: no authentication."""),
    ] = []
    api_key_file: Annotated[
        str,
        _doc("""A file with one API key per line (blank lines and # comments
        skipped), read at start; adds to api_key."""),
    ] = ""
    webui: Annotated[
        bool,
        _doc("""Serve the web pages: a chat playground at / and a live view of the scheduler
        at /dashboard (--no-webui: neither; the JSON of /dashboard/snapshot stays)."""),
    ] = True
    header_timeout_s: Annotated[
        float, _doc("Seconds a client may take to send a request's headers (from its first byte).")
    ] = 10.0
    keep_alive_timeout_s: Annotated[
        float,
        _doc("""Seconds an idle keep-alive connection stays open (sent as Keep-Alive: timeout=N);
        keep it above a load balancer's idle timeout (60 s: AWS ALB, nginx)."""),
    ] = 75.0
    body_timeout_s: Annotated[float, _doc("Seconds a client may take to send a request's body (else 408).")] = 60.0
    max_connections: Annotated[
        int,
        _doc("""Open HTTP connections at most; more are answered 503 at once. The
        api raises its open-file limit to the hard limit at start."""),
    ] = 10000
    responses_store: Annotated[
        str,
        _doc("""Where the Responses API keeps `store: true` responses (for
        previous_response_id and GET / DELETE /v1/responses/{id}): empty = SQLite in the state directory
        ($STATE_DIRECTORY, /var/lib/batchserve under systemd; else ~/.local/state/batchserve), shared by
        the replicas of one machine and kept across restarts; `sqlite:PATH`; `postgresql://...` (a
        PostgreSQL server, for replicas on several machines); or `memory` (this api process only, gone at a
        restart)."""),
    ] = ""
    responses_ttl_s: Annotated[
        float,
        _doc("""Seconds a stored response is kept (OpenAI keeps them 30
        days)."""),
    ] = 30 * 24 * 3600.0
    # processes
    runtime_dir: Annotated[
        str,
        _doc("""Directory of the processes' sockets; empty = $RUNTIME_DIRECTORY
        (/run/batchserve under systemd), else a fresh temporary directory."""),
    ] = ""
    log_format: Annotated[
        Literal["text", "json"],
        _doc("""stderr log lines, which journald collects: text, or
        json for one JSON object per line (request logs included)."""),
    ] = "text"
    drain_timeout_s: Annotated[
        float,
        _doc("""Seconds a stopping process waits for in-flight requests; keep
        below the systemd units' TimeoutStopSec= (45 s)."""),
    ] = 30.0

    def __post_init__(self) -> None:
        if self.slo:
            Slo.parse(self.slo)  # a bad objective is refused at start, named
        if self.responses_store not in ("", "memory") and not self.responses_store.startswith(
            ("sqlite:", "postgresql://", "postgres://")
        ):
            raise ValueError(
                f"responses_store {self.responses_store!r}: expected memory, sqlite:PATH, "
                f"postgresql://... or empty (SQLite in the state directory)"
            )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.max_cpu_loras and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be 0 (no limit) or at least max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        if self.enable_lora_runtime_updates and not self.enable_lora:
            raise ValueError("enable_lora_runtime_updates needs enable_lora")
        parse_lora_modules(self.lora_modules)  # a malformed entry is refused at start, named
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {self.max_loras}, {self.max_lora_rank}")
        if not self.responses_ttl_s > 0:
            raise ValueError(f"responses_ttl_s must be > 0, got {self.responses_ttl_s}")

    @property
    def objectives(self) -> Slo | None:
        """`slo` parsed (None: no objectives)."""
        return Slo.parse(self.slo) if self.slo else None

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> ServerConfig:
        return msgspec.json.decode(data, type=cls)

    @classmethod
    def load(cls, path: str | Path) -> ServerConfig:
        return cls.from_json(Path(path).read_bytes())


# Every setting but the server's alone (`shared.config_scopes`): what `batchserve generate` takes as `serve` does.
ENGINE_FIELDS: tuple[str, ...] = engine_fields(ServerConfig.__struct_fields__)


def request_cap(max_running_requests: int, max_waiting: int) -> int | None:
    """Most requests in the server at once, running + waiting (more are refused with 503), as the api
    counts them (choices) and the scheduler (its queue); None when `max_waiting` is 0: no limit."""
    return max_running_requests + max_waiting if max_waiting > 0 else None


FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "tensor_parallel_size": ("--tp",),
    "data_parallel_size": ("--dp",),
}  # the peers' short spellings

_DESCRIPTIONS = field_descriptions(ServerConfig)


def field_description(name: str) -> str:
    """The help text of a `ServerConfig` field (its `msgspec.Meta` description)."""
    return _DESCRIPTIONS[name]


def add_config_arguments(parser: argparse._ActionsContainer, only: tuple[str, ...] | None = None) -> None:
    """Add one CLI flag per `ServerConfig` field (or per field in `only`), to a parser or an argument group;
    defaults stay unset. A list field's flag is repeatable."""
    add_struct_arguments(parser, ServerConfig, _DESCRIPTIONS, FLAG_ALIASES, only)


def config_table_markdown() -> str:
    """The settings table of docs/configuration.md: every field's flag, environment variable, default and help."""
    return settings_table(ServerConfig, _DESCRIPTIONS)


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None, **overrides: Any) -> ServerConfig:
    """Defaults < `BATCHSERVE_*` environment (`env`, else the process's) < CLI flags < explicit overrides.
    Bad values raise ValueError."""
    return struct_from_args(ServerConfig, args, os.environ if env is None else env, overrides)


def cache_dir() -> Path:
    """Where converted models and downloaded wheels live (`BATCHSERVE_CACHE`, default ~/.cache/batchserve)."""
    return Path(os.environ.get("BATCHSERVE_CACHE") or Path.home() / ".cache" / "batchserve")
