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


# ------------------------------------------------------------------------------------ the terms in the GEMV's epilogue

def gemv_group(fmt, widths, ranks, k, tokens, dtype, stacked, seed=0):
    """Weights of a group (one stacked weight or one per part), x, A and B^T of its adapted parts (rank > 0)."""
    np = pytest.importorskip("numpy")
    from test_triton_kernels import random_weight  # imports gguf and triton

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    weights = [random_weight(fmt, n, k, rng)[0] for n in ([sum(widths)] if stacked else widths)]
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = (torch.randn(sum(ranks), k, generator=g) / k**0.5).to(dtype)
    b_t = torch.block_diag(*[torch.randn(r, w, generator=g) / r**0.5 for w, r in zip(widths, ranks) if r]).to(dtype)
    return weights, x, a, b_t


def interpreted_or_cuda() -> str:
    pytest.importorskip("triton")
    from workbench.kernels.triton.launch import INTERPRETING

    if not INTERPRETING and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    return "cpu" if INTERPRETING else "cuda"


# (format, widths, ranks, input width, tokens, stacked): q/k/v stacked with k unadapted (PEFT's default q and v); one
# weight per part, two tokens (the GEMV's two rows a program); three adapted parts of one weight; an input of 3 slices
# of the shrink (the last partial) with 3 tokens, in float32 only
EPILOGUE_GROUPS = [("Q4_K", (64, 32, 32), (16, 0, 8), 768, 1, True), ("Q8_0", (64, 32), (4, 16), 256, 2, False),
                   ("Q8_0", (32, 64, 32), (8, 4, 16), 256, 2, True), ("Q8_0", (32,), (16,), 2304, 3, True)]


@pytest.mark.parametrize("in_launch", [True, False], ids=["shrink in the launch", "shrink apart"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("fmt, widths, ranks, k, tokens, stacked", EPILOGUE_GROUPS)
def test_gemv_epilogue_adds_the_terms(monkeypatch, fmt, widths, ranks, k, tokens, stacked, dtype, in_launch):
    """The GEMV with the LoRA epilogue, its shrink in its own launch or apart, against the GEMV alone plus the terms in
    float64 and the torch formula's roundings; a part of rank 0 keeps the GEMV's bits."""
    device = interpreted_or_cuda()
    from workbench.kernels.triton import gemv, lora
    from workbench.kernels.triton.lora import arrival_counter, linear_with_terms, shrink

    monkeypatch.setattr(lora, "IN_LAUNCH_WARPS", 1 << 20 if in_launch else 0)
    shrinks = []
    monkeypatch.setattr(lora, "shrink", lambda *args: shrinks.append(1) or shrink(*args))

    if k == 2304 and dtype != torch.float32:
        pytest.skip("the long input once, in float32")
    weights, x, a, b_t = (v.to(device) if isinstance(v, torch.Tensor) else [w.to(device) for w in v]
                          for v in gemv_group(fmt, widths, ranks, k, tokens, dtype, stacked))
    got = torch.cat(linear_with_terms(x, weights, widths, a, b_t, ranks), dim=-1).cpu()
    base = torch.cat([gemv(x, w) for w in weights], dim=-1).cpu()
    x, a, b_t = x.cpu(), a.cpu(), b_t.cpu()
    starts = [sum(widths[:p]) for p in range(len(widths) + 1)]
    adapted = [p for p, r in enumerate(ranks) if r]
    columns = torch.cat([torch.arange(starts[p], starts[p + 1]) for p in adapted])
    for p, r in enumerate(ranks):
        if not r:
            assert torch.equal(got[:, starts[p]:starts[p + 1]], base[:, starts[p]:starts[p + 1]])
    # Each output within its roundings of A x, of the term and of the sum (a unit roundoff of 2^-8 for bfloat16 rounded
    # to nearest; the interpreter truncates: 2^-7), against the exact sums and against the torch formula's
    shrunk = x.double() @ a.double().T
    term = shrunk @ b_t.double()
    exact = base[:, columns].double() + term
    roundoff = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    bound = 2 * roundoff * (exact.abs() + term.abs() + shrunk.abs() @ b_t.double().abs())
    assert ((got[:, columns].double() - exact).abs() <= bound).all()
    formula = base[:, columns].double() + lora_ops.torch_terms(x, a, b_t).double()
    assert ((got[:, columns].double() - formula).abs() <= 2 * bound).all()
    assert bool(shrinks) != in_launch
    # the launch's programs met at the stream's counter and left it at 0; a second launch gives the same bits
    assert arrival_counter(weights[0].data.device).item() == 0
    again = torch.cat(linear_with_terms(x.to(device), weights, widths, a.to(device), b_t.to(device), ranks), dim=-1)
    assert torch.equal(again.cpu(), got)
    if not in_launch:
        partials = shrink(x.to(device), a.to(device)).cpu()
        assert partials.shape == (-(-k // 1024), tokens, sum(ranks)) and partials.dtype == torch.float32
        torch.testing.assert_close(partials.sum(0).double(), x.double() @ a.double().T, rtol=1e-5, atol=1e-5)


def test_gemv_epilogue_refuses_parts_its_programs_straddle():
    device = interpreted_or_cuda()
    from workbench.kernels.triton.lora import linear_with_terms

    # three tokens: programs of 8 rows (launch_choices' gemv.config), and k starts at row 36
    weights, x, a, b_t = gemv_group("Q8_0", (36, 28), (4, 4), 64, 3, torch.float32, True)
    weights = [w.to(device) for w in weights]
    assert linear_with_terms(x.to(device), weights, (36, 28), a.to(device), b_t.to(device), (4, 4)) is None
    with pytest.raises(ValueError, match="linear_with_terms"):
        linear_with_terms(x.to(device), weights, (36, 28), a.to(device), b_t.to(device), (4, 5))


def test_linear_with_terms_takes_the_epilogue_only_after_the_gemv(monkeypatch):
    """``kernels.lora``'s op: the GEMV's epilogue where every weight's kernel is the GEMV, else the base's kernel and
    ``add_terms``, the same sums; and the op compiled graphs call (schema, shape function)."""
    device = interpreted_or_cuda()
    widths, ranks = (64, 32, 32), (16, 0, 8)
    weights, x, a, b_t = gemv_group("Q8_0", widths, ranks, 256, 1, torch.float32, False)
    weights, x, a, b_t = [w.to(device) for w in weights], x.to(device), a.to(device), b_t.to(device)
    epilogue = []
    triton_terms = lora_ops._triton_linear_with_terms
    monkeypatch.setattr(lora_ops, "_triton_linear_with_terms", lambda *args: epilogue.append(1) or triton_terms(*args))
    apart = lora_ops._linear_terms(x, weights, widths, a, b_t, ranks)
    assert not epilogue or device == "cuda"
    monkeypatch.setattr(lora_ops, "_takes_gemv", lambda x, w: True)
    fused = lora_ops._linear_terms(x, weights, widths, a, b_t, ranks)
    assert epilogue
    assert [tuple(t.shape) for t in fused] == [tuple(t.shape) for t in apart] == [(1, w) for w in widths]
    for got, expected in zip(fused, apart):
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)
    formats = ",".join(w.fmt.name for w in weights)
    torch.library.opcheck(lora_ops._linear_terms_op,
                          (x, [w.data for w in weights], formats, list(widths), a, b_t, list(widths), list(ranks)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("in_launch", [True, False], ids=["shrink in the launch", "shrink apart"])
@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "one weight a part"])
def test_gemv_with_terms_in_a_graph_keeps_the_bits(monkeypatch, stacked, in_launch):
    """In a CUDA graph where a kernel writes x just before the GEMV with terms (as a decode step's norm does), every
    replay gives the bits of launches in plain stream order, for new values of x: with the shrink in the GEMV's launch
    its counter is back at 0 after each replay; apart, on Hopper the shrink starts while the kernel that writes x runs
    and the GEMV while the shrink runs."""
    pytest.importorskip("triton")
    from workbench.kernels.triton import launch, lora
    from workbench.kernels.triton.lora import linear_with_terms

    monkeypatch.setattr(lora, "IN_LAUNCH_WARPS", 1 << 20 if in_launch else 0)
    widths, ranks = (576, 192, 192), (16, 0, 16)
    weights, x, a, b_t = gemv_group("Q4_1", widths, ranks, 576, 1, torch.float32, stacked)
    weights, a, b_t = [w.to("cuda") for w in weights], a.cuda(), b_t.cuda()
    sources = [torch.randn(1, 576, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(3)]
    source, x = sources[0].clone(), torch.empty(1, 576, device="cuda")

    def step() -> list[torch.Tensor]:
        torch.mul(source, 1.0, out=x)  # a kernel that writes x, right before the GEMV (or the shrink)
        return linear_with_terms(x, weights, widths, a, b_t, ranks)

    monkeypatch.setattr(launch, "_PROGRAMMATIC", {torch.cuda.current_device(): False})
    expected = []
    for new in sources:
        source.copy_(new)
        expected.append(torch.cat(step(), dim=-1))
    monkeypatch.setattr(launch, "_PROGRAMMATIC", {})
    step()  # compiles the programmatic launches outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(3):
        for want, new in zip(expected, sources):
            source.copy_(new)
            graph.replay()
            assert torch.equal(torch.cat(outs, dim=-1), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gemv_with_its_shrink_on_two_streams_and_more_programs_than_the_gpu_holds(monkeypatch):
    """An 8B's gate/up shape with the shrink in the GEMV's launch (7,168 programs of one warp, more than an H100 holds
    at once, behind 128 shrink programs): launches on two streams at once, each stream's at its own counter, give the
    bits of launches one after another, and none waits forever."""
    pytest.importorskip("triton")
    from workbench.kernels.triton import lora
    from workbench.kernels.triton.lora import linear_with_terms

    monkeypatch.setattr(lora, "IN_LAUNCH_WARPS", 1 << 20)
    widths, ranks = (14336, 14336), (16, 16)
    weights, x, a, b_t = gemv_group("Q4_K", widths, ranks, 4096, 1, torch.float32, True)
    weights, a, b_t = [w.to("cuda") for w in weights], a.cuda(), b_t.cuda()
    inputs = [torch.randn(1, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(s)) for s in range(4)]
    expected = [linear_with_terms(x, weights, widths, a, b_t, ranks)[0] for x in inputs]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for stream in streams:
        stream.wait_stream(torch.cuda.current_stream())
    outs = []
    for round in range(8):
        for s, stream in enumerate(streams):
            which = 2 * (round % 2) + s
            with torch.cuda.stream(stream):
                outs.append((which, linear_with_terms(inputs[which], weights, widths, a, b_t, ranks)[0]))
    torch.cuda.synchronize()
    for which, out in outs:
        assert torch.equal(out, expected[which])


def test_arrival_counter_is_none_where_it_cannot_be_zeroed(monkeypatch):
    """The first counter of a device asked for inside a CUDA graph capture is None (the caller takes the base's matmuls
    and ``add_terms``); outside, each stream gets its own, at 0, until the slots run out."""
    pytest.importorskip("triton")
    from workbench.kernels.triton import lora

    monkeypatch.setattr(lora, "_counter_pools", {})
    monkeypatch.setattr(lora, "_counters", {})
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            assert lora.arrival_counter(device) is None
    counter = lora.arrival_counter(device)
    assert counter.dtype == torch.int32 and counter.item() == 0 and lora.arrival_counter(device) is counter
    monkeypatch.setattr(lora, "COUNTER_SLOTS", 1)
    if device.type == "cuda":
        with torch.cuda.stream(torch.cuda.Stream()):
            assert lora.arrival_counter(device) is None
