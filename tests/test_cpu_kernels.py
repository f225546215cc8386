"""The C++ CPU kernels of workbench.kernels.cpu against the gguf package's reference dequantizer."""
from __future__ import annotations

import importlib
import warnings

import gguf
import numpy as np
import pytest
import torch

from workbench.kernels import cpu, layer_ops
from workbench.kernels.formats import QuantFormat
from workbench.kernels.linear import (
    BLOCKWISE, REGISTRY, Kernel, linear, linear_parts, linear_segments, select_kernel,
)
from workbench.kernels.quant_tensor import QuantTensor

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
# Byte offsets of the fp16 scale / min fields in each block; every other byte may be anything.
HALF_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "MXFP4": [],
}
K = 512
U = 2.0**-24  # fp32 unit roundoff

pytestmark = pytest.mark.skipif(cpu.extension() is None, reason="C++ CPU kernels could not be built")


def gguf_format(name: str) -> QuantFormat:
    """A format whose dequantizer is the gguf package's numpy reference, independent of our own."""
    qtype = gguf.GGMLQuantizationType[name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]

    def dequantize(blocks: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype).reshape(-1, block_size).copy())

    def quantize(values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    return QuantFormat(name, int(qtype), block_size, type_size, dequantize, quantize)


def random_weight(name: str, rows: int, cols: int, seed: int = 0) -> QuantTensor:
    """Random GGUF bytes (all bit patterns) with finite fp16 scales of either sign."""
    fmt = gguf_format(name)
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (rows * cols // fmt.block_size, fmt.type_size), dtype=np.uint8)
    for offset in HALF_FIELDS[name]:
        scales = (rng.uniform(2e-4, 2e-3, len(data)) * rng.choice([-1, 1], len(data))).astype(np.float16)
        data[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if name == "MXFP4":  # its scale is the power of two in its first byte: 2**-18 .. 2**-3, as finite as the others
        data[:, 0] = rng.integers(110, 126, len(data))
    return QuantTensor(torch.from_numpy(data).reshape(rows, -1), fmt, (rows, cols))


def assert_within_fp32_rounding(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """|y - ref| <= (K + 2) u (|x| @ |w|.T): the worst case of any fp32 summation order."""
    bound = (x.abs().double() @ w.abs().double().T) * (x.shape[-1] + 2) * U
    excess = ((y.double() - ref).abs() - bound).max().item()
    assert excess <= 0, f"error exceeds the fp32 rounding bound by {excess}"


@pytest.fixture(params=["fused", "panel"])
def exact_path(request, monkeypatch):
    """Run exact matmuls through the fused dot products or through dequantized panels + BLAS."""
    monkeypatch.setattr(cpu, "PANEL_MIN_BATCH", 10**9 if request.param == "fused" else 1)
    return request.param


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_exact_matches_dequantized_reference(name, m, exact_path):
    w = random_weight(name, 40, K)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    assert select_kernel(x, w) is cpu.EXACT
    w_ref = w.dequantize()
    y = linear(x, w)
    assert y.shape == (m, 40) and y.dtype == torch.float32
    assert_within_fp32_rounding(y, x.double() @ w_ref.double().T, x, w_ref)


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_panels_split_over_threads_in_inference_mode(name, exact_path):
    """With two threads each dequantizes its own panels and multiplies them on its own, carrying the caller's
    inference mode into the pool (the output is an inference tensor): the single thread's results within fp32
    rounding, and the reference's. (The suite's workers run one thread each, so this sets two.)"""
    w = random_weight(name, 520, 256)  # at least 64 rows a thread, panels of unequal rows
    x = torch.randn(70, 256, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, w)
        torch.set_num_threads(2)
        with torch.inference_mode():
            two = linear(x, w)
    finally:
        torch.set_num_threads(threads)
    w_ref = w.dequantize()
    assert_within_fp32_rounding(two, x.double() @ w_ref.double().T, x, w_ref)
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("values", [0, 9216], ids=["3 blocks", "past two spans"])
def test_exact_rows_of_an_odd_number_of_blocks(name, values):
    """Fused dot products that alternate accumulators between blocks handle a last, unpaired block; rows of more than
    one span of blocks (those decoded into memory a span at a time: 4,096 values a span for Q6_K, 8,192 for the 4-bit
    formats) end in a short last span."""
    k = values + 3 * gguf_format(name).block_size
    w = random_weight(name, 8, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(3))
    w_ref = w.dequantize()
    assert_within_fp32_rounding(linear(x, w), x.double() @ w_ref.double().T, x, w_ref)


DIGIT_FORMATS = ["Q6_K", "Q3_K"]  # those whose single rows multiply in integers on AVX-512


def activations_as_digits(x: torch.Tensor, values: int = 16) -> torch.Tensor:
    """x as the single-row dot products of DIGIT_FORMATS take it on AVX-512 (values=16), or the AMX tiles of
    TILE_FORMATS (values=32): each run of that many values rounded (half to even) to a multiple of 2^(e - 23), where
    2^e is the power of two above their largest magnitude (e = 0 for zeros, at least -100), and at most 2^23 - 1
    multiples from zero. In float64."""
    groups = x.double().reshape(*x.shape[:-1], -1, values)
    e = torch.frexp(groups.abs().amax(-1, keepdim=True)).exponent.clamp(min=-100)
    step = torch.pow(2.0, (e - 23).double())
    return (torch.round(groups / step).clamp(-(2**23 - 1), 2**23 - 1) * step).reshape(x.shape)


def activations_of_every_magnitude(rows: int, k: int, values: int, g: torch.Generator) -> torch.Tensor:
    """Activations whose runs of `values` values each take a magnitude from 1e-30 to 1e30, spread within each run, the
    first run of row 0 zeros."""
    x = torch.randn(rows, k, generator=g) * torch.pow(
        10.0, torch.randint(-30, 31, (rows, k // values, 1), generator=g).float()).repeat_interleave(values, 1).reshape(
        rows, k)
    x = x * torch.rand(rows, k, generator=g) ** 6
    x[0, :values] = 0.0
    return x


def digits_in_build() -> bool:
    return cpu.extension() is not None and cpu._native_isa().startswith("avx512")


@pytest.mark.parametrize("name", DIGIT_FORMATS)
@pytest.mark.parametrize("k", [256, 2048])
def test_single_rows_multiply_integer_digits_of_the_activations(name, k):
    """On AVX-512, a Q6_K or Q3_K weight times a single row of activations (or each row past the tiles of 4: rows 5
    and 6 of 6) is integer arithmetic on the activations as activations_as_digits rounds them: within (K / 256 + 8) u
    (|x~| @ |w|.T) of the float64 product of the rounded activations x~ (the lane sums are exact; a sum's conversion,
    the chain of K / 256 multiply-adds a lane and the final sums round), where the float32 bound of x @ w allows
    (K + 2) u. Activations of every magnitude from 1e-30 to 1e30, zeros and sign flips within a 16."""
    if not digits_in_build():
        pytest.skip("the digits are the AVX-512 builds' path")
    g = torch.Generator().manual_seed(11)
    w = random_weight(name, 24, k)
    w_ref = w.dequantize().double()
    x = activations_of_every_magnitude(6, k, 16, g)
    for rows in (x[:1], x):
        y = cpu.extension().linear_exact(rows, [w.data], [w.fmt.ggml_type], [24], k, 10**9)
        single = rows[-2:] if len(rows) == 6 else rows
        rounded = activations_as_digits(single)
        bound = (rounded.abs() @ w_ref.abs().T) * (k / 256 + 8) * U
        assert ((y[-len(single):].double() - rounded @ w_ref.T).abs() <= bound).all()
        assert_within_fp32_rounding(y, rows.double() @ w_ref.T, rows, w_ref.float())


@pytest.mark.parametrize("name", DIGIT_FORMATS)
def test_digits_round_half_to_even_and_leave_rows_with_nan_to_floats(name):
    """A hand-made case: the weight is w1 (about 1) at value 1, about -0.5 at value 3 and 0 elsewhere; the activations
    1 at value 0, 3 * 2^-23 at value 1 and 2^-24 at value 3: their 16 step by 2^-22, so 1.5 steps round to 2 and a
    quarter step to 0, and the product is exactly w1 * 2^-21, where float dot products give w1 * 3 * 2^-23 +
    w3 * 2^-24. A row with a NaN keeps the float dot products and its NaN, and leaves the other row's result as it
    was."""
    if not digits_in_build():
        pytest.skip("the digits are the AVX-512 builds' path")
    row = torch.zeros(1, 256)
    row[0, 1], row[0, 3] = 1.0, -0.5
    w = QuantTensor.quantize(row, name)
    w_ref = w.dequantize()
    assert (w_ref != 0).sum() == 2
    x = torch.zeros(2, 256)
    x[:, 0], x[:, 1], x[:, 3] = 1.0, 3 * 2.0**-23, 2.0**-24
    x[1, 5] = float("nan")
    y = cpu.extension().linear_exact(x, [w.data], [w.fmt.ggml_type], [1], 256, 10**9)
    assert y[0].item() == w_ref[0, 1].item() * 2.0**-21 != w_ref[0, 1].item() * 3 * 2.0**-23
    assert y[1].isnan().item()


TILE_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "MXFP4"]  # a scale a 32: AMX's batches


def tiles_in_build() -> bool:
    return cpu.extension() is not None and cpu._native_isa() == "avx512_amx"


@pytest.mark.parametrize("name", TILE_FORMATS)
@pytest.mark.parametrize("k", [256, 2048])
def test_batches_multiply_integer_tiles_of_the_activations(name, k):
    """With AMX, a batch of 12 to 256 rows multiplies in int8 tiles: the activations as activations_as_digits rounds
    each 32 values, the codes as integers, every 32 products summed exactly. Within (K / 32 + 8) u (|x~| @ |w|.T) of
    the float64 product of the rounded activations x~ (a unit's three sums combine with two roundings, then one
    multiply-add a unit and the offsets' term round), and within the float32 bound of the unrounded product. Activations
    of every magnitude from 1e-30 to 1e30, zeros, 37 rows (two tiles of 16 and a partial one) and 40 weight rows (a
    partial tile of 16)."""
    if not tiles_in_build():
        pytest.skip("the tiles are the AMX build's path")
    g = torch.Generator().manual_seed(12)
    w = random_weight(name, 40, k)
    w_ref = w.dequantize().double()
    x = activations_of_every_magnitude(37, k, 32, g)
    y = cpu.extension().linear_exact(x, [w.data], [w.fmt.ggml_type], [40], k, 24).double()
    rounded = activations_as_digits(x, 32)
    bound = (rounded.abs() @ w_ref.abs().T) * (k / 32 + 8) * U
    assert ((y - rounded @ w_ref.T).abs() <= bound).all()
    assert_within_fp32_rounding(y, x.double() @ w_ref.T, x, w_ref.float())
    # the tiles from 12 rows on (below panel_min_batch too), each row the same bits; 11 rows take the float dot products
    run = lambda rows: cpu.extension().linear_exact(rows, [w.data], [w.fmt.ggml_type], [40], k, 10**9)  # noqa: E731
    assert torch.equal(run(x[:12]), y[:12].float())
    assert not torch.equal(run(x[:11]), y[:11].float())


def test_tile_rows_are_independent_of_their_batch_and_nan_rows_take_the_panels():
    """A row's result on the tiles is the same bits in a batch of 24 or of 250 rows, and whatever row of its tile of 16
    it lands in; a batch with a NaN takes the panels and keeps the NaN to its row; past 256 rows the panels take
    over."""
    if not tiles_in_build():
        pytest.skip("the tiles are the AMX build's path")
    g = torch.Generator().manual_seed(13)
    w = random_weight("Q4_1", 48, K)
    x = torch.randn(300, K, generator=g)
    run = lambda rows: cpu.extension().linear_exact(rows, [w.data], [w.fmt.ggml_type], [48], K, 24)  # noqa: E731
    whole, first, shifted = run(x[:250]), run(x[:24]), run(x[5:29])
    assert torch.equal(whole[:24], first) and torch.equal(whole[5:29], shifted)
    assert not torch.equal(run(x)[:24], first)
    with_nan = x[:24].clone()
    with_nan[3, 7] = float("nan")
    y = run(with_nan)
    assert y[3].isnan().all() and not y[torch.arange(24) != 3].isnan().any()
    clean = torch.arange(24) != 3
    assert not torch.equal(y[clean], first[clean])  # the panels' float products, not the tiles'
    w_ref = w.dequantize()
    assert_within_fp32_rounding(y[clean], x[:24][clean].double() @ w_ref.double().T, x[:24][clean], w_ref)


def test_exact_keeps_batch_dims_and_half_precision_inputs():
    w = random_weight("Q4_1", 24, 256)
    x = torch.randn(2, 3, 256)
    y = linear(x, w)
    assert y.shape == (2, 3, 24)
    torch.testing.assert_close(y, x @ w.dequantize().T, rtol=1e-5, atol=1e-5)
    y_bf16 = linear(x.bfloat16(), w)
    assert y_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(y_bf16, (x.bfloat16().float() @ w.dequantize().T).bfloat16())


def test_unsupported_format_and_dtype_take_blockwise_path():
    w = random_weight("Q4_1", 16, 256)
    assert select_kernel(torch.randn(2, 256, dtype=torch.float64), w) is BLOCKWISE
    # a format the extension has no code for (here gguf's IQ4_NL, with gguf's dequantizer) still multiplies
    blocks = torch.arange(16 * 8 * 18).remainder(251).to(torch.uint8).reshape(-1, 18)
    blocks[:, :2] = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)  # each block's scale d
    iq4 = QuantTensor(blocks.reshape(16, 144), gguf_format("IQ4_NL"), (16, 256))
    x = torch.randn(2, 256)
    assert select_kernel(x, iq4) is BLOCKWISE
    torch.testing.assert_close(linear(x, iq4), x @ iq4.dequantize().T)


@pytest.mark.parametrize("m", [1, 5, 20])
def test_parts_in_one_call_equal_separate_calls(m, exact_path):
    """q, k, v of mixed formats (as in Q4_K_M files) through one call give each part's own result, bit for bit."""
    parts = [random_weight("Q4_K", 40, K, seed=1), random_weight("Q4_K", 8, K, seed=2), random_weight("Q6_K", 8, K, seed=3)]
    x = torch.randn(2, m, K, generator=torch.Generator().manual_seed(m))
    outs = linear_parts(x, parts)
    assert [tuple(y.shape) for y in outs] == [(2, m, 40), (2, m, 8), (2, m, 8)]
    for y, w in zip(outs, parts):
        assert torch.equal(y, linear(x, w))


@pytest.mark.parametrize("m", [1, 5])
def test_parts_in_llamacpp_numerics_equal_separate_calls(m):
    """In llama.cpp numerics too: when every part has one type they share one quantization of x and one call (the op
    on q and k in Q4_K); parts of mixed types (v in Q6_K, a Q8_0) take a call each; every part's result bit for bit
    as alone."""
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    parts = [random_weight("Q4_K", 40, K, seed=1), random_weight("Q4_K", 8, K, seed=2),
             random_weight("Q6_K", 8, K, seed=3), random_weight("Q8_0", 16, K, seed=4)]
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    with cpu.numerics("llamacpp"):
        assert select_kernel(x, parts[0]).name == "cpu-gguf-llamacpp"
        outs = linear_parts(x, parts)
        for y, w in zip(outs, parts):
            assert torch.equal(y, linear(x, w))
        together = cpu.extension().linear_llamacpp(x, [w.data for w in parts[:2]], parts[0].fmt.ggml_type, [40, 8], K)
        assert torch.equal(together, torch.cat(outs[:2], dim=-1))


def test_parts_check_each_weight_and_fall_back_when_kernels_differ():
    x = torch.randn(1, K)
    with pytest.raises(ValueError, match="expects 256"):
        linear_parts(x, [random_weight("Q4_0", 8, K), random_weight("Q4_0", 8, 256)])
    dense = QuantTensor(torch.randn(8, K).view(torch.uint8), "F32", (8, K))
    quantized = random_weight("Q8_0", 8, K)
    y_dense, y_quantized = linear_parts(x, [dense, quantized])
    assert torch.equal(y_dense, linear(x, dense)) and torch.equal(y_quantized, linear(x, quantized))


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0", "MXFP4"])
def test_segments_in_one_call_equal_separate_calls(name, mode):
    """Each weight on its own rows of x (an MoE layer's chosen experts) through one call gives each part's own result
    on its rows, bit for bit: rows in the fused dot products, 14 rows (on AMX's tiles where the build has them), rows
    in the panels (or the tiles), and a part with no rows."""
    parts = [random_weight(name, 24, K, seed=seed) for seed in range(5)]
    x = torch.randn(cpu.PANEL_MIN_BATCH + 24, K, generator=torch.Generator().manual_seed(4))
    starts, counts = [0, 3, 3, 4, 18], [3, 0, 1, 14, cpu.PANEL_MIN_BATCH + 4]
    with cpu.numerics(mode):
        assert select_kernel(x, parts[0]).run_segments is not None
        out = linear_segments(x, parts, starts, counts)
        expected = torch.cat([linear(x[start:start + count], w) for w, start, count in zip(parts, starts, counts)])
    assert out.shape == (sum(counts), 24) and torch.equal(out, expected)
    with pytest.raises(ValueError, match="one shape"):
        linear_segments(x, [parts[0], random_weight(name, 8, K)], [0, 0], [1, 1])
    with pytest.raises(RuntimeError, match="outside"):
        cpu.extension().linear_exact_segments(x, [parts[0].data], [parts[0].fmt.ggml_type], 24, K, [len(x) - 1], [2],
                                              16)


@pytest.mark.parametrize("mode", ["exact", "llamacpp"])
def test_rows_shared_out_between_threads_keep_their_bits(mode):
    """Threads take chunks of rows in turn: with 3 threads every row is computed, with the bits one thread gives, for
    plain, several-part and segment calls (enough rows for many chunks)."""
    parts = [random_weight("Q4_K", 1500, K, seed=5), random_weight("Q4_K", 1500, K, seed=6)]
    x = torch.randn(4, K, generator=torch.Generator().manual_seed(6))
    starts, counts = [0, 1], [1, 3]
    threads = torch.get_num_threads()
    outs = {}
    with cpu.numerics(mode):
        for n in (1, 3):
            torch.set_num_threads(n)
            try:
                outs[n] = [linear(x[:1], parts[0]), *linear_parts(x, parts), linear_segments(x, parts, starts, counts)]
            finally:
                torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(outs[1], outs[3]))
    w_ref = parts[0].dequantize()
    if mode == "exact":
        assert_within_fp32_rounding(outs[3][0], x[:1].double() @ w_ref.double().T, x[:1], w_ref)


def test_extension_rejects_malformed_weights():
    x = torch.randn(2, 256)
    with pytest.raises(RuntimeError, match="packed weight must be"):
        cpu.extension().linear_exact(x, [torch.zeros(8, 100, dtype=torch.uint8)], [3], [8], 256, 32)
    with pytest.raises(RuntimeError, match="unsupported GGML type"):
        cpu.extension().linear_exact(x, [torch.zeros(8, 144, dtype=torch.uint8)], [20], [8], 256, 32)  # IQ4_NL
    with pytest.raises(RuntimeError, match="one type and row count per packed weight"):
        cpu.extension().linear_exact(x, [torch.zeros(8, 160, dtype=torch.uint8)], [2, 2], [8], 256, 32)


@pytest.fixture()
def fresh_registry():
    """The kernel registry with no choice kept, before the test and after it (which may have kept a choice that only
    holds in its patched world)."""
    REGISTRY.reset()
    yield REGISTRY
    REGISTRY.reset()


def test_build_failure_warns_and_falls_back_to_blockwise(monkeypatch, fresh_registry):
    def no_compiler(isa):
        raise RuntimeError("no C++ compiler")

    # a fresh process: nothing built yet, no kernel chosen yet
    monkeypatch.setattr(cpu, "_build_extension", no_compiler)
    monkeypatch.setattr(cpu, "_extension", {})
    w = random_weight("Q8_0", 8, 256)
    with pytest.warns(RuntimeWarning, match="blockwise-dequant-matmul"):
        assert select_kernel(torch.randn(1, 256), w) is BLOCKWISE


def test_an_amx_build_that_fails_falls_back_to_the_vnni_build(monkeypatch):
    """A compiler without AMX's intrinsics fails the AMX build; the VNNI build is asked for next, with no warning."""
    asked = []

    def compiler_without_amx(isa):
        asked.append(isa)
        if isa == "avx512_amx":
            raise RuntimeError("unrecognized command-line option '-mamx-tile'")
        return f"ops for {isa}"

    monkeypatch.setattr(cpu, "_build_extension", compiler_without_amx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpu._build_or_warn("avx512_amx") == "ops for avx512_vnni"
    assert asked == ["avx512_amx", "avx512_vnni"]


def test_kernel_choices_are_kept_only_where_they_depend_on_types_alone():
    """A registry keeps the CPU kernels' choice per (device type, format, dtype, numerics); a kernel whose ``supports``
    reads more (here the row count, as the CUDA kernels do) is asked again every time."""
    registry = REGISTRY.copy()  # the default registry's kernels; registering here leaves that one alone
    one_row = Kernel("one-row", "meta", lambda x, w: x.shape[0] == 1, lambda x, w: x @ w.T)
    registry.register(one_row)
    w = random_weight("Q8_0", 8, 256)
    for rows, expected in [(1, one_row), (2, BLOCKWISE), (1, one_row), (2, BLOCKWISE)]:
        assert registry.select(torch.empty(rows, 256, device="meta"), w) is expected, rows
    assert registry.chosen == {}
    x = torch.randn(1, 256)
    assert registry.select(x, w) is cpu.EXACT is registry.select(x, w)
    with cpu.numerics("llamacpp"):
        assert registry.select(x, w) is cpu.LLAMACPP
    assert registry.select(x, w) is cpu.EXACT
    assert registry.select(x, w, "llamacpp") is cpu.LLAMACPP  # numerics given rather than current
    assert registry.chosen == {("cpu", "Q8_0", torch.float32, "exact"): cpu.EXACT,
                               ("cpu", "Q8_0", torch.float32, "llamacpp"): cpu.LLAMACPP}
    assert "meta" not in REGISTRY.kernels


# --- llama.cpp numerics --------------------------------------------------------------------------

# The activation type ggml-cpu pairs with each weight type (its vec_dot_type).
ACTIVATION_TYPE = {
    "Q4_0": "Q8_0", "Q5_0": "Q8_0", "Q8_0": "Q8_0", "Q4_1": "Q8_1", "Q5_1": "Q8_1", "MXFP4": "Q8_0",
    **{k_quant: "Q8_K" for k_quant in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")},
}


def quantize_q8_reference(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Torch rendering of ggml-cpu's quantize_row_q8_0/_1/_K: (GGUF bytes, Q8_1 sums s, dequantized x in fp64)."""
    m, k = x.shape
    if kind == "Q8_K":
        blocks = x.reshape(m, -1, 256)
        extreme = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))  # first signed value of largest |x|
        # (tensor division: `scalar / tensor` in torch multiplies by a rounded reciprocal)
        iscale = torch.where(extreme != 0, torch.full_like(extreme, -127.0) / extreme, torch.zeros_like(extreme))
        q = torch.round(iscale * blocks).clamp(max=127)
        d = torch.where(extreme != 0, torch.ones_like(iscale) / iscale, torch.zeros_like(iscale))
        bsums = q.reshape(m, -1, 16, 16).sum(-1).to(torch.int16)
        parts = [d.view(torch.uint8), q.to(torch.int8).view(torch.uint8), bsums.view(torch.uint8)]
        return torch.cat(parts, -1).reshape(m, -1), None, (d.double() * q.double()).reshape(m, k)
    blocks = x.reshape(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    d = amax / 127.0
    q = torch.round(blocks * torch.where(amax != 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax)))
    d16 = d.half()
    parts = [d16.view(torch.uint8)]
    s = None
    if kind == "Q8_1":
        s = (d * q.sum(-1, keepdim=True)).half()
        parts.append(s.view(torch.uint8))
    parts.append(q.to(torch.int8).view(torch.uint8))
    x_deq = (d16.double() * q.double()).reshape(m, k)
    return torch.cat(parts, -1).reshape(m, -1), None if s is None else s.double().squeeze(-1), x_deq


def llamacpp_reference(x: torch.Tensor, w: QuantTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's result for x @ w.T in fp64, and the weights it multiplies (for the rounding bound)."""
    _, s, x_deq = quantize_q8_reference(x, ACTIVATION_TYPE[w.fmt.name])
    if s is None:
        w_deq = w.dequantize().double()
        return x_deq @ w_deq.T, w_deq
    # Q4_1/Q5_1: d*q against the activations, plus the block min times the fp16 sum s of the Q8_1 block.
    zero_min = w.data.clone()
    zero_min.view(-1, w.fmt.type_size)[:, 2:4] = 0
    w_scaled = QuantTensor(zero_min, w.fmt, w.shape).dequantize().double()
    mins = w.data.view(-1, w.fmt.type_size)[:, 2:4].contiguous().view(torch.float16).double().reshape(w.shape[0], -1)
    return x_deq @ w_scaled.T + s @ mins.T, w_scaled + mins.repeat_interleave(32, 1)


@pytest.mark.parametrize("name", FORMATS)
def test_activation_quantization_matches_ggml(name):
    kind = ACTIVATION_TYPE[name]
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(1))
    x[1] = 0  # an all-zero row quantizes to zero scales
    # Ties: with |x| = 127 at the block maximum the scale is exactly 1, so 2.5 and -3.5 must round half to even.
    x[2, :4] = torch.tensor([127.0, 2.5, -3.5, 0.5])
    expected, _, _ = quantize_q8_reference(x, kind)
    assert torch.equal(cpu.quantize_activations(x, int(gguf.GGMLQuantizationType[name])), expected)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 64])
def test_llamacpp_matches_quantized_reference(name, m):
    w = random_weight(name, 40, K, seed=m)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    with cpu.numerics("llamacpp"):
        assert select_kernel(x, w) is cpu.LLAMACPP
        y = linear(x, w)
    assert cpu.get_numerics() == "exact"
    ref, w_ref = llamacpp_reference(x, w)
    _, _, x_deq = quantize_q8_reference(x, ACTIVATION_TYPE[name])
    assert_within_fp32_rounding(y, ref, x_deq, w_ref)
    # ... and it is not the exact result: the activation quantization shows.
    exact = x.double() @ w.dequantize().double().T
    assert (y.double() - exact).abs().max() > 100 * (y.double() - ref).abs().max()


def test_llamacpp_numerics_for_unsupported_format_warns_and_runs_exactly(fresh_registry):
    iq4 = QuantTensor(torch.zeros(16, 144, dtype=torch.uint8), gguf_format("IQ4_NL"), (16, 256))
    with cpu.numerics("llamacpp"), pytest.warns(RuntimeWarning, match="no .llamacpp.-numerics kernel for IQ4_NL .* on cpu; .* exact numerics on the .blockwise-dequant-matmul. path"):
        assert select_kernel(torch.randn(2, 256), iq4) is BLOCKWISE


@pytest.mark.parametrize("name", ["F16", "BF16", "F32"])
def test_llamacpp_numerics_of_float_weights_round_the_activations_to_their_type(name):
    """ggml-cpu converts the activations to a float weight's type (F16, BF16; F32 unchanged) before its dot products,
    which it sums in float32."""
    dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[name]
    w = QuantTensor.from_floats(torch.randn(24, 64, generator=torch.Generator().manual_seed(2)).to(dtype))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    with cpu.numerics("llamacpp"), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a kernel of these numerics exists: no fallback warning
        assert select_kernel(x, w).name == "dense-matmul-llamacpp"
        y = linear(x, w)
    expected = x.to(dtype).double() @ w.dequantize().double().T
    assert (y.double() - expected).abs().max() < 1e-5 * expected.abs().max()
    exact = x.double() @ w.dequantize().double().T
    if dtype != torch.float32:
        assert (exact - expected).abs().max() > 100 * (y.double() - expected).abs().max()


def test_set_numerics_rejects_unknown_mode():
    with pytest.raises(ValueError, match="'exact' or 'llamacpp'"):
        cpu.set_numerics("ggml")
    assert cpu.get_numerics() == "exact"


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512", "avx512_vnni"])
def test_narrower_builds_match_the_native_build(isa):
    """The builds for CPUs without AVX-512 (AVX2) or without AVX2 (portable C++) compute the same numbers up
    to fp32 rounding (the AVX2 build's llama.cpp numerics bit for bit), and quantize activations and attend for
    llama.cpp numerics identically (the one-chunk
    attention's F16 steps in 16, 8 or 1 lanes: heads of 64 on its F32 path, 128 on the native F16 one, 144 on both).
    The AVX-512 build without VNNI gives every bit the VNNI build gives (its byte dot products' two-instruction form
    sums the same integers; the Q6_K and Q3_K row of 5 takes them), and the VNNI build every bit of the AMX build
    below its batches (5 rows)."""
    order = ["scalar", "avx2", "avx512", "avx512_vnni", "avx512_amx"]
    if order.index(isa) >= order.index(cpu._native_isa()):
        pytest.skip(f"the native build ({cpu._native_isa()}) is not wider than {isa}")
    narrow = cpu._build_extension(isa)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(5))
    for name in FORMATS:
        w = random_weight(name, 24, K)
        t = w.fmt.ggml_type
        w_ref = w.dequantize()
        ys = [ext.linear_exact(x, [w.data], [t], [24], K, 10**9) for ext in (narrow, cpu.extension())]
        for y in ys:
            assert_within_fp32_rounding(y, x.double() @ w_ref.double().T, x, w_ref)
        if isa in ("avx512", "avx512_vnni"):
            assert torch.equal(*ys), name
        assert torch.equal(narrow.quantize_activations(x, t), cpu.extension().quantize_activations(x, t))
        got, native = (ext.linear_llamacpp(x, [w.data], t, [24], K) for ext in (narrow, cpu.extension()))
        if isa in ("avx2", "avx512", "avx512_vnni"):  # the same integer lanes scaled and summed in the same order
            assert torch.equal(got, native), name
        else:  # the portable build sums its lanes in another order
            torch.testing.assert_close(got, native)
    g = torch.Generator().manual_seed(6)
    for d in (64, 128, 144):
        q = torch.randn(8, 3, d, generator=g) * 3
        keys, values = ((torch.randn(2, 40, d, generator=g) * 3).half() for _ in range(2))  # 4 query heads each
        allowed = torch.rand(8, 3, 40, generator=g) > 0.2
        assert torch.equal(narrow.flash_attn_one_chunk(q, keys, values, allowed, 0.1),
                           cpu.extension().flash_attn_one_chunk(q, keys, values, allowed, 0.1)), d
    for n in (5, 16, 40, 1000):
        for x in argmax_cases(n, g):
            assert torch.equal(narrow.argmax_rows(x), x.argmax(-1)), n
    logits = torch.randn(6, 3000, generator=g) * 8  # the lens's top-k softmax: the same ids, the same probabilities
    (probs, ids), (native_probs, native_ids) = (ext.top_k_softmax(logits, 7) for ext in (narrow, cpu.extension()))
    assert torch.equal(ids, native_ids)
    torch.testing.assert_close(probs, native_probs, rtol=1e-6, atol=0)


def argmax_cases(n: int, g: torch.Generator) -> list[torch.Tensor]:
    """Rows of n values: random, many ties, a NaN in the middle, all -inf, zeros of both signs, inf then a NaN last."""
    ties = torch.randint(-3, 3, (3, n), generator=g).float()
    nan = torch.randn(3, n, generator=g)
    nan[:, n // 2] = float("nan")
    signed_zeros = torch.zeros(3, n)
    signed_zeros[:, ::2] = -0.0
    last_nan = torch.randn(3, n, generator=g)
    last_nan[:, 0], last_nan[:, -1] = float("inf"), float("nan")
    return [torch.randn(3, n, generator=g), ties, nan, torch.full((3, n), float("-inf")), signed_zeros, last_nan]


def test_argmax_picks_what_torch_picks():
    """The greedy pick's C++ argmax: torch's index (the first of equal maxima, a NaN counting as the largest) for rows
    shorter than a vector, with tails, and of vocabulary sizes, one row or several, rows strided."""
    g = torch.Generator().manual_seed(7)
    for n in [*range(1, 70), 49152, 151936]:
        for x in argmax_cases(n, g):
            assert torch.equal(layer_ops.argmax(x), x.argmax(-1)), n
            assert torch.equal(layer_ops.argmax(x[1]), x[1].argmax()), n
            if n > 1:
                assert torch.equal(layer_ops.argmax(x[:, 1:]), x[:, 1:].argmax(-1)), n


def test_the_lens_top_k_softmax_pass_against_float64():
    """The lens's C++ top-k and softmax of each row: the k largest values best first, the first of equal ones ranked
    higher, their probabilities within a few float32 roundings of float64's softmax, for rows shorter than a vector,
    with tails past the blocks and of a vocabulary's length, rows strided; rows with a NaN or an infinity (and rows of
    -inf, whose softmax is NaN) as torch gives them."""
    from workbench.kernels.lens import _top_k_softmax

    g = torch.Generator().manual_seed(3)
    for n, k in [(1, 1), (5, 5), (17, 3), (1030, 10), (2049, 64), (49152, 10)]:
        for x in argmax_cases(n, g):
            x = torch.cat([x, x * 40.0, x.flip(1) - 90.0])  # wide ranges: exponentials that underflow to 0 too
            for rows in (x, x[:, :-1] if n > k else x):
                probs, ids = _top_k_softmax(rows, k)
                top = rows.topk(k, dim=-1)
                if not torch.isfinite(rows).all(1).any():
                    continue
                finite = torch.isfinite(rows).all(1)
                expected = torch.softmax(rows[finite].double(), -1)
                assert torch.equal(rows[finite].gather(1, ids[finite]), top.values[finite]), n  # the k largest
                # of equal values the first index first
                same = rows[finite].gather(1, ids[finite])
                ties = (same[:, 1:] == same[:, :-1])
                assert (ids[finite][:, 1:][ties] > ids[finite][:, :-1][ties]).all(), n
                torch.testing.assert_close(probs[finite].double(), expected.gather(1, ids[finite]), rtol=8e-7,
                                           atol=1e-30)
                fallback = torch.softmax(rows[~finite], -1).gather(1, top.indices[~finite])
                assert torch.equal(ids[~finite], top.indices[~finite])
                torch.testing.assert_close(probs[~finite], fallback, equal_nan=True)


@pytest.mark.parametrize("name", ["Q2_K", "Q3_K", "Q5_K"])
def test_models_in_the_newer_k_quants_run_on_the_extension(name, monkeypatch, tiny_model):
    """Every matrix of a random model in these formats goes through the C++ kernels, for decode and for prefill, and
    the logits are those of the blockwise fallback, which multiplies gguf-exact dequantized weights."""
    model = tiny_model("llama", name, seed=2, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512, tied_embeddings=False,
                       device="cpu")
    assert set(model.kernel_report(1).values()) == set(model.kernel_report(64).values()) == {"cpu-gguf-exact"}
    prompts = [list(range(3, 60, 3)), [7]]  # dequantized panels for the BLAS; the fused dot products of decode
    logits = [model.forward(ids) for ids in prompts]
    monkeypatch.setattr(importlib.import_module("workbench.kernels.linear"), "select_kernel", lambda x, w: BLOCKWISE)
    for ids, ours in zip(prompts, logits):
        reference = model.forward(ids)
        assert (ours - reference).abs().max() < 1e-4 * reference.abs().max()
