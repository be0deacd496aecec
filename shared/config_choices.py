"""The closed sets of values a setting chooses from, each a `Literal` type that `ServerConfig` declares its
field with (msgspec refuses any other value) and, where code checks or lists them, the tuple of its
values; and the defaults that the server's settings share with the scheduler's and the tools'.
`shared.config` re-exports them all beside `ServerConfig`.
"""

from __future__ import annotations

from typing import Literal, get_args

# The scheduler's batch-forming policies (procs/scheduler/managers.py implements each).
Policy = Literal["mixed", "prefill-first", "fixed"]  # the default first
POLICIES: tuple[str, ...] = get_args(Policy)
# Weight formats of the linear layers (kernels/ops.pack_linear_weight implements each; auto: as none, a GGUF file's
# or a quantized folder's blocks kept; q8_0, q4_0, q4_k: quantized at load into GGUF blocks,
# kernels/block_quantize.py).
Quantization = Literal["auto", "none", "int8", "q8_0", "q4_0", "q4_k"]  # the default first
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# Overlap scheduling (procs/scheduler/process.py): auto = on with a CUDA worker.
OverlapSchedule = Literal["auto", "on", "off"]  # the default first
# The waiting queue's order (procs/scheduler/SCHEDULING.md section 8): arrival, or priority then arrival.
SchedulingPolicy = Literal["fcfs", "priority"]  # the default first
SCHEDULING_POLICIES: tuple[str, ...] = get_args(SchedulingPolicy)
# Speculative decoding (the worker verifies): off, prompt lookup (procs/scheduler/speculation/ngram.py proposes) or a
# draft model (procs/worker/speculation/draft_model.py proposes).
Speculative = Literal["off", "ngram", "draft"]  # the default first
SPECULATIVE_METHODS: tuple[str, ...] = get_args(Speculative)
# The gateway in front of the replicas (procs/router.py): none, or the Shepherd Model Gateway.
Router = Literal["none", "smg"]  # the default first
# What the server does with the model (shared/pooling.py): generate text, or pool a prompt into a vector
# (/v1/embeddings); auto = pooling for a sentence-transformers folder or a decoder without an LM head.
Runner = Literal["auto", "generate", "pooling"]  # the default first
# The pooling runner's override of the model's own pooling (empty: the model's files decide).
PoolingOverride = Literal["", "last", "mean", "cls"]
# smg's routing policies that need nothing but the requests (its manual and passthrough ones need routing
# keys); cache_aware first, the default: a conversation's turns reach the replica holding its history.
RouterPolicy = Literal[
    "cache_aware", "round_robin", "power_of_two", "prefix_hash", "consistent_hashing", "least_load", "random"
]
ROUTER_POLICIES: tuple[str, ...] = get_args(RouterPolicy)
# their defaults (the server's and the scheduler's); k = 6 measured best on 2 CPU cores (loadtests/results/)
NUM_SPECULATIVE_TOKENS, NGRAM_MIN, NGRAM_MAX = 6, 2, 4
MIN_PREFILL_SHARE = 0.25  # the step-time bound's prefill floor (SCHEDULING.md 6.5, measured there)
DEFAULT_MODEL = "smollm2-135m-instruct"
