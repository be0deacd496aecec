"""Prometheus metrics of the api process, in a registry of its own (one per app).

Scheduler gauges come from `SchedulerStats` pushed by the engine client; latencies and token
counts are measured here, per request. Names (all prefixed `batchserve_`):

gauges     num_requests_running, num_requests_waiting, kv_cache_used_tokens, kv_cache_total_tokens,
           kv_cache_usage_ratio (used / total, 0..1), api_requests_in_flight, kv_reserve_ratio (the
           scheduler's configured ratio), spec_decode_mean_acceptance_length (1 + accepted draft
           tokens / drafts, since the start)
histograms time_to_first_token_seconds, inter_token_latency_seconds (gap between successive token
           deliveries of one request), e2e_request_latency_seconds, request_queue_time_seconds (arrival at
           the scheduler to first admission), batch_size (requests per step)
counters   prompt_tokens_total, generation_tokens_total, request_success_total{finish_reason}
           (a client that disconnects counts as finish_reason="abort"),
           request_rejected_total{status}, preemptions_total (requests preempted for KV and recomputed),
           step_target_out_of_reach_total (steps whose decodes alone took --max-step-ms: they are then
           not bounded),
           spec_decode_num_drafts_total, spec_decode_num_draft_tokens_total,
           spec_decode_num_accepted_tokens_total (speculative decoding, vLLM's names: decode rows with a
           draft, their draft tokens, the accepted ones),
           moe_routed_tokens_total (mixture of experts: token-to-expert assignments, over all MoE layers),
           prefix_cache_hit_tokens_total, prefix_cache_queried_tokens_total, prefix_cache_evicted_pages_total
prefix cache gauges: prefix_cache_pages (cached, shared or evictable), prefix_cache_referenced_pages
service-level objectives (with --slo; objective = ttft, tpot, e2el or all): slo_requests_total (finished
           requests judged), slo_met_requests_total{objective}, slo_attainment_ratio{objective} (met / judged
           since the start); times as the api sees them (arrival to first token, then per later token)
mixture of experts: moe_expert_load_imbalance (histogram: per MoE layer and report interval, about a second,
           the busiest expert's tokens over the mean expert's; 1 is perfect balance, num_experts / top_k the
           worst), moe_max_expert_load_imbalance (gauge: the most imbalanced layer of the last interval) -
           one series each, not one per expert per layer
LoRA (with --enable-lora): lora_requests_total{adapter}, lora_generation_tokens_total{adapter}, and vLLM's
           vllm:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters} (its own name)

For routers and autoscalers (the Gateway API Inference Extension's model server protocol: queued and
running requests, KV-cache utilization), the three gauges also under the names its endpoint picker
reads by default, vLLM's: `vllm:num_requests_waiting`, `vllm:num_requests_running`,
`vllm:kv_cache_usage_perc` (a fraction, as vLLM's, despite the name).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from batchserve.shared.messages import SchedulerStats
from batchserve.shared.slo import Slo

# 0.25, 0.3 and 0.4: step-time targets and the lines drawn around them (loadtests' per-token ITL quantiles)
_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.25,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
_IMBALANCE_BUCKETS = (1.05, 1.1, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 32.0, 64.0)


# Our gauge -> its alias under the name the Inference Extension's endpoint picker reads by default.
PROTOCOL_ALIASES = {
    "batchserve_num_requests_waiting": "vllm:num_requests_waiting",
    "batchserve_num_requests_running": "vllm:num_requests_running",
    "batchserve_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
}


class ExpertLoadMetrics:
    """A mixture of experts' load: one histogram and one gauge of imbalance, whatever its layers and experts."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.routed = Counter("batchserve_moe_routed_tokens", "Token-to-expert assignments in MoE layers", registry=r)
        self.imbalance = Histogram(
            "batchserve_moe_expert_load_imbalance",
            "Per MoE layer and interval: the busiest expert's tokens / the mean's",
            buckets=_IMBALANCE_BUCKETS,
            registry=r,
        )
        self.max_imbalance = Gauge(
            "batchserve_moe_max_expert_load_imbalance",
            "The most imbalanced MoE layer of the last interval (busiest / mean)",
            registry=r,
        )

    def observe(self, load: np.ndarray) -> None:
        """load [layers, experts]: tokens routed to each expert since the last stats message."""
        routed = load.sum(axis=1)
        layers = routed > 0
        if not layers.any():
            return
        self.routed.inc(float(routed.sum()))
        imbalance = load[layers].max(axis=1) / (routed[layers] / load.shape[1])
        for value in imbalance:
            self.imbalance.observe(float(value))
        self.max_imbalance.set(float(imbalance.max()))


class SloMetrics:
    """With `--slo`: of the requests that finished, how many met each objective (`objective` ttft, tpot,
    e2el, and all of them together: "all"), and that as a fraction since the start."""

    def __init__(self, slo: Slo, r: CollectorRegistry) -> None:
        self.slo = slo
        self.judged = Counter("batchserve_slo_requests", "Finished requests judged against the SLO", registry=r)
        self.met = Counter(
            "batchserve_slo_met_requests", "Finished requests that met the objective", ["objective"], registry=r
        )
        self.attainment = Gauge(
            "batchserve_slo_attainment_ratio",
            "Share of the finished requests since the start that met the objective",
            ["objective"],
            registry=r,
        )
        self._counts = dict.fromkeys([*slo.limits(), "all"], 0)
        self._total = 0

    def observe(self, ttft_s: float, tpot_s: float | None, e2el_s: float) -> None:
        met = self.slo.met(ttft_s, tpot_s, e2el_s)
        met["all"] = all(met.values())
        self.judged.inc()
        self._total += 1
        for objective, ok in met.items():
            self._counts[objective] += ok
            if ok:
                self.met.labels(objective=objective).inc()
            self.attainment.labels(objective=objective).set(self._counts[objective] / self._total)


class PrefixCacheMetrics:
    """The prefix cache's counters and size, from the scheduler's stats."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.hits = Counter(
            "batchserve_prefix_cache_hit_tokens", "Prompt tokens whose KV was found in the prefix cache", registry=r
        )
        self.queries = Counter(
            "batchserve_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.evictions = Counter(
            "batchserve_prefix_cache_evicted_pages", "Prefix-cache pages evicted to make room", registry=r
        )
        self.pages = Gauge("batchserve_prefix_cache_pages", "KV pages in the prefix cache", registry=r)
        self.referenced = Gauge(
            "batchserve_prefix_cache_referenced_pages",
            "Prefix-cache pages used by running requests (the rest can be evicted)",
            registry=r,
        )

    def observe(self, stats: SchedulerStats) -> None:
        self.hits.inc(stats.cache_hit_tokens)
        self.queries.inc(stats.cache_queried_tokens)
        self.evictions.inc(stats.cache_evicted_pages)
        self.pages.set(stats.cache_pages)
        self.referenced.set(stats.cache_referenced_pages)


class LoraMetrics:
    """Per-adapter counters, and vLLM's `vllm:lora_requests_info` (the one series with the running and the
    waiting adapters' names, comma-separated, and max_lora as labels; its value the time it was set), which
    routers read to place a request where its adapter already runs."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "batchserve_lora_requests", "Finished requests of each LoRA adapter", ["adapter"], registry=r
        )
        self.tokens = Counter(
            "batchserve_lora_generation_tokens", "Tokens generated by each LoRA adapter", ["adapter"], registry=r
        )
        self.info = Gauge(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests (vLLM's)",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=r,
        )
        self.max_loras = 0  # --max-loras; 0: LoRA off, no info series
        self.name_of: Callable[[int], str] = str  # an adapter index's name (the api's `ServedModels.name`)

    def observe(self, stats: SchedulerStats) -> None:
        if not self.max_loras:
            return
        self.info.clear()
        self.info.labels(
            max_lora=str(self.max_loras),
            waiting_lora_adapters=",".join(self.name_of(i) for i in stats.waiting_adapters),
            running_lora_adapters=",".join(self.name_of(i) for i in stats.running_adapters),
        ).set_to_current_time()


class SpecDecodeMetrics:
    """Speculative decoding, vLLM's names: decode rows that carried a draft, their draft tokens, the accepted
    ones, and the mean acceptance length since the start."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.drafts = Counter("batchserve_spec_decode_num_drafts", "Decode rows that carried a draft", registry=r)
        self.draft_tokens = Counter("batchserve_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter(
            "batchserve_spec_decode_num_accepted_tokens", "Draft tokens the model accepted", registry=r
        )
        self.acceptance_length = Gauge(
            "batchserve_spec_decode_mean_acceptance_length",
            "Tokens a decode row with a draft gave on average since the start (1 + accepted draft tokens / drafts)",
            registry=r,
        )
        self._totals = [0, 0]  # drafts, accepted tokens: the mean acceptance length's terms

    def observe(self, stats: SchedulerStats) -> None:
        if not stats.spec_drafts:
            return
        self.drafts.inc(stats.spec_drafts)
        self.draft_tokens.inc(stats.spec_draft_tokens)
        self.accepted.inc(stats.spec_accepted_tokens)
        self._totals[0] += stats.spec_drafts
        self._totals[1] += stats.spec_accepted_tokens
        self.acceptance_length.set(1 + self._totals[1] / self._totals[0])


class ApiMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, slo: Slo | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.slo = SloMetrics(slo, r) if slo is not None else None
        self._scheduler_metrics(r)
        self.in_flight = Gauge("batchserve_api_requests_in_flight", "Requests the api is handling", registry=r)
        self.ttft = Histogram(
            "batchserve_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "batchserve_inter_token_latency_seconds",
            "Time between successive token deliveries of one request",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "batchserve_e2e_request_latency_seconds",
            "Time from arrival to the last token",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "batchserve_request_queue_time_seconds",
            "Time from arrival at the scheduler to the request's first admission",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "batchserve_batch_size", "Requests per model step", buckets=_BATCH_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("batchserve_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("batchserve_generation_tokens", "Generated tokens", registry=r)
        self.success = Counter(
            "batchserve_request_success", "Requests that ended, by finish reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "batchserve_request_rejected", "Requests refused, by HTTP status", ["status"], registry=r
        )
        self.lora = LoraMetrics(r)
        # tokens streamed so far, counted as they go out (generation_tokens counts a request's at its end): the
        # live view's tokens/s (`live_view.py`)
        self.tokens_delivered = 0

    def _scheduler_metrics(self, r: CollectorRegistry) -> None:
        """The gauges and counters of the scheduler's state, set from its stats (`observe_scheduler_stats`);
        the three the Inference Extension reads also under their aliases."""
        self.running = Gauge("batchserve_num_requests_running", "Requests in the scheduler's running set", registry=r)
        self.waiting = Gauge("batchserve_num_requests_waiting", "Requests in the scheduler's waiting queue", registry=r)
        self.kv_used = Gauge("batchserve_kv_cache_used_tokens", "KV cache positions in use", registry=r)
        self.kv_total = Gauge("batchserve_kv_cache_total_tokens", "KV cache positions in the pool", registry=r)
        self.weight_bytes = Gauge(
            "batchserve_model_weight_bytes", "Bytes of the model's weights as the worker holds them", registry=r
        )
        self.kv_usage = Gauge(
            "batchserve_kv_cache_usage_ratio", "KV cache positions in use, as a fraction of the pool (0..1)", registry=r
        )
        gauges = {next(iter(g.describe())).name: g for g in (self.waiting, self.running, self.kv_usage)}
        self.aliases = {
            gauges[name]: Gauge(alias, f"{name}, under the name routers read by default (vLLM's)", registry=r)
            for name, alias in PROTOCOL_ALIASES.items()
        }
        self.reserve_ratio = Gauge(
            "batchserve_kv_reserve_ratio",
            "Share of remaining max_tokens reserved in the KV cache at admission",
            registry=r,
        )
        self.preemptions = Counter(
            "batchserve_preemptions", "Requests preempted (KV freed, recomputed later)", registry=r
        )
        self.out_of_reach = Counter(
            "batchserve_step_target_out_of_reach",
            "Steps with prefill waiting whose decodes alone took the step-time target",
            registry=r,
        )
        self.spec = SpecDecodeMetrics(r)
        self.prefix_cache = PrefixCacheMetrics(r)
        self.request_pages = Gauge(
            "batchserve_kv_request_pages_max",
            "Most KV pages one decoding request holds (with a sliding window: at most the window and a page)",
            registry=r,
        )
        self.moe = ExpertLoadMetrics(r)

    def _set(self, gauge: Gauge, value: float) -> None:
        """Set `gauge`, and its alias if it has one."""
        gauge.set(value)
        if gauge in self.aliases:
            self.aliases[gauge].set(value)

    def observe_scheduler_stats(self, stats: SchedulerStats) -> None:
        self._set(self.running, stats.num_running)
        self._set(self.waiting, stats.num_waiting)
        self.kv_used.set(stats.kv_used_tokens)
        self.kv_total.set(stats.kv_total_tokens)
        self.weight_bytes.set(stats.model_weight_bytes)
        self.request_pages.set(stats.kv_request_pages_max)
        self._set(self.kv_usage, stats.kv_used_tokens / stats.kv_total_tokens if stats.kv_total_tokens else 0.0)
        self.reserve_ratio.set(stats.kv_reserve_ratio)
        self.prefix_cache.observe(stats)
        if stats.preemptions:
            self.preemptions.inc(stats.preemptions)
        if stats.steps_target_out_of_reach:
            self.out_of_reach.inc(stats.steps_target_out_of_reach)
        self.spec.observe(stats)
        if stats.expert_load is not None:
            self.moe.observe(stats.expert_load)
        for size in stats.batch_sizes:
            self.batch_size.observe(size)
        for seconds in stats.queue_times:
            self.queue_time.observe(seconds)
        self.lora.observe(stats)

    def render(self) -> bytes:
        return generate_latest(self.registry)
