"""gpt-oss's harmony chat format: the checkpoint's template renders the prompt (with the request's
`reasoning_effort`), a harmony chat keeps its special tokens in the text and stops at `<|return|>` or
`<|call|>`, and the api turns the channels into `reasoning_content`, `content` and `tool_calls` through the
openai package, streamed and whole (every split of a stream: tests/test_api_structured.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from api_fake_engine import FakeEngine
from conftest import TINY_VOCAB, build_tiny_model, write_byte_tokenizer
from test_api_structured import CHAT, TOOLS, accumulate, calls_of, openai_api, pieces, run
from transformers import AutoTokenizer

from batchserve.procs.api.schemas import ChatCompletionRequest
from batchserve.procs.api.validation import validate_chat
from batchserve.procs.detokenizer.process import Detokenizers
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.chat_format import ChatFormat
from batchserve.shared.errors import Refusal
from batchserve.shared.messages import TokenDelta
from batchserve.shared.model import ModelSpec

SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
# the shape of gpt-oss's template, cut down: a system message with the reasoning effort, the messages, and
# the generation prompt; history answers in the final channel
TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m['content'] }}<|end|>{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
ANSWER = (
    "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>'
)


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory) -> Path:
    """A tiny gpt-oss whose tokenizer has harmony's special tokens (the vocabulary's last ids) and template."""
    out = build_tiny_model(tmp_path_factory.mktemp("harmony"), "gpt_oss", max_position_embeddings=4096)
    write_byte_tokenizer(out, TINY_VOCAB - len(SPECIALS))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out)
    return out


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "the weather in Paris?"}], **fields}
    return msgspec.convert(body, ChatCompletionRequest)


def test_the_format_is_told_by_the_template():
    assert ChatFormat.of(TEMPLATE).reasoning == "harmony" and ChatFormat.of(TEMPLATE).harmony
    assert ChatFormat.of("{{ '</think>' }}").reasoning == "think" and ChatFormat.of("{{ x }}").reasoning == ""


def test_reasoning_effort_reaches_the_template(harmony_model):
    prompts = PromptTokenizer.of(ModelSpec.resolve(harmony_model))
    (generate,) = validate_chat(_chat(reasoning_effort="high"), rid="r", model_name="m").requests
    ids, _ = prompts.prompt_ids(generate)
    text = prompts.tokenizer.decode(ids)
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    (default,) = validate_chat(_chat(), rid="r", model_name="m").requests
    assert "Reasoning: medium" in prompts.tokenizer.decode(prompts.prompt_ids(default)[0])
    with pytest.raises(msgspec.ValidationError):
        _chat(reasoning_effort="extreme")


def test_a_harmony_chat_keeps_special_tokens_and_stops_at_return_and_call(harmony_model):
    prompts = PromptTokenizer.of(ModelSpec.resolve(harmony_model))
    vocab = prompts.tokenizer.get_vocab()
    (generate,) = validate_chat(_chat(stop_token_ids=[5]), rid="r", model_name="m").requests
    stop = prompts.tokenize(generate).params.stop
    assert not stop.skip_special_tokens
    assert stop.stop_token_ids == (5, vocab["<|return|>"], vocab["<|call|>"])
    completion = msgspec.structs.replace(generate, messages=None, prompt="the weather")
    assert prompts.tokenize(completion).params.stop.skip_special_tokens  # a raw prompt: as asked


def test_forced_calls_and_structured_output_are_refused_for_harmony_chats(harmony_model):
    prompts = PromptTokenizer.of(ModelSpec.resolve(harmony_model))
    (forced,) = validate_chat(_chat(tools=TOOLS, tool_choice="required"), rid="r", model_name="m").requests
    with pytest.raises(Refusal, match="harmony format") as refused:
        prompts.tokenize(forced)
    assert refused.value.param == "tool_choice"
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    (constrained,) = validate_chat(_chat(response_format=schema), rid="r", model_name="m").requests
    with pytest.raises(Refusal, match="harmony format"):
        prompts.tokenize(constrained)


def test_the_detokenizer_keeps_special_tokens_when_asked(harmony_model):
    prompts = PromptTokenizer.of(ModelSpec.resolve(harmony_model))
    (generate,) = validate_chat(_chat(), rid="r", model_name="m").requests
    tokenized = prompts.tokenize(generate)
    ids = prompts.tokenizer.encode("<|channel|>final<|message|>Sunny.<|return|>", add_special_tokens=False)
    for skip, expected in ((False, "<|channel|>final<|message|>Sunny.<|return|>"), (True, "finalSunny.")):
        stop = msgspec.structs.replace(tokenized.params.stop, skip_special_tokens=skip)
        delta = TokenDelta(
            rid="r",
            token_ids=ids,
            finish_reason="length",
            prompt_tokens=3,
            completion_tokens=len(ids),
            stop=stop,
            prompt_tail=[],
        )
        text, _ = Detokenizers(prompts.tokenizer).handle(delta)
        assert text.text == expected


def test_channels_become_reasoning_content_and_tool_calls_through_openai():
    async def go(text: str, **kwargs):
        async with openai_api(FakeEngine(pieces(text)), reasoning="harmony") as client:
            whole = await client.chat.completions.create(model="fake-model", messages=CHAT, **kwargs)
            stream = await client.chat.completions.create(model="fake-model", messages=CHAT, stream=True, **kwargs)
            return whole, [c async for c in stream]

    whole, chunks = run(go(ANSWER, tools=TOOLS, reasoning_effort="low"))
    message = whole.choices[0].message
    assert message.model_extra["reasoning_content"] == "The user wants the weather." and message.content is None
    assert calls_of(message.tool_calls) == [("get_weather", {"city": "Paris"})]
    assert whole.choices[0].finish_reason == "tool_calls"
    got = accumulate(chunks)
    assert (got["reasoning"], got["content"], got["finish"]) == ("The user wants the weather.", None, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()] == [
        ("get_weather", {"city": "Paris"})
    ]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>"
    whole, chunks = run(go(final))
    assert (whole.choices[0].message.content, whole.choices[0].message.model_extra["reasoning_content"]) == (
        "Paris.",
        "Easy.",
    )
    assert (accumulate(chunks)["content"], whole.choices[0].finish_reason) == ("Paris.", "stop")


def test_the_offline_engine_keeps_special_tokens_when_asked(harmony_model):
    """`skip_special_tokens` reaches the offline engine's detokenizer too: a special token the bias forces
    shows in the text only when asked for."""
    from batchserve.procs.engine import OfflineEngine, request
    from batchserve.shared.config import ServerConfig

    engine = OfflineEngine(
        ServerConfig(model=str(harmony_model), page_size=4, max_running_requests=2, kv_capacity_tokens=256)
    )
    channel = engine.tokenizer.convert_tokens_to_ids("<|channel|>")
    texts = {
        skip: engine.generate(
            [
                request(
                    f"r{skip}",
                    prompt="the quick",
                    sampling={"temperature": 0},
                    logits={"logit_bias": {channel: 100.0}},
                    stop={"max_tokens": 3, "ignore_eos": True, "skip_special_tokens": skip},
                )
            ]
        )[0].text
        for skip in (True, False)
    }
    assert texts[False] == "<|channel|>" * 3 and texts[True] == ""
