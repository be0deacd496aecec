"""The scheduler's knobs (`SchedulerConfig`), the checks that refuse unworkable combinations, and how
the server's settings and the worker's report become them (step-time target, overlap scheduling)."""

from __future__ import annotations

import math

import msgspec

from batchserve.shared.config import (
    MIN_PREFILL_SHARE,
    NGRAM_MAX,
    NGRAM_MIN,
    NUM_SPECULATIVE_TOKENS,
    POLICIES,
    SCHEDULING_POLICIES,
    SPECULATIVE_METHODS,
    Policy,
    SchedulingPolicy,
    ServerConfig,
    Speculative,
)
from batchserve.shared.process_messages import WorkerInfo

DEFAULT_MAX_STEP_MS = {"cpu": 300.0, "cuda": 100.0}
NO_STEP_BOUND = -1.0  # max_step_ms that turns the bound off (config files are JSON: no inf)


class SchedulerConfigError(ValueError):
    """A `SchedulerConfig` that the scheduler cannot run (names the offending field)."""


def check_reserve_ratio(ratio: float) -> None:
    """0 < ratio <= 1 in whole percents (0.05, not 0.055), else `SchedulerConfigError`."""
    if not 0 < ratio <= 1:
        raise SchedulerConfigError(f"kv_reserve_ratio must be in (0, 1], got {ratio}")
    if abs(ratio * 100 - round(ratio * 100)) > 1e-6:
        raise SchedulerConfigError(f"kv_reserve_ratio must be a whole number of percents (e.g. 0.05), got {ratio}")


class SchedulerConfig(msgspec.Struct, kw_only=True, frozen=True):
    """Limits of the chapter: request slots, prefill token budget, KV capacity; plus the policy.

    `kv_capacity_tokens` is rounded down to whole pages; the worker's pool holds one more page
    (page 0, the dummy page padded rows write into), see `Scheduler.num_pool_pages`.
    """

    max_running_requests: int
    prefill_budget: int
    kv_capacity_tokens: int
    page_size: int = 1
    policy: Policy = "prefill-first"
    max_context: int = 0  # 0: no limit besides KV capacity
    max_waiting: int = 0  # 0: unbounded waiting queue
    # rho of SCHEDULING.md: the share of each request's remaining max_tokens that admission reserves
    # (whole percents); 1 reserves the worst case and never preempts.
    kv_reserve_ratio: float = 1.0
    # Share the KV of prompt prefixes across requests (radix tree over full pages); off: the chapter.
    prefix_cache: bool = False
    # The waiting queue's order: arrival (the chapter), or priority then arrival (SCHEDULING.md section 8).
    scheduling_policy: SchedulingPolicy = "fcfs"
    # A long prompt's chunk leaves half of a step to the requests behind it (SCHEDULING.md section 9); off: the chapter.
    fair_prefill: bool = False
    # Speculative decoding: "ngram" proposes up to `num_speculative_tokens` tokens per decode row by
    # prompt lookup (`procs/scheduler/speculation/ngram.py`), matches of `ngram_min`..`ngram_max` tokens; "draft"
    # plans rows of `num_speculative_tokens` placeholders that the worker's draft model fills.
    speculative: Speculative = "off"
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS
    ngram_min: int = NGRAM_MIN
    ngram_max: int = NGRAM_MAX
    # The step-time bound (SCHEDULING.md 6.5): a step with prefill sized to take about this long, given
    # a step-cost model (`Scheduler(cost=...)`); 0: no bound. `min_prefill_share`: the floor of a step's
    # prefill, as a share of what a step of max_step_s could prefill alone.
    max_step_s: float = 0.0
    min_prefill_share: float = MIN_PREFILL_SHARE
    # The prompt length past which the model's rope uses other factors (longrope's original context;
    # 0: one set): the prefix cache keeps requests of the two regimes apart (`KVManager.cache_namespace`).
    rope_switch_length: int = 0
    # Dynamic NTK: a prompt longer than this computes its keys with frequencies of its own length, so it
    # shares cached KV only with prompts of that length (SCHEDULING.md 5); 0: not so
    rope_dynamic_length: int = 0
    # Every layer attends to its last `sliding_window` positions (0: not so): a request's pages wholly
    # before them go back to the pool, and reservations count at most a window and a page (SCHEDULING.md 5).
    sliding_window: int = 0
    # A hybrid model's linear layers keep one state per request in its slot, which each row continues
    # (SCHEDULING.md 5): a row may not start after a prefix its slot's state does not end at.
    recurrent_state: bool = False
    state_snapshots: int = 0  # the worker's snapshots of such states, which the prefix cache serves from
    # Distinct LoRA adapters among the admitted requests at most (base-model requests aside; 0: no limit):
    # a waiting request of another adapter waits at the head of the queue (SCHEDULING.md section 10).
    max_loras: int = 0
    # The pooling runner (SCHEDULING.md section 11): every request one prefill sampled once for its vector,
    # none other accepted; no prefix cache (pooling needs every token computed) and no speculation.
    pooling: bool = False
    # An encoder's (bidirectional attention, section 11): a prompt runs whole in one step, never chunked; one
    # longer than prefill_budget is refused at arrival.
    whole_prompts: bool = False

    def __post_init__(self) -> None:
        self._check_features_combine()
        self._check_values()

    def _check_features_combine(self) -> None:
        """The features that exclude each other, or need another (SCHEDULING.md 5 and 11)."""
        if self.pooling and (self.prefix_cache or self.speculative != "off"):
            raise SchedulerConfigError(
                "the pooling runner computes every prompt token: prefix_cache and speculative decoding are off with it"
            )
        if self.prefix_cache and self.sliding_window:
            raise SchedulerConfigError(
                "prefix_cache and sliding_window exclude each other: a cached prefix needs "
                "every page, which the window gives back (SCHEDULING.md 5)"
            )
        if self.recurrent_state and self.speculative != "off":
            raise SchedulerConfigError(
                f"speculative {self.speculative!r}: this model's linear-attention layers keep one state per request, "
                f"which a rejected draft token would leave changed (SCHEDULING.md 5); serve it with speculative off"
            )
        if self.recurrent_state and self.prefix_cache and not self.state_snapshots:
            raise SchedulerConfigError(
                "prefix_cache with recurrent_state needs state_snapshots: a cached prefix of a "
                "hybrid model serves only where its state was kept (SCHEDULING.md 5)"
            )

    def _check_values(self) -> None:
        """Each knob within its range or among its choices, and the budget that `mixed` needs."""
        for name in ("max_running_requests", "prefill_budget", "kv_capacity_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise SchedulerConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_context", "max_waiting"):
            if getattr(self, name) < 0:
                raise SchedulerConfigError(f"{name} must be >= 0 (0: no limit), got {getattr(self, name)}")
        check_reserve_ratio(self.kv_reserve_ratio)
        if not 0 <= self.max_step_s < math.inf:  # NaN fails too
            raise SchedulerConfigError(f"max_step_s must be >= 0 (0: no bound), got {self.max_step_s}")
        if not 0 <= self.min_prefill_share <= 1:
            raise SchedulerConfigError(f"min_prefill_share must be in [0, 1], got {self.min_prefill_share}")
        if self.policy not in POLICIES:
            raise SchedulerConfigError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise SchedulerConfigError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if self.speculative not in SPECULATIVE_METHODS:
            raise SchedulerConfigError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.speculative!r}"
            )
        if self.num_speculative_tokens < 1:
            raise SchedulerConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise SchedulerConfigError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min} and ngram_max={self.ngram_max}"
            )
        if self.kv_capacity_tokens < self.page_size:
            raise SchedulerConfigError(
                f"kv_capacity_tokens ({self.kv_capacity_tokens}) must hold at least one page of "
                f"page_size ({self.page_size}) tokens"
            )
        if self.policy == "mixed" and self.prefill_budget <= self.max_running_requests:
            # Decode tokens count against the budget under `mixed`; with every slot decoding, a
            # budget <= slots would leave nothing for prefill and a waiting request could starve.
            raise SchedulerConfigError(
                f"policy 'mixed' needs prefill_budget > max_running_requests "
                f"(got prefill_budget={self.prefill_budget}, max_running_requests="
                f"{self.max_running_requests}): otherwise decodes can use the whole budget and "
                f"waiting requests starve"
            )

    @property
    def kv_reserve_percent(self) -> int:
        """`kv_reserve_ratio` in whole percents (1..100), the integer the reservation arithmetic uses."""
        return round(self.kv_reserve_ratio * 100)

    @property
    def num_kv_pages(self) -> int:
        """Pages the allocator hands out (page 0 excluded)."""
        return self.kv_capacity_tokens // self.page_size


def scheduler_config_from_server(config: ServerConfig, info: WorkerInfo) -> SchedulerConfig:
    """The server's settings, sized by what the worker reported (KV capacity, page size, context, the
    device's step-time target)."""
    return SchedulerConfig(
        max_running_requests=config.max_running_requests,
        prefill_budget=config.prefill_budget,
        kv_capacity_tokens=info.kv_capacity_tokens,
        page_size=info.page_size,
        policy=config.policy,
        max_context=info.max_context,
        max_waiting=config.max_waiting,
        kv_reserve_ratio=config.kv_reserve_ratio,
        # SCHEDULING.md 5: a cached prefix needs every layer's KV, which neither windows nor rings keep, and a
        # linear layer's state at the prefix's end, which only the worker's snapshots keep
        prefix_cache=not config.disable_prefix_cache
        and not info.sliding_window
        and not info.sliding_rings
        and (not info.recurrent_state_bytes or info.state_snapshots > 0)
        and not info.pooling,
        scheduling_policy=config.scheduling_policy,
        fair_prefill=config.fair_prefill,
        speculative=config.speculative,
        num_speculative_tokens=config.num_speculative_tokens,
        ngram_min=config.ngram_min,
        ngram_max=config.ngram_max,
        # the step-time bound keeps decodes' inter-token latency: a pooling server decodes nothing
        max_step_s=0.0 if info.pooling else step_target_s(config, info) or 0.0,
        min_prefill_share=config.min_prefill_share,
        rope_switch_length=info.rope_switch_length,
        rope_dynamic_length=info.rope_dynamic_length,
        sliding_window=info.sliding_window,
        recurrent_state=info.recurrent_state_bytes > 0,
        state_snapshots=info.state_snapshots,
        max_loras=config.max_loras if config.enable_lora else 0,
        pooling=info.pooling,
        whole_prompts=info.bidirectional,
    )


def step_target_s(config: ServerConfig, info: WorkerInfo) -> float | None:
    """The step-time target in seconds: max_step_ms, else the SLO's tpot objective (a step is every
    running stream's inter-token gap), else the device's default; None: no bound (-1), or no probe to
    model steps with."""
    if config.max_step_ms == NO_STEP_BOUND or len({shape.tokens for shape, _ in info.step_costs}) < 2:
        return None
    objectives = config.objectives
    ms = (
        config.max_step_ms
        or (objectives.tpot_ms if objectives is not None else None)
        or DEFAULT_MAX_STEP_MS.get(info.device_type, DEFAULT_MAX_STEP_MS["cpu"])
    )
    return ms / 1000


def overlap_schedule(config: ServerConfig, info: WorkerInfo) -> bool:
    """Whether to launch a step before the previous one's tokens are back (`auto`: on a CUDA worker
    without speculative decoding, whose rows must be verified before the next step plans them)."""
    return config.overlap_schedule == "on" or (
        config.overlap_schedule == "auto" and info.device_type == "cuda" and config.speculative == "off"
    )


def check_config(config: ServerConfig) -> None:
    """Refuse unworkable scheduler settings at once, before waiting for the model (ValueError)."""
    if not (config.max_step_ms == NO_STEP_BOUND or 0 <= config.max_step_ms < math.inf):  # NaN fails too
        raise ValueError(
            f"max_step_ms must be -1 (no bound), 0 (the device's suggested target) or a time in ms, "
            f"got {config.max_step_ms}"
        )
    if not config.step_timeout_s > 0:  # NaN fails too; the scheduler's wait for every step
        raise ValueError(f"step_timeout_s must be > 0, got {config.step_timeout_s}")
    if config.speculative != "off" and config.overlap_schedule == "on":
        raise ValueError(
            "speculative decoding needs overlap_schedule off or auto: a speculative row must be "
            "verified before the next step plans its request"
        )
    if (config.speculative == "draft") != bool(config.draft_model):
        raise ValueError(
            "speculative draft needs a draft_model, and a draft_model needs speculative draft "
            f"(got speculative {config.speculative!r}, draft_model {config.draft_model!r})"
        )
    if config.speculative == "draft" and config.tensor_parallel_size > 1:
        raise ValueError("speculative draft runs with tensor_parallel_size 1 only (the draft model is not sharded)")
    scheduler_config_from_server(
        config,
        WorkerInfo(
            kv_capacity_tokens=max(config.page_size, 1), eos_token_ids=[], max_context=0, page_size=config.page_size
        ),
    )
