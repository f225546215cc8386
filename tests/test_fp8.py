"""FP8 checkpoints as Hugging Face folders store them: block-wise (transformers' fine-grained FP8, ``weight_scale_inv``
per 128x128 block) and per-row (compressed-tensors' per-channel ``weight_scale``), loaded and kept in FP8.

The folders are written here: a tiny random transformers model's projections quantized to E4M3 by this file's own
quantizer, beside a float32 folder of the same weights dequantized, which transformers runs as the reference.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import workbench
from workbench.errors import ModelLoadError
from workbench.kernels import QuantTensor, linear, numerics, select_kernel
from workbench.synthetic import random_hf_checkpoint

from test_loading import write_hf_tokenizer

IDS = [5, 77, 120, 3, 250, 9, 14, 200, 31, 64]
E4M3 = torch.float8_e4m3fn
# rows of 128 values or more (the FP8 layout's group); k/v have 64 rows: a partial 128-row block
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CONFIGS = {
    "block": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"},
    "channel": {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}}},
}
CONFIGS["tensor"] = json.loads(json.dumps(CONFIGS["channel"]).replace('"channel"', '"tensor"'))
SCALE_NAMES = {"block": "weight_scale_inv", "channel": "weight_scale", "tensor": "weight_scale"}


def quantize_e4m3(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scale) as the quantizers write them: a scale per 128x128 block (partial blocks at the edges), or per
    row ``[out, 1]``; scale = largest magnitude / 448."""
    rows, cols = weight.shape
    if kind == "tensor":
        scale = weight.abs().max().reshape(1) / 448
        return (weight / scale).to(E4M3), scale
    if kind == "channel":
        scale = weight.abs().amax(dim=1, keepdim=True) / 448
        return (weight / scale).to(E4M3), scale
    blocks = torch.zeros(math.ceil(rows / 128), math.ceil(cols / 128))
    for i in range(blocks.shape[0]):
        for j in range(blocks.shape[1]):
            blocks[i, j] = weight[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max() / 448
    full = blocks.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return (weight / full).to(E4M3), blocks


def dequantize_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = codes.shape
    if scale.dim() == 1:  # one scale per tensor
        return codes.float() * scale
    full = scale.repeat_interleave(rows // scale.shape[0] if scale.shape[0] == rows else 128, 0)[:rows]
    return codes.float() * full.repeat_interleave(cols // scale.shape[1] if scale.shape[1] > 1 else cols, 1)[:, :cols]


def is_projection(name: str) -> bool:
    return name.endswith("_proj.weight") and ".layers." in name


def fp8_folders(family: str, kind: str, tmp_path, **settings):
    """(FP8 folder, float32 reference folder) of one tiny random model; the scales go to a second shard."""
    fp8_dir, ref_dir = tmp_path / "fp8", tmp_path / "reference"
    random_hf_checkpoint(family, fp8_dir, n_layers=2, tie=False, **{**SHAPES, **settings})
    weights = load_file(str(fp8_dir / "model.safetensors"))
    stored, scales, dequantized = {}, {}, {}
    for name, value in weights.items():
        if is_projection(name):
            codes, scale = quantize_e4m3(value.float(), kind)
            stored[name] = codes
            scales[name.removesuffix("weight") + SCALE_NAMES[kind]] = scale
            dequantized[name] = dequantize_e4m3(codes, scale)
        else:
            stored[name] = dequantized[name] = value
    (fp8_dir / "model.safetensors").unlink()
    save_file(stored, str(fp8_dir / "model-00001-of-00002.safetensors"))
    save_file(scales, str(fp8_dir / "model-00002-of-00002.safetensors"))
    config = json.loads((fp8_dir / "config.json").read_text())
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(config))
    save_file(dequantized, str(ref_dir / "model.safetensors"))
    config["quantization_config"] = CONFIGS[kind]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    write_hf_tokenizer(fp8_dir)
    return fp8_dir, ref_dir


def reference_logits(ref_dir) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].float()


@pytest.mark.parametrize("family, kind", [("llama", "block"), ("qwen3", "channel"), ("qwen3", "block"),
                                          ("llama", "channel"), ("llama", "tensor"), ("qwen3moe", "block")])
def test_fp8_folder_matches_transformers_on_the_dequantized_weights(family, kind, tmp_path):
    settings = dict(moe_intermediate_size=128, num_experts=4, num_experts_per_tok=2) if family == "qwen3moe" else {}
    fp8_dir, ref_dir = fp8_folders(family, kind, tmp_path, **settings)
    model = workbench.load(fp8_dir, device="cpu")
    got = model.forward(IDS)
    assert (got - reference_logits(ref_dir)).abs().max().item() < 1e-4
    # every projection stays FP8 in memory: one E4M3 byte per weight plus a float32 scale per 128
    fmt = {"block": "FP8_BLOCK", "channel": "FP8_ROW", "tensor": "FP8_ROW"}[kind]
    matrices = dict(model.runner.weights.named_matrices())
    fp8 = {name: w for name, w in matrices.items() if w.fmt.name == fmt}
    expected = {f"blocks.{i}.{p}" for i in range(2) for p in ("wq", "wk", "wv", "wo")}
    expected |= {f"blocks.{i}.moe.{p}" for i in range(2) for p in ("gate", "up", "down")} if settings else \
        {f"blocks.{i}.{p}" for i in range(2) for p in ("w_gate", "w_up", "w_down")}
    assert set(fp8) == expected
    for w in fp8.values():
        assert w.data.dtype == torch.uint8 and w.nbytes == w.shape[0] * w.shape[1] * 33 // 32
    # the serving numerics quantize activations: close to the exact forward, not equal to it
    with numerics("llamacpp"):
        served = model.forward(IDS)
    drift = (served - got).abs().max().item()
    assert 0 < drift < 0.2 * got.abs().max().item()


def test_fp8_block_scales_follow_rows_through_the_rope_permutation(tmp_path):
    """llama's Q/K rows are reordered for llama.cpp's rope, which interleaves the two halves of a head; with heads of
    256 rows those halves are two 128-row blocks of their own scales, so a scale that stayed put would show."""
    fp8_dir, ref_dir = fp8_folders("llama", "block", tmp_path, hidden_size=256, head_dim=256,
                                   num_attention_heads=2, num_key_value_heads=1)
    got = workbench.load(fp8_dir, device="cpu").forward(IDS)
    assert (got - reference_logits(ref_dir)).abs().max().item() < 1e-4


@pytest.mark.parametrize("fmt", ["FP8_ROW", "FP8_BLOCK"])
def test_serving_numerics_quantize_activations_as_the_engines_do(fmt):
    """``numerics("llamacpp")`` on FP8 weights: E4M3 activations per token (FP8_ROW) or per 128 values of a token
    (FP8_BLOCK), computed here by hand, times the dequantized weights."""
    torch.manual_seed(0)
    w = QuantTensor.quantize(torch.randn(96, 384), fmt)
    x = torch.randn(5, 384) * torch.linspace(0.1, 10, 384)
    x[1, :128] = 0  # a zero group
    group = 128 if fmt == "FP8_BLOCK" else 384
    parts = x.view(5, -1, group)
    scale = parts.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448
    activations = ((parts / scale).to(E4M3).float() * scale).view(5, 384)
    expected = activations.double() @ w.dequantize().double().T
    with numerics("llamacpp"):
        assert select_kernel(x, w).name == "fp8-emulated-activations"
        got = linear(x, w)
    assert torch.allclose(got.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())
    exact = linear(x, w)
    assert torch.allclose(exact.double(), x.double() @ w.dequantize().double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fmt", ["FP8_ROW", "FP8_BLOCK"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_triton_fp8_gemm_matches_the_emulated_kernel(fmt, rows):
    """The Triton tensor-core GEMM (interpreted on the CPU, where tests/conftest.py sets TRITON_INTERPRET=1) against
    the emulated kernel: the same E4M3 activations and weights, float32 sums in another order. 80 output rows leave a
    partial weight tile; 5 and 40 rows a partial activation tile."""
    pytest.importorskip("triton")
    from workbench.kernels import fp8 as fp8_kernels
    from workbench.kernels.triton.fp8 import fp8_gemm

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    torch.manual_seed(0)
    w = QuantTensor.quantize(torch.randn(80, 384), fmt).to(device)
    x = torch.randn(rows, 384, device=device)
    codes, scale = fp8_kernels.quantize_activations(x, fmt)
    got = fp8_gemm(codes, scale, w, torch.float32)
    expected = fp8_kernels._emulated_scaled_mm(x, w)
    # Hopper's FP8 MMA sums each 128-wide dot in fewer bits than float32 (DeepSeek-V3's report: about 14), so on the
    # GPU the bound is that accumulator's rounding, not float32's
    bound = 1e-5 if device == "cpu" else 2e-3
    error = (got - expected).abs().max().item() / expected.abs().max().item()
    assert error < bound, f"max error {error:.2e} of the largest output"


def test_scaled_mm_reads_the_packed_codes_in_place():
    """The CUDA kernel's call, run by torch's CPU ``_scaled_mm`` (row-wise scales): the codes as a column-major view of
    the packed rows (row stride 528 bytes, not 512) and the per-row scales give the emulated kernel's result."""
    from workbench.kernels import fp8 as fp8_kernels

    torch.manual_seed(0)
    w = QuantTensor.quantize(torch.randn(64, 512), "FP8_ROW")
    x = torch.randn(3, 512, dtype=torch.bfloat16)
    try:
        got = fp8_kernels._scaled_mm(x, w).float()
    except (RuntimeError, NotImplementedError, ValueError) as err:
        pytest.skip(f"this torch has no CPU _scaled_mm: {err}")
    expected = fp8_kernels._emulated_scaled_mm(x.float(), w)
    assert torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())  # bf16 out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fmt", ["FP8_ROW", "FP8_BLOCK"])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_tensor_core_fp8_matches_the_emulated_kernel_on_cuda(fmt, rows):
    """The CUDA kernel that serves FP8 (``torch._scaled_mm``, else the Triton GEMM) against the emulated one: the same
    E4M3 activations and weights, the tensor cores' sums rounded once to bf16."""
    from workbench.kernels import fp8 as fp8_kernels

    torch.manual_seed(0)
    w = QuantTensor.quantize(torch.randn(1024, 2048), fmt).to("cuda")
    x = torch.randn(rows, 2048, device="cuda", dtype=torch.bfloat16)
    with numerics("llamacpp"):
        kernel = select_kernel(x, w)
        got = linear(x, w).float()
    if torch.cuda.get_device_capability() < (8, 9):
        assert kernel.name == "fp8-emulated-activations"
    elif fmt == "FP8_ROW":  # row-wise scaled FP8 GEMMs: cuBLAS on Ada and Hopper
        assert kernel.name == "fp8-scaled-mm"
    else:
        assert kernel.name in ("fp8-scaled-mm", "fp8-triton-gemm")
    expected = fp8_kernels._emulated_scaled_mm(x.float(), w)
    assert torch.allclose(got, expected, rtol=1e-2, atol=1e-2 * expected.abs().max().item())
    # exact numerics dequantize on the GPU too
    exact = linear(x.float(), w)
    assert torch.allclose(exact, x.float() @ w.dequantize().T, rtol=1e-4, atol=1e-3)


def test_fp8_rows_round_trip_and_one_block_rows():
    torch.manual_seed(1)
    values = torch.randn(4, 256)
    for fmt in ("FP8_ROW", "FP8_BLOCK"):
        w = QuantTensor.quantize(values, fmt)
        assert w.data.shape == (4, 264)
        assert (w.dequantize() - values).abs().max() <= values.abs().max() / 16
        assert torch.equal(w.dequantize_rows(slice(1, 3)), w.dequantize()[1:3])
        block = w.fmt.quantize(values[:, :128].contiguous())  # a row of one block: codes then scale
        assert torch.equal(w.fmt.dequantize(block), QuantTensor.quantize(values[:, :128], fmt).dequantize())
    per_row = QuantTensor.quantize(values, "FP8_ROW").data[:, 256:].view(torch.float32)
    assert torch.equal(per_row[:, 0], per_row[:, 1])


def _edit_folder(fp8_dir, edit_scales=None, edit_config=None):
    if edit_scales is not None:
        path = fp8_dir / "model-00002-of-00002.safetensors"
        scales = load_file(str(path))
        edit_scales(scales)
        save_file(scales, str(path))
    if edit_config is not None:
        config = json.loads((fp8_dir / "config.json").read_text())
        edit_config(config["quantization_config"])
        (fp8_dir / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit_scales, edit_config, message", [
    (lambda s: s.update({"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(2, 2)}), None,
     r"FP8 scale of blk\.0\.attn_q\.weight has shape \(2, 2\); blocks of \[128, 128\] need \(1, 1\)"),
    (lambda s: s["model.layers.1.mlp.down_proj.weight_scale_inv"].fill_(float("nan")), None,
     r"FP8 scale of blk\.1\.ffn_down\.weight holds a non-finite value"),
    (lambda s: s.pop("model.layers.0.mlp.up_proj.weight_scale_inv"), None,
     r"FP8 tensor blk\.0\.ffn_up\.weight has no weight_scale_inv"),
    (None, lambda q: q.update(weight_block_size=[128, 96]), r"block size \[128, 96\]: its columns must be a multiple"),
    (None, lambda q: q.update(weight_block_size=[128]), r"block size must be two positive integers"),
    (None, lambda q: q.update(quant_method="gptq"), r"quantization 'gptq' is not supported"),
])
def test_bad_fp8_folders_get_one_line_errors(tmp_path, edit_scales, edit_config, message):
    fp8_dir, _ = fp8_folders("llama", "block", tmp_path)
    _edit_folder(fp8_dir, edit_scales, edit_config)
    with pytest.raises(ModelLoadError, match=message) as err:
        workbench.load(fp8_dir, device="cpu")
    assert "\n" not in str(err.value)


def test_fp8_rows_must_be_whole_groups(tmp_path):
    fp8_dir, _ = fp8_folders("qwen3", "channel", tmp_path, hidden_size=96, head_dim=24)
    with pytest.raises(ModelLoadError, match=r"has 96 columns; FP8 weights need a multiple of 128"):
        workbench.load(fp8_dir, device="cpu")


def test_quantize_on_load_starts_from_the_fp8_values(tmp_path):
    """quantize="F32" dequantizes an FP8 folder once (the fast CPU path), equal to the FP8 forward; a float folder
    quantizes into FP8_BLOCK on load."""
    fp8_dir, ref_dir = fp8_folders("llama", "block", tmp_path)
    kept = workbench.load(fp8_dir, device="cpu")
    floats = workbench.load(fp8_dir, device="cpu", quantize="F32")
    assert set(floats.tensor_formats().values()) == {"F32"}
    assert torch.allclose(floats.forward(IDS), kept.forward(IDS), rtol=1e-5, atol=1e-5)
    write_hf_tokenizer(ref_dir)
    requantized = workbench.load(ref_dir, device="cpu", quantize="FP8_BLOCK")
    assert set(requantized.tensor_formats().values()) == {"FP8_BLOCK"}
    # a scale per 128 values of a row instead of per 128x128 block: within E4M3's resolution (3 mantissa bits)
    before, after = kept.runner.weights.layers[0].w_up.dequantize(), requantized.runner.weights.layers[0].w_up.dequantize()
    assert 0 < (after - before).abs().max() <= before.abs().max() / 16
