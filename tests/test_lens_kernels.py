"""The logit lens's top-k (``workbench.kernels.lens``): the fused Triton kernel (run by Triton's interpreter on the CPU,
``TRITON_INTERPRET=1`` from tests/conftest.py, or on a GPU) and the chunked path against softmax in float64, and the
lens through the public API with the fused kernel equal to the lens without it."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from workbench import probes
from workbench.kernels import QuantTensor, linear, numerics
from workbench.kernels import lens as lens_ops

# (rows, vocabulary, width, k, vocabulary slices, tile columns, lanes a tile folds onto): a vocabulary that is no
# multiple of the tile, k = 1, k past the tile (the tile widens to k's power of two), slices narrower than k's power of
# two, one row, and a slice of 64 tiles: past its first few, tiles fold onto k's power of two (and the crowded ones
# still sort whole)
SHAPES = [(37, 200, 48, 5, 2, 32, 32), (9, 100, 24, 1, 1, 16, 2), (11, 70, 16, 20, 3, 16, 16),
          (1, 130, 32, 64, 1, 32, 64), (12, 4096, 32, 6, 1, 64, 8)]
# Error in log-probability (about the probabilities' relative error) against float64's: a logit within the product
# error (PRODUCT_ERROR below) of sum |x_i w_i|, and a log-probability within twice that (its logit's error and the
# maximum's); float32 sums and exponentials add some 1e-6. Measured under the interpreter (float32 products): at most
# 2.3e-6 (torch's float32 softmax of the same logits: 4.4e-6). In half precision, where the
# kernel's float32 sum and float64's fall on two sides of a rounding boundary the logit moves by an ulp: two ulps of the
# largest logit are allowed on top.
TOLERANCE = 1e-5  # the chunked path: float32 products
HALF_ULPS = {torch.float32: 0.0, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Float64 logits as the dense matmul gives them: rounded to the inputs' dtype."""
    return (x.double() @ w.double().T).to(x.dtype).double()


def assert_top_k(probs: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, k: int, tolerance: float) -> None:
    """``ids`` a top k of ``softmax(logits)`` best first and ``probs`` theirs, to ``tolerance`` in log-probability:
    the ids equal float64's wherever its log-probabilities are more than twice that apart."""
    assert probs.shape == ids.shape == (logits.shape[0], k) and ids.dtype == torch.long
    expected = logits.log_softmax(-1)
    top = expected.topk(min(k + 1, expected.shape[1]))  # one more: the k-th may tie with the next
    chosen = expected.gather(1, ids)
    assert float((chosen - top.values[:, :k]).abs().max()) <= 2 * tolerance  # a near-tie may swap ids
    gaps = top.values[:, :-1] - top.values[:, 1:] > 2 * tolerance
    untied = (F.pad(gaps, (1, 0), value=True) & F.pad(gaps, (0, 1), value=True))[:, :k]
    assert torch.equal(ids[untied], top.indices[:, :k][untied])
    assert float((probs.double().log() - chosen).abs().max()) <= tolerance


def triton_device() -> str:
    pytest.importorskip("triton")
    from workbench.kernels.triton.launch import INTERPRETING

    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    return "cpu" if INTERPRETING else "cuda"


# float32 inputs at each precision, half inputs (multiplied exactly at any); each product's error as a fraction of
# |x_i w_i|: at fp16x3 about 3 x 2^-24 (each half of an 11-bit significand, the low halves' product left out), within
# 2^-20; at TF32 2^-10
INPUTS = [(torch.float32, "fp16x3"), (torch.float32, "tf32"), (torch.float16, "fp16x3"), (torch.bfloat16, "fp16x3")]
PRODUCT_ERROR = {"fp16x3": 2.0**-20, "tf32": 2.0**-10}


@pytest.mark.parametrize("dtype, precision", INPUTS, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("rows, vocab, width, k, splits, block_n, fold", SHAPES)
def test_fused_kernel_against_float64(rows, vocab, width, k, splits, block_n, fold, dtype, precision):
    device = triton_device()
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter multiplies bfloat16 tiles wrongly (and truncates to it): left to CUDA")
    from workbench.kernels.triton.lens import top_k_probs

    g = torch.Generator().manual_seed(rows)
    # logits of spread ~5, a few rows peaked: the probabilities span many orders of magnitude
    x = (torch.randn(rows, width, generator=g) * torch.linspace(0.3, 3.0, rows)[:, None]).to(dtype)
    w = (torch.randn(vocab, width, generator=g) * 2 / width**0.5).to(dtype)
    probs, ids = top_k_probs(x.to(device), w.to(device), k, block_m=16, block_n=block_n, block_k=16, splits=splits,
                             precision=precision, fold=fold)
    logits = reference(x, w)
    dot_error = PRODUCT_ERROR[precision] * float((x.double().abs() @ w.double().abs().T).max())
    assert_top_k(probs.cpu(), ids.cpu(), logits, k, 1e-6 + 2 * dot_error + HALF_ULPS[dtype] * float(logits.abs().max()))
    with pytest.raises(ValueError, match="lens top_k_probs"):
        top_k_probs(x.to(device), w.to(device), vocab + 1)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        top_k_probs(x.to(device), w.to(device), k, precision="fp8")
    with pytest.raises(ValueError, match="fold 12"):
        top_k_probs(x.to(device), w.to(device), k, fold=12)


@pytest.mark.parametrize("rows", [21, 8])  # several chunks of 8: the weight dequantized once; one: read packed
@pytest.mark.parametrize("fmt", ["Q8_0", "F32"])
def test_chunked_path_against_float64(fmt, rows, monkeypatch):
    monkeypatch.setattr(lens_ops, "ROWS_PER_CHUNK", 8)  # several chunks and a short last one
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 64, generator=g)
    w = QuantTensor.quantize(torch.randn(300, 64, generator=g) / 4, fmt)
    probs, ids = lens_ops.top_k_probs(x, w, 7)
    assert_top_k(probs, ids, reference(x, w.dequantize()), 7, TOLERANCE)
    empty = lens_ops.top_k_probs(x[:0], w, 7)
    assert empty[0].shape == empty[1].shape == (0, 7)


def test_chunked_path_in_llamacpp_numerics():
    """The production matmul's own numerics (activations quantized to Q8 blocks), not the dequantized weight's."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 64, generator=g)
    w = QuantTensor.quantize(torch.randn(300, 64, generator=g) / 4, "Q8_0")
    with numerics("llamacpp"):
        probs, ids = lens_ops.top_k_probs(x, w, 5)
        expected = linear(x, w).double()
    assert_top_k(probs, ids, expected, 5, TOLERANCE)
    assert float((expected - reference(x, w.dequantize())).abs().max()) > 1e-3  # the numerics differ measurably


def test_lens_with_the_fused_kernel_equals_the_lens_without(tiny_model, monkeypatch):
    """The fused kernel in place of the chunked path (on the CPU through the interpreter) changes no top id but at
    ties and the probabilities within float32 rounding, at every point of a batch of prompts of unequal lengths."""
    device = triton_device()
    model = tiny_model("llama", n_layers=2, device=device, dtype=torch.float32)
    prompts = ["the cat sat on the mat", "a dog", "the cat"]
    points = ("resid_pre", "resid_post")
    monkeypatch.setattr(lens_ops, "fuses", lambda x, k: False)
    plain = probes.logit_lens_batch(model, prompts, points=points, k=4)
    fused_rows = []
    monkeypatch.setattr(lens_ops, "fuses", lambda x, k: fused_rows.append(len(x)) or True)
    fused = probes.logit_lens_batch(model, prompts, points=points, k=4)
    # one call: 2 layers, every point, each position once ("the cat" starts two prompts)
    positions = {tuple(lens.ids[:j + 1]) for lens in plain for j in range(len(lens.ids))}
    assert fused_rows == [len(points) * 2 * len(positions)] and len(positions) < sum(len(lens.ids) for lens in plain)
    for a, b in zip(plain, fused):
        assert a.tokens == b.tokens
        for point in points:
            # float32 products against fp16x3's on CUDA: each ~1e-6 from float64's (test_fused_kernel_against_float64)
            torch.testing.assert_close(b.top_probs[point], a.top_probs[point], rtol=1e-4, atol=1e-7)
            same = b.top_ids[point] == a.top_ids[point]
            # where ids differ, the lens's probabilities tie
            assert same.all() or torch.allclose(b.top_probs[point][~same], a.top_probs[point][~same], rtol=1e-6)
            full = torch.stack([a.logits(layer, point) for layer in range(2)]).softmax(-1)
            top = full.topk(4)
            torch.testing.assert_close(b.top_probs[point], top.values, rtol=1e-4, atol=1e-7)


def test_split_keeps_float32_rows_to_their_largest_magnitude():
    """``split``'s halves rebuild each row within 2^-22 of its largest magnitude: rows near float32's largest number
    and near 2^-99, a zero row, and one of spread magnitudes; a NaN comes through."""
    pytest.importorskip("triton")
    from workbench.kernels.triton.lens import split

    g = torch.Generator().manual_seed(3)
    rows = torch.randn(6, 64, generator=g) * torch.tensor([1.0, 1e38, 1e-30, 0.0, 1.0, 1.0])[:, None]
    rows[4] *= torch.logspace(-20, 0, 64)  # magnitudes from 1e-20 up
    high, low, scale = split(rows)
    assert high.dtype == low.dtype == torch.float16 and scale.dtype == torch.float32
    rebuilt = (high.double() + low.double()) * scale.double()[:, None]
    error = (rebuilt - rows.double()).abs().amax(1)
    assert torch.all(error <= 2.0**-22 * rows.double().abs().amax(1))
    assert float(error[4]) > 0  # the halves drop the smallest magnitudes' last bits: the bound is not vacuous
    rows[5, 7] = float("nan")
    assert split(rows)[0][5].isnan().any()


def test_the_fused_path_splits_a_kept_weight_once(monkeypatch):
    """Calls that share ``kept`` (a lens's groups of layers) split the unembedding once, and give what a call that
    splits it afresh gives."""
    device = triton_device()
    monkeypatch.setattr(lens_ops, "fuses", lambda x, k: True)
    fused = lens_ops._fused_top_k_probs  # small tiles: the interpreter's time grows with theirs
    monkeypatch.setattr(lens_ops, "_fused_top_k_probs", functools.partial(fused, block_m=16, block_n=32, block_k=16))
    splits = []
    split = lens_ops._split
    monkeypatch.setattr(lens_ops, "_split", lambda w: splits.append(tuple(w.shape)) or split(w))
    g = torch.Generator().manual_seed(4)
    w = QuantTensor.quantize(torch.randn(300, 64, generator=g) / 4, "Q8_0").to(device)
    x = torch.randn(2, 10, 64, generator=g).to(device)
    kept: dict = {}
    lens_ops.top_k_probs(x[0], w, 5, kept=kept)
    probs, ids = lens_ops.top_k_probs(x[1], w, 5, kept=kept)
    assert splits == [(300, 64)]
    fresh_probs, fresh_ids = lens_ops.top_k_probs(x[1], w, 5)
    assert splits == [(300, 64)] * 2
    assert torch.equal(probs, fresh_probs) and torch.equal(ids, fresh_ids)
    assert_top_k(probs.cpu(), ids.cpu(), reference(x[1].cpu(), w.dequantize().cpu()), 5, TOLERANCE)
