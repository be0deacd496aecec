"""What each `--quantization` (int8, q8_0, q4_0, q4_k by default) costs in accuracy, against `none` on the same
weights (fp32, or a GGUF file's own blocks), in one run.

- Greedy agreement over 50 prompts x 64 tokens (the 40 chat questions of the `questions` workload,
  then 10 openings of the fixed text below as plain completions; `ignore_eos`):
  - free-running: each engine generates its own 64 greedy tokens; completions identical, and the
    mean number of tokens before the first difference;
  - teacher-forced: both engines read fp32's prompt + completion in one prefill; the share of the
    64 positions where their top-1 token is the same (what a difference in the logits does to
    the next-token choice, without the divergence that one early difference causes after it).
- Perplexity on a fixed English text (`loadtests/data/english_text.txt`: public-domain passages,
  about a thousand tokens), from the prompt logprobs of each engine.

    .venv/bin/python -P -m batchserve.loadtests.quant_accuracy [--model NAME] [--prompts 50] [--tokens 64] \
        [--quantizations int8,q8_0,q4_0,q4_k]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from batchserve.loadtests.workload import QUESTIONS
from batchserve.procs.engine import Completion, OfflineEngine, request
from batchserve.shared.config import DEFAULT_MODEL, ServerConfig

TEXT = Path(__file__).parent / "data" / "english_text.txt"
GREEDY = {"temperature": 0.0}


def prompts(count: int) -> list[dict]:
    """Chat questions first, then openings of the fixed text's paragraphs (plain completions)."""
    chats = [{"messages": [{"role": "user", "content": q}]} for q in QUESTIONS]
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if p.strip()]
    openings = [{"prompt": " ".join(p.split()[: 12 + 3 * i])} for i, p in enumerate(paragraphs * 3)]
    return (chats + openings)[:count]


def generate(engine: OfflineEngine, items: list[dict], tokens: int) -> list[Completion]:
    return engine.generate(
        [
            request(f"p{i}", **item, sampling=GREEDY, stop={"max_tokens": tokens, "ignore_eos": True})
            for i, item in enumerate(items)
        ]
    )


def teacher_forced_top1(engine: OfflineEngine, sequences: list[list[int]]) -> list[list[int]]:
    """Each sequence's top-1 token after every prefix (positions 1..), from one prefill per sequence."""
    done = engine.generate(
        [
            request(
                f"t{i}", prompt_token_ids=ids, sampling=GREEDY, stop={"max_tokens": 1}, logits={"prompt_logprobs": 1}
            )
            for i, ids in enumerate(sequences)
        ]
    )
    return [[p.top_ids[0] for p in c.prompt_logprobs] for c in done]


def perplexity(engine: OfflineEngine, ids: list[int]) -> float:
    done = engine.generate(
        [request("ppl", prompt_token_ids=ids, sampling=GREEDY, stop={"max_tokens": 1}, logits={"prompt_logprobs": 0})]
    )[0]
    logprobs = [p.logprob for p in done.prompt_logprobs]
    return math.exp(-sum(logprobs) / len(logprobs))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(reference: list[Completion], a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(positions, of the generated ones, where teacher-forced top-1 tokens `a` and `b` agree; positions)."""
    agree = total = 0
    for r, x, y in zip(reference, a, b):
        start = len(r.prompt_ids) - 1  # the prediction of the first generated token
        agree += sum(p == q for p, q in zip(x[start:], y[start:]))
        total += len(x) - start
    return agree, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--quantizations", default="int8,q8_0,q4_0,q4_k")
    args = parser.parse_args()

    items = prompts(args.prompts)
    names = ["none", *args.quantizations.split(",")]
    engines = {
        q: OfflineEngine(
            ServerConfig(model=args.model, quantization=q, max_running_requests=64, kv_capacity_tokens=16384)
        )
        for q in names
    }
    text_ids = list(engines["none"].tokenizer.encode(TEXT.read_text()))
    results = {name: (generate(e, items, args.tokens), perplexity(e, text_ids)) for name, e in engines.items()}
    reference = results["none"][0]
    forced = [r.prompt_ids + r.token_ids for r in reference]
    top1 = {name: teacher_forced_top1(engine, forced) for name, engine in engines.items()}
    print(f"model {args.model}; {len(items)} prompts x {args.tokens} greedy tokens; each against none")
    print(f"{'':6s} {'identical':>10s} {'mean prefix':>12s} {'forced top-1':>13s} {'perplexity':>11s} {'/ none':>7s}")
    for name in names:
        prefixes = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(reference, results[name][0])]
        agree, total = agreement(reference, top1["none"], top1[name])
        identical = sum(p == args.tokens for p in prefixes)
        ppl = results[name][1]
        print(
            f"{name:6s} {identical:>4d} / {len(items):<3d} {sum(prefixes) / len(prefixes):>12.1f} "
            f"{100 * agree / total:>12.2f}% {ppl:>11.3f} {ppl / results['none'][1]:>7.4f}"
        )
    print(f"(perplexity on {TEXT.name}, {len(text_ids)} tokens; forced top-1: {total} positions)")


if __name__ == "__main__":
    main()
