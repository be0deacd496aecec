"""An independent, deliberately plain implementation of procs/scheduler/SCHEDULING.md (token positions, page size 1).

It shares no code with `procs.scheduler`: one object per request, lists instead of tables, every
quantity recomputed from its definition each time. The tests compare its traces with those of
`batchserve simulate` on random scenarios; where they differ, one of the two misreads the spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class _Req:
    id: str
    arrival: int
    input_tokens: int
    output_tokens: int
    max_tokens: int
    prompt_len: int = 0  # what (re-)admission prefills: the prompt, plus generated tokens after a preemption
    prefilled: int = 0
    generated: int = 0
    fed: int = 0  # generated tokens fed back by decodes since the latest admission
    state: str = "future"  # future | waiting | admitted | finished | cancelled
    admitted_at: int = -1  # latest admission
    first_admitted_at: int = -1

    def allocated(self) -> int:
        return self.prefilled + self.fed

    def est(self, percent: int) -> int:
        return (self.prompt_len - self.prefilled) + (percent * (self.max_tokens - self.generated) + 99) // 100


def reference_trace(scenario: dict[str, Any], policy: str) -> list[dict[str, Any]]:
    cfg = scenario["config"]
    slots = cfg["max_running_requests"]
    budget_per_step = cfg["prefill_budget"]
    capacity = cfg["kv_capacity_tokens"]
    percent = round(cfg.get("kv_reserve_ratio", 1.0) * 100)
    reqs = [_Req(r["id"], r["arrival_step"], r["input_tokens"], r["output_tokens"],
                 r.get("max_tokens") or r["output_tokens"], prompt_len=r["input_tokens"]) for r in scenario["requests"]]
    by_id = {r.id: r for r in reqs}
    cancels = scenario.get("cancels", [])
    waiting: list[_Req] = []
    admissions = 0
    trace: list[dict[str, Any]] = []
    step = 0
    while True:
        for r in reqs:  # 1. arrivals, in scenario order
            if r.state == "future" and r.arrival <= step:
                r.state = "waiting"
                waiting.append(r)
        cancelled = []
        for c in cancels:  # 2. cancellations
            r = by_id[c["id"]]
            if c["before_step"] == step and r.state in ("waiting", "admitted"):
                if r.state == "waiting":
                    waiting.remove(r)
                r.state = "cancelled"
                cancelled.append(r.id)
        if not cancelled and all(r.state in ("finished", "cancelled") for r in reqs):
            return trace

        admitted = sorted((r for r in reqs if r.state == "admitted"), key=lambda r: r.admitted_at)

        def plan_prefill(budget: int, admit: bool) -> list[list[Any]]:
            nonlocal admissions
            items: list[list[Any]] = []
            for r in admitted:  # chunks of admitted requests first, in admission order
                if r.prefilled < r.prompt_len and budget > 0:
                    n = min(r.prompt_len - r.prefilled, budget)
                    items.append([r, n])
                    budget -= n
            while admit and waiting and budget > 0:
                live = [r for r in reqs if r.state == "admitted"]
                if len(live) >= slots:
                    break
                head = waiting[0]
                free = capacity - sum(r.allocated() for r in live)
                if head.est(percent) + sum(r.est(percent) for r in live) > free:
                    break
                waiting.pop(0)
                head.state = "admitted"
                head.admitted_at = admissions
                if head.first_admitted_at < 0:
                    head.first_admitted_at = admissions
                admissions += 1
                n = min(head.prompt_len, budget)
                items.append([head, n])
                budget -= n
            return items

        def decodable() -> list[_Req]:
            return [r for r in admitted if r.prefilled == r.prompt_len]

        if policy == "mixed":
            decode = decodable()
            prefill = plan_prefill(budget_per_step - len(decode), True)
        elif policy == "prefill-first":
            prefill = plan_prefill(budget_per_step, True)
            decode = [] if prefill else decodable()
        else:  # fixed
            prefill = plan_prefill(budget_per_step, not admitted)
            decode = [] if prefill else decodable()

        # 3b. preemption
        preempted: list[str] = []
        live = [r for r in reqs if r.state == "admitted"]
        positions = sum(r.allocated() for r in live) + sum(n for _, n in prefill) + len(decode)
        while positions > capacity:
            victim = max(live, key=lambda r: r.admitted_at)
            live.remove(victim)
            planned = sum(n for r, n in prefill if r is victim) + (1 if victim in decode else 0)
            positions -= victim.allocated() + planned
            prefill = [item for item in prefill if item[0] is not victim]
            decode = [r for r in decode if r is not victim]
            victim.state = "waiting"
            victim.prompt_len = victim.input_tokens + victim.generated
            victim.prefilled = victim.fed = 0
            before = [w for w in waiting if 0 <= w.first_admitted_at < victim.first_admitted_at]
            waiting.insert(len(before), victim)
            preempted.append(victim.id)

        # 4-5. run, sample, finish
        finished = []
        sampling = list(decode)
        for r in decode:
            r.fed += 1
        for r, n in prefill:
            r.prefilled += n
            if r.prefilled == r.prompt_len:
                sampling.append(r)
        for r in sampling:
            r.generated += 1
            if r.generated >= r.output_tokens or r.generated >= r.max_tokens:
                r.state = "finished"
                finished.append(r.id)
        record: dict[str, Any] = {"step": step, "prefill": [[r.id, n] for r, n in prefill],
                                  "decode": [r.id for r in decode], "finished": finished, "cancelled": cancelled}
        if preempted:
            record["preempted"] = preempted
        trace.append(record)
        step += 1
