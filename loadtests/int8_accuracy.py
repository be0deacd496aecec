"""What `--quantization int8` costs in accuracy, against fp32 on the same weights, in one run.

- Greedy agreement over 50 prompts x 64 tokens (the 40 chat questions of the `questions` workload,
  then 10 openings of the fixed text below as plain completions; `ignore_eos`):
  - free-running: each engine generates its own 64 greedy tokens; completions identical, and the
    mean number of tokens before the first difference;
  - teacher-forced: both engines read fp32's prompt + completion in one prefill; the share of the
    64 positions where their top-1 token is the same (what a difference in the logits does to
    the next-token choice, without the divergence that one early difference causes after it).
- Perplexity on a fixed English text (`loadtests/data/english_text.txt`: public-domain passages,
  about a thousand tokens), from the prompt logprobs of each engine.

    .venv/bin/python -m batchserve.loadtests.int8_accuracy [--model NAME] [--prompts 50] [--tokens 64]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()

    items = prompts(args.prompts)
    engines = {
        q: OfflineEngine(
            ServerConfig(model=args.model, quantization=q, max_running_requests=64, kv_capacity_tokens=65536)
        )
        for q in ("none", "int8")
    }
    text_ids = list(engines["none"].tokenizer.encode(TEXT.read_text()))
    results = {}
    for name, engine in engines.items():
        results[name] = (generate(engine, items, args.tokens), perplexity(engine, text_ids))
    reference, candidate = results["none"][0], results["int8"][0]
    prefixes = [common_prefix(a.token_ids, b.token_ids) for a, b in zip(reference, candidate)]
    forced = [r.prompt_ids + r.token_ids for r in reference]
    top1 = {name: teacher_forced_top1(engine, forced) for name, engine in engines.items()}
    agree = total = 0
    for r, a, b in zip(reference, top1["none"], top1["int8"]):
        start = len(r.prompt_ids) - 1  # the prediction of the first generated token
        agree += sum(x == y for x, y in zip(a[start:], b[start:]))
        total += len(a) - start

    print(f"model {args.model}; {len(items)} prompts x {args.tokens} greedy tokens; fp32 (none) vs int8")
    print(f"  identical completions                    {sum(p == args.tokens for p in prefixes)} / {len(items)}")
    print(
        f"  tokens before the first difference       mean {sum(prefixes) / len(prefixes):.1f}, "
        f"median {sorted(prefixes)[len(prefixes) // 2]} (of {args.tokens})"
    )
    print(f"  teacher-forced top-1 agreement           {agree} / {total} = {100 * agree / total:.2f} %")
    print(f"perplexity on {TEXT.name} ({len(text_ids)} tokens)")
    for name, (_, ppl) in results.items():
        print(f"  {name:5s} {ppl:8.3f}")
    print(f"  int8 / fp32 perplexity: {results['int8'][1] / results['none'][1]:.4f}")


if __name__ == "__main__":
    main()
