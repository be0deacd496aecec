"""The step-time bound (`--max-step-ms`): the step-cost model fits and follows measured steps, sizes a
step's prefill to a target, and the scheduler honours the size it is given (without one, every trace
is procs/scheduler/SCHEDULING.md's, which the scenario tests check)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchserve.procs.scheduler.config import DEFAULT_MAX_STEP_MS, SchedulerConfig, check_config, step_target_s
from batchserve.procs.scheduler.core import Scheduler
from batchserve.procs.scheduler.executor import ScriptedExecutor
from batchserve.procs.scheduler.step_cost import CostWeights, StepCostModel
from batchserve.procs.scheduler.step_time_cap import MIN_PREFILL_TOKENS, StepTimeCap
from batchserve.shared.config import ServerConfig
from batchserve.shared.messages import RequestParams, SamplingParams, StopParams
from batchserve.shared.process_messages import WorkerInfo
from batchserve.shared.step_features import StepShape, attention_pairs, experts_read, step_shape

TRUE = CostWeights(step=0.004, token=0.0015, row=0.0005, pairs_1k=0.0002)  # seconds


def seconds(shape: StepShape, weights: CostWeights = TRUE) -> float:
    return (
        weights.step + weights.token * shape.tokens + weights.row * shape.rows + weights.pairs_1k * shape.pairs / 1000
    )


def decodes(rows: int, context: float = 300.0) -> StepShape:
    """`rows` decode rows (one token each) pairing `context` keys each."""
    return StepShape(tokens=rows, rows=rows, pairs=rows * context)


def chunk(n: int, prefix: int = 0) -> StepShape:
    return step_shape([prefix], [n])


def scaled(weights: CostWeights, by: float) -> CostWeights:
    return CostWeights(*(w * by for w in weights.vector()))


def probe(weights: CostWeights = TRUE) -> list[tuple[StepShape, float]]:
    shapes = [
        step_shape(p, e)
        for p, e in [
            ([0], [32]),
            ([0], [256]),
            ([0], [1024]),
            ([256], [1]),
            ([256] * 16, [1] * 16),
            ([256] * 16 + [0], [1] * 16 + [100]),
        ]
    ]
    return [(shape, seconds(shape, weights)) for shape in shapes]


def test_probe_fit_recovers_the_costs_and_sizes_prefill_to_the_target():
    model = StepCostModel(probe())
    assert model.weights.vector() == pytest.approx(TRUE.vector(), rel=1e-6, abs=1e-12)
    load = decodes(16)
    n = model.max_prefill_tokens(0.3, load, 0, 2048)

    def within(k: int) -> bool:
        return seconds(load + chunk(k)) <= 0.3

    assert within(n) and not within(n + 1)
    assert model.max_prefill_tokens(10.0, load, 0, 2048) == 2048  # the cap holds
    assert model.max_prefill_tokens(0.001, load, 0, 2048) == 0  # decodes alone overrun


def test_a_row_costs_apart_from_its_tokens():
    """A decode row samples (the LM head, the sampler), a prompt token does not: fitted in tokens alone, a
    step of 256 decode rows and one of a 256-token chunk would be predicted alike."""
    model = StepCostModel(probe())
    assert model.predict(decodes(256, 0.0)) - model.predict(StepShape(256, 1, 0.0)) == pytest.approx(255 * TRUE.row)


def test_refits_follow_a_machine_that_slows_down():
    model = StepCostModel(probe())
    slower = scaled(TRUE, 2)
    rng = np.random.default_rng(0)
    for _ in range(256):
        rows = int(rng.choice([1, 8, 32]))
        shape = decodes(rows) + (chunk(int(rng.choice([0, 32, 480]))))
        model.observe(shape, seconds(shape, slower))
    # The probe stays in the fit, but 256 recent steps outweigh its six.
    assert model.predict(decodes(512)) == pytest.approx(seconds(decodes(512), slower), rel=0.05)
    assert model.predict(chunk(512)) == pytest.approx(seconds(chunk(512), slower), rel=0.05)


def test_weights_stay_non_negative_and_a_probe_without_spread_is_refused():
    noisy = [(decodes(1, 100), 0.02), (decodes(64, 100), 0.01), (chunk(512), 0.5)]  # a hiccup on the batch-1 step
    assert min(StepCostModel(noisy).weights.vector()) >= 0
    with pytest.raises(ValueError):
        StepCostModel([(StepShape(16, 16, 100.0), 0.01), (StepShape(16, 16, 200.0), 0.02)])


MOE = (8, 2)  # experts, top k
MOE_TRUE = CostWeights(step=0.004, token=0.0004, pairs_1k=0.0002, expert_read=0.003)


def moe_seconds(shape: StepShape) -> float:
    return seconds(shape, MOE_TRUE) + MOE_TRUE.expert_read * experts_read(shape.tokens, *MOE)


def test_an_moe_models_steps_are_predicted_from_the_experts_they_read():
    """A decode step of 1 token reads 2 of 8 experts, one of 16 nearly all: the cost bends, which a fit
    in tokens alone cannot follow; with the expert term the probe's fit predicts every batch size."""
    shapes = [
        step_shape(p, e)
        for p, e in [([0], [32]), ([0], [256]), ([256], [1]), ([256] * 4, [1] * 4), ([256] * 16, [1] * 16)]
    ]
    costs = [(shape, moe_seconds(shape)) for shape in shapes]
    moe, linear = StepCostModel(costs, MOE), StepCostModel(costs)
    assert moe.weights.vector() == pytest.approx(MOE_TRUE.vector(), rel=1e-6, abs=1e-12)
    for rows in (1, 2, 4, 8, 32, 64):
        assert moe.predict(decodes(rows)) == pytest.approx(moe_seconds(decodes(rows)), rel=1e-6)
    assert max(abs(linear.predict(decodes(r)) / moe_seconds(decodes(r)) - 1) for r in (1, 2, 4, 8)) > 0.2
    # a draft token pays when it raises tokens per second: its added cost (experts newly read included)
    for rows in (1, 16):
        wider = StepShape(rows + 1, rows, (rows + 1) * 300.0)
        added = moe_seconds(wider) - moe_seconds(decodes(rows))
        assert moe.min_acceptance(decodes(rows)) == pytest.approx(added * rows / moe_seconds(decodes(rows)))


def test_the_scheduler_prefills_no_more_than_it_is_given():
    config = SchedulerConfig(max_running_requests=4, prefill_budget=64, kv_capacity_tokens=1024, policy="mixed")
    sched = Scheduler(config)
    sched.add_request(
        "long", np.arange(3, 103), RequestParams(sampling=SamplingParams(temperature=0), stop=StopParams(max_tokens=2))
    )
    executor = ScriptedExecutor(lambda slot: 10)
    chunks, prefixes = [], []
    while sched.has_unfinished():
        prefixes.append(sched.planner.prefill_prefix())
        out = sched.step(executor, prefill_tokens=24)
        chunks += [n for _, n in out.prefill]
    assert chunks == [24, 24, 24, 24, 4]
    assert prefixes[:5] == [0, 24, 48, 72, 96]  # what each chunk's attention reads besides itself
    assert sched.decode_load() == StepShape()


def test_the_bound_is_on_by_default_with_a_suggested_target_per_device():
    info = WorkerInfo(kv_capacity_tokens=64, eos_token_ids=[], max_context=64, page_size=16, step_costs=probe())
    assert step_target_s(ServerConfig(), info) == DEFAULT_MAX_STEP_MS["cpu"] / 1000  # the default is 0
    assert step_target_s(ServerConfig(max_step_ms=0), info) == DEFAULT_MAX_STEP_MS["cpu"] / 1000
    cuda = WorkerInfo(**{**{f: getattr(info, f) for f in info.__struct_fields__}, "device_type": "cuda"})
    assert step_target_s(ServerConfig(max_step_ms=0), cuda) == DEFAULT_MAX_STEP_MS["cuda"] / 1000
    assert step_target_s(ServerConfig(max_step_ms=150), info) == 0.15
    assert step_target_s(ServerConfig(slo=["ttft:4000", "tpot:120"]), info) == 0.12  # the SLO's tpot, unless
    assert step_target_s(ServerConfig(slo=["tpot:120"], max_step_ms=150), info) == 0.15  # a target is set
    assert step_target_s(ServerConfig(slo=["ttft:4000"]), info) == DEFAULT_MAX_STEP_MS["cpu"] / 1000
    assert step_target_s(ServerConfig(max_step_ms=-1), info) is None
    for bad in (-2.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="max_step_ms"):
            check_config(ServerConfig(max_step_ms=bad))
    check_config(ServerConfig(max_step_ms=-1))
    no_probe = WorkerInfo(kv_capacity_tokens=64, eos_token_ids=[], max_context=64, page_size=16)
    assert step_target_s(ServerConfig(max_step_ms=0), no_probe) is None


def test_a_real_probe_fits(tiny_model_dir):
    from batchserve.procs.worker.model_runner import ModelRunner
    from batchserve.procs.worker.step_probe import probe_step_costs

    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", kv_capacity_tokens=256, max_running_requests=16)
    costs = probe_step_costs(runner)
    assert [(s.tokens, s.rows) for s, _ in costs] == [(32, 1), (256, 1), (1, 1), (16, 16)]  # 1024: past 512 positions
    assert all(s > 0 for _, s in costs)
    StepCostModel(costs)  # fits
    assert runner.kv_cache.page_table.abs().sum() == 0  # only the dummy page was touched


def test_the_off_value_survives_the_config_file_every_process_reads():
    # Processes get the config as JSON, which has no inf: "off" must be a plain number.
    for value in (-1.0, 0.0, 150.0):
        assert ServerConfig.from_json(ServerConfig(max_step_ms=value).to_json()).max_step_ms == value


def test_a_probe_taken_on_a_busy_machine_stops_counting_once_live_steps_span_enough():
    model = StepCostModel(probe(scaled(TRUE, 3)))  # three servers probing on two cores at once
    rng = np.random.default_rng(1)
    for _ in range(64):
        # what a starved start carries: decodes, plus the smallest chunk
        shape = decodes(int(rng.integers(8, 25)), float(rng.integers(100, 300))) + chunk(int(rng.choice([0, 32])))
        model.observe(shape, seconds(shape))
    assert model.predict(decodes(1024, 512)) == pytest.approx(seconds(decodes(1024, 512)), rel=0.05)
    assert model.predict(chunk(1024)) == pytest.approx(seconds(chunk(1024)), rel=0.05)


def test_decode_steps_alone_leave_the_probe_in_the_fit():
    """Decode rows of one token each cannot tell a token's cost from a row's: the probe stays in the fit."""
    model = StepCostModel(probe(scaled(TRUE, 3)))
    for rows in [1, 8, 16, 32, 48] * 13:
        model.observe(decodes(rows, 200), seconds(decodes(rows, 200)))
    assert model.predict(chunk(1024)) > 1.5 * seconds(chunk(1024))  # still the probe's (3x) prefill


def test_a_margin_keeps_nine_in_ten_steps_with_prefill_within_the_target():
    """The fit predicts the mean: steps with prefill that run 1.3x longer than the probe said, with
    noise, overrun the target every time at first, and about every other time once refits have learnt
    the 1.3x. The margin learnt from their overruns keeps ~90% within."""
    model = StepCostModel(probe())
    rng = np.random.default_rng(2)
    target, load = 0.3, decodes(16)
    within = []
    cap = StepTimeCap(model, target, 0.0, 2048)  # no floor: what fits alone
    for _ in range(400):
        n = cap.prompt_tokens(Load(load))
        shape = load + chunk(n)
        actual = seconds(shape) * 1.3 * float(rng.lognormal(0.0, 0.1))
        model.observe(shape, actual, with_prefill=True)
        within.append(actual <= target)
    assert sum(within[:8]) <= 1  # before the margin: planned to the mean, which is over
    assert 0.8 <= np.mean(within[100:]) <= 0.97
    assert 1.05 < model.margin < 1.3  # the noise's 90th percentile: the refits took the 1.3x


def test_a_busy_start_probe_is_soon_replaced_and_its_overruns_do_not_stretch_later_steps():
    """A probe three times too slow (the server's other processes starting beside it) plans small chunks
    that run in a third of their predicted time. The first live steps replace it within a few refits, and
    the margin is taken against the refitted weights: the old 1/3 ratios must not let steps run past the
    target (a margin of them, at its floor of 0.5, planned twice the target until 64 newer steps)."""
    model = StepCostModel(probe(scaled(TRUE, 3)))
    cap = StepTimeCap(model, 0.3, 0.0, 2048)
    rng = np.random.default_rng(3)
    ran = []
    for _ in range(60):
        load = decodes(int(rng.integers(4, 17)))
        shape = load + chunk(cap.prompt_tokens(Load(load)) or 0)
        actual = seconds(shape) * float(rng.lognormal(0.0, 0.03))
        model.observe(shape, actual, with_prefill=True)
        model.observe(load, seconds(load))  # a decode-only step between
        ran.append(actual)
    assert max(ran[:4]) < 0.3 * 0.6  # planned by the slow probe: small chunks
    assert max(ran) < 1.1 * 0.3  # never stretched past the target (before: 1.8x, steps 8 and 9)
    assert min(ran[8:]) > 0.8 * 0.3  # the target filled once live steps replaced the probe
    assert model.margin == pytest.approx(1.0, abs=0.1)


class Load:
    """A `StepLoad` of given decodes, with prompt tokens waiting (a chunk from the prompt's start)."""

    def __init__(self, decodes: StepShape, waiting: bool = True) -> None:
        self.decodes, self.waiting = decodes, waiting

    def decode_load(self) -> StepShape:
        return self.decodes

    def has_prefill_work(self) -> bool:
        return self.waiting

    def prefill_prefix(self) -> int:
        return 0


def test_a_step_carries_what_fits_beside_its_decodes_and_never_less_than_the_floor():
    """SCHEDULING.md 6.5: the prompt tokens that fit within the target beside the decodes; while the
    decodes leave less room than the floor (a share of what a step of the target prefills alone), the floor."""
    model = StepCostModel(probe())
    cap = StepTimeCap(model, 0.3, 0.25, 4096)
    alone = model.max_prefill_tokens(0.3, StepShape(), 0, 4096)
    floor = int(0.25 * alone)
    assert cap.floor_tokens(0.3) == floor > MIN_PREFILL_TOKENS
    few = cap.prompt_tokens(Load(decodes(4)))

    def within(k: int) -> bool:
        return seconds(decodes(4) + chunk(k)) <= 0.3

    assert within(few) and not within(few + 1) and few > floor  # the target, filled
    rows = 130  # decodes that leave room for less than the floor (and less than its own floor)
    assert seconds(decodes(rows)) < 0.3 and model.max_prefill_tokens(0.3, decodes(rows), 0, 4096) < MIN_PREFILL_TOKENS
    assert cap.prompt_tokens(Load(decodes(rows))) == floor
    assert cap.steps_out_of_reach == 0
    tiny = StepTimeCap(model, 0.3, 0.0, 4096)  # no share: the floor's own floor still moves the queue
    assert tiny.prompt_tokens(Load(decodes(rows))) == MIN_PREFILL_TOKENS


def test_an_unreachable_target_bounds_nothing(caplog):
    """The decodes alone past the target: throughput wins, the step plans with the budget alone (None);
    said once, counted for every step that had prefill waiting."""
    model = StepCostModel(probe())
    cap = StepTimeCap(model, 0.1, 0.25, 4096)
    load = decodes(64, 4000.0)  # decodes alone: 0.13 s of rows + 0.05 s of attention
    assert seconds(load) > 0.1
    with caplog.at_level("WARNING", logger="batchserve.scheduler"):
        for _ in range(3):
            assert cap.prompt_tokens(Load(load)) is None
        cap.prompt_tokens(Load(load, waiting=False))
    assert cap.steps_out_of_reach == 3
    assert [r.getMessage() for r in caplog.records].count(
        "the step-time target is out of reach: the decodes alone take longer, so steps are not bounded while they do"
    ) == 1


def test_the_prefill_share_is_checked():
    for bad in (-0.1, 1.01, math.nan):
        with pytest.raises(ValueError, match="min_prefill_share"):
            check_config(ServerConfig(min_prefill_share=bad))
    check_config(ServerConfig(min_prefill_share=0.0))
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="step_timeout_s"):
            check_config(ServerConfig(step_timeout_s=bad))


def test_a_draft_must_win_more_tokens_than_it_costs():
    """Speculative decoding's break-even share: k draft tokens add k * (w_token + w_pairs * context / 1000) s
    (no row: they widen one) and win accepted tokens; they pay when tokens per second rise, i.e. when the
    accepted share is above what a token costs over the step's time per row."""
    model = StepCostModel(probe())
    for rows in (1, 4, 64):
        share = model.min_acceptance(decodes(rows))
        k = 4
        base = rows / seconds(decodes(rows))

        def with_draft(accepted: float, rows: int = rows, k: int = k) -> float:
            return (rows + accepted) / seconds(decodes(rows) + StepShape(k, 0, k * 300.0))

        assert with_draft(k * share * 1.05) > base > with_draft(k * share * 0.95)
    assert model.min_acceptance(decodes(1)) < 0.5 < model.min_acceptance(decodes(64))
    assert model.min_acceptance(StepShape()) == 0.0


def test_a_draft_models_cost_raises_the_break_even():
    """With a draft model, a draft token also costs the draft's time to propose it (the worker reports
    it per step; a moving average per token): the share that must be accepted rises with it, past 1
    (no draft pays) where the model's own tokens are cheap beside it."""
    model = StepCostModel(probe())
    plain = model.min_acceptance(decodes(16))
    for _ in range(100):
        model.observe_drafts(0.016, 4)  # 4 ms a draft token
    assert model.draft_token_s == pytest.approx(0.004, rel=1e-3)
    per_row = seconds(decodes(16)) / 16
    assert model.min_acceptance(decodes(16)) == pytest.approx(plain + 0.004 / per_row, rel=1e-3)
    model.observe_drafts(1.0, 0)  # no draft tokens: nothing to learn
    assert model.draft_token_s == pytest.approx(0.004, rel=1e-3)


def test_attention_pairs_count_each_layers_window():
    """A layer with a window of W pairs a token with at most W keys; the model's pairs are the layers' mean."""
    import random

    def brute(prefix_lens, extend_lens, windows):
        return sum(
            min(p + i, w) if w else p + i
            for w in windows
            for p, n in zip(prefix_lens, extend_lens)
            for i in range(1, n + 1)
        ) / len(windows)

    rng = random.Random(0)
    for _ in range(300):
        prefix_lens, extend_lens = [rng.randint(0, 40) for _ in range(3)], [rng.randint(1, 20) for _ in range(3)]
        windows = [rng.choice([0, 1, 5, 16, 50]) for _ in range(rng.randint(1, 4))]
        assert attention_pairs(prefix_lens, extend_lens, windows) == pytest.approx(
            brute(prefix_lens, extend_lens, windows)
        )
    assert attention_pairs([1000], [1], [256]) == 256 and attention_pairs([1000], [1], [256, 0]) == (256 + 1001) / 2
    model = StepCostModel([(decodes(8, 12), 0.01), (decodes(64, 14), 0.05), (chunk(256), 0.2)], windows=(8, 0))
    assert model.shape([100], [2]).pairs == attention_pairs([100], [2], (8, 0))


def test_a_hybrid_models_prefill_counts_whole_chunks_of_its_linear_layers():
    """Three linear layers to one full: a row of n > 1 tokens computes ceil(n / 64) chunks of 64 in each
    linear layer; one-token rows none (their state reads count as pairs); other models none at all."""
    windows = (-300, -300, -300, 0)
    assert step_shape([0], [16], windows).chunked == 64 * 3 / 4
    assert step_shape([0, 5], [100, 1], windows).chunked == 128 * 3 / 4
    assert step_shape([5, 7], [1, 1], windows).chunked == 0
    assert step_shape([0], [100], (0, 0)).chunked == 0 and step_shape([0], [100], (8, 0)).chunked == 0


def test_a_slow_models_probe_stays_short(tiny_model_dir, monkeypatch):
    """An 8B model on 2 cores took 103 s to probe (4 s per 32 tokens, every step twice): a step slower than
    REPEAT_MAX_S runs once, the warm-up is a few tokens, and the longer chunks are cut to what STEP_MAX_S holds,
    the solo one keeping the fit's spread of tokens."""
    from batchserve.procs.worker import step_probe
    from batchserve.procs.worker.model_runner import ModelRunner

    runner = ModelRunner(tiny_model_dir("llama"), device="cpu", kv_capacity_tokens=512, max_running_requests=32)
    timed: list[int] = []

    def slow_step(_runner, batch) -> float:  # 150 ms a token: 4.8 s for 32
        timed.append(len(batch.input_ids))
        return 0.15 * len(batch.input_ids)

    monkeypatch.setattr(step_probe, "timed_step", slow_step)
    costs = step_probe.probe_step_costs(runner)
    assert [(s.tokens, s.rows) for s, _ in costs] == [(10, 1), (30, 1), (1, 1), (16, 16), (36, 17)]
    # A short warm-up (1.2 s: slow), then each once but the 0.15 s decode (best of two): the first chunk what
    # 1.5 s holds, the second three times it (the fit's spread), the chunk beside 16 decodes what 3 s holds.
    assert timed == [8, 10, 30, 1, 1, 16, 36]
    StepCostModel(costs)  # still fits
    assert step_probe.affordable_tokens(256, 32, 0.01) == 256  # a fast model's chunk as asked
    assert step_probe.first_chunk(32, 0.05) == 32 and step_probe.first_chunk(32, 1.9) == 8  # the 8B model's
    assert step_probe.affordable_tokens(256, 32, 1.0) == 96  # 3 s of 32 tokens a second
