"""The pooling runner (issue 48) on tiny decoder embedders, through the offline engine (tokenizer,
scheduler and worker code in one process): vectors equal to sentence-transformers' within 1e-4 for
last-token, mean and CLS pooling, normalised or not, batched and one at a time, with prompts chunked by a
small prefill budget and with a pool small enough that they wait for each other; a checkpoint saved
without its LM head (`Qwen3Model`, Qwen3-Embedding's layout); Matryoshka cuts; the pooling rule read
from the model's files and refused where they name what this server does not run; a decoder reranker
(Qwen3-Reranker's form) scoring as `CrossEncoder.predict`."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pooling_models import build_decoder_reranker, build_st_embedder, st_vectors, words

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import ModelLoadError, Refusal
from batchserve.shared.pooling import PoolerConfig, finish_vector, pooler_for, read_pooler, runner_for

TEXTS = [words(5, 0), words(17, 40), words(41, 90), words(3, 200), words(12, 7)]


def engine_vectors(
    model_dir,
    texts,
    *,
    prefill_budget=8,
    kv_capacity_tokens=256,
    normalize=True,
    one_by_one=False,
    dimensions=None,
    **config,
) -> np.ndarray:
    """The engine's vectors of `texts` (chunks of at most `prefill_budget` tokens), finished as the api does."""
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            max_running_requests=4,
            prefill_budget=prefill_budget,
            kv_capacity_tokens=kv_capacity_tokens,
            dtype="float32",
            **config,
        )
    )
    pooling = {} if dimensions is None else {"dimensions": dimensions}
    batches = [[t] for t in texts] if one_by_one else [texts]
    done = [
        c
        for batch in batches
        for c in engine.generate([request(f"r{i}", prompt=t, pooling=pooling) for i, t in enumerate(batch)])
    ]
    assert all(c.finish_reason == "stop" and not c.token_ids for c in done)
    return np.stack([finish_vector(c.pooled, dimensions, normalize) for c in done])


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_vectors_equal_sentence_transformers(tmp_path, pooling):
    model_dir = build_st_embedder(tmp_path / "model", pooling=pooling)
    reference = st_vectors(model_dir, TEXTS)
    np.testing.assert_allclose(engine_vectors(model_dir, TEXTS), reference, atol=1e-4)
    # one at a time, and whole prompts in one chunk each
    np.testing.assert_allclose(
        engine_vectors(model_dir, TEXTS, one_by_one=True, prefill_budget=64), reference, atol=1e-4
    )


def test_unnormalised_mean_on_llama_and_waiting_for_kv(tmp_path):
    """No Normalize module: raw means. A pool of 64 tokens holds one long prompt at a time: the others wait
    in the queue and are admitted as each finishes (its KV freed at once, none cached)."""
    model_dir = build_st_embedder(tmp_path / "model", "llama", pooling="mean", normalize=False)
    reference = st_vectors(model_dir, TEXTS)
    assert abs(float(np.linalg.norm(reference[0])) - 1.0) > 1e-3  # really not normalised
    ours = engine_vectors(model_dir, TEXTS, normalize=False, kv_capacity_tokens=64)
    np.testing.assert_allclose(ours, reference, atol=1e-4)


def test_headless_checkpoint_is_served_by_the_pooling_runner(tmp_path):
    model_dir = build_st_embedder(tmp_path / "model", headless=True)
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]
    assert runner_for("auto", model_dir, "Qwen3Model") == "pooling"
    np.testing.assert_allclose(engine_vectors(model_dir, TEXTS[:3]), st_vectors(model_dir, TEXTS[:3]), atol=1e-4)
    with pytest.raises(ModelLoadError, match="no LM head.*--runner pooling"):
        OfflineEngine(ServerConfig(model=str(model_dir), runner="generate", kv_capacity_tokens=256))


def test_matryoshka_dimensions(tmp_path):
    model_dir = build_st_embedder(tmp_path / "model", matryoshka_dimensions=[16, 32])
    reference = st_vectors(model_dir, TEXTS, truncate_dim=16)
    reference /= np.linalg.norm(reference, axis=1, keepdims=True)  # cut, then normalised (vLLM's, OpenAI's)
    np.testing.assert_allclose(engine_vectors(model_dir, TEXTS, dimensions=16), reference, atol=1e-4)
    pooler = read_pooler(model_dir, json.loads((model_dir / "config.json").read_text()))
    pooler.check_dimensions(32)
    with pytest.raises(Refusal, match="not one this model was trained for: 16, 32") as refused:
        pooler.check_dimensions(24)
    assert refused.value.param == "dimensions"
    with pytest.raises(Refusal, match="does not support matryoshka"):
        PoolerConfig(pooling="last", normalize=True).check_dimensions(16)
    with pytest.raises(Refusal, match="between 1 and the model's embedding size 64"):
        PoolerConfig(pooling="last", normalize=True, matryoshka=True, hidden_size=64).check_dimensions(65)


def test_pooling_rule_from_the_files(tmp_path):
    model_dir = build_st_embedder(tmp_path / "model", pooling="mean")
    raw = json.loads((model_dir / "config.json").read_text())
    assert read_pooler(model_dir, raw) == PoolerConfig(
        pooling="mean", normalize=True, source="modules.json", hidden_size=64
    )
    assert read_pooler(model_dir, raw, "cls").pooling == "cls"  # --pooling wins
    assert runner_for("auto", model_dir, raw["architectures"][0]) == "pooling"  # modules.json says so
    # a generative folder: the generate runner, unless asked
    (model_dir / "modules.json").rename(model_dir / "modules.off")
    assert pooler_for(model_dir, "Qwen3ForCausalLM", raw, "auto") is None
    assert pooler_for(model_dir, "Qwen3ForCausalLM", raw, "pooling") == PoolerConfig(
        pooling="last", normalize=True, hidden_size=64
    )
    with pytest.raises(ModelLoadError, match="--pooling mean needs the pooling runner"):
        pooler_for(model_dir, "Qwen3ForCausalLM", raw, "generate", "mean")
    (model_dir / "modules.off").rename(model_dir / "modules.json")
    modules = json.loads((model_dir / "modules.json").read_text())
    (model_dir / "modules.json").write_text(
        json.dumps(modules + [{"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}])
    )
    with pytest.raises(ModelLoadError, match="module.s. Dense are not run by this server"):
        read_pooler(model_dir, raw)
    (model_dir / "modules.json").write_text(json.dumps(modules))
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ModelLoadError, match="exactly one of .*got pooling_mode_max_tokens"):
        read_pooler(model_dir, raw)
    (model_dir / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "lasttoken"}))  # ST 6's spelling
    assert read_pooler(model_dir, raw).pooling == "last"


def test_pooling_requests_are_refused_where_they_cannot_run(tmp_path, tiny_model_dir):
    model_dir = build_st_embedder(tmp_path / "model")
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            max_running_requests=2,
            kv_capacity_tokens=256,
            max_context=32,
            dtype="float32",
        )
    )
    with pytest.raises(Refusal, match="maximum context length is 32 tokens; this input has 40"):
        engine.generate([request("long", prompt=words(40, 0), pooling={})])
    done = engine.generate([request("cut", prompt=words(40, 0), pooling={"truncate_prompt_tokens": 32})])
    assert len(done[0].pooled) == 64 * 4  # the input's last 32 tokens, pooled
    np.testing.assert_allclose(
        finish_vector(done[0].pooled, None, True),
        engine_vectors(model_dir, [words(32, 8)], max_context=32)[0],
        atol=1e-5,
    )
    with pytest.raises(Refusal, match="it answers /v1/embeddings only, no generation"):
        engine.generate([request("gen", prompt=words(4, 0))])
    generator = OfflineEngine(
        ServerConfig(model=str(tiny_model_dir("qwen3", with_tokenizer=True)), kv_capacity_tokens=256)
    )
    with pytest.raises(Refusal, match="it computes no embeddings"):
        generator.generate([request("emb", prompt=words(4, 0), pooling={})])


def test_decoder_reranker_scores_equal_sentence_transformers(tmp_path):
    """A decoder reranker (sentence-transformers 6's CrossEncoder of a text-generation Transformer and a
    LogitScore, Qwen3-Reranker's form): a pair is a "query" and a "document" message rendered by the chat
    template; its score is sigmoid(logit(yes) - logit(no)) at the last token, here through chunks of 16."""
    from sentence_transformers import CrossEncoder

    model_dir = build_decoder_reranker(tmp_path / "reranker")
    pooler = read_pooler(model_dir, json.loads((model_dir / "config.json").read_text()))
    assert (pooler.kind, pooler.pooling, pooler.activation, len(pooler.logit_tokens)) == (
        "classify",
        "last",
        "sigmoid",
        2,
    )
    pairs = [
        ("the quick fox", "the lazy dog jumps over the fox"),
        ("a", "b"),
        ("name age", "the quick brown fox jumps over the lazy dog " * 3),
    ]
    engine = OfflineEngine(
        ServerConfig(
            model=str(model_dir),
            page_size=4,
            max_running_requests=4,
            prefill_budget=16,
            kv_capacity_tokens=1024,
            dtype="float32",
        )
    )
    done = engine.generate(
        [
            request(f"r{i}", messages=[{"role": "query", "content": a}, {"role": "document", "content": b}], pooling={})
            for i, (a, b) in enumerate(pairs)
        ]
    )
    scores = [pooler.score(float(finish_vector(c.pooled, None, False)[0])) for c in done]
    np.testing.assert_allclose(scores, CrossEncoder(str(model_dir), device="cpu").predict(pairs), atol=1e-4)
