"""BERT-style encoders on the pooling runner (issue 48): `BertModel` and `XLMRobertaModel` with bidirectional
attention, vectors equal to sentence-transformers' within 1e-4 (mean and CLS pooling, batched and one at a
time, on the cpu and torch attention backends); each input runs whole in one step, so one longer than the
prefill budget is refused and the others wait for a step with room; int8 weights stay close. Cross-encoders
(`BertForSequenceClassification`, `XLMRobertaForSequenceClassification`): scores equal to
`CrossEncoder.predict`, and the head's files read or refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pooling_models import build_encoder, st_vectors, words, write_st_files

from batchserve.procs.engine import OfflineEngine, request
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import ModelLoadError, Refusal
from batchserve.shared.pooling import finish_vector, read_pooler

TEXTS = [words(5, 10), words(17, 40), words(41, 90), words(1, 200), words(60, 7), words(30, 150)]


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(arch, pooling) -> a sentence-transformers encoder folder, built once."""
    built = {}

    def get(arch: str, pooling: str):
        if (arch, pooling) not in built:
            folder = build_encoder(tmp_path_factory.mktemp(f"{arch}-{pooling}"), arch)
            built[arch, pooling] = write_st_files(folder, pooling, normalize=True)
        return built[arch, pooling]

    return get


def engine(model_dir, **config) -> OfflineEngine:
    fields = dict(page_size=4, max_running_requests=4, prefill_budget=64, kv_capacity_tokens=512, dtype="float32")
    return OfflineEngine(ServerConfig(model=str(model_dir), **{**fields, **config}))


def vectors(eng: OfflineEngine, texts: list[str]) -> np.ndarray:
    done = eng.generate([request(f"r{i}", prompt=t, pooling={}) for i, t in enumerate(texts)])
    return np.stack([finish_vector(c.pooled, None, True) for c in done])


@pytest.mark.parametrize(
    "arch,pooling,backend", [("bert", "mean", "cpu"), ("bert", "cls", "torch"), ("xlm_roberta", "mean", "torch")]
)
def test_vectors_equal_sentence_transformers(encoders, arch, pooling, backend):
    model_dir = encoders(arch, pooling)
    reference = st_vectors(model_dir, TEXTS)
    eng = engine(model_dir, attention_backend=backend)
    np.testing.assert_allclose(vectors(eng, TEXTS), reference, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([vectors(eng, [t]) for t in TEXTS]), reference, atol=1e-4)


def test_inputs_run_whole(encoders):
    """Budget 64: the 60-token input waits for a step of its own rather than being cut into chunks (a
    chunk would not see the tokens after it), and a 65-token input is refused at once, naming it."""
    model_dir = encoders("bert", "mean")
    eng = engine(model_dir)
    steps: list[list[tuple[str, int]]] = []
    step = eng.scheduler.step
    eng.scheduler.step = lambda executor: steps.append((out := step(executor)).prefill) or out
    np.testing.assert_allclose(vectors(eng, TEXTS), st_vectors(model_dir, TEXTS), atol=1e-4)
    lengths = {f"r{i}": len(t.split()) + 2 for i, t in enumerate(TEXTS)}  # [CLS] text [SEP]
    assert all(n == lengths[rid] for prefill in steps for rid, n in prefill)  # never a chunk
    assert all(sum(n for _, n in prefill) <= 64 for prefill in steps)
    with pytest.raises(Refusal, match="an input runs whole in one step, and this one's 65 tokens exceed the prefill"):
        eng.generate([request("long", prompt=words(63, 0), pooling={})])


def test_truncation_keeps_the_special_tokens(encoders):
    """truncate_prompt_tokens k keeps a text's last tokens with its [CLS] and [SEP] (cut before they are
    added, as vLLM and transformers cut): k = 8 is [CLS], the last 6 words, [SEP]."""
    model_dir = encoders("bert", "cls")
    done = engine(model_dir).generate([request("cut", prompt=TEXTS[1], pooling={"truncate_prompt_tokens": 8})])
    last_words = " ".join(TEXTS[1].split()[-6:])
    np.testing.assert_allclose(
        finish_vector(done[0].pooled, None, True), st_vectors(model_dir, [last_words])[0], atol=1e-4
    )
    with pytest.raises(Refusal, match="truncate_prompt_tokens 1 is fewer than the tokens this input keeps") as refused:
        engine(model_dir).generate([request("tiny", prompt=TEXTS[1], pooling={"truncate_prompt_tokens": 1})])
    assert refused.value.param == "truncate_prompt_tokens"


def test_int8_weights_stay_close(encoders):
    model_dir = encoders("bert", "mean")
    reference = st_vectors(model_dir, TEXTS)
    ours = vectors(engine(model_dir, quantization="int8"), TEXTS)
    assert float(np.min(np.sum(ours * reference, axis=1))) > 0.999  # cosine similarity to the fp32 vectors


@pytest.mark.parametrize("arch", ["bert", "xlm_roberta"])
def test_cross_encoder_scores_equal_sentence_transformers(tmp_path, arch):
    """A pair is one input, joined by the tokenizer (BERT's second text of token type 1); its score is the
    head's logit through the activation sentence-transformers applies (sigmoid for one label)."""
    from sentence_transformers import CrossEncoder

    model_dir = build_encoder(tmp_path / "cross-encoder", arch, head="classification", num_labels=1)
    pooler = read_pooler(model_dir, json.loads((model_dir / "config.json").read_text()))
    assert (pooler.kind, pooler.pooling, pooler.activation) == ("classify", "cls", "sigmoid")
    pairs = [(words(4, 10), words(9, 50)), (words(4, 10), words(30, 80)), (words(12, 3), words(2, 200))]
    done = engine(model_dir).generate(
        [request(f"r{i}", prompt=a, prompt_pair=b, pooling={}) for i, (a, b) in enumerate(pairs)]
    )
    scores = [pooler.score(float(finish_vector(c.pooled, None, False)[0])) for c in done]
    np.testing.assert_allclose(scores, CrossEncoder(str(model_dir), device="cpu").predict(pairs), atol=1e-4)


def test_cross_encoder_files(tmp_path):
    model_dir = build_encoder(tmp_path / "cross-encoder", head="classification", num_labels=2)
    raw = json.loads((model_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="a cross-encoder scores with one label, this one has 2"):
        read_pooler(model_dir, raw)
    raw.update(id2label={"0": "LABEL_0"})
    (model_dir / "config_sentence_transformers.json").write_text(
        json.dumps({"activation_fn": "torch.nn.modules.linear.Identity", "model_type": "CrossEncoder"})
    )
    assert read_pooler(model_dir, raw).score(-3.5) == -3.5  # the raw logit
    with pytest.raises(ModelLoadError, match="a cross-encoder's head reads its .CLS. token"):
        read_pooler(model_dir, raw, "mean")


def test_remote_code_models_are_refused_in_one_line(tmp_path):
    """nomic-embed-text and gte-v1.5 define their architecture in their own folder (auto_map)."""
    from batchserve.procs.worker.loader import load_model_config
    from batchserve.shared.model import ModelSpec

    model_dir = build_encoder(tmp_path / "nomic")
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(architectures=["NomicBertModel"], auto_map={"AutoModel": "modeling_hf_nomic_bert.NomicBertModel"})
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ModelLoadError, match="NomicBertModel is defined by code in its own folder .* trust_remote_code"
    ):
        load_model_config(ModelSpec.resolve(model_dir))
