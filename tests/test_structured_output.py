"""Structured output below the api: grammars compiled (and refused) by the tokenizer process, tools
rendered into chat templates, the worker's per-slot grammar masks, and whole requests through the
`OfflineEngine` on a tiny random model with a byte-level tokenizer.

A random model writes nonsense, so whatever valid output it produces comes from the grammar alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from llguidance import LLMatcher

from batchserve.kernels.sampling import apply_token_bitmask_
from batchserve.procs.engine import OfflineEngine, request
from batchserve.procs.tokenizer.tools import template_inputs
from batchserve.procs.worker.grammar_masks import SlotGrammars
from batchserve.procs.worker.sample_rows import SampleRows
from batchserve.shared.chat_format import ChatFormat
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import GenerateRequest
from batchserve.shared.model import ModelSpec

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["ok", "colour", "n"],
    "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green"]}, "n": {"type": "integer"}},
}
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CLOCK = {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama", with_tokenizer="bytes", seed=3, max_position_embeddings=2048)


def engine(model_dir, **overrides) -> OfflineEngine:
    config = dict(model=str(model_dir), page_size=4, kv_capacity_tokens=4096, prefill_budget=64, max_running_requests=4)
    return OfflineEngine(ServerConfig(**{**config, **overrides}))


@pytest.fixture(scope="module")
def eng(model_dir):
    return engine(model_dir)


def constrained(
    rid: str,
    kind: str,
    spec: str = "",
    *,
    seed: int | None = None,
    max_tokens: int = 48,
    prompt: str = "the quick brown fox",
    **fields,
) -> GenerateRequest:
    sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    return request(
        rid,
        prompt=prompt,
        sampling=sampling,
        stop={"max_tokens": max_tokens},
        constraint={"kind": kind, "spec": spec},
        **fields,
    )


# ------------------------------------------------------------------------------------------- the kernel


def test_bitmask_masks_exactly_the_disallowed_tokens():
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the last word is partly past the vocabulary
    allowed = torch.rand(3, vocab) < 0.3
    allowed[2] = False
    allowed[2, 5] = True
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    bitmask = words.to(torch.int32)  # bit 31 set wraps negative, as llguidance's int32 words do
    scores = torch.randn(3, vocab)
    expected = torch.where(allowed, scores, torch.tensor(float("-inf")))
    apply_token_bitmask_(scores, bitmask)
    torch.testing.assert_close(scores, expected, rtol=0, atol=0)


def test_a_row_with_nothing_left_keeps_the_grammars_tokens():
    scores = torch.full((1, 40), float("-inf"))
    scores[0, :3] = 1.0  # logit_bias / min_tokens left only tokens 0-2, the grammar allows only 7
    apply_token_bitmask_(scores, torch.tensor([[1 << 7, 0]], dtype=torch.int32))
    assert int(scores.argmax()) == 7 and torch.isneginf(scores[0, :7]).all()


# ------------------------------------------------------------- the worker's masks on rows of several tokens

ROW_REGEX = "(ab|cd)x{2,6}y"


@pytest.fixture(scope="module")
def spec(model_dir):
    return ModelSpec.resolve(model_dir)


def slot_grammars(spec, *starts: tuple[int, int | None]) -> SlotGrammars:
    """Slots (slot, `after` token or None) under ROW_REGEX."""
    grammars = SlotGrammars(4, spec.vocab_size, tokenizer=spec.grammar_tokenizer, device=torch.device("cpu"))
    for slot, after in starts:
        grammars.start(slot, LLMatcher.grammar_from_regex(ROW_REGEX), [], after=after)
    return grammars


def allowed(grammars: SlotGrammars, rows: SampleRows) -> torch.Tensor:
    logits = torch.zeros(rows.slots.shape[0], grammars.vocab_size)
    grammars.mask_(logits, rows)
    return torch.isfinite(logits)


def single_row(slot: int) -> SampleRows:
    return SampleRows.build(np.array([slot]), np.array([0]), np.array([1]), np.array([0]))


def test_each_position_of_a_row_is_masked_after_the_proposed_tokens_before_it(spec):
    """Slot 0 feeds [t0, d1, d2] beside slot 1's one-token row: position j's mask is the one single
    steps give after d1 .. dj, and accepting the row's tokens leaves the matcher where they leave it."""
    ids = spec.grammar_tokenizer().tokenize_str("abxxxy")
    wide, single = slot_grammars(spec, (0, None), (1, None)), slot_grammars(spec, (0, None), (1, None))
    rows = SampleRows.build(np.array([1, 0]), np.array([0, 0]), np.array([1, 3]), np.array([9, 9, *ids[:2]]))
    expected = [allowed(single, single_row(1))[0]]
    for token in ids[:3]:
        expected.append(allowed(single, single_row(0))[0])
        single.accept(np.array([0]), [token])
    assert not expected[1].all() and not torch.equal(expected[1], expected[2])  # the masks differ, and bind
    assert torch.equal(allowed(wide, rows), torch.stack(expected[:4]))
    wide.accept(rows.slots, [ids[0], *ids[:3]])
    single.accept(np.array([1]), [ids[0]])
    for slot in (0, 1):
        assert torch.equal(allowed(wide, single_row(slot)), allowed(single, single_row(slot)))


def test_positions_after_a_proposal_the_grammar_rejects_are_unconstrained(spec):
    tokenizer = spec.grammar_tokenizer()
    ids, rejected = tokenizer.tokenize_str("abxxy"), tokenizer.tokenize_str("q")[0]
    grammars = slot_grammars(spec, (0, None))
    start = allowed(grammars, single_row(0))[0]
    masks = allowed(
        grammars, SampleRows.build(np.array([0]), np.array([0]), np.array([3]), np.array([9, ids[0], rejected]))
    )
    assert torch.equal(masks[0], start) and not masks[1].all() and masks[2].all()
    assert torch.equal(allowed(grammars, single_row(0))[0], start)  # the matcher itself did not move


def test_a_grammar_starts_within_a_row_after_its_after_token(spec):
    """A thinking slot whose `after` token is proposed: the positions after it are masked from the
    grammar's start, and accepting the row starts the grammar there."""
    ids, think_close = spec.grammar_tokenizer().tokenize_str("abxxy"), 7
    reference = slot_grammars(spec, (0, None))
    first = allowed(reference, single_row(0))[0]
    reference.accept(np.array([0]), [ids[0]])
    second = allowed(reference, single_row(0))[0]
    grammars = slot_grammars(spec, (0, think_close))
    masks = allowed(
        grammars, SampleRows.build(np.array([0]), np.array([0]), np.array([3]), np.array([9, think_close, ids[0]]))
    )
    assert masks[0].all() and torch.equal(masks[1], first) and torch.equal(masks[2], second)
    grammars.accept(np.array([0, 0, 0]), [think_close, ids[0], ids[1]])
    reference.accept(np.array([0]), [ids[1]])
    assert torch.equal(allowed(grammars, single_row(0)), allowed(reference, single_row(0)))


# ------------------------------------------------------------------------------- compiling and refusing


@pytest.mark.parametrize(
    "kind, spec, param",
    [
        ("json_schema", '{"type": 3}', "response_format"),
        ("json_schema", "not json", "guided_json"),
        ("regex", "a[b", "guided_regex"),
        ("choice", "[]", "guided_choice"),
        ("lark", "start: undefined_rule", "guided_grammar"),
    ],
)
def test_a_bad_grammar_is_a_400_naming_its_field(eng, kind, spec, param):
    with pytest.raises(Refusal) as info:
        eng.tokenize(request("x", prompt="fox", constraint={"kind": kind, "spec": spec, "param": param}))
    assert info.value.status == 400 and info.value.param == param


def test_grammars_are_compiled_once_per_text(eng):
    first = eng.tokenize(constrained("a", "json_schema", json.dumps(SCHEMA))).params.logits.grammar
    again = eng.tokenize(constrained("b", "json_schema", json.dumps(SCHEMA))).params.logits.grammar
    assert first is not None and again is first


def test_structured_output_needs_a_tokenizer_llguidance_reads(tiny_model_dir):
    words = engine(tiny_model_dir("llama", with_tokenizer=True, seed=3))  # WordLevel: no byte decoder
    with pytest.raises(Refusal) as info:
        words.tokenize(request("x", prompt="w1", constraint={"kind": "json_object"}))
    assert info.value.param == "response_format" and "tokenizer" in info.value.message
    assert words.tokenize(request("y", prompt="w1")).params.logits.grammar is None  # the rest still works


# ------------------------------------------------------------------------------------- end to end


def test_every_kind_of_constraint_holds_on_a_random_model(eng):
    lark = 'start: "say " WORD "!"\nWORD: /[a-z]{2,5}/'
    reqs = [
        constrained("schema", "json_schema", json.dumps(SCHEMA)),
        constrained("object", "json_object"),
        constrained("regex", "regex", "(yes|no)-[0-9]{3}"),
        constrained("choice", "choice", '["left", "right"]'),
        constrained("lark", "lark", lark),
    ]
    schema, obj, regex, choice, lark_out = eng.generate(reqs)
    assert all(c.finish_reason == "stop" for c in (schema, regex, choice, lark_out))
    value = json.loads(schema.text)
    assert set(value) == {"ok", "colour", "n"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")
    assert obj.text.startswith("{")  # a free-form object may run past max_tokens; every prefix is valid JSON
    assert regex.text[:3] in ("yes", "no-") and regex.text.split("-")[-1].isdigit()
    assert choice.text in ("left", "right")
    assert lark_out.text.startswith("say ") and lark_out.text.endswith("!")
    assert eng.scheduler.kv_used_tokens == 0


def test_sampled_constrained_output_is_valid_for_every_seed(eng):
    done = eng.generate([constrained(f"s{seed}", "json_schema", json.dumps(SCHEMA), seed=seed) for seed in range(8)])
    for c in done:
        assert c.finish_reason == "stop"
        assert set(json.loads(c.text)) == {"ok", "colour", "n"}


def test_constrained_and_free_requests_in_one_batch_leave_each_other_alone(model_dir):
    free = [
        request(f"f{i}", prompt=p, sampling={"temperature": 0}, stop={"max_tokens": 16, "ignore_eos": True})
        for i, p in enumerate(["the lazy dog", "fox jumps"])
    ]
    bound = [constrained("g0", "json_schema", json.dumps(SCHEMA)), constrained("g1", "regex", "[a-c]{20}", seed=5)]
    alone = [c.token_ids for c in engine(model_dir).generate(free)] + [
        c.token_ids for c in engine(model_dir).generate(bound)
    ]
    mixed_engine = engine(model_dir)
    mixed = mixed_engine.generate([free[0], bound[0], free[1], bound[1]])
    assert [c.token_ids for c in (mixed[0], mixed[2], mixed[1], mixed[3])] == alone  # 4 slots: one batch


def test_a_preempted_constrained_request_replays_its_tokens_through_the_grammar(model_dir):
    reqs = [constrained(f"p{i}", "regex", "[a-z ]{10,30}\\.", seed=i, max_tokens=40) for i in range(4)]
    solo = [engine(model_dir).generate([r])[0] for r in reqs]
    crowded = engine(model_dir, kv_capacity_tokens=48, kv_reserve_ratio=0.05, page_size=1)
    together = crowded.generate(reqs)
    assert crowded.preemptions > 0
    assert [c.token_ids for c in together] == [c.token_ids for c in solo]
    assert all(c.text.endswith(".") and c.finish_reason == "stop" for c in together)


def test_required_tool_choice_forces_one_valid_call_in_the_prompted_format(eng):
    tools = [WEATHER, CLOCK]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    required = eng.generate(
        [
            request(
                f"t{s}",
                messages=msgs,
                sampling={"temperature": 1.0, "seed": s},
                stop={"max_tokens": 80},
                tools=tools,
                tool_choice="required",
            )
            for s in range(3)
        ]
    )
    named = eng.generate(
        [
            request(
                "n",
                messages=msgs,
                sampling={"temperature": 0},
                stop={"max_tokens": 80},
                tools=tools,
                tool_choice="required",
                forced_tool="get_weather",
            )
        ]
    )[0]
    for c in [*required, named]:
        assert c.finish_reason == "stop"
        assert c.text.startswith("<tool_call>\n") and c.text.endswith("\n</tool_call>")
        call = json.loads(c.text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        assert call["name"] in ("get_weather", "get_time")
        if call["name"] == "get_weather":
            assert set(call["arguments"]) == {"city"} and len(call["arguments"]["city"]) <= 12
    assert json.loads(named.text.split("\n")[1])["name"] == "get_weather"
    # "none" hides the tools: the prompt is the plain chat's
    plain = eng.tokenize(request("p", messages=msgs)).prompt_ids.tolist()
    hidden = eng.tokenize(request("h", messages=msgs, tools=tools, tool_choice="none"))
    assert hidden.prompt_ids.tolist() == plain and hidden.params.logits.grammar is None


def test_a_thinking_model_thinks_freely_then_answers_in_the_grammar(tiny_model_dir):
    eng = engine(tiny_model_dir("llama", with_tokenizer="thinking", seed=3, max_position_embeddings=2048))
    think_close = eng.tokenizer.convert_tokens_to_ids("</think>")
    chat = [{"role": "user", "content": "fox"}]

    def ask(rid: str, seed: int, **fields) -> GenerateRequest:
        # the bias makes </think> the first token wherever nothing masks it
        return request(
            rid,
            messages=chat,
            sampling={"temperature": 1.0, "seed": seed},
            stop={"max_tokens": 24},
            constraint={"kind": "regex", "spec": "(yes|no)!"},
            logits={"logit_bias": {think_close: 100.0}},
            **fields,
        )

    thinking = [ask(f"t{s}", s) for s in range(4)]
    solo = [eng.generate([r])[0] for r in thinking]
    for c in solo:
        assert c.token_ids[0] == think_close  # thinking is free: the grammar does not hold it back
        assert c.finish_reason == "stop" and eng.tokenizer.decode(c.token_ids[1:-1]) in ("yes!", "no!")
    crowded = engine(
        tiny_model_dir("llama", with_tokenizer="thinking", seed=3, max_position_embeddings=2048),
        kv_capacity_tokens=96,
        kv_reserve_ratio=0.05,
        page_size=1,
    )
    assert [c.token_ids for c in crowded.generate(thinking)] == [c.token_ids for c in solo]
    assert crowded.preemptions > 0  # the replay found </think> and restarted the grammar after it
    # thinking off: the template closes the block in the prompt, and the grammar holds from the first token
    off = eng.generate([ask("off", 0, chat_template_kwargs={"enable_thinking": False})])[0]
    assert think_close not in off.token_ids and off.text in ("yes!", "no!")


# ---------------------------------------------------------------------------------- chat templates


def chat_request(**fields) -> GenerateRequest:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}],
        },
        {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
    ]
    return request("c", messages=messages, **fields)


def test_templates_without_tools_get_hermes_instructions_and_turns():
    messages, extra = template_inputs(chat_request(tools=[WEATHER]), ChatFormat.of("{{ m['content'] }}"))
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert (
        messages[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "get_weather"' in messages[0]["content"]
    )
    assert (
        messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    assert messages[3]["content"] == '<tool_response>\n{"temp": 21}\n</tool_response>'


def test_templates_with_tools_get_them_and_the_calls_as_objects():
    qwen_like = (
        "{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    fmt = ChatFormat.of(qwen_like)
    assert fmt.template_takes_tools and fmt.tool_call_style == "hermes"
    messages, extra = template_inputs(chat_request(tools=[WEATHER]), fmt)
    assert extra["tools"][0]["function"]["name"] == "get_weather"
    assert messages[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"}
    assert ChatFormat.of("{% for t in tools %}{{ t }}{% endfor %}").tool_call_style == "json"  # Llama 3's
    assert ChatFormat.of("{{ '</think>' }}").reasoning and not ChatFormat.of("{{ x }}").reasoning


def test_a_follow_up_turn_renders_through_the_real_template(eng):
    done = eng.generate([chat_request(tools=[WEATHER], sampling={"temperature": 0}, stop={"max_tokens": 4})])
    assert done[0].finish_reason in ("stop", "length")
    ids = eng.tokenize(chat_request(tools=[WEATHER])).prompt_ids.tolist()
    text = eng.tokenizer.decode(ids)
    assert "<tool_response>" in text and "# Tools" in text and '"city": "Paris"' in text


def test_chat_template_kwargs_reach_the_template_and_cannot_override_ours(eng):
    with pytest.raises(Refusal) as info:
        eng.tokenize(request("k", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"tools": []}))
    assert info.value.param == "chat_template_kwargs"
    assert eng.tokenize(
        request("k2", messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"enable_thinking": False})
    ).prompt_ids.size


def test_an_unconstrained_engine_never_builds_the_grammar_tokenizer(model_dir):
    eng = engine(model_dir)
    eng.generate([request("u", prompt="fox", stop={"max_tokens": 3})])
    assert eng.runner.grammars._tokenizer is None
    assert not eng.runner.grammars.active.any()


# ------------------------------------------------------------- a grammar that fails mid-answer ends it


def test_a_token_the_grammar_rejects_is_reported_and_the_slot_left_unmasked(spec):
    """The matcher cannot go on (here: a token it never allowed): the slot reports the failure for the
    scheduler to end the request with, and stops masking."""
    rejected = spec.grammar_tokenizer().tokenize_str("q")[0]
    grammars = slot_grammars(spec, (2, None))
    grammars.accept(np.array([2]), [rejected])
    failures = grammars.take_failures()
    assert [slot for slot, _ in failures] == [2] and failures[0][1]
    assert not grammars.constrains(np.array([2])) and grammars.take_failures() == []


def test_a_failed_grammar_ends_its_request_with_an_error_naming_the_field(spec):
    """The scheduler frees the request and its final delta carries the error; the detokenizer turns it
    into a 400 naming the constraint's field."""
    from batchserve.procs.detokenizer.process import Detokenizers
    from batchserve.procs.scheduler import Scheduler, SchedulerConfig
    from batchserve.shared.messages import LogitsParams, RequestParams, SamplingParams, StepResult, StopParams

    sched = Scheduler(SchedulerConfig(max_running_requests=2, prefill_budget=64, kv_capacity_tokens=256, page_size=1))
    logits = LogitsParams(grammar="{}", grammar_param="response_format")
    params = RequestParams(sampling=SamplingParams(), stop=StopParams(max_tokens=8), logits=logits)
    sched.add_request("a", [5, 6, 7], params)
    sched.add_request("b", [5, 6], RequestParams(sampling=SamplingParams(), stop=StopParams(max_tokens=8)))

    class Failing:  # the worker: the constrained slot's grammar fails on the step's token
        def execute(self, batch):
            (slot,) = [start.slot for start in batch.slot_starts if start.params.logits.grammar]
            ids = np.full(sum(batch.sample_lens), 50, dtype=np.int32)
            return StepResult(step=batch.step, next_token_ids=ids, grammar_failures=[(slot, "too deep")])

    out = sched.step(Failing())
    assert out.cancelled == ["a"] and "a" not in sched.requests and "b" in sched.requests
    (delta,) = [d for d in sched.token_deltas(out) if d.rid == "a" and d.finish_reason == "abort"]
    assert delta.error_param == "response_format" and "too deep" in (delta.error or "")
    rejected = Detokenizers(spec.load_tokenizer()).fail(delta)
    assert rejected is not None and (rejected.status, rejected.param) == (400, "response_format")
    assert sched.num_running == 1  # a's slot is free again
