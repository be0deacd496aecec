"""Embedding throughput of the pooling runner against sentence-transformers on the same CPU, in one run
(issue 48): inputs/s for `--inputs` texts of 32-256 tokens, embedded by `SentenceTransformer.encode` (its
own length-sorted batches of 32) and by `batchserve serve` answering `/v1/embeddings` to `--clients`
concurrent clients (one input per request), fp32 and `--quantization int8`.

The model is random (a benchmark of speed, not of vectors): a BERT shaped like all-MiniLM-L6-v2 (6 layers,
hidden 384, 12 heads, intermediate 1536, vocabulary 30522), fp32, with mean pooling and normalisation in
its sentence-transformers files, and a word-level tokenizer (each word one token, [CLS] and [SEP] added).

    .venv/bin/python -m batchserve.loadtests.bench_embeddings [--inputs 256] [--clients 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp

from batchserve.loadtests.server_process import DEFAULT_SERVE_COMMAND, ServerProcess

MINILM = dict(
    vocab_size=30522,
    hidden_size=384,
    num_hidden_layers=6,
    num_attention_heads=12,
    intermediate_size=1536,
    max_position_embeddings=512,
)


def build(out_dir: Path) -> Path:
    """The MiniLM-shaped encoder with its tokenizer and sentence-transformers files (seed 0)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    torch.manual_seed(0)
    BertModel(BertConfig(**MINILM), add_pooling_layer=False).save_pretrained(out_dir)
    vocab = {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, **{f"w{i}": i for i in range(4, MINILM["vocab_size"])}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]"
    ).save_pretrained(out_dir)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (out_dir / "modules.json").write_text(json.dumps(modules))
    (out_dir / "1_Pooling").mkdir()
    (out_dir / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": MINILM["hidden_size"], "pooling_mode_mean_tokens": True})
    )
    (out_dir / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512}))
    return out_dir


def texts(count: int, seed: int = 0) -> list[str]:
    """`count` texts of 30-254 words (32-256 tokens with [CLS] and [SEP])."""
    rng = random.Random(seed)
    return [
        " ".join(f"w{rng.randrange(4, MINILM['vocab_size'])}" for _ in range(rng.randint(30, 254)))
        for _ in range(count)
    ]


def sentence_transformers_rate(model_dir: Path, inputs: list[str], repeats: int) -> float:
    """Inputs/s of `SentenceTransformer.encode` (batches of 32, sorted by length), the best of `repeats`."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    model.encode(inputs[:32])  # warm up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        model.encode(inputs, batch_size=32)
        best = min(best, time.perf_counter() - started)
    return len(inputs) / best


async def _clients(url: str, inputs: list[str], clients: int) -> float:
    """Seconds for `clients` concurrent clients to embed every input, one per request."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in inputs:
        queue.put_nowait(text)

    async def client(http: aiohttp.ClientSession) -> None:
        while not queue.empty():
            text = queue.get_nowait()
            async with http.post(f"{url}/v1/embeddings", json={"input": text}) as response:
                body = await response.json()
                assert response.status == 200 and len(body["data"][0]["embedding"]) == MINILM["hidden_size"], body

    async with aiohttp.ClientSession() as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        return time.perf_counter() - started


def server_rate(model_dir: Path, inputs: list[str], clients: int, repeats: int, log: Path, *flags: str) -> float:
    """Inputs/s of `batchserve serve` (`flags` added) to `clients` concurrent clients, the best of `repeats`."""
    command = [*DEFAULT_SERVE_COMMAND, "--model", str(model_dir), "--max-running-requests", str(clients), *flags]
    with ServerProcess(command, log) as server:
        asyncio.run(_clients(server.base_url, inputs[: clients * 2], clients))  # warm up
        return len(inputs) / min(asyncio.run(_clients(server.base_url, inputs, clients)) for _ in range(repeats))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "minilm")
        inputs = texts(args.inputs)
        reference = sentence_transformers_rate(model_dir, inputs, args.repeats)
        rates = {
            "batchserve fp32": server_rate(model_dir, inputs, args.clients, args.repeats, Path(tmp) / "fp32.log"),
            "batchserve int8": server_rate(
                model_dir, inputs, args.clients, args.repeats, Path(tmp) / "int8.log", "--quantization", "int8"
            ),
        }
    print(f"{args.inputs} inputs of 32-256 tokens, MiniLM-shaped BERT (6 x 384), {args.clients} clients")
    print(f"{'':24s} {'inputs/s':>9s} {'vs sentence-transformers':>25s}")
    print(f"{'sentence-transformers':24s} {reference:9.1f} {1.0:25.2f}")
    for name, rate in rates.items():
        print(f"{name:24s} {rate:9.1f} {rate / reference:25.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
