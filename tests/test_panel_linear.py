"""The CPU's linear layers on packed panels (`kernels.panel_linear`), fp32 and `--quantization int8`: the
kernel against fp64 arithmetic on the weights it stands for, its independence of the batch, and the
engine and server running with int8."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from e2e_server import http, reference_greedy, start_server
from native_marks import requires_native_kernels
from safetensors.torch import load_file, save_file

from batchserve.kernels import native
from batchserve.kernels.ops import linear, pack_linear_weight
from batchserve.kernels.panel_linear import PanelWeight, pack_panels
from batchserve.procs.cli import main as cli_main
from batchserve.procs.worker.devices import check_quantization

pytestmark = requires_native_kernels


def quantize_int8(weight: torch.Tensor) -> PanelWeight:
    return pack_panels(weight, "int8")


def unpacked(weight: PanelWeight) -> torch.Tensor:
    """The fp32 [out, in] weight the panels [panels, in, PANEL] stand for (int8 ones dequantized): the
    reference the kernel is checked against."""
    panels, in_features, width = weight.packed.shape
    out = weight.packed.permute(0, 2, 1).reshape(panels * width, in_features).float()
    if weight.scale is not None:
        out = out * weight.scale[:, None]
    return out[: weight.out_features]


@pytest.mark.parametrize("quantization", ["none", "int8"])
# (229, 320): two threads even for one row, 15 panels split 7 + 8, blocks of 6 panels ending mid-range
@pytest.mark.parametrize("out_features,in_features", [(37, 20), (16, 64), (96, 40), (200, 33), (229, 320)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_fp64_on_the_weight_it_packs(
    quantization: str, out_features: int, in_features: int, with_bias: bool
) -> None:
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    packed = pack_panels(weight, quantization)
    if quantization == "none":
        assert torch.equal(unpacked(packed), weight)
    for rows in [*range(1, 14), 31]:
        x = torch.randn(rows, in_features)
        expected = torch.nn.functional.linear(
            x.double(), unpacked(packed).double(), None if bias is None else bias.double()
        )
        torch.testing.assert_close(linear(x, packed, bias), expected.float(), rtol=1e-5, atol=1e-4)


def test_fp32_cpu_weights_are_packed_for_the_kernel() -> None:
    assert isinstance(pack_linear_weight(torch.randn(8, 4)), PanelWeight)


def test_rounding_is_per_output_channel_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(40, 24) * torch.logspace(-3, 1, 40)[:, None]  # channels of very different size
    weight[7] = 0.0  # a channel of zeros: scale 0, output 0
    quantized = quantize_int8(weight)
    step = weight.abs().amax(dim=1, keepdim=True) / 127
    assert ((unpacked(quantized) - weight).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(linear(torch.randn(3, 24), quantized)[:, 7], torch.zeros(3))


@pytest.mark.parametrize("quantization", ["none", "int8"])
@pytest.mark.parametrize("out_features,in_features", [(70, 48), (229, 320)])  # one thread; two
def test_each_row_is_what_it_is_alone_whatever_the_batch(
    quantization: str, out_features: int, in_features: int
) -> None:
    """The kernel sums every output in one order over the inputs for any batch size, so a request's
    tokens do not depend on the others in its step (fbgemm's dynamic int8 shares one activation scale)."""
    torch.manual_seed(1)
    quantized = pack_panels(torch.randn(out_features, in_features), quantization)
    x = torch.randn(13, in_features) * torch.logspace(-2, 2, 13)[:, None]  # one row with outliers changes nothing
    alone = torch.cat([linear(x[i : i + 1], quantized) for i in range(13)])
    for rows in range(1, 14):
        assert torch.equal(linear(x[:rows], quantized), alone[:rows])


@pytest.mark.skipif(not native.has_wide_vectors(), reason="builds for this CPU use 8-float vectors already")
def test_an_avx2_build_gives_this_cpus_bits(tmp_path) -> None:
    """Where the CPU has AVX-512 the kernel's blocks of rows run on 16-float vectors; an AVX2 build runs
    the same FMA chain per output on 8-float halves, so a checkpoint gives the same tokens on both machines."""
    narrow_flags = [flag.replace("-march=native", "-march=x86-64-v3") for flag in native.BASE_FLAGS]
    native._build(native.compiler(), [*narrow_flags, "-fopenmp"], tmp_path / "avx2.so")
    avx2 = native._load(tmp_path / "avx2.so")
    torch.manual_seed(3)
    weight = torch.randn(229, 320)
    for quantization in ("none", "int8"):
        packed = pack_panels(weight, quantization)
        for rows in [*range(1, 18), 64]:
            x = torch.randn(rows, 320)
            narrow = torch.empty(rows, 229)
            if packed.scale is None:
                avx2.f32_linear(x.data_ptr(), rows, 320, packed.packed.data_ptr(), None, 229, 320, narrow.data_ptr())
            else:
                avx2.int8_linear(
                    x.data_ptr(),
                    rows,
                    320,
                    packed.packed.data_ptr(),
                    packed.scale.data_ptr(),
                    None,
                    229,
                    320,
                    narrow.data_ptr(),
                )
            assert torch.equal(linear(x, packed), narrow), (quantization, rows)


def test_strided_rows_are_read_in_place() -> None:
    torch.manual_seed(2)
    quantized = quantize_int8(torch.randn(32, 16))
    wide = torch.randn(5, 40)
    assert torch.equal(linear(wide[:, 8:24], quantized), linear(wide[:, 8:24].contiguous(), quantized))


def test_only_fp32_cpu_weights_quantize() -> None:
    with pytest.raises(ValueError, match="fp32 CPU weights"):
        pack_linear_weight(torch.randn(4, 4, dtype=torch.bfloat16), "int8")
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        pack_linear_weight(torch.randn(4, 4), "int4")


@pytest.mark.parametrize("device,dtype", [("cuda", torch.float32), ("cpu", torch.bfloat16)])
def test_int8_refuses_what_it_cannot_run(device: str, dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match="int8 runs on the CPU at dtype float32"):
        check_quantization("int8", torch.device(device), dtype)
    check_quantization("none", torch.device(device), dtype)


def test_int8_needs_the_c_kernels(monkeypatch) -> None:
    monkeypatch.setattr(native, "available", lambda: False)
    with pytest.raises(ValueError, match="C kernels unavailable"):
        check_quantization("int8", torch.device("cpu"), torch.float32)


def test_the_cli_names_a_bad_quantization(capsys) -> None:
    assert cli_main(["generate", "--prompt", "hi", "--quantization", "int4"]) != 0
    assert "'int4'" in (err := capsys.readouterr().err) and "quantization" in err


def write_int8_grid_model(source: Path, target: Path) -> Path:
    """A copy of a tiny model whose linear weights lie on their own int8 grid, so that int8 is lossless
    there and the int8 engine must give the fp32 engine's tokens."""
    shutil.copytree(source, target)
    (weights_file,) = target.glob("*.safetensors")
    tensors = load_file(weights_file)
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and "embed" not in name:
            tensors[name] = unpacked(quantize_int8(tensor)).contiguous()
    save_file(tensors, weights_file, metadata={"format": "pt"})
    config = json.loads((target / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # the LM head is rounded too
    return target


@pytest.fixture(scope="module")
def grid_model(tiny_model_dir, tmp_path_factory) -> Path:
    return write_int8_grid_model(
        tiny_model_dir("qwen2", with_tokenizer=True, seed=5), tmp_path_factory.mktemp("int8") / "model"
    )


PROMPTS = [[5, 6, 7], [100, 3, 250, 17, 9], [42], list(range(3, 40))]


def test_engine_on_int8_grid_weights_gives_the_fp32_tokens(grid_model) -> None:
    fp32 = reference_greedy(grid_model, PROMPTS, 10, ignore_eos=True, kv_capacity_tokens=1024)
    int8 = reference_greedy(grid_model, PROMPTS, 10, ignore_eos=True, kv_capacity_tokens=1024, quantization="int8")
    assert int8 == fp32


def test_server_with_int8_streams_the_offline_int8_tokens(grid_model, tmp_path) -> None:
    expected = reference_greedy(
        grid_model, PROMPTS[:2], 8, ignore_eos=True, kv_capacity_tokens=1024, quantization="int8"
    )
    server = start_server(grid_model, tmp_path / "serve.log", "--kv-capacity-tokens", "1024", "--quantization", "int8")
    try:
        for prompt, tokens in zip(PROMPTS[:2], expected):
            status, body = http(
                f"{server.url}/v1/completions",
                {"model": str(grid_model), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            )
            assert status == 200, body
            words = re.findall(r"w(\d+)", body["choices"][0]["text"])  # the tiny tokenizer's token t is "w<t>"
            assert [int(w) for w in words] == [t for t in tokens if t > 2]
    finally:
        server.stop()
