"""Numerics are run state of a call: scoped per thread and async task (``with numerics(...)``), or a model's own
(``workbench.load(numerics=...)``), never shared between concurrent calls; the kernel registry is an object."""
from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import workbench
from workbench.generation import generate_tokens
from workbench.kernels import (
    REGISTRY, KernelRegistry, QuantTensor, cpu, get_numerics, linear, numerics, select_kernel, set_numerics,
)
from workbench.kernels.linear import Kernel, _traced_numerics

IDS = [5, 17, 42, 99, 7, 23]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    model = tiny_model("llama", "Q8_0", seed=7, device="cpu")
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels (llama.cpp numerics) are not available")
    return model


def logits_in(model, mode: str) -> torch.Tensor:
    with numerics(mode):
        return model.forward(IDS)


def test_recording_the_pattern_keeps_llamacpp_attention_and_an_edit_leaves_it(tiny):
    """llama.cpp's flash attention forms no pattern: one recorded is computed beside it, for the hooks alone, and the
    logits keep its bits (one prompt and a batch); a hook that edits scores or the pattern takes the float32 path."""
    with numerics("llamacpp"):
        plain, batch = tiny.forward(IDS), tiny.run_batch([IDS, IDS[:3]])
        recorded = tiny.run(IDS, record=["*"])
        assert torch.equal(recorded.logits, plain) and "blocks.1.attn.hook_pattern" in recorded.activations
        assert all(torch.equal(a.logits, b.logits) for a, b in zip(tiny.run_batch([IDS, IDS[:3]], record=["*"]), batch))
        edited = tiny.forward(IDS, interventions=[{"type": "scale", "hook": "blocks.1.attn.hook_pattern",
                                                   "factor": 0.5, "positions": [-1]}])
        assert not torch.equal(edited, plain)


def test_two_threads_compute_each_in_their_own_numerics(tiny):
    """Two threads run forwards side by side, one in llama.cpp numerics, one exact: each gets what it gets alone."""
    expected = {mode: logits_in(tiny, mode) for mode in ("exact", "llamacpp")}
    assert not torch.equal(expected["exact"], expected["llamacpp"])
    barrier = threading.Barrier(2)
    results: dict[str, list[torch.Tensor]] = {mode: [] for mode in expected}
    errors = []

    def worker(mode: str) -> None:
        try:
            with numerics(mode):
                barrier.wait()
                for _ in range(25):
                    results[mode].append(tiny.forward(IDS))
                    assert get_numerics() == mode
        except Exception as err:  # surfaced below: an assertion in a thread would be lost
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(mode,)) for mode in expected]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for mode, logits in results.items():
        assert len(logits) == 25 and all(torch.equal(x, expected[mode]) for x in logits), mode
    assert get_numerics() == "exact"  # the threads' blocks never reached this one


def test_async_tasks_keep_their_own_numerics(tiny):
    expected = {mode: logits_in(tiny, mode) for mode in ("exact", "llamacpp")}

    async def task(mode: str) -> list[torch.Tensor]:
        out = []
        with numerics(mode):
            for _ in range(3):
                await asyncio.sleep(0)  # the other task runs here
                out.append(tiny.forward(IDS))
        return out

    async def both():
        return await asyncio.gather(task("llamacpp"), task("exact"))

    llamacpp, exact = asyncio.run(both())
    assert all(torch.equal(x, expected["llamacpp"]) for x in llamacpp)
    assert all(torch.equal(x, expected["exact"]) for x in exact)


def test_the_process_default_holds_outside_blocks_and_a_block_wins(tiny):
    try:
        set_numerics("llamacpp")
        assert get_numerics() == "llamacpp"
        assert torch.equal(tiny.forward(IDS), logits_in(tiny, "llamacpp"))
        with numerics("exact"):
            assert get_numerics() == "exact"
        thread_saw = []
        thread = threading.Thread(target=lambda: thread_saw.append(get_numerics()))
        thread.start()
        thread.join()
        assert thread_saw == ["llamacpp"]  # a default, unlike a block, reaches every thread
    finally:
        set_numerics("exact")
    with pytest.raises(ValueError, match="'exact' or 'llamacpp'"):
        with numerics("ggml"):
            pass


def test_a_models_own_numerics(tiny, tiny_checkpoint):
    """``Model(numerics=...)``: its calls compute in them outside any block, a block wins (so a trace replays in its
    recorded numerics), and traces and the kernel report say which ran."""
    own = workbench.Model(tiny_checkpoint("llama", "Q8_0", seed=7), device="cpu", numerics="llamacpp")
    assert own.numerics == "llamacpp" and own.current_numerics() == "llamacpp" and get_numerics() == "exact"
    expected = logits_in(tiny, "llamacpp")
    assert torch.equal(own.forward(IDS), expected)
    trace = own.run(IDS)
    assert torch.equal(trace.logits, expected) and trace.backend["numerics"] == "llamacpp"
    assert set(own.kernel_report(1).values()) == {"cpu-gguf-llamacpp"}
    with numerics("exact"):
        assert own.current_numerics() == "exact"
        assert torch.equal(own.forward(IDS), tiny.forward(IDS))
        assert set(own.kernel_report(1).values()) == {"cpu-gguf-exact"}
        assert workbench.replay(trace, own).verdict == "identical"  # in the trace's numerics, not the block's
    exact_trace = tiny.run(IDS)
    assert exact_trace.backend["numerics"] == "exact" and workbench.replay(exact_trace, own).verdict == "identical"
    with pytest.raises(ValueError, match="'exact' or 'llamacpp'"):
        workbench.Model(tiny_checkpoint("llama", "Q8_0", seed=7), device="cpu", numerics="ggml")


def test_a_stream_computes_in_the_numerics_it_was_made_in(tiny, tiny_checkpoint, monkeypatch):
    """A stream takes the numerics when it is made (in a block, or the model's own): every forward of it runs in them
    wherever it is read, and they never leak into the reader's code between tokens."""
    own = workbench.Model(tiny_checkpoint("llama", "Q8_0", seed=7), device="cpu", numerics="llamacpp")
    forwards_ran_in = []
    for model in (tiny, own):
        forward = model.runner.forward
        monkeypatch.setattr(model.runner, "forward", lambda *a, forward=forward, **k: (
            forwards_ran_in.append(get_numerics()), forward(*a, **k))[1])
    with numerics("llamacpp"):
        made_inside = generate_tokens(tiny.runner, IDS, 4)
    assert [get_numerics() for _ in made_inside] == ["exact"] * 4
    assert forwards_ran_in == ["llamacpp"] * 4
    forwards_ran_in.clear()
    reader_saw = [get_numerics() for _ in own.stream(IDS, 4)]
    assert reader_saw == ["exact"] * len(reader_saw) and forwards_ran_in == ["llamacpp"] * len(reader_saw)


# --------------------------------------------------------------------------------------------- kernel registry


def test_a_registry_copy_is_separate_and_reset_forgets_its_choices():
    w = QuantTensor.quantize(torch.randn(8, 256, generator=torch.Generator().manual_seed(0)), "Q8_0")
    registry = REGISTRY.copy()
    one_row = Kernel("one-row", "meta", lambda x, w: x.shape[0] == 1, lambda x, w: x @ w.T)
    registry.register(one_row)
    assert "meta" not in REGISTRY.kernels and registry.kernels["meta"] == [one_row]
    assert registry.select(torch.empty(1, 256, device="meta"), w) is one_row
    x = torch.randn(1, 256)
    assert registry.select(x, w) is REGISTRY.select(x, w)
    assert registry.chosen and isinstance(registry, KernelRegistry)
    registry.reset()
    assert registry.chosen == {} and registry.kernels["meta"] == [one_row]  # the kernels stay


def test_tracing_reads_the_numerics_as_a_constant_without_a_graph_break():
    """torch.compile cannot trace a ContextVar: ``_traced_numerics`` carries the mark of
    ``torch.compiler.assume_constant_result`` (set by hand, so that importing workbench does not import dynamo), and a
    graph traced in llama.cpp numerics calls the llama.cpp kernel."""
    assert getattr(torch.compiler.assume_constant_result(lambda: 0), "_dynamo_marked_constant", False)
    assert _traced_numerics._dynamo_marked_constant
    if cpu.extension() is None:
        pytest.skip("the C++ CPU kernels are not available")
    w = QuantTensor.quantize(torch.randn(16, 256, generator=torch.Generator().manual_seed(1)), "Q4_K")
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(2))
    with numerics("llamacpp"):
        expected = linear(x, w)
        assert select_kernel(x, w) is cpu.LLAMACPP
        explained = torch._dynamo.explain(lambda x: linear(x, w))(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        compiled = torch.compile(lambda x: linear(x, w), backend="eager", fullgraph=True)
        assert torch.equal(compiled(x), expected)
    assert not torch.equal(linear(x, w), expected)
