"""An independent, deliberately plain implementation of procs/scheduler/SCHEDULING.md (token positions, page size 1).

Sections 1-5, 8, 9, 10 (adapters) and 11 (pooling: max_tokens 0; an encoder's whole prompts). It shares no
code with `procs.scheduler`: one object per request, lists instead of tables, every quantity recomputed from
its definition each time. The tests compare its traces with those of `batchserve simulate` on random
scenarios; where they differ, one of the two misreads the spec.
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
    priority: int = 0
    joined: int = -1  # arrival order (the order requests joined the waiting queue first)
    filled_at: int = -1  # when its latest prefill completed
    adapter: int = 0  # its LoRA adapter (section 10; 0: the base model)

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
    by_priority = cfg.get("scheduling_policy", "fcfs") == "priority"
    fair = cfg.get("fair_prefill", False)
    pooling, whole = cfg.get("pooling", False), cfg.get("whole_prompts", False)  # section 11
    reqs = [
        _Req(
            r["id"],
            r["arrival_step"],
            r["input_tokens"],
            r["output_tokens"],
            0 if pooling else r.get("max_tokens") or r["output_tokens"],
            prompt_len=r["input_tokens"],
            priority=r.get("priority", 0),
            adapter=r.get("adapter", 0),
        )
        for r in scenario["requests"]
    ]
    by_id = {r.id: r for r in reqs}
    cancels = scenario.get("cancels", [])
    waiting: list[_Req] = []
    admissions = 0
    joins = 0
    fills = 0
    trace: list[dict[str, Any]] = []

    def wait_again(victim: _Req) -> None:
        """Preempted: back to the waiting queue, to recompute its prompt and what it generated."""
        victim.state = "waiting"
        victim.prompt_len = victim.input_tokens + victim.generated
        victim.prefilled = victim.fed = 0
        if by_priority:  # section 8: by priority, then arrival
            before = [w for w in waiting if (w.priority, w.joined) < (victim.priority, victim.joined)]
        else:  # section 4: behind the preempted requests first admitted before it
            before = [w for w in waiting if 0 <= w.first_admitted_at < victim.first_admitted_at]
        waiting.insert(len(before), victim)

    max_loras = cfg.get("max_loras", 0)

    def fits(head: _Req, live: list[_Req]) -> bool:
        free = capacity - sum(r.allocated() for r in live)
        return len(live) < slots and head.est(percent) + sum(r.est(percent) for r in live) <= free

    def adapter_fits(head: _Req, live: list[_Req]) -> bool:  # section 10
        running = {r.adapter for r in live if r.adapter}
        return not (max_loras and head.adapter and head.adapter not in running and len(running) >= max_loras)

    step = 0
    while True:
        for r in reqs:  # 1. arrivals, in scenario order
            if r.state == "future" and r.arrival <= step:
                r.state = "waiting"
                r.joined = joins
                joins += 1
                if by_priority:  # behind every waiting request of its priority or a lower value
                    waiting.insert(len([w for w in waiting if w.priority <= r.priority]), r)
                else:
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

        preempted: list[str] = []
        if by_priority and policy != "fixed" and waiting:  # 2b. the head preempts lower priorities
            head = waiting[0]
            live = [r for r in reqs if r.state == "admitted"]
            if not fits(head, live):
                candidates = sorted(
                    (r for r in live if r.priority > head.priority),
                    key=lambda r: (r.priority, r.admitted_at),
                    reverse=True,
                )
                for k in range(1, len(candidates) + 1):
                    if fits(head, [r for r in live if r not in candidates[:k]]):
                        for victim in candidates[:k]:
                            wait_again(victim)
                            preempted.append(victim.id)
                        break

        admitted = sorted((r for r in reqs if r.state == "admitted"), key=lambda r: r.admitted_at)

        def plan_prefill(budget: int, admit: bool, admitted: list[_Req] = admitted) -> list[list[Any]]:
            nonlocal admissions
            half = budget - budget // 2  # section 9: what an item others could follow may take
            admit = admit and bool(waiting)
            items: list[list[Any]] = []
            held: list[list[Any]] = []

            def take(r: _Req, others: bool) -> None:
                nonlocal budget
                rest = r.prompt_len - r.prefilled
                n = min(rest, budget, half if fair and others and not whole else budget)
                item = [r, n]
                items.append(item)
                if n < min(rest, budget):
                    held.append(item)
                budget -= n

            chunks = [r for r in admitted if r.prefilled < r.prompt_len]
            for i, r in enumerate(chunks):  # chunks of admitted requests first, in admission order
                if budget > 0:
                    take(r, i + 1 < len(chunks) or admit)
            while admit and waiting and budget > 0:
                live = [r for r in reqs if r.state == "admitted"]
                head = waiting[0]
                if not adapter_fits(head, live) or not fits(head, live) or whole and head.prompt_len > budget:
                    break
                waiting.pop(0)
                head.state = "admitted"
                head.admitted_at = admissions
                if head.first_admitted_at < 0:
                    head.first_admitted_at = admissions
                admissions += 1
                take(head, bool(waiting))
            for item in held:  # the budget nobody took goes back to the held items, in order
                extra = min(item[0].prompt_len - item[0].prefilled - item[1], budget)
                item[1] += extra
                budget -= extra
            return [(r, n) for r, n in items]

        def decodable(
            admitted: list[_Req] = admitted,
        ) -> list[_Req]:  # in admission order; with fair prefill, in the order prefills completed
            ready = [r for r in admitted if r.prefilled == r.prompt_len]
            return sorted(ready, key=lambda r: r.filled_at) if fair else ready

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
        live = [r for r in reqs if r.state == "admitted"]
        positions = sum(r.allocated() for r in live) + sum(n for _, n in prefill) + len(decode)
        while positions > capacity:
            victim = max(live, key=lambda r: (r.priority if by_priority else 0, r.admitted_at))
            live.remove(victim)
            planned = sum(n for r, n in prefill if r is victim) + (1 if victim in decode else 0)
            positions -= victim.allocated() + planned
            prefill = [item for item in prefill if item[0] is not victim]
            decode = [r for r in decode if r is not victim]
            wait_again(victim)
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
                r.filled_at = fills
                fills += 1
        for r in sampling:
            r.generated += 1
            if r.generated >= r.output_tokens or r.generated >= r.max_tokens:
                r.state = "finished"
                finished.append(r.id)
        record: dict[str, Any] = {
            "step": step,
            "prefill": [[r.id, n] for r, n in prefill],
            "decode": [r.id for r in decode],
            "finished": finished,
            "cancelled": cancelled,
        }
        if preempted:
            record["preempted"] = preempted
        trace.append(record)
        step += 1
