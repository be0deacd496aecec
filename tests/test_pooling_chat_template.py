"""Embedders whose sentence-transformers 6 folder lists the `message` modality (issue 66 item 6): saved by
sentence-transformers with a tokenizer that has a chat template, `encode` renders each text as one user
message through that template, so the pooling runner does too. Vectors equal to
`SentenceTransformer.encode` within 1e-4 (a flat and a structured message, a saved generation prompt,
batched and one at a time), `truncate_prompt_tokens` cutting the text inside the template, the same folder
without the modality embedding its plain text as before, and the folders that cannot be run refused at
start in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from e2e_server import http, start_server
from pooling_models import build_encoder, build_message_embedder, st_vectors, words, write_st_files

from batchserve.procs.engine import OfflineEngine, request
from batchserve.procs.tokenizer.prompts import PromptTokenizer
from batchserve.shared.config import ServerConfig
from batchserve.shared.errors import ModelLoadError, Refusal
from batchserve.shared.messages import GenerateRequest, PoolingParams, RequestParams, StopParams
from batchserve.shared.model import ModelSpec
from batchserve.shared.pooling import ChatInput, finish_vector, read_chat_input, read_pooler

TEXTS = [words(5, 10), words(17, 40), words(41, 90), words(1, 200), words(30, 150)]
# Templates over the tiny vocabulary (w5.. are words, [CLS] and [SEP] its special tokens): the first reads a
# message's content as the text itself, the second as typed parts (sentence-transformers infers "flat" and
# "structured" from their text); both wrap the text in words of their own and write the special tokens.
FLAT = (
    "{% for m in messages %}[CLS] w5 {{ m['content'] }} w6 [SEP]{% endfor %}{% if add_generation_prompt %}w7{% endif %}"
)
STRUCTURED = (
    "{% for m in messages %}[CLS] w8 w9 {{ m.content[0].text }} [SEP]{% endfor %}"
    "{% if add_generation_prompt %}w10 w11{% endif %}"
)


def engine(model_dir) -> OfflineEngine:
    fields = dict(page_size=4, max_running_requests=4, prefill_budget=64, kv_capacity_tokens=512, dtype="float32")
    return OfflineEngine(ServerConfig(model=str(model_dir), **fields))


def vectors(eng: OfflineEngine, texts: list[str], **pooling) -> np.ndarray:
    done = eng.generate([request(f"r{i}", prompt=t, pooling=pooling) for i, t in enumerate(texts)])
    return np.stack([finish_vector(c.pooled, None, True) for c in done])


def pooler(model_dir):
    return read_pooler(model_dir, json.loads((model_dir / "config.json").read_text()))


@pytest.mark.parametrize(
    "template,pooling,chat_kwargs,structured",
    [(FLAT, "mean", {}, False), (STRUCTURED, "cls", {"add_generation_prompt": True}, True)],
)
def test_vectors_equal_sentence_transformers(tmp_path, template, pooling, chat_kwargs, structured):
    """The structured template's generation prompt follows its [SEP]: still token type 0, as the tokenizer
    gives a rendering (one text), not a pair's 1."""
    model_dir = build_message_embedder(tmp_path / "embedder", template, pooling=pooling, chat_kwargs=chat_kwargs)
    saved = json.loads((model_dir / "sentence_bert_config.json").read_text())
    assert "message" in saved["modality_config"]
    assert pooler(model_dir).chat == ChatInput(structured=structured, template_kwargs=chat_kwargs)
    reference = st_vectors(model_dir, TEXTS)
    eng = engine(model_dir)
    np.testing.assert_allclose(vectors(eng, TEXTS), reference, atol=1e-4)
    np.testing.assert_allclose(np.concatenate([vectors(eng, [t]) for t in TEXTS]), reference, atol=1e-4)


def test_a_decoder_pools_its_renderings_last_token(tmp_path):
    """A Qwen3 embedder (Qwen3-Embedding's form, last-token pooling) whose saved kwargs add the generation
    prompt: its last token is the template's, after the text."""
    template = (
        "{% for m in messages %}<s> w3 {{ m['content'] }} </s>{% endfor %}{% if add_generation_prompt %} w4{% endif %}"
    )
    model_dir = build_message_embedder(
        tmp_path / "embedder", template, pooling="lasttoken", chat_kwargs={"add_generation_prompt": True}, decoder=True
    )
    assert pooler(model_dir).pooling == "last"
    reference = st_vectors(model_dir, TEXTS)
    fields = dict(page_size=4, max_running_requests=4, prefill_budget=8, kv_capacity_tokens=512, dtype="float32")
    np.testing.assert_allclose(
        vectors(OfflineEngine(ServerConfig(model=str(model_dir), **fields)), TEXTS), reference, atol=1e-4
    )


def test_the_rendering_is_sentence_transformers(tmp_path):
    """The ids the tokenizer process runs are the ones sentence-transformers' preprocess gives (the template
    writes [CLS] and [SEP], none are added), and they differ from the plain text's."""
    from sentence_transformers import SentenceTransformer

    model_dir = build_message_embedder(tmp_path / "embedder", FLAT, chat_kwargs={"add_generation_prompt": True})
    prompts = PromptTokenizer.of(ModelSpec.resolve(model_dir))
    params = RequestParams(stop=StopParams(max_tokens=0), pooling=PoolingParams())
    ours = prompts.tokenize(GenerateRequest(rid="r", prompt=TEXTS[0], params=params)).prompt_ids.tolist()
    theirs = SentenceTransformer(str(model_dir), device="cpu")[0].preprocess([TEXTS[0]])["input_ids"][0].tolist()
    assert ours == theirs == [2, 5, *(int(w[1:]) for w in TEXTS[0].split()), 6, 3, 7]
    assert ours != prompts.tokenizer.encode(TEXTS[0])


def test_through_the_server(tmp_path):
    """`batchserve serve` (its tokenizer process renders): /v1/embeddings equal to sentence-transformers', the
    usage counting the template's tokens, and /v1/score the cosine of the two rendered texts."""
    model_dir = build_message_embedder(tmp_path / "embedder", STRUCTURED, chat_kwargs={"add_generation_prompt": True})
    reference = st_vectors(model_dir, TEXTS[:2], normalize_embeddings=True)
    server = start_server(model_dir, tmp_path / "serve.log", "--kv-capacity-tokens", "512", "--max-context", "128")
    try:
        status, body = http(f"{server.url}/v1/embeddings", {"input": TEXTS[:2]})
        assert status == 200, body
        assert isinstance(body, dict)
        np.testing.assert_allclose([d["embedding"] for d in body["data"]], reference, atol=1e-4)
        assert body["usage"]["prompt_tokens"] == 5 + 17 + 2 * 6  # [CLS] w8 w9 ... [SEP] w10 w11 around each
        status, body = http(f"{server.url}/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1]})
        assert status == 200, body
        assert isinstance(body, dict)
        assert body["data"][0]["score"] == pytest.approx(float(reference[0] @ reference[1]), abs=1e-4)
    finally:
        server.stop()


def test_truncation_cuts_the_text_inside_the_template(tmp_path):
    """truncate_prompt_tokens k keeps the template's tokens and the text's last ones: k = 10 is [CLS] w5, the
    last 6 words, w6 [SEP]; fewer than the template's own 4 is refused, naming the field."""
    model_dir = build_message_embedder(tmp_path / "embedder", FLAT)
    eng = engine(model_dir)
    last_words = " ".join(TEXTS[1].split()[-6:])
    np.testing.assert_allclose(
        vectors(eng, [TEXTS[1]], truncate_prompt_tokens=10), st_vectors(model_dir, [last_words]), atol=1e-4
    )
    with pytest.raises(Refusal, match="truncate_prompt_tokens 3 is fewer than the tokens this input keeps") as refused:
        vectors(eng, [TEXTS[1]], truncate_prompt_tokens=3)
    assert refused.value.param == "truncate_prompt_tokens"


def test_without_the_modality_a_text_embeds_as_before(tmp_path):
    """The same folder with modality_config taken out (as sentence-transformers before 6 saved it): text only,
    whatever the tokenizer's template, and so here."""
    model_dir = build_message_embedder(tmp_path / "embedder", FLAT)
    path = model_dir / "sentence_bert_config.json"
    config = json.loads(path.read_text())
    del config["modality_config"], config["module_output_name"]
    path.write_text(json.dumps(config))
    assert read_chat_input(model_dir) is None and pooler(model_dir).chat is None
    reference = st_vectors(model_dir, TEXTS)
    np.testing.assert_allclose(vectors(engine(model_dir), TEXTS), reference, atol=1e-4)


def test_message_format_auto_is_read_from_the_template(tmp_path):
    """A hand-written "auto" format (sentence-transformers saves the one it inferred): structured where the
    template indexes the content's parts, as sentence-transformers infers it."""
    model_dir = build_message_embedder(tmp_path / "embedder", STRUCTURED)
    path = model_dir / "sentence_bert_config.json"
    config = json.loads(path.read_text())
    config["modality_config"]["message"]["format"] = "auto"
    path.write_text(json.dumps(config))
    assert read_chat_input(model_dir) == ChatInput(structured=True)
    np.testing.assert_allclose(vectors(engine(model_dir), TEXTS[:2]), st_vectors(model_dir, TEXTS[:2]), atol=1e-4)


def test_folders_that_cannot_run_are_refused_in_one_line(tmp_path):
    model_dir = build_message_embedder(tmp_path / "embedder", FLAT)
    path = model_dir / "sentence_bert_config.json"
    config = json.loads(path.read_text())
    config["processing_kwargs"] = {"chat_template": {"max_length": 16}}
    path.write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError, match=r"processing_kwargs.chat_template sets max_length, which this server"
    ) as e:
        pooler(model_dir)
    assert "\n" not in str(e.value)
    del config["processing_kwargs"]
    path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").unlink()  # the tokenizer's template gone, the modality still listed
    with pytest.raises(ModelLoadError, match="modality_config lists 'message', but the tokenizer has no chat template"):
        pooler(model_dir)
    # a cross-encoder whose pairs sentence-transformers would render as messages
    cross = build_encoder(tmp_path / "cross", head="classification", num_labels=1)
    write_st_files(cross, "cls", normalize=False)
    (cross / "sentence_bert_config.json").write_text(path.read_text())
    (cross / "chat_template.jinja").write_text(FLAT)
    with pytest.raises(ModelLoadError, match="modality_config lists 'message' .* not run for a cross-encoder"):
        pooler(cross)
