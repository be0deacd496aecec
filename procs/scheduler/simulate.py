"""`batchserve simulate SCENARIO.json`: run a scheduling scenario through the real scheduler.

The model is replaced by `ScriptedExecutor` (request X emits EOS as its `output_tokens`-th token);
everything else (queues, slots, KV pages, budget, policy) is the production `Scheduler`. With
`num_speculative_tokens` k > 0 in the config, every decoding request with room gets a k-token draft
each step, of which the request's next `accepted` entry is accepted (all of it past the list's end):
`ScriptedDrafts` proposes the tokens the scripted model will sample, up to that many. Output is
the step trace of SCHEDULING.md as JSON lines, or a table like the chapter's Figures 3 and 8.

With `max_step_ms` and a scripted `step_cost` in the config, the step-time bound of SCHEDULING.md 6.5
runs on that cost model (exact: its margin is 1), and the clock is the scripted time of the steps
so far; each step's line then shows its prompt-token cap and its predicted milliseconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Annotated, Any, TextIO, TypeGuard

import msgspec
import numpy as np

from batchserve.procs.cli import CliError
from batchserve.procs.scheduler.config import POLICIES, SchedulerConfig, SchedulerConfigError
from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.executor import ScriptedExecutor, scripted_token
from batchserve.procs.scheduler.step_cost import CostWeights, LinearStepCost
from batchserve.procs.scheduler.step_output import StepOutput
from batchserve.shared.config import MIN_PREFILL_SHARE, Policy
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import PoolingParams, RequestParams, SamplingParams, StopParams

EOS_TOKEN_ID = 2
FIRST_TOKEN_ID = 100  # the scripted model's k-th token is FIRST_TOKEN_ID + k (ScriptedExecutor)
NEVER_SAMPLED = 1  # a draft token the scripted model never samples (below FIRST_TOKEN_ID, not EOS)
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]


class ScenarioStepCost(msgspec.Struct, forbid_unknown_fields=True):
    """A scripted step-cost model: a step takes ms_per_step + ms_per_token * tokens + ms_per_row * rows +
    ms_per_1k_pairs * attention pairs / 1000 (`LinearStepCost`)."""

    ms_per_step: NonNegativeFloat
    ms_per_token: Annotated[float, msgspec.Meta(gt=0)]
    ms_per_1k_pairs: NonNegativeFloat = 0.0
    ms_per_row: NonNegativeFloat = 0.0

    def model(self) -> LinearStepCost:
        return LinearStepCost(
            CostWeights(
                step=self.ms_per_step / 1000,
                token=self.ms_per_token / 1000,
                row=self.ms_per_row / 1000,
                pairs_1k=self.ms_per_1k_pairs / 1000,
            )
        )


class ScenarioConfig(msgspec.Struct, forbid_unknown_fields=True):
    max_running_requests: PositiveInt
    prefill_budget: PositiveInt
    kv_capacity_tokens: PositiveInt
    page_size: PositiveInt = 1
    max_context: NonNegativeInt = 0
    kv_reserve_ratio: float = 1.0  # SCHEDULING.md's rho: < 1 reserves an estimate and may preempt
    prefix_cache: bool = False  # share the KV of common prompt prefixes (requests' `shared_prefix`)
    policy: str | None = None  # the scenario's default policy; `--policy` wins
    scheduling_policy: str = "fcfs"  # the waiting queue's order: fcfs | priority (SCHEDULING.md section 8)
    fair_prefill: bool = False  # a long prompt leaves half of a step to those behind it (SCHEDULING.md section 9)
    num_speculative_tokens: NonNegativeInt = 0  # k > 0: scripted drafts of k tokens (SCHEDULING.md 6.4)
    max_step_ms: NonNegativeFloat = 0.0  # > 0: the step-time bound on `step_cost` (SCHEDULING.md 6.5)
    step_cost: ScenarioStepCost | None = None
    min_prefill_share: NonNegativeFloat = MIN_PREFILL_SHARE
    sliding_window: NonNegativeInt = 0  # every layer's window: pages before it go back (SCHEDULING.md 5)
    rope_switch_length: NonNegativeInt = 0  # longrope's original context: a request growing past it is recomputed
    recurrent_state: bool = False  # a hybrid model's per-slot linear-attention states (SCHEDULING.md 5)
    state_snapshots: NonNegativeInt = 0  # the worker's snapshots of them, which the prefix cache serves from
    max_loras: NonNegativeInt = 0  # distinct LoRA adapters among the admitted requests (0: no limit)
    pooling: bool = False  # the pooling runner: every request one prefill, its vector in place of tokens (section 11)
    whole_prompts: bool = False  # an encoder's: each prompt runs whole in one step (section 11)


class ScenarioRequest(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    arrival_step: NonNegativeInt
    input_tokens: PositiveInt
    output_tokens: PositiveInt
    max_tokens: PositiveInt | None = None  # default: output_tokens
    shared_prefix: NonNegativeInt = 0  # the first tokens of its prompt are the ones every such request has
    priority: int = 0  # lower first, under scheduling_policy "priority"
    accepted: list[NonNegativeInt] = []  # accepted tokens of its successive drafts; past the end: all
    adapter: NonNegativeInt = 0  # its LoRA adapter (0: the base model), which `max_loras` counts


class ScenarioCancel(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    before_step: NonNegativeInt


class Scenario(msgspec.Struct):
    config: ScenarioConfig
    requests: list[ScenarioRequest]
    cancels: list[ScenarioCancel] = []
    name: str = ""
    source: str = ""
    expected: dict[str, Any] = {}


class ScenarioError(ValueError):
    """A scenario file that cannot be simulated; the message names the field."""


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ScenarioError(f"cannot read: {exc.strerror or exc}") from None
    try:
        scenario = msgspec.json.decode(data, type=Scenario)
    except msgspec.ValidationError as exc:
        raise ScenarioError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise ScenarioError(f"not valid JSON: {exc}") from None
    if scenario.config.pooling and any(r.output_tokens != 1 or r.max_tokens for r in scenario.requests):
        raise ScenarioError(
            "a pooling scenario's requests have output_tokens 1 (their vector) and no max_tokens - at `$.requests`"
        )
    if (scenario.config.max_step_ms > 0) != (scenario.config.step_cost is not None):
        raise ScenarioError("max_step_ms and step_cost come together (the bound needs a cost model) - at `$.config`")
    ids: set[str] = set()
    arrival: dict[str, int] = {}
    for i, request in enumerate(scenario.requests):
        if request.shared_prefix > request.input_tokens:
            raise ScenarioError(
                f"shared_prefix ({request.shared_prefix}) exceeds input_tokens ({request.input_tokens})"
                f" - at `$.requests[{i}].shared_prefix`"
            )
        if request.id in ids:
            raise ScenarioError(f"duplicate request id {request.id!r} - at `$.requests[{i}].id`")
        ids.add(request.id)
        arrival[request.id] = request.arrival_step
    for i, cancel in enumerate(scenario.cancels):
        if cancel.id not in ids:
            raise ScenarioError(f"cancel of unknown request {cancel.id!r} - at `$.cancels[{i}].id`")
        if cancel.before_step < arrival[cancel.id]:
            raise ScenarioError(
                f"request {cancel.id!r} is cancelled before step {cancel.before_step} but arrives at "
                f"step {arrival[cancel.id]} - at `$.cancels[{i}].before_step`"
            )
    return scenario


def _is_policy(name: str) -> TypeGuard[Policy]:
    return name in POLICIES


def scheduler_config_from_scenario(scenario: Scenario, policy: str | None) -> SchedulerConfig:
    """The scenario's `config`, run under `policy` when given (else its own, else prefill-first)."""
    chosen = policy or scenario.config.policy or "prefill-first"
    if not _is_policy(chosen):
        raise ScenarioError(f"policy must be one of {', '.join(POLICIES)}, got {chosen!r} - at `$.config.policy`")
    c = scenario.config
    try:
        return SchedulerConfig(
            max_running_requests=c.max_running_requests,
            prefill_budget=c.prefill_budget,
            kv_capacity_tokens=c.kv_capacity_tokens,
            page_size=c.page_size,
            max_context=c.max_context,
            kv_reserve_ratio=c.kv_reserve_ratio,
            prefix_cache=c.prefix_cache,
            policy=chosen,
            # arg-type: any str the scenario gives; SchedulerConfig refuses one not of SchedulingPolicy (below)
            scheduling_policy=c.scheduling_policy,  # type: ignore[arg-type]
            fair_prefill=c.fair_prefill,  # drafts: the scenario's scripted ones (run_scenario)
            max_step_s=c.max_step_ms / 1000,
            min_prefill_share=c.min_prefill_share,
            sliding_window=c.sliding_window,
            rope_switch_length=c.rope_switch_length,
            recurrent_state=c.recurrent_state,
            state_snapshots=c.state_snapshots,
            max_loras=c.max_loras,
            pooling=c.pooling,
            whole_prompts=c.whole_prompts,
        )
    except SchedulerConfigError as exc:
        raise ScenarioError(f"{exc} - at `$.config`") from None


def scenario_prompt(index: int, request: ScenarioRequest) -> list[int]:
    """Token ids of a request's prompt: `shared_prefix` tokens common to all requests, then its own
    (no other request's prompt has them, so nothing else is ever found in a prefix cache)."""
    shared = min(request.shared_prefix, request.input_tokens)
    return [3 + i for i in range(shared)] + [5000 + 1000 * index + i for i in range(request.input_tokens - shared)]


class ScriptedDrafts:
    """Drafts for `simulate`: request r's next draft is `k` tokens (at most the limit), of which the
    first `accepted` are the tokens `ScriptedExecutor` will sample there and the rest a token it never
    samples, so verification keeps exactly `accepted` of them."""

    def __init__(self, scenario: Scenario, k: int) -> None:
        self.k = k
        self.prompt_len = {r.id: r.input_tokens for r in scenario.requests}
        self.output_tokens = {r.id: r.output_tokens for r in scenario.requests}
        self.accepted = {r.id: list(r.accepted) for r in scenario.requests}

    def propose(self, history: np.ndarray, limit: int, rid: str) -> np.ndarray:
        n = min(self.k, limit)
        script = self.accepted[rid]
        accepted = min(script.pop(0) if script else n, n)
        count = history.shape[0] - self.prompt_len[rid]  # tokens generated so far
        tokens = [
            scripted_token(count + j, self.output_tokens[rid], eos_token_id=EOS_TOKEN_ID, first_token_id=FIRST_TOKEN_ID)
            for j in range(accepted)
        ]
        return np.asarray(tokens + [NEVER_SAMPLED] * (n - accepted), dtype=np.int32)


class ScriptedClock:
    """`simulate`'s clock: the seconds the scripted step-cost model gives the steps run so far."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def scenario_scheduler(scenario: Scenario, config: SchedulerConfig) -> Scheduler:
    """A fresh scheduler for `scenario`: EOS id `EOS_TOKEN_ID`, the scenario's scripted drafts, and its
    scripted step-cost model and clock."""
    k, cost = scenario.config.num_speculative_tokens, scenario.config.step_cost
    return Scheduler(
        config,
        eos_token_ids=(EOS_TOKEN_ID,),
        proposer=ScriptedDrafts(scenario, k) if k else None,
        cost=cost.model() if cost is not None else None,
        clock=ScriptedClock(),
    )


def run_scenario(
    scenario: Scenario, config: SchedulerConfig, *, scheduler: Scheduler | None = None
) -> list[StepOutput]:
    """Every step until all requests have finished or been cancelled (idle steps included).

    `scheduler`: one from `scenario_scheduler`, to inspect afterwards (default: a fresh one).
    """
    if scheduler is None:
        scheduler = scenario_scheduler(scenario, config)
    outputs_of = {r.id: r.output_tokens for r in scenario.requests}

    def output_tokens(slot: int) -> int:
        rid = scheduler.rid_in_slot(slot)
        assert rid is not None, f"the scheduler planned slot {slot}, which holds no request"
        return outputs_of[rid]

    executor = ScriptedExecutor(
        output_tokens, eos_token_id=EOS_TOKEN_ID, first_token_id=FIRST_TOKEN_ID, pooling=config.pooling
    )
    arrivals = sorted(scenario.requests, key=lambda r: r.arrival_step)  # stable: scenario order within a step
    cancels = sorted(scenario.cancels, key=lambda c: c.before_step)
    next_arrival = next_cancel = 0
    trace: list[StepOutput] = []
    step = 0
    while True:
        while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_step <= step:
            r = arrivals[next_arrival]
            next_arrival += 1
            prompt = scenario_prompt(scenario.requests.index(r), r)
            # a pooling request generates nothing: its one sampled row is its vector (SCHEDULING.md section 11)
            stop = StopParams(max_tokens=0 if config.pooling else r.max_tokens or r.output_tokens)
            pooling = PoolingParams() if config.pooling else None
            try:
                scheduler.add_request(
                    r.id,
                    prompt,
                    RequestParams(
                        sampling=SamplingParams(temperature=0.0),
                        stop=stop,
                        priority=r.priority,
                        adapter=r.adapter,
                        pooling=pooling,
                    ),
                )
            except Refusal as exc:
                index = scenario.requests.index(r)
                raise ScenarioError(f"request {r.id!r}: {exc} - at `$.requests[{index}]`") from None
        while next_cancel < len(cancels) and cancels[next_cancel].before_step <= step:
            scheduler.abort(cancels[next_cancel].id)  # ignored (False) for a request that already finished
            next_cancel += 1
        # Cancellations not yet reported keep has_unfinished() true: the last ones get a step line.
        if not scheduler.has_unfinished() and next_arrival == len(arrivals):
            return trace
        out = scheduler.step(executor)
        if out.predicted_s is not None and isinstance(scheduler.clock, ScriptedClock):
            scheduler.clock.now += out.predicted_s
        trace.append(out)
        step += 1


def trace_record(out: StepOutput) -> dict[str, Any]:
    """A step of the trace; `preempted` appears only on steps that preempt (SCHEDULING.md)."""
    record = {
        "step": out.step,
        "prefill": [[rid, n] for rid, n in out.prefill],
        "decode": list(out.decode),
        "finished": list(out.finished),
        "cancelled": list(out.cancelled),
    }
    if out.preempted:
        record["preempted"] = list(out.preempted)
    if out.drafted:
        record["drafts"] = [[rid, n, accepted] for rid, n, accepted in out.drafted]
    if out.prefill_cap is not None or out.predicted_s is not None:  # the step-time bound (6.5)
        record["cap"] = out.prefill_cap
        record["ms"] = None if out.predicted_s is None else round(out.predicted_s * 1000, 6)
    return record


def write_jsonl(trace: list[StepOutput], stream: TextIO) -> None:
    for out in trace:
        stream.write(json.dumps(trace_record(out)) + "\n")


def write_table(scenario: Scenario, trace: list[StepOutput], stream: TextIO) -> None:
    """A row per step: what ran, cumulative output tokens per request, what finished or was cancelled
    (and, when any step preempts, what was preempted)."""
    ids = [r.id for r in scenario.requests]
    prompt_len = {r.id: r.input_tokens for r in scenario.requests}
    to_prefill = dict(prompt_len)  # a preempted request recomputes its prompt and outputs
    done_prefill = dict.fromkeys(ids, 0)
    outputs = dict.fromkeys(ids, 0)
    preempts = any(out.preempted for out in trace)
    header = ("Step", "Current execution", "Outputs (" + " / ".join(ids) + ")", "Finished", "Cancelled")
    rows: list[tuple[str, ...]] = [header + ("Preempted",) if preempts else header]
    for out in trace:
        for rid in out.preempted:
            to_prefill[rid] = prompt_len[rid] + outputs[rid]
            done_prefill[rid] = 0
        parts = []
        if out.decode:
            parts.append("Decode: " + ", ".join(out.decode))
        if out.prefill:
            chunks = []
            for rid, n in out.prefill:
                whole = done_prefill[rid] == 0 and n == to_prefill[rid]
                done_prefill[rid] += n
                chunks.append(
                    rid if whole else f"{rid} [{done_prefill[rid] - n}:{done_prefill[rid]} of {to_prefill[rid]}]"
                )
            parts.append("Prefill: " + ", ".join(chunks))
        for rid, _ in out.new_tokens:
            outputs[rid] += 1
        row: tuple[str, ...] = (
            str(out.step),
            " + ".join(parts) or "Idle",
            " / ".join(str(outputs[i]) for i in ids),
            ", ".join(out.finished),
            ", ".join(out.cancelled),
        )
        rows.append(row + (", ".join(out.preempted),) if preempts else row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for k, row in enumerate(rows):
        stream.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
        if k == 0:
            stream.write("  ".join("-" * w for w in widths) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", help="scenario JSON file (config, requests, optional cancels)")
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="scheduling policy (default: the scenario's config.policy, else prefill-first)",
    )
    parser.add_argument(
        "--format",
        choices=("jsonl", "table"),
        default="jsonl",
        help="jsonl: the SCHEDULING.md trace, one step per line; table: like the chapter's figures",
    )


def main(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario)
        trace = run_scenario(scenario, scheduler_config_from_scenario(scenario, args.policy))
    except ScenarioError as exc:
        raise CliError(f"{args.scenario}: {exc}") from None
    if args.format == "table":
        write_table(scenario, trace, sys.stdout)
    else:
        write_jsonl(trace, sys.stdout)
    return 0
