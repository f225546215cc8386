"""The fused LoRA terms of a group of projections (``workbench.kernels.lora``): the C++ op and the Triton kernel (run
by Triton's interpreter on the CPU, ``TRITON_INTERPRET=1`` from tests/conftest.py) against the torch formula in
float64, for groups of one to three parts of unequal widths and ranks (rank 1 to 64), inputs and outputs that are
strided views as the runner passes them."""
from __future__ import annotations

import pytest
import torch

from workbench.kernels import cpu
from workbench.kernels import lora as lora_ops

# (output widths, ranks, input width): q/k/v and gate/up shapes of the embedded model, rank 1, a mix's unequal ranks,
# and a wide input (the Triton kernel's 8-warp shrink of many pipelined steps, the last one partial) at the largest rank
GROUPS = [((576, 192, 192), (16, 16, 16), 576), ((96,), (1,), 200), ((1536, 1536), (8, 24), 64),
          ((40, 72, 24), (64, 3, 5), 100), ((200, 64), (128, 16), 2100)]


def make_group(widths, ranks, k, tokens, dtype, seed=0):
    """x (a strided slice of wider rows), A, B^T block-diagonal, the base outputs (views of one [T, O]) and the
    expected sums in float64 from the same rounded inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k + 8, generator=g)[:, 3:3 + k]
    a = torch.randn(sum(ranks), k, generator=g) / k**0.5
    b_t = torch.block_diag(*[torch.randn(r, w, generator=g) / r**0.5 for w, r in zip(widths, ranks)])
    base = torch.randn(tokens, sum(widths), generator=g)
    x, a, b_t, base = (t.to(dtype) for t in (x, a, b_t, base))
    outs = list(base.split(list(widths), dim=-1))
    expected = base.double() + x.double() @ a.double().T @ b_t.double()
    return x, a, b_t, outs, expected


def assert_sums(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    assert got.shape == expected.shape
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(cpu.extension() is None, reason="the C++ CPU kernels could not be built")
@pytest.mark.parametrize("widths, ranks, k", GROUPS)
@pytest.mark.parametrize("tokens", [1, 3, lora_ops.MAX_ROWS])
def test_cpu_op_against_float64(widths, ranks, k, tokens):
    x, a, b_t, outs, expected = make_group(widths, ranks, k, tokens, torch.float32)
    for parallel_work in (1, lora_ops.CPU_PARALLEL_WORK):  # expansion split over threads, or on one
        got = cpu.extension().lora_add(x.contiguous(), a, b_t, outs, list(ranks), parallel_work)
        assert_sums(got, expected, 2e-5)
    if tokens == 1:  # what torch.compile's graphs (the compiled CPU decode step) see: schema and shape function
        torch.library.opcheck(cpu.extension().lora_add.default, (x.contiguous(), a, b_t, outs, list(ranks), 1))
    with pytest.raises(RuntimeError, match="lora_add outputs of"):
        cpu.extension().lora_add(x.contiguous(), a, b_t, outs[:-1] + [outs[-1][:, 1:]], list(ranks), 1)


@pytest.mark.skipif(cpu.extension() is None, reason="the C++ CPU kernels could not be built")
def test_add_terms_fuses_few_rows_and_takes_the_formula_for_more(monkeypatch):
    widths, ranks, k = GROUPS[0]
    formula_rows = []
    torch_terms = lora_ops.torch_terms
    monkeypatch.setattr(lora_ops, "torch_terms", lambda x, a, b_t: formula_rows.append(len(x)) or torch_terms(x, a, b_t))
    for tokens in (2, lora_ops.MAX_ROWS + 1):
        x, a, b_t, outs, expected = make_group(widths, ranks, k, tokens, torch.float32)
        got = lora_ops.add_terms(x, a, b_t, outs, ranks)
        assert [tuple(t.shape) for t in got] == [(tokens, w) for w in widths]
        assert_sums(torch.cat(got, dim=-1), expected, 2e-5)
    assert formula_rows == [lora_ops.MAX_ROWS + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("widths, ranks, k", GROUPS)
def test_triton_kernel_against_float64(widths, ranks, k, dtype):
    pytest.importorskip("triton")
    from workbench.kernels.triton.launch import INTERPRETING
    from workbench.kernels.triton.lora import lora_add

    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    device = "cpu" if INTERPRETING else "cuda"
    x, a, b_t, outs, expected = make_group(widths, ranks, k, 3, dtype)
    got = lora_add(x.to(device), a.to(device), b_t.to(device), [o.to(device) for o in outs], ranks)
    assert got.dtype == dtype
    # A x, the term and the sum each rounded once to the dtype (the interpreter truncates to bfloat16: 2^-7)
    tolerance = {torch.float32: 2e-5, torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-7}[dtype]
    assert_sums(got.cpu(), expected, tolerance * 4)
    formula = torch.cat(outs, -1).double() + lora_ops.torch_terms(x, a, b_t).double()  # the torch formula's roundings
    assert_sums(got.cpu(), formula, tolerance * 4)
    if dtype == torch.float32:  # the op compiled graphs call: its schema and shape function against the kernel
        torch.library.opcheck(lora_ops._lora_op, (x.to(device), a.to(device), b_t.to(device),
                                                   [o.to(device) for o in outs], list(ranks)))
    with pytest.raises(ValueError, match="lora_add"):
        lora_add(x.to(device), a.to(device), b_t.to(device), [o.to(device) for o in outs], [*ranks[:-1], ranks[-1] + 1])
