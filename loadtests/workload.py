"""Benchmark workloads: what each request asks for, and when it is sent.

A workload is a list of `RequestSpec`s generated from a seed, so every configuration in a
comparison run sees exactly the same prompts and output lengths. Arrival times come from a
separate seeded Poisson process.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class RequestSpec:
    prompt: str
    input_len: int  # intended prompt length in tokens (the prompt is built to be about this long)
    # Tokens asked for (max_tokens), with ignore_eos so the server produces exactly this many unless
    # `stop_at_eos`; None: no max_tokens at all (the openai client's default), the request ends at EOS
    # or at the end of the context.
    output_len: int | None
    temperature: float = 0.0
    seed: int | None = None  # sampling seed: with temperature > 0 the same tokens on every target
    # Multi-turn chats: turn `turn` of conversation `conversation` is sent after the turn before it
    # ended, with `history` (the system prompt, earlier questions and the answers they got) first.
    conversation: int | None = None
    turn: int = 0
    history: tuple[tuple[str, str], ...] = ()  # (role, content) messages before this turn's question
    stop_at_eos: bool = False  # with output_len: at most that many tokens, ending at EOS
    model: str = ""  # the model or LoRA adapter this request names ("": the run's --model)


def spread_over_models(specs: list[RequestSpec], models: list[str]) -> list[RequestSpec]:
    """Request i names models[i % len(models)] (a conversation: its first turn's), e.g. LoRA adapters."""
    if not models:
        return specs
    return [
        replace(s, model=models[(s.conversation if s.conversation is not None else i) % len(models)])
        for i, s in enumerate(specs)
    ]


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    @classmethod
    def parse(cls, text: str, what: str) -> LengthRange:
        """`"128"` (fixed) or `"64:256"` (uniform, inclusive)."""
        parts = text.split(":")
        try:
            values = [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"{what}: expected N or MIN:MAX, got {text!r}") from None
        if len(values) == 1:
            values = values * 2
        if len(values) != 2 or values[0] < 1 or values[1] < values[0]:
            raise ValueError(f"{what}: expected 1 <= MIN <= MAX, got {text!r}")
        return cls(values[0], values[1])

    def draw(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))


class PromptBuilder(Protocol):
    def build(self, rng: np.random.Generator, num_tokens: int) -> str: ...


# Common short English words; with a leading space each is one token in the usual BPE vocabularies,
# so a prompt of n words is about n tokens long.
WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """the of and to in is was for on that with as by at from his it an were are which this be
    has had one or first their its after new who they have her she two been other when there all
    during into school time may years more most only over city some world would where later up
    such used many can state about national out known university united then made under film also
    team through these season year well being both including war while will between american
    series part three since second team same well each home work game back people life day house
    water music book open light field power story right long place small great old land high
    line road night name river early family group round head hand point food young word fire
    church music side table green black white red blue south north east west king party data""".split()
    )
)


class WordPromptBuilder:
    """Prompts of random common words: no tokenizer needed, length in tokens approximately right."""

    def build(self, rng: np.random.Generator, num_tokens: int) -> str:
        idx = rng.integers(0, len(WORDS), size=num_tokens)
        return " ".join(WORDS[i] for i in idx)


class TokenizerPromptBuilder:
    """Prompts decoded from random token ids of the model's own tokenizer (as vLLM's random dataset).

    Decoding then re-encoding can merge or split tokens, so the text is re-encoded and cut to
    `num_tokens` once; the result is within a few tokens of the target.
    """

    def __init__(self, tokenizer_json: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_json))
        special = set(self.tokenizer.get_added_tokens_decoder())
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=False)
        self.ids = np.array([i for i in range(vocab) if i not in special], dtype=np.int64)
        if len(self.ids) == 0:
            raise ValueError(f"{tokenizer_json}: tokenizer has no ordinary tokens")

    def build(self, rng: np.random.Generator, num_tokens: int) -> str:
        ids = rng.choice(self.ids, size=num_tokens).tolist()
        text = self.tokenizer.decode(ids)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids[:num_tokens]
        return self.tokenizer.decode(ids)


def random_workload(
    num_prompts: int, input_len: LengthRange, output_len: LengthRange, seed: int, builder: PromptBuilder
) -> list[RequestSpec]:
    """`num_prompts` requests with lengths drawn uniformly from the ranges; same seed, same workload."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(num_prompts):
        n_in, n_out = input_len.draw(rng), output_len.draw(rng)
        specs.append(RequestSpec(builder.build(rng, n_in), n_in, n_out))
    return specs


@dataclass(frozen=True)
class ChatClass:
    """One kind of chat traffic: how often it occurs, how long its prompt and answer are."""

    name: str
    weight: float
    instruction: str
    input_len: LengthRange
    output_len: LengthRange


# A chat-like mix: mostly short questions, some longer conversations, a few long documents.
CHAT_MIX: tuple[ChatClass, ...] = (
    ChatClass("short question", 0.55, "Answer briefly:", LengthRange(16, 96), LengthRange(24, 128)),
    ChatClass("conversation", 0.25, "Continue this conversation:", LengthRange(128, 512), LengthRange(48, 192)),
    ChatClass("summary", 0.12, "Summarize the following notes:", LengthRange(512, 1280), LengthRange(64, 160)),
    ChatClass("code", 0.08, "Write code that does the following:", LengthRange(64, 256), LengthRange(128, 320)),
)


def chat_workload(
    num_prompts: int, seed: int, builder: PromptBuilder, mix: Sequence[ChatClass] = CHAT_MIX
) -> list[RequestSpec]:
    """`num_prompts` requests whose kind is drawn from `mix` by weight; same seed, same workload."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    weights = np.array([c.weight for c in mix], dtype=np.float64)
    kinds = rng.choice(len(mix), size=num_prompts, p=weights / weights.sum())
    specs = []
    for k in kinds:
        kind = mix[int(k)]
        n_in, n_out = kind.input_len.draw(rng), kind.output_len.draw(rng)
        body = builder.build(rng, max(1, n_in - len(kind.instruction.split())))
        specs.append(RequestSpec(f"{kind.instruction} {body}", n_in, n_out))
    return specs


# Everyday chat questions, answered until the model's EOS: the traffic of clients that send no max_tokens.
QUESTIONS: tuple[str, ...] = (
    "What is the capital of France?",
    "How do I boil an egg?",
    "Why is the sky blue?",
    "What are three tips for better sleep?",
    "Explain photosynthesis to a child.",
    "What is a prime number?",
    "Write a haiku about the sea.",
    "How does a refrigerator keep food cold?",
    "What is the difference between weather and climate?",
    "Give me a recipe for pancakes.",
    "What causes the seasons on Earth?",
    "How do vaccines work?",
    "Suggest a name for a pet turtle.",
    "What is machine learning?",
    "How many continents are there, and what are they?",
    "Write a short poem about autumn leaves.",
    "What should I pack for a weekend camping trip?",
    "How do airplanes stay in the air?",
    "What is the Pythagorean theorem?",
    "Explain what a CPU does.",
    "How can I save money on groceries?",
    "What is the tallest mountain in the world?",
    "Describe a cat in three sentences.",
    "How do I make a good cup of coffee?",
    "What is the water cycle?",
    "Why do leaves change colour in autumn?",
    "What is a black hole?",
    "Give me three ideas for a rainy day.",
    "How does the internet work?",
    "What is the meaning of the word 'ephemeral'?",
    "How do bees make honey?",
    "What is inflation?",
    "Write a limerick about a frog.",
    "How do I start learning to play the guitar?",
    "What are the planets in our solar system?",
    "Why is exercise good for you?",
    "What is a noun?",
    "How does a rainbow form?",
    "Tell me a fun fact about octopuses.",
    "What is the speed of light?",
)
QUESTION_TEMPERATURE = 0.7  # a usual chat setting; every request carries its own seed


def questions_workload(num_prompts: int, seed: int) -> list[RequestSpec]:
    """`num_prompts` chat questions (cycled in a seeded order) with no max_tokens, sampled at
    QUESTION_TEMPERATURE with a per-request seed: every target generates the very same tokens."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(QUESTIONS))
    seeds = rng.integers(0, 2**31 - 1, size=num_prompts)
    return [
        RequestSpec(
            QUESTIONS[order[i % len(QUESTIONS)]],
            len(QUESTIONS[order[i % len(QUESTIONS)]].split()),
            None,
            QUESTION_TEMPERATURE,
            int(seeds[i]),
        )
        for i in range(num_prompts)
    ]


EDITS = (
    "Rewrite the following text with every 'that' replaced by 'which'. Reply with the rewritten text only.",
    "Repeat the following text word for word.",
    "Rewrite the following text, writing 'nation' as 'country' and changing nothing else.",
    "Copy the following text, starting every sentence on a new line.",
)
PASSAGES = Path(__file__).parent / "data" / "english_text.txt"  # public-domain passages


def editing_workload(num_prompts: int, seed: int) -> list[RequestSpec]:
    """`num_prompts` chat requests to edit a passage (of `PASSAGES`) that the answer mostly repeats:
    the work speculative decoding by prompt lookup is for. Greedy, ending at EOS (or at twice the
    passage's words, should a model ramble), so every target computes the same tokens."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    passages = [p.strip() for p in PASSAGES.read_text().split("\n\n") if len(p.split()) >= 20]
    rng = np.random.default_rng(seed)
    specs = []
    for _ in range(num_prompts):
        passage = passages[int(rng.integers(len(passages)))]
        prompt = f"{EDITS[int(rng.integers(len(EDITS)))]}\n\n{passage}"
        specs.append(RequestSpec(prompt, len(prompt.split()) * 4 // 3, 2 * len(passage.split()), stop_at_eos=True))
    return specs


def multiturn_workload(
    conversations: int, turns: int, system_tokens: int, output_len: int, seed: int, builder: PromptBuilder
) -> list[RequestSpec]:
    """`conversations` chats of `turns` questions each behind one shared `system_tokens`-token system
    prompt; every turn resends the whole history (its answers are filled in as the run goes).
    Answers are `output_len` tokens (ignore_eos), greedy, so every target computes the same work."""
    if conversations < 1 or turns < 1 or system_tokens < 0:
        raise ValueError(
            f"need conversations >= 1, turns >= 1, system_tokens >= 0; got {conversations}, {turns}, {system_tokens}"
        )
    rng = np.random.default_rng(seed)
    system = builder.build(rng, system_tokens) if system_tokens else ""
    history = (("system", system),) if system else ()
    specs = []
    for c in range(conversations):
        for t in range(turns):
            question = f"{QUESTIONS[int(rng.integers(len(QUESTIONS)))]} {builder.build(rng, 8)}"
            specs.append(
                RequestSpec(
                    question,
                    system_tokens + t * (output_len + 20) + 20,
                    output_len,
                    conversation=c,
                    turn=t,
                    history=history,
                )
            )
    return specs


def poisson_arrivals(num_requests: int, request_rate: float, seed: int) -> list[float]:
    """Send times (seconds from start) of a Poisson process at `request_rate`; inf: all at once."""
    if request_rate <= 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=num_requests)
    gaps[0] = 0.0  # the first request starts the clock
    return np.cumsum(gaps).tolist()
