"""The Triton GEMV/GEMM kernels against gguf's reference dequantizer, in float64.

On CPU the kernels run under ``TRITON_INTERPRET=1`` (``TestInterpreted``). That switch must be set before triton is
imported: tests/conftest.py sets it for the whole run where no CUDA device is present (the CUDA backend then registers
no kernel, so no other test runs interpreted), and the xdist workers spread these tests over the cores, since the
interpreter runs on one. ``TestCuda`` runs full model shapes on a GPU and is skipped without one.

Weights are random bytes with sane float16 scale fields, so every bit pattern of the quants occurs.
Tolerances are relative Frobenius-norm errors: float32 accumulation over K <= 14336 products stays
far under 1e-5; a float16 / bfloat16 output adds one rounding (unit roundoff 2^-11 / 2^-8, and the
interpreter truncates to bfloat16, up to 2^-7); the GEMM also rounds the weights to the activation
dtype before the tensor-core product.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("triton")

from workbench.kernels import QuantTensor, cpu, get_format, layer_ops, linear, numerics, select_kernel  # noqa: E402
from workbench.kernels.formats import QuantFormat  # noqa: E402
from workbench.kernels.triton import (  # noqa: E402
    GEMV_MAX_ROWS, LLAMACPP_GEMM_MIN_ROWS, MMA_K_MULTIPLE, MMA_MAX_ROWS, add_rms_norm, attend, attention_scores,
    dequant_matmul, dequantize, gemm, gemm_llamacpp, gemm_rows, gemv, gemv_by_expert, gemv_llamacpp,
    gemv_llamacpp_by_expert, gemv_rows, mma_gemm, mma_rows, packed_attention, quantize_activations, rms_norm, rope,
    swiglu,
)
from workbench.kernels.triton import launch  # noqa: E402
from workbench.kernels.triton.matmul import (  # noqa: E402
    GemmConfig, GemvConfig, Int8GemmConfig, MmaConfig, gemm_config, mma_config,
)

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
MMA_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
FORMATS = MMA_FORMATS + ("Q5_0", "Q5_1", "Q5_K", "Q2_K", "Q3_K")  # each has a GEMV, a GEMM and llama.cpp numerics
EXACT_ONLY = ("MXFP4",)  # a GEMV, a GEMM and the dequantizer; llama.cpp numerics run exact on CUDA
# Byte offsets of each block's float16 fields (scales, mins); every other byte is a quant.
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,), "Q5_0": (0,),
              "Q5_1": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "MXFP4": ()}
# Relative error bound of a float32 result, and of a result rounded once to each activation dtype.
FP32_TOL = 2e-5
ROUNDING_TOL = {torch.float32: FP32_TOL, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def random_weight(fmt: str, rows: int, cols: int, rng: np.random.Generator) -> tuple[QuantTensor, np.ndarray]:
    """A QuantTensor of random blocks and its float64 dequantization by gguf."""
    qformat = get_format(fmt)
    blocks = rng.integers(0, 256, size=(rows * cols // qformat.block_size, qformat.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[fmt]:
        scales = (rng.uniform(-1, 1, size=len(blocks)) * 2.0**-6).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if fmt == "MXFP4":  # the exponent byte: scales 2**-10 .. 2**-4, as the others' (test_formats tries every one)
        blocks[:, 0] = rng.integers(118, 125, size=len(blocks))
    data = blocks.reshape(rows, -1)
    reference = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt]).astype(np.float64)
    return QuantTensor(torch.from_numpy(data.copy()), qformat, (rows, cols)), reference


def ggml_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-cpu's Q8_K blocks of ``x`` (the CPU kernels' quantizer) as ``quantize_activations(x, "Q4_K")`` returns them: values, scales,
    sums of 16 (from the 292-byte blocks: float32 d, 256 int8, 16 int16 sums of 16)."""
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    m, k = x.shape
    blocks = cpu.quantize_activations(x.float().cpu(), 12).view(m, k // 256, 292)
    scales = blocks[..., :4].contiguous().view(torch.float32).view(m, -1)
    values = blocks[..., 4:260].contiguous().view(torch.int8).view(m, k)
    sums = blocks[..., 260:].contiguous().view(torch.int16).view(m, -1).int()
    return values, scales, sums


def ggml_q8(x: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml-cpu's Q8_0 (``ggml_type`` 8) or Q8_1 (3) blocks of ``x`` as ``quantize_activations(x, "Q4_1")`` returns them: values, scales,
    scale * sums (from the 34- or 36-byte blocks: float16 d, for Q8_1 float16 s, 32 int8)."""
    ggml_q8_k(torch.zeros(1, 256))  # skips where the CPU kernels are missing
    m, k = x.shape
    size = 36 if ggml_type == 3 else 34
    blocks = cpu.quantize_activations(x.float().cpu(), ggml_type).view(m, k // 32, size)
    halves = blocks[..., : size - 32].contiguous().view(torch.float16).float()
    values = blocks[..., size - 32 :].contiguous().view(torch.int8).view(m, k)
    return values, halves[..., 0], halves[..., -1]


def llamacpp_cpu(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """``x @ w.T`` in llama.cpp numerics by the C++ CPU kernel, in float32 on the CPU."""
    ggml_q8_k(x[:, :256])  # skips where the CPU kernels are missing
    return cpu.LLAMACPP.run(x.float().cpu(), w.to("cpu"))


def relative_error(out: torch.Tensor, expected: np.ndarray) -> float:
    assert torch.isfinite(out).all()
    actual = out.cpu().double().numpy()
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1, which tests/conftest.py sets where no CUDA "
                                               "device is present")
class TestInterpreted:
    # 20 rows: not a multiple of any row block. K = 768: 24 blocks / 3 super-blocks, so the last
    # step of every kernel runs past the end of the row.
    N, K = 20, 768

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_gemv(self, fmt, dtype):
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 1])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        x = torch.from_numpy(rng.standard_normal((1, self.K))).to(dtype)
        out = gemv(x, w)
        assert out.shape == (1, self.N) and out.dtype == dtype
        tolerance = 2 * ROUNDING_TOL[dtype] if dtype == torch.bfloat16 else ROUNDING_TOL[dtype]
        assert relative_error(out, x.double().numpy() @ reference.T) < tolerance

    # bfloat16 is left to the CUDA tests (tests/test_runner.py): the interpreter truncates to it instead of rounding.
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_rms_norm(self, dtype):
        """Rows of 40 and 96 values (blocks of 64 and 128 with masked lanes): the scale to a few float32 roundings, the
        output the torch ops' products of it, bit for bit. Other shapes are for ``layer_ops`` to flatten
        (tests/test_runner.py); given here, they are refused."""
        generator = torch.Generator().manual_seed(8)
        with pytest.raises(ValueError, match="contiguous"):
            rms_norm(torch.randn(2, 2, 96).to(dtype), torch.randn(96).to(dtype), 1e-5)
        for shape in [(3, 40), (4, 96)]:
            x = (3 * torch.randn(shape, generator=generator)).to(dtype)
            weight = torch.randn(shape[-1], generator=generator).to(dtype)
            scale, out = rms_norm(x, weight, 1e-5)
            expected = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
            bound = 2.0**-21 if dtype == torch.float32 else 2.0**-11
            assert scale.shape == (*shape[:-1], 1) and scale.dtype == dtype
            assert ((scale.double() - expected).abs() / expected).max() <= bound, shape
            assert torch.equal(out, x * scale * weight), shape

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_add_rms_norm(self, dtype):
        """The residual sum and its norm in one launch: the sum as torch adds, the norm ``rms_norm``'s of that sum, bit
        for bit; a delta of another shape is refused."""
        generator = torch.Generator().manual_seed(9)
        x, delta = ((3 * torch.randn(4, 96, generator=generator)).to(dtype) for _ in range(2))
        weight = torch.randn(96, generator=generator).to(dtype)
        total, scale, out = add_rms_norm(x, delta, weight, 1e-5)
        assert torch.equal(total, x + delta)
        expected_scale, expected = rms_norm(x + delta, weight, 1e-5)
        assert torch.equal(scale, expected_scale) and torch.equal(out, expected)
        with pytest.raises(ValueError, match="delta"):
            add_rms_norm(x, delta[:3], weight, 1e-5)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_swiglu(self, dtype):
        """silu(gate) * up on the halves of a fused output (rows strided past their width; 300 values: a block with
        masked lanes), as the torch formula rounds it; other layouts are refused."""
        gate_up = (4 * torch.randn(3, 600, generator=torch.Generator().manual_seed(10))).to(dtype)
        gate, up = gate_up.split(300, dim=-1)
        out = swiglu(gate, up)
        torch.testing.assert_close(out, torch.nn.functional.silu(gate) * up, rtol=2**-22 if dtype == torch.float32
                                   else 0, atol=0)
        with pytest.raises(ValueError, match="swiglu"):
            swiglu(gate.t(), up.t())

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    @pytest.mark.parametrize("interleaved", [True, False], ids=["adjacent-pairs", "halves"])
    def test_rope(self, dtype, interleaved):
        """Heads of 48 values (a block of 64 with masked lanes) read from a slice of a wider row, as the forward's q is a
        slice of the stacked q/k/v output; 20 heads in two blocks of 16: the torch formula's bits."""
        generator = torch.Generator().manual_seed(9)
        tokens, heads, d = 3, 20, 48
        wide = torch.randn(tokens, heads * d + 16, generator=generator).to(dtype)
        x = wide[:, : heads * d].view(tokens, heads, d)
        cos, sin = torch.randn(2, tokens, 1, d, generator=generator).unbind(0)
        half = d // 2
        shape, axis = ((half, 2), -1) if interleaved else ((2, half), -2)
        expected = (x.float() * cos + x.float().unflatten(-1, shape).flip(axis).flatten(-2) * sin).to(dtype)
        out = rope(x, cos, sin, interleaved)
        assert out.is_contiguous() and torch.equal(out, expected)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    def test_attention_products(self, dtype):
        """6 query heads on 2 kv heads, 20 tokens against 70 slots read from a longer cache (blocks of 16 tokens and
        64 slots, both with tails), heads of 48 values (a block of 64), with and without a causal mask: the scores and
        z of the batched matmuls (``layer_ops``' CPU path), up to sums in another order rounded to the dtype."""
        generator = torch.Generator().manual_seed(10)
        tokens, heads, kv_heads, slots, d = 20, 6, 2, 70, 48
        q = torch.randn(tokens, heads, d, generator=generator).to(dtype)
        keys = torch.randn(kv_heads, 96, d, generator=generator).to(dtype)[:, :slots]
        values = torch.randn(kv_heads, 96, d, generator=generator).to(dtype)[:, :slots]
        bound = 2 * ROUNDING_TOL[dtype]
        for blocked in (None, torch.ones(tokens, slots, dtype=torch.bool).triu(slots - tokens + 1)):
            scores = attention_scores(q, keys, math.sqrt(d), blocked)
            expected = layer_ops.attention_scores(q, keys, math.sqrt(d), blocked)
            assert scores.shape == (heads, tokens, slots) and scores.dtype == torch.float32
            assert torch.equal(scores.isinf(), expected.isinf())
            assert int(scores.isinf().sum()) == (0 if blocked is None else heads * int(blocked.sum()))
            visible = ~expected.isinf()
            assert relative_error(scores[visible], expected[visible].double().numpy()) < bound
            pattern = expected.softmax(-1)
            z = attend(pattern, values)
            assert z.shape == (tokens, heads, d) and z.dtype == dtype and z.is_contiguous()
            assert relative_error(z, layer_ops.attend(pattern, values).double().numpy()) < bound

    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_gemv_several_units_per_thread(self, fmt):
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 3])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        x = torch.from_numpy(rng.standard_normal((1, self.K)).astype(np.float32))
        # 64 units per step against 24 in a row: the one step runs past the end of the row.
        out = gemv(x, w, GemvConfig(block_n=8, num_warps=1, block_u=64))
        assert relative_error(out, x.double().numpy() @ reference.T) < FP32_TOL

    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_gemv_whole_steps(self, fmt):
        # K = 2048: every step lies inside the row, the path without bounds checks.
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 4])
        w, reference = random_weight(fmt, self.N, 2048, rng)
        x = torch.from_numpy(rng.standard_normal((1, 2048)).astype(np.float32))
        out = gemv(x, w, GemvConfig(block_n=4, num_warps=1, block_u=32))
        assert relative_error(out, x.double().numpy() @ reference.T) < FP32_TOL

    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_gemv_several_rows(self, fmt):
        """Batched decode: each weight unpacked once for a block of activation rows. The default tilings (two rows per
        program: two rows fill one block, three leave the last block with one), and four rows per program for three
        rows, whose missing row re-reads the first and is never stored."""
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 5])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        for m, config in [(2, None), (GEMV_MAX_ROWS - 1, None),
                          (3, GemvConfig(block_n=4, num_warps=1, block_u=32, block_m=4))]:
            x = torch.from_numpy(rng.standard_normal((m, self.K)).astype(np.float32))
            out = gemv(x, w, config)
            assert out.shape == (m, self.N)
            assert relative_error(out, x.double().numpy() @ reference.T) < FP32_TOL, (m, config)
            # each row as it would be on its own
            assert relative_error(out[-1:], gemv(x[-1:], w).double().numpy()) < FP32_TOL, (m, config)

    # The interpreter's bfloat16 tl.dot is wrong (and truncates); bfloat16 GEMMs are checked on CUDA.
    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_gemm(self, fmt, dtype):
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 2])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        x = torch.from_numpy(rng.standard_normal((5, self.K))).to(dtype)
        # Small tiles: several programs in both directions, and row tails in both; K steps of 64 values, and of 512,
        # whose last step runs past the end of the row; K split in three runs of steps (with 512-value steps the third
        # run is empty), whose partial sums the last program of each tile adds up. Each call runs twice: a split
        # leaves its arrival counters zeroed for the next call, and adds the same partial sums in the same order.
        # Last, one tile of 128 rows, where Q2_K and Q3_K read 32-value units instead of 64-value chunks.
        for block_m, block_u, split_k in [(4, 2, 1), (4, 16, 1), (4, 2, 3), (4, 16, 3), (128, 4, 1)]:
            config = GemmConfig(block_m=block_m, block_n=8, block_u=block_u, num_warps=1, num_stages=1, group_m=2,
                                split_k=split_k)
            out = gemm(x, w, config)
            assert out.shape == (5, self.N) and out.dtype == dtype
            assert relative_error(out, x.double().numpy() @ reference.T) < 2 * ROUNDING_TOL[dtype], config
            assert torch.equal(gemm(x, w, config), out), config

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("fmt", MMA_FORMATS)
    def test_mma_gemm(self, fmt, dtype):
        """On mma.sync fragments: 20 weight rows (a full and a partial tile of 16), K = 768 (3 super-blocks, 12 pairs
        of blocks; Q6_K rows of 630 bytes, so every other row starts 2 bytes past a word) dealt to 1, 2 and 4 warps,
        one or two pairs a step (the last step of 2 warps over super-blocks, and of 4 warps of two pairs, leaves warps
        past the row's end), 1, 3, 8 and 13 rows of activations (8 fill the instruction's columns; fewer re-read rows
        from the first; 13 take a second tile of 8, partly filled, on the same unpacked weights, and leave the first tile's
        results as they are without it)."""
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), dtype.itemsize, 6])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        for m, config in [(1, MmaConfig(num_warps=1)), (3, MmaConfig(num_warps=2)),
                          (8, MmaConfig(num_warps=4, step_pairs=2)), (13, MmaConfig(num_warps=2))]:
            x = torch.from_numpy(rng.standard_normal((m, self.K))).to(dtype)
            out = mma_gemm(x, w, config)
            assert out.shape == (m, self.N) and out.dtype == dtype
            assert relative_error(out, x.double().numpy() @ reference.T) < 2 * ROUNDING_TOL[dtype], (m, config)
            if m > 8:
                assert torch.equal(out[:8], mma_gemm(x[:8].contiguous(), w, config)), config

    @pytest.mark.parametrize("fmt", FORMATS + EXACT_ONLY)
    def test_dequantize(self, fmt):
        rng = np.random.default_rng([(FORMATS + EXACT_ONLY).index(fmt), 4])
        w, reference = random_weight(fmt, self.N, self.K, rng)
        dense = dequantize(w, torch.float32).double().numpy()
        if get_format(fmt).block_size == 32:
            np.testing.assert_array_equal(dense, reference)  # one rounding of an exact product, as gguf does
        else:
            # scale * q - min in one fused multiply-add: within a float32 rounding of the block's largest term
            np.testing.assert_allclose(dense, reference, rtol=0, atol=4 * 2.0**-24 * np.abs(reference).max())
        x = torch.from_numpy(rng.standard_normal((3, self.K)).astype(np.float32))
        assert relative_error(dequant_matmul(x, w), x.double().numpy() @ reference.T) < FP32_TOL

    @pytest.mark.parametrize("kernel", [gemv, gemm, dequant_matmul])
    def test_no_rows(self, kernel):
        w, _ = random_weight("Q4_K", self.N, self.K, np.random.default_rng(5))
        assert kernel(torch.zeros(0, self.K), w).shape == (0, self.N)

    @pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
    def test_quantized_real_weights(self, fmt):
        """Blocks as gguf's own quantizer writes them, through the default configs."""
        rng = np.random.default_rng(3)
        weight = rng.standard_normal((12, 512)).astype(np.float32)
        data = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[fmt])
        reference = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[fmt]).astype(np.float64)
        w = QuantTensor(torch.from_numpy(data), fmt, (12, 512))
        x = torch.from_numpy(rng.standard_normal((3, 512)).astype(np.float32))
        assert relative_error(gemv(x[:1], w), x[:1].double().numpy() @ reference.T) < FP32_TOL
        assert relative_error(gemm(x, w), x.double().numpy() @ reference.T) < FP32_TOL


    def test_quantize_q8_k_matches_ggml_cpu(self):
        x = torch.from_numpy(np.random.default_rng(6).standard_normal((3, 1024)).astype(np.float32)) * 3
        x[0, :256] = 0  # a zero block: zero scale and values
        x[1, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # scale 1: ties round to even
        x[1, 256:512] = 0.25
        x[1, 300], x[1, 301] = -4.0, 4.0  # equal magnitudes: the first, negative, maps to -127
        for got, expected in zip(quantize_activations(x, "Q4_K"), ggml_q8_k(x)):
            assert torch.equal(got, expected)

    def test_quantize_q8_matches_ggml_cpu(self):
        x = torch.from_numpy(np.random.default_rng(8).standard_normal((3, 256)).astype(np.float32)) * 3
        x[0, :32] = 0  # a zero block
        x[1, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])  # inverse scale 1: ties round to even
        values, scales, sums = quantize_activations(x, "Q4_1")
        for ggml_type in (8, 3):  # Q8_0 (for Q4_0 and Q8_0 weights), Q8_1 (for Q4_1)
            expected_values, expected_scales, expected_sums = ggml_q8(x, ggml_type)
            assert torch.equal(values, expected_values) and torch.equal(scales, expected_scales)
        assert torch.equal(sums, expected_sums)

    @pytest.mark.parametrize("k", [768, 2048])  # a partial last step; whole steps
    @pytest.mark.parametrize("m", [1, 3])
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_gemv_llamacpp_matches_the_cpu_kernel(self, fmt, m, k):
        rng = np.random.default_rng([m, k])
        w, reference = random_weight(fmt, self.N, k, rng)
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
        out = gemv_llamacpp(x, w)
        expected = llamacpp_cpu(x, w)
        # the same integer dots; only the float32 sums of the scaled block dots run in another order
        assert (out - expected).abs().max() < 1e-5 * expected.abs().max()
        exact = x.double().numpy() @ reference.T
        assert relative_error(out, exact) > 100 * relative_error(expected, out.double().numpy())


    @pytest.mark.parametrize("fmt", FORMATS)
    def test_gemm_llamacpp_matches_the_cpu_kernel(self, fmt):
        """The tensor-core GEMM: small tiles, so the N = 20 weight rows and M = 20 activation rows each span two
        tiles with a partial one, and K = 768 leaves a partial last tile row of neither."""
        rng = np.random.default_rng(FORMATS.index(fmt))
        w, reference = random_weight(fmt, self.N, self.K, rng)
        x = torch.from_numpy(rng.standard_normal((20, self.K)).astype(np.float32))
        out = gemm_llamacpp(x, w, Int8GemmConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, group_m=2))
        expected = llamacpp_cpu(x, w)
        assert (out - expected).abs().max() < 1e-5 * expected.abs().max()
        exact = x.double().numpy() @ reference.T
        assert relative_error(out, exact) > 100 * relative_error(expected, out.double().numpy())


def test_the_launch_key_is_at_least_as_fine_as_tritons_specialization():
    """``launch`` reuses a compiled kernel for arguments of the same class; Triton compiles one kernel per
    specialization, so no class may hold arguments that Triton specializes differently (a Triton that specialized on
    something new would fail here)."""
    libtriton = pytest.importorskip("triton._C.libtriton")
    from triton.backends.compiler import BaseBackend

    from workbench.kernels.triton.launch import _argument_class

    specialize = getattr(libtriton, "native_specialize_impl", None)
    if specialize is None:
        pytest.skip("this Triton specializes in Python")
    ints = [0, 1, 2, 3, 8, 15, 16, 17, 32, 48, 576, 4096, 14336, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**32 + 8,
            2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16, -(2**31), -(2**31) - 1, -(2**63)]
    buffers = [torch.zeros(64, dtype=dtype) for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int32)]
    tensors = [buffer[offset:] for buffer in buffers for offset in range(17)]
    classes: dict = {}
    for arg in [*ints, *tensors, True, False, 0.5, 1.0, 1e30]:
        classes.setdefault(_argument_class(arg), set()).add(specialize(BaseBackend, arg, False, True, True))
    assert all(len(specializations) == 1 for specializations in classes.values()), classes


# Where the kernels of the tests below run: interpreted on CPU tensors, else on a GPU.
TRITON_DEVICE = "cpu" if INTERPRETING else "cuda" if torch.cuda.is_available() else None


@pytest.mark.skipif(TRITON_DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [0, 7], ids=["causal", "window-7"])
def test_packed_attention(dtype, window):
    """Four sequences of 5, 40, 1 and 33 tokens packed in one axis (query blocks of 32 and 64 with tails; a lone
    token), 6 query heads on 2 kv heads of 48 values, v a strided slice as the forward's is: each token's attention over
    its own sequence's keys, causal and within the window, against softmax in float64."""
    if dtype == torch.bfloat16 and INTERPRETING:
        pytest.skip("Triton's interpreter truncates to bfloat16 instead of rounding: left to CUDA")
    generator = torch.Generator().manual_seed(11)
    lengths, heads, kv_heads, d = [5, 40, 1, 33], 6, 2, 48
    n = sum(lengths)
    q, k = (torch.randn(n, h, d, generator=generator).to(dtype) for h in (heads, kv_heads))
    v = torch.randn(n, kv_heads, 2 * d, generator=generator).to(dtype)[..., d:]
    starts = torch.tensor([0, *np.cumsum(lengths)])
    z = packed_attention(*(x.to(TRITON_DEVICE) for x in (q, k, v, starts)), max(lengths), math.sqrt(d), window)
    assert z.shape == (n, heads, d) and z.dtype == dtype
    expected = []
    for start, length in zip(starts.tolist(), lengths):
        qs, ks, vs = (x[start:start + length].double() for x in (q, k, v))
        scores = torch.einsum("thd,shd->hts", qs, ks.repeat_interleave(heads // kv_heads, 1)) / math.sqrt(d)
        behind = torch.arange(length)[:, None] - torch.arange(length)[None, :]
        unseen = (behind < 0) | ((behind >= window) if window else False)
        pattern = scores.masked_fill(unseen, float("-inf")).softmax(-1)
        expected.append(torch.einsum("hts,shd->thd", pattern, vs.repeat_interleave(heads // kv_heads, 1)))
    # the scores rounded to the dtype as a matmul rounds them, the pattern rounded to it before its product
    assert relative_error(z, torch.cat(expected).numpy()) < 4 * ROUNDING_TOL[dtype]
    with pytest.raises(ValueError, match="packed_attention"):
        packed_attention(q, k[:, :, :32], v, starts, max(lengths), math.sqrt(d))


@pytest.mark.skipif(TRITON_DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("interleaved", [True, False], ids=["adjacent-pairs", "halves"])
def test_packed_attention_ropes_q_and_k_as_rope_does(interleaved):
    """The rope inside the launch gives q and k ``rope``'s bits, so ``z`` is the packed attention's of ``rope``'s
    outputs bit for bit (q a strided view of a wider row, as the forward's is)."""
    generator = torch.Generator().manual_seed(12)
    lengths, heads, kv_heads, d = [7, 33, 2], 4, 2, 48
    n = sum(lengths)
    wide = torch.randn(n, (heads + 1) * d, generator=generator).to(TRITON_DEVICE, torch.float16)
    q = wide[:, :heads * d].view(n, heads, d)
    k, v = (torch.randn(n, kv_heads, d, generator=generator).to(TRITON_DEVICE, torch.float16) for _ in range(2))
    cos, sin = (torch.randn(n, 1, d, generator=generator).to(TRITON_DEVICE) for _ in range(2))
    starts = torch.tensor([0, *np.cumsum(lengths)], device=TRITON_DEVICE)
    args = (starts, max(lengths), math.sqrt(d), 0)
    fused = packed_attention(q, k, v, *args, (cos, sin, interleaved))
    separate = packed_attention(rope(q, cos, sin, interleaved), rope(k, cos, sin, interleaved), v, *args)
    assert torch.equal(fused, separate)
    with pytest.raises(ValueError, match="cos"):
        packed_attention(q, k, v, *args, (cos[:, :, :32], sin, interleaved))


BY_EXPERT_FORMATS = ("Q4_K", "Q6_K", "Q8_0", "Q4_0", "MXFP4")


@pytest.mark.skipif(TRITON_DEVICE is None, reason="needs a CUDA GPU or TRITON_INTERPRET=1")
class TestByExpert:
    """The GEMV over (activation row, expert) pairs of stacked experts, interpreted on CPU tensors or on a GPU."""

    @pytest.mark.parametrize("fmt", BY_EXPERT_FORMATS)
    def test_gemv_by_expert_is_each_chosen_experts_gemv(self, fmt):
        """llama.cpp's ``mul_mat_id`` on the stacked experts as stored: each (activation row, expert) pair's output
        is the GEMV of that expert's rows alone (the kernel ``linear`` runs for one row on CUDA), bit for bit, for 1
        and 16 pairs with experts and rows repeated; and the product with gguf's float64 dequantization."""
        from workbench.moe import _rows

        rng = np.random.default_rng([BY_EXPERT_FORMATS.index(fmt), 8])
        n_experts, rows, k = 4, 12, 256  # 12 rows: not a multiple of the GEMV's row blocks
        w, reference = random_weight(fmt, n_experts * rows, k, rng)
        w = w.to(TRITON_DEVICE)
        dtypes = [torch.float32] if INTERPRETING else [torch.float32, torch.bfloat16]
        for dtype in dtypes:
            x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32)).to(TRITON_DEVICE, dtype)
            for pairs in (1, 16):
                experts = torch.from_numpy(rng.integers(0, n_experts, pairs)).to(TRITON_DEVICE)
                x_rows = torch.from_numpy(rng.integers(0, len(x), pairs)).to(TRITON_DEVICE)
                out = gemv_by_expert(x, w, n_experts, experts, x_rows)
                assert out.shape == (pairs, rows) and out.dtype == dtype
                for p, (e, r) in enumerate(zip(experts.tolist(), x_rows.tolist())):
                    assert torch.equal(out[p], gemv(x[r:r + 1], _rows(w, e, n_experts))[0]), (dtype, pairs, p)
                    expected = x[r:r + 1].double().cpu().numpy() @ reference[e * rows:(e + 1) * rows].T
                    assert relative_error(out[p:p + 1], expected) < ROUNDING_TOL[dtype], (dtype, pairs, p)
        empty = torch.zeros(0, dtype=torch.long, device=TRITON_DEVICE)
        assert gemv_by_expert(x, w, n_experts, empty, empty).shape == (0, rows)

    @pytest.mark.parametrize("fmt", ["Q4_K", "Q6_K", "Q8_0"])
    def test_gemv_llamacpp_by_expert_is_each_chosen_experts_gemv(self, fmt):
        """The same in llama.cpp's numerics: each row of activations quantized once, each pair's integer dots the
        llama.cpp-numerics GEMV's of that row and expert, bit for bit."""
        from workbench.moe import _rows

        rng = np.random.default_rng([BY_EXPERT_FORMATS.index(fmt), 9])
        n_experts, rows, k = 3, 8, 256
        w = random_weight(fmt, n_experts * rows, k, rng)[0].to(TRITON_DEVICE)
        x = torch.from_numpy(rng.standard_normal((2, k)).astype(np.float32)).to(TRITON_DEVICE)
        experts = torch.tensor([2, 0, 2, 1, 2], device=TRITON_DEVICE)
        x_rows = torch.tensor([0, 1, 1, 0, 0], device=TRITON_DEVICE, dtype=torch.int32)
        out = gemv_llamacpp_by_expert(x, w, n_experts, experts, x_rows)
        for p, (e, r) in enumerate(zip(experts.tolist(), x_rows.tolist())):
            assert torch.equal(out[p], gemv_llamacpp(x[r:r + 1], _rows(w, e, n_experts))[0]), p


class TestBadInput:
    """Rejected before any kernel runs, interpreter or not."""

    def weight(self, fmt="Q4_0", rows=8, cols=64):
        return random_weight(fmt, rows, cols, np.random.default_rng(0))[0]

    @pytest.mark.parametrize("kernel", [gemv, gemm])
    def test_wrong_feature_count(self, kernel):
        with pytest.raises(ValueError, match="features"):
            kernel(torch.zeros(1, 32), self.weight())

    @pytest.mark.parametrize("kernel", [gemv, gemm])
    def test_not_2d(self, kernel):
        with pytest.raises(ValueError, match="2-D"):
            kernel(torch.zeros(1, 1, 64), self.weight())

    @pytest.mark.parametrize("kernel", [gemv, gemm])
    def test_non_contiguous(self, kernel):
        with pytest.raises(ValueError, match="contiguous"):
            kernel(torch.zeros(64, 2).T[:1], self.weight())

    @pytest.mark.parametrize("kernel", [gemv, gemm])
    def test_unsupported_dtype(self, kernel):
        with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
            kernel(torch.zeros(1, 64, dtype=torch.float64), self.weight())

    @pytest.mark.parametrize("kernel", [gemv, mma_gemm, gemm])
    def test_unsupported_format(self, kernel):
        # gguf's IQ4_NL (32 values in 18 bytes), which no kernel of ours reads
        iq4_nl = QuantFormat("IQ4_NL", 20, 32, 18, dequantize=lambda blocks: None, quantize=lambda values: None)
        w = QuantTensor(torch.zeros(8, 18 * 8, dtype=torch.uint8), iq4_nl, (8, 256))
        with pytest.raises(ValueError, match="IQ4_NL"):
            kernel(torch.zeros(1, 256, dtype=torch.bfloat16), w)

    def test_mma_gemm_reads_only_its_formats(self):
        w = QuantTensor(torch.zeros(16, 22 * 4, dtype=torch.uint8), "Q5_0", (16, 128))
        with pytest.raises(ValueError, match="this kernel reads Q4_0, .*; got Q5_0"):
            mma_gemm(torch.zeros(1, 128, dtype=torch.bfloat16), w)

    @pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
    def test_misaligned_data(self, fmt):
        w = self.weight(fmt)
        shifted = torch.zeros(w.data.numel() + 1, dtype=torch.uint8)[1:].view(w.data.shape)
        misaligned = QuantTensor(shifted, fmt, w.shape)
        with pytest.raises(ValueError, match="multiple of"):
            gemv(torch.zeros(1, 64), misaligned)

    def test_mma_gemm_inputs(self):
        w = self.weight("Q4_K", 16, 256)
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            mma_gemm(torch.zeros(2, 256), w)
        with pytest.raises(ValueError, match=f"at most {MMA_MAX_ROWS} row"):
            mma_gemm(torch.zeros(MMA_MAX_ROWS + 1, 256, dtype=torch.bfloat16), w)
        with pytest.raises(ValueError, match=f"multiple of {MMA_K_MULTIPLE} values, got 96"):
            mma_gemm(torch.zeros(2, 96, dtype=torch.bfloat16), self.weight("Q8_0", 16, 96))
        shifted = torch.zeros(2 * 256 + 1, dtype=torch.bfloat16)[1:].view(2, 256)
        with pytest.raises(ValueError, match="multiples of 16 bytes"):
            mma_gemm(shifted, w)
        with pytest.raises(ValueError, match="num_warps"):
            mma_gemm(torch.zeros(2, 256, dtype=torch.bfloat16), w, MmaConfig(num_warps=6))
        with pytest.raises(ValueError, match="step_pairs"):
            mma_gemm(torch.zeros(2, 256, dtype=torch.bfloat16), w, MmaConfig(step_pairs=0))

    @pytest.mark.parametrize("kernel", [gemv_llamacpp, gemm_llamacpp])
    def test_llamacpp_unsupported_format(self, kernel):
        w = QuantTensor(torch.zeros(8, 64 * 2, dtype=torch.uint8), "F16", (8, 64))
        with pytest.raises(ValueError, match="F16"):
            kernel(torch.zeros(1, 64), w)

    def test_q8_needs_whole_blocks(self):
        with pytest.raises(ValueError, match="multiple of 256"):
            quantize_activations(torch.zeros(1, 96), "Q6_K")
        with pytest.raises(ValueError, match="multiple of 32"):
            quantize_activations(torch.zeros(1, 48), "Q8_0")

    def test_gemv_by_expert_pairs(self):
        w, x, pairs = self.weight(rows=8), torch.zeros(1, 64), torch.zeros(2, dtype=torch.long)
        with pytest.raises(ValueError, match="8 rows do not stack 3 experts"):
            gemv_by_expert(x, w, 3, pairs, pairs)
        with pytest.raises(ValueError, match="experts and x_rows must be 1-D int32/int64 tensors of one length"):
            gemv_by_expert(x, w, 2, pairs, pairs[:1])
        with pytest.raises(ValueError, match="experts and x_rows"):
            gemv_by_expert(x, w, 2, pairs.float(), pairs)
        with pytest.raises(ValueError, match="this kernel reads .*; got MXFP4"):
            gemv_llamacpp_by_expert(torch.zeros(1, 64), self.weight("MXFP4", 8, 64), 2, pairs, pairs)

    def test_gemv_row_limit(self):
        with pytest.raises(ValueError, match=f"at most {GEMV_MAX_ROWS} row"):
            gemv(torch.zeros(GEMV_MAX_ROWS + 1, 64), self.weight())

    def test_cpu_tensors_without_interpreter(self, monkeypatch):
        from workbench.kernels.triton import common

        monkeypatch.setattr(common, "INTERPRETING", False)  # as in a process without TRITON_INTERPRET=1
        with pytest.raises(ValueError, match="CUDA"):
            gemv(torch.zeros(1, 64), self.weight())


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU")
class TestCuda:
    # A model shape whose K leaves a partial last step, K = 4096 (the 4-bit GEMVs' two units per thread)
    # and a Llama-3-8B shape (N x K).
    SHAPES = {32: [(1536, 576), (1024, 4096), (4096, 14336)], 256: [(576, 1536), (1024, 4096), (4096, 14336)]}
    # (rows, dtype): decode (GEMV), batched decode (GEMV, few-row GEMM, K split), prefill (GEMM, one partial tile of
    # 128 rows included; dequantize + cuBLAS).
    BATCHES = [
        (1, torch.bfloat16), (1, torch.float16), (3, torch.bfloat16), (8, torch.bfloat16), (12, torch.bfloat16),
        (16, torch.float16), (40, torch.bfloat16), (100, torch.bfloat16), (128, torch.float16), (512, torch.bfloat16),
    ]

    @pytest.mark.parametrize("fmt", FORMATS)
    def test_full_shapes(self, fmt):
        rng = np.random.default_rng(FORMATS.index(fmt))
        # and a weight of one 64-row tile per multiprocessor, where the fused GEMM takes up to 128 rows (not in Q6_K);
        # its last 4-, 16- and 64-row tiles are partial
        wide = (64 * torch.cuda.get_device_properties(0).multi_processor_count - 22, 256)
        for n, k in [*self.SHAPES[get_format(fmt).block_size], wide]:
            w, reference = random_weight(fmt, n, k, rng)
            w = w.to("cuda")
            reference = torch.from_numpy(reference).cuda()
            for m, dtype in self.BATCHES:
                x = torch.randn(m, k, device="cuda").to(dtype)
                mma = fmt in MMA_FORMATS and m <= MMA_MAX_ROWS and k % MMA_K_MULTIPLE == 0
                kind = ("gemv" if m <= gemv_rows(fmt) else "mma" if mma and m <= mma_rows(fmt) else "gemm"
                        if m <= gemm_rows(fmt, n, x.device) else "dequant-matmul")
                if n >= 4096 and m in (128, 512):
                    assert kind == ("dequant-matmul" if fmt == "Q6_K" or m == 512 else "gemm")
                if (n, k) == (4096, 14336) and kind == "gemm":  # K split at 65-128 rows
                    assert gemm_config(m, n, k, x.device, fmt).split_k > 1
                assert select_kernel(x, w).name == f"triton-{kind}-{fmt.lower()}"
                expected = (x.double() @ reference.T).cpu().numpy()
                # The GEMM and the dense matmul round the weights to the activation dtype too.
                tolerance = ROUNDING_TOL[dtype] * (1 if kind in ("gemv", "mma") else 2)
                out = linear(x, w)
                assert relative_error(out, expected) < tolerance, (fmt, n, k, m, dtype)
                assert torch.equal(out, linear(x, w)), "results differ between runs: a race"
                if mma:
                    assert relative_error(mma_gemm(x, w), expected) < ROUNDING_TOL[dtype], (fmt, n, k, m, dtype, "mma")
                # the many-row paths, whichever linear picked (one row: the GEMM compiled for M = 1)
                tolerance = 2 * ROUNDING_TOL[dtype]
                assert relative_error(gemm(x, w), expected) < tolerance, (fmt, n, k, m, dtype, "gemm")
                assert relative_error(dequant_matmul(x, w), expected) < tolerance, (fmt, n, k, m, dtype)

    @pytest.mark.parametrize("fmt", MMA_FORMATS)
    def test_mma_config(self, fmt):
        """Powers of two, and no more warps than a row has steps (6 super-blocks at K = 1536), for one and two tiles of
        activation rows."""
        for n, k in [(576, 1536), (4096, 4096), (4096, 14336), (14336, 4096), (128256, 4096), (16, 256), (16, 64)]:
            for m in (8, MMA_MAX_ROWS):
                config = mma_config(n, k, torch.device("cuda"), fmt, m)
                warps = config.num_warps
                assert warps & (warps - 1) == 0 and 1 <= warps <= max(1, k // config.step_values(fmt)), (n, k, m, warps)

    def test_unsupported_dtype_falls_back(self):
        w = random_weight("Q4_0", 64, 256, np.random.default_rng(0))[0].to("cuda")
        x = torch.randn(1, 256, device="cuda", dtype=torch.float64)
        assert not select_kernel(x, w).name.startswith("triton")

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("fmt", FORMATS)
    def test_llamacpp_kernels_match_the_cpu_kernel(self, fmt, dtype):
        rng = np.random.default_rng(7)
        for n, k in [(1536, 768), (1024, 4096), (4096, 14336)]:
            w = random_weight(fmt, n, k, rng)[0].to("cuda")
            for m in (1, 3, LLAMACPP_GEMM_MIN_ROWS, 200):  # GEMV, GEMM
                kind = "gemv" if m < LLAMACPP_GEMM_MIN_ROWS else "gemm"
                x = torch.randn(m, k, device="cuda").to(dtype)
                expected_blocks = ggml_q8_k(x) if fmt.endswith("_K") else ggml_q8(x, 3)
                for got, expected in zip(quantize_activations(x, fmt), expected_blocks):
                    assert torch.equal(got.cpu(), expected)
                with numerics("llamacpp"):
                    assert select_kernel(x, w).name == f"triton-{kind}-llamacpp-{fmt.lower()}"
                    out = linear(x, w)
                expected = llamacpp_cpu(x, w)
                tolerance = 1e-5 if dtype == torch.float32 else 2.0**-8  # a bfloat16 output adds one rounding
                assert (out.float().cpu() - expected).abs().max() < tolerance * expected.abs().max(), (n, k, m)

    @pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K", "Q5_K", "Q2_K"])
    def test_llamacpp_numerics_of_a_model_are_the_cpu_ones(self, fmt, tiny_model):
        """Every matrix of a model (fused projections, float32 activations, a 13-token prompt: the GEMM) computes on
        CUDA in llama.cpp numerics what the CPU kernels compute, not the exact product.

        Each matrix gets the CPU run's input, patched in: the activations' quantizer is discontinuous, so where the two
        devices' float32 sums (the same integer dots, scaled in another order) round one value to different int8s, every
        later activation differs by about as much as the numerics themselves differ from exact ones. Unpatched, that
        happened in about a third of such random models on an H100 (docs/kernels.md, "Numerics: exact and
        llama.cpp")."""
        from workbench.hooks import Patch

        shape = dict(n_layers=2, d_model=256, d_mlp=512)
        on_cpu = tiny_model("llama", fmt, seed=4, device="cpu", **shape)
        on_cuda = tiny_model("llama", fmt, seed=4, device="cuda", dtype="float32", **shape)
        ids = list(range(3, 40, 3))
        inputs = [f"blocks.{i}.{p}" for i in range(2)
                  for p in ("ln1.hook_normalized", "attn.hook_z", "ln2.hook_normalized", "mlp.hook_post")]
        inputs.append("ln_final.hook_normalized")
        outputs = [f"blocks.{i}.{p}" for i in range(2) for p in (
            "attn.hook_q", "attn.hook_k", "attn.hook_v", "hook_attn_out", "mlp.hook_pre", "mlp.hook_pre_linear",
            "hook_mlp_out")]
        exact = on_cpu.run(ids, record=outputs)
        with numerics("llamacpp"), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # every matrix has a llama.cpp-numerics kernel
            expected = on_cpu.run(ids, record=inputs + outputs)
            got = on_cuda.run(ids, record=outputs, interventions=[Patch(name, donor=expected) for name in inputs])
        for name in [*outputs, "logits"]:
            want = expected.logits if name == "logits" else expected.activations[name]
            error = ((got.logits if name == "logits" else got.activations[name]).cpu() - want).abs().max()
            assert error < 1e-5 * want.abs().max(), name
            exact_error = ((exact.logits if name == "logits" else exact.activations[name]) - want).abs().max()
            assert exact_error > 100 * error, name

    def test_llamacpp_numerics_without_a_kernel_say_they_run_exactly(self):
        """Packed data at an odd address fits no Triton kernel (they load whole 16-bit words): under llama.cpp numerics
        the matmul warns, names the path that ran, and gives the exact result."""
        packed = QuantTensor.quantize(torch.randn(64, 256), "Q4_0").to("cuda")
        buffer = torch.empty(packed.data.numel() + 1, dtype=torch.uint8, device="cuda")
        w = QuantTensor(buffer[1:].view(packed.data.shape), packed.fmt, packed.shape)
        w.data.copy_(packed.data)
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)
        assert select_kernel(x, w).name == "blockwise-dequant-matmul"
        exact = linear(x, w)
        with numerics("llamacpp"), pytest.warns(
            RuntimeWarning, match="no 'llamacpp'-numerics kernel for Q4_0 .* on cuda; .* 'blockwise-dequant-matmul' path"
        ):
            assert torch.equal(linear(x, w), exact)

    def test_device_mismatch(self):
        w = random_weight("Q4_0", 64, 256, np.random.default_rng(0))[0]
        with pytest.raises(ValueError, match="weight on cpu"):
            gemv(torch.randn(1, 256, device="cuda"), w)

    def test_launches_reuse_a_compiled_kernel_only_where_it_holds(self):
        """``launch`` keeps one compiled kernel per argument class. Rows at and off 16-byte boundaries, and widths of 1
        (a constant to Triton), multiples of 16 and neither, in an order that reuses every kept kernel: each norm
        equals the torch formula's and each GEMV the aligned copy's."""
        buffer = torch.randn(8 * 64 + 16, device="cuda", dtype=torch.bfloat16)
        for d in (64, 1, 17, 48, 1, 64):
            weight = torch.randn(d, device="cuda", dtype=torch.bfloat16)
            for offset in (0, 1, 8, 3, 0):
                x = buffer[offset:offset + 8 * d].view(8, d)
                assert (x.data_ptr() % 16 == 0) == (offset % 8 == 0)
                scale, out = rms_norm(x, weight, 1e-6)
                with layer_ops.torch_formulas():
                    expected_scale, expected = layer_ops.rms_norm(x, weight, 1e-6)
                torch.testing.assert_close(scale, expected_scale, rtol=2**-7, atol=0)
                torch.testing.assert_close(out, expected, rtol=2**-7, atol=1e-5)
        w = random_weight("Q4_K", 512, 1024, np.random.default_rng(3))[0].to("cuda")
        for offset in (0, 1, 8, 5, 0):
            x = torch.randn(1024 + 8, device="cuda", dtype=torch.bfloat16)[offset:offset + 1024].view(1, 1024)
            assert torch.equal(gemv(x, w), gemv(x.clone(), w)), offset
        kept = [key[0].__name__ for key in launch._COMPILED]
        assert "_rms_norm_kernel" in kept and "_gemv_kernel" in kept, "the kept kernels are never launched directly"
        # A host tensor where a kept kernel reads device memory: Triton's C launcher refuses it, as its Python one did.
        with pytest.raises(ValueError, match="cannot be accessed"):
            rms_norm(buffer[:64].view(1, 64), torch.randn(64, dtype=torch.bfloat16), 1e-6)
