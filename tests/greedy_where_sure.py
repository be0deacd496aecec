"""A served model's greedy tokens against transformers' where transformers is sure: the reference's greedy
tokens with each step's top-2 logit margin, then, teacher-forced (each reference step's prefix a prompt of its
own, so one close call does not end the run), the runner's token at every step whose margin exceeds the
kernels' rounding bound must be the reference's. For quantized weights checked against their de-quantized
reference (GGUF blocks, repacked folders, blocks quantized at load)."""

from __future__ import annotations

from typing import Any

import torch
from model_batches import generate_greedy


def reference_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers `model`'s greedy tokens for each prompt, with each step's top-2 margin."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            result = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            top2 = [s[0].topk(2).values for s in result.scores]
            out.append((result.sequences[0, len(prompt) :].tolist(), [float(t[0] - t[1]) for t in top2]))
    return out


def assert_greedy_where_sure(
    runner: Any, model: Any, prompts: list[list[int]], new_tokens: int, margin: float, chunk: int = 16
) -> None:
    """The runner's greedy token equals `model`'s at every step whose top-2 margin exceeds `margin`, and at
    least a third of the steps are that sure (enough to tell)."""
    steps = [
        (p + tokens[:i], tokens[i], margins[i])
        for p, (tokens, margins) in zip(prompts, reference_greedy(model, prompts, new_tokens))
        for i in range(new_tokens)
    ]
    got = generate_greedy(runner, [prefix for prefix, _, _ in steps], 1, chunk=chunk, arrival_gap=1)
    decided = [(g[0], token) for g, (_, token, m) in zip(got, steps) if m > margin]
    assert all(ours == theirs for ours, theirs in decided), decided
    assert len(decided) >= len(steps) // 3, len(decided)
