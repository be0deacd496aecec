"""CUDA only (skipped elsewhere): the flashinfer backend against the torch reference, and CUDA-graph
replay against eager, on tiny random models (head_dim 64) in bfloat16."""

from __future__ import annotations

import pytest
import torch
from model_batches import generate_greedy
from test_graph_runner import PAGE_SIZE, decode_batch, prefill, prompts_for

from batchserve.kernels.attention import AttentionMetadata, create_backend
from batchserve.kernels.kv_cache import KVCache
from batchserve.procs.worker.graph_runner import DecodeGraphRunner
from batchserve.procs.worker.lora.step import load_lora_adapter
from batchserve.procs.worker.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return True


needs_flashinfer = pytest.mark.skipif(not flashinfer_importable(), reason="needs flashinfer")
DEVICE = torch.device("cuda")
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir(
        "llama",
        hidden_size=HEADS * HEAD_DIM,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        intermediate_size=512,
    )


def cuda_runner(model_dir, backend: str, graphs: bool, **kwargs) -> ModelRunner:
    return ModelRunner(
        model_dir,
        device="cuda",
        dtype="bfloat16",
        page_size=PAGE_SIZE,
        kv_capacity_tokens=1024,
        max_running_requests=10,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        **kwargs,
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)  # bitwise comparison that treats NaN garbage like any other value


# -- attention level --------------------------------------------------------------------------------


def random_cache(seed: int = 0) -> KVCache:
    cache = KVCache(
        num_layers=1,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        page_size=16,
        num_pages=64,
        max_running_requests=4,
        max_pages_per_request=8,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    for pool in (*cache.k, *cache.v):
        pool[1:] = torch.randn(pool[1:].shape, generator=generator, device=DEVICE, dtype=torch.bfloat16)
    cache.page_table[0, :3] = torch.tensor([5, 9, 2], dtype=torch.int32)
    cache.page_table[1, :1] = torch.tensor([7], dtype=torch.int32)
    cache.page_table[2, :4] = torch.tensor([11, 30, 13, 14], dtype=torch.int32)
    cache.page_table[3, :2] = torch.tensor([40, 41], dtype=torch.int32)
    return cache


def kv_locs_for(cache: KVCache, slots, prefix_lens, extend_lens, num_padding: int = 0) -> torch.Tensor:
    table = cache.page_table.cpu().numpy()
    locs = [
        int(table[s, p // 16]) * 16 + p % 16
        for s, pre, ext in zip(slots, prefix_lens, extend_lens)
        for p in range(pre, pre + ext)
    ]
    locs[len(locs) - num_padding :] = [0] * num_padding
    return torch.tensor(locs, dtype=torch.int64, device=DEVICE)


def attend(backend, metadata: AttentionMetadata, q, k, v, graph: bool = False, sinks=None) -> torch.Tensor:
    (backend.plan_cuda_graph if graph else backend.plan)(metadata)
    return backend.forward(q, k, v, 0, sinks)


@needs_flashinfer
@pytest.mark.parametrize(
    "slots, prefix_lens, extend_lens",
    [
        ([0, 1, 2], [20, 0, 30], [1, 10, 17]),  # decode + fresh prefill + chunk after a cached prefix
        ([0, 2, 3], [33, 50, 16], [1, 1, 1]),  # decode only
        ([0, 2, 3], [33, 50, 16], [3, 3, 3]),  # decode rows of 3 tokens
    ],
)
@pytest.mark.parametrize(
    "window, softcap, sinks",
    [(0, 0.0, False), (8, 0.0, False), (8, 30.0, False), (8, 0.0, True)],
    ids=["full", "window-8", "softcap", "sinks"],
)
def test_flashinfer_matches_torch(slots, prefix_lens, extend_lens, window, softcap, sinks):
    """Also a sliding window shorter than every context (window_left), Gemma 2's soft-capped scores and
    gpt-oss's attention sinks (flashinfer's return_lse and the keys' share beside the sink)."""
    cache = random_cache()
    metadata = AttentionMetadata(
        slots=slots,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        kv_locs=kv_locs_for(cache, slots, prefix_lens, extend_lens),
    )
    tokens = sum(extend_lens)
    q = torch.randn(tokens, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    scale = HEAD_DIM**-0.5
    sink = torch.linspace(-1.0, 3.0, HEADS, device=DEVICE) if sinks else None
    expected = attend(
        create_backend("torch", cache, HEADS, KV_HEADS, HEAD_DIM, scale, (window,), softcap),
        metadata,
        q,
        k,
        v,
        sinks=sink,
    )
    got = attend(
        create_backend("flashinfer", cache, HEADS, KV_HEADS, HEAD_DIM, scale, (window,), softcap),
        metadata,
        q,
        k,
        v,
        sinks=sink,
    )
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


@needs_flashinfer
def test_flashinfer_graph_plan_pads_with_the_dummy_page():
    cache = random_cache()
    backend = create_backend("flashinfer", cache, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    backend.init_cuda_graphs([1, 2, 4])
    slots, prefix_lens, extend_lens = [2, 0, 0, 0], [40, 5, 0, 0], [1, 1, 1, 1]
    metadata = AttentionMetadata(
        slots=slots,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        kv_locs=kv_locs_for(cache, slots, prefix_lens, extend_lens, 2),
        num_padding=2,
    )
    q = torch.randn(4, HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    k = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn(4, KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    real_pages = [bits(t[1:]).clone() for t in (*cache.k, *cache.v)]
    got = attend(backend, metadata, q, k, v, graph=True)
    reference = create_backend("torch", cache, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    expected = attend(reference, metadata, q, k, v)
    torch.testing.assert_close(got[:2].float(), expected[:2].float(), atol=2e-2, rtol=2e-2)
    # a padded row attends to the dummy page alone: its output is the V it wrote there
    assert torch.isfinite(got[2:]).all()
    locs = metadata.kv_locs[:2].tolist()
    for before, pool in zip(real_pages, (*cache.k, *cache.v)):
        after = bits(pool[1:]).flatten(0, 1)
        changed = torch.nonzero((after != before.flatten(0, 1)).any(-1).any(-1)).flatten() + 16
        assert set(changed.tolist()) <= set(locs)


# -- model level ------------------------------------------------------------------------------------


@needs_flashinfer
def test_graph_replay_tokens_match_eager_and_torch(model_dir):
    prompts = prompts_for(8, seed=1)
    outputs = {}
    for label, backend, graphs in (
        ("graphs", "flashinfer", True),
        ("eager", "flashinfer", False),
        ("torch", "torch", False),
    ):
        runner = cuda_runner(model_dir, backend, graphs)
        if label == "graphs":
            assert runner.graph_runner.uses_cuda_graphs
        outputs[label] = (generate_greedy(runner, prompts, 6), generate_greedy(runner, prompts, 6, arrival_gap=1))
        if label == "graphs":
            assert set(runner.graph_runner.steps_per_size) >= {1, 2, 4, 8}  # staggered arrivals hit every size
        del runner
    assert outputs["graphs"] == outputs["eager"]
    assert outputs["graphs"] == outputs["torch"]


@needs_flashinfer
def test_capture_and_padded_replay_touch_only_the_dummy_page(model_dir):
    runner = cuda_runner(model_dir, "flashinfer", graphs=False)
    cache = runner.kv_cache
    requests = prefill(runner, prompts_for(3, seed=2), slots=[5, 6, 7])
    snapshot = [bits(t).clone() for t in (*cache.k_flat, *cache.v_flat)]
    graph_runner = DecodeGraphRunner(runner.model, runner.attention, cache, max_batch_size=8)
    assert graph_runner.uses_cuda_graphs and graph_runner.capture_seconds > 0
    for before, pool in zip(snapshot, (*cache.k_flat, *cache.v_flat)):
        assert torch.equal(before[PAGE_SIZE:], bits(pool)[PAGE_SIZE:]), "capture wrote outside the dummy page"
    runner.graph_runner = graph_runner
    batch = decode_batch(requests)
    with torch.inference_mode():
        padded = runner.forward_logits(batch)
    assert graph_runner.steps_per_size[4] == 1
    real_locs = set(batch.kv_locs.tolist())
    for before, pool in zip(snapshot, (*cache.k_flat, *cache.v_flat)):
        changed = torch.nonzero((before != bits(pool)).flatten(1).any(dim=1)).flatten().tolist()
        assert set(changed) - set(range(PAGE_SIZE)) == real_locs
    runner.graph_runner = None
    with torch.inference_mode():
        eager = runner.forward_logits(batch)
    torch.testing.assert_close(padded, eager, atol=5e-2, rtol=5e-2)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))


def random_adapter(folder, model_dir, seed: int, rank: int = 8):
    """A PEFT folder of random pairs on every layer's q, v and down projections (written directly: the GPU
    box has no peft), B large enough to change the greedy tokens."""
    import json

    from safetensors.torch import save_file

    from batchserve.shared.lora import PREFIX

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter, kv = config["hidden_size"], config["intermediate_size"], KV_HEADS * HEAD_DIM
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.v_proj": (hidden, kv), "mlp.down_proj": (inter, hidden)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            tensors[f"{PREFIX}{layer}.{module}.lora_A.weight"] = (
                torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            )
            tensors[f"{PREFIX}{layer}.{module}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.5
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj", "v_proj", "down_proj"]}
        )
    )
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


@needs_flashinfer
def test_graph_replay_with_adapter_rows_matches_eager(model_dir, tmp_path):
    """Decode steps with adapter rows replay the adapter graphs (the mask an input, its padding rows 0), captured
    anew after a load: tokens equal the eager path's, base rows beside adapter rows."""
    folders = {name: random_adapter(tmp_path / name, model_dir, seed) for seed, name in enumerate("ab")}
    prompts = prompts_for(6, seed=4)
    chosen = [1, 0, 2, 1, 2, 0]
    outputs = {}
    for label, graphs in (("graphs", True), ("eager", False)):
        runner = cuda_runner(model_dir, "flashinfer", graphs)
        load_lora_adapter(runner, 1, "a", str(folders["a"]), max_rank=16)
        first = generate_greedy(runner, prompts, 6, adapters=[min(c, 1) for c in chosen], arrival_gap=1)
        load_lora_adapter(runner, 2, "b", str(folders["b"]))  # the adapter graphs are captured again
        second = generate_greedy(runner, prompts, 6, adapters=chosen, arrival_gap=1)
        base = generate_greedy(runner, prompts, 6, arrival_gap=1)
        outputs[label] = (first, second, base)
        if graphs:
            assert runner.graph_runner.lora_steps > 0 and runner.graph_runner.lora_captures == 2
        del runner
    assert outputs["graphs"] == outputs["eager"]
    second, base = outputs["graphs"][1], outputs["graphs"][2]
    assert all(s == b for s, b, c in zip(second, base, chosen) if c == 0)  # base rows: no adapter's term
    assert any(s != b for s, b, c in zip(second, base, chosen) if c > 0)


def test_torch_backend_padded_path_on_cuda(model_dir):
    """Without a graph-capable backend decode runs unpadded; asked for, the padded path runs eagerly
    on CUDA too, with equal tokens."""
    prompts = prompts_for(5, seed=3)
    assert cuda_runner(model_dir, "torch", graphs=True).graph_runner is None  # nothing to replay: no padding
    padded = cuda_runner(model_dir, "torch", graphs=True, pad_decode=True)
    assert not padded.graph_runner.uses_cuda_graphs
    eager = cuda_runner(model_dir, "torch", graphs=False)
    assert generate_greedy(padded, prompts, 6, arrival_gap=1) == generate_greedy(eager, prompts, 6, arrival_gap=1)
    assert padded.graph_runner.steps_per_size


@needs_flashinfer
def test_auto_picks_flashinfer_on_cuda_in_bfloat16(model_dir):
    assert cuda_runner(model_dir, "auto", graphs=False).attention.name == "flashinfer"


@needs_flashinfer
def test_flashinfer_rejects_float32(model_dir):
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ModelRunner(
            model_dir,
            device="cuda",
            dtype="float32",
            page_size=PAGE_SIZE,
            kv_capacity_tokens=256,
            attention_backend="flashinfer",
        )
