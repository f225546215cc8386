"""Workbench against TransformerLens and nnsight: the same four interpretability jobs on the same model, in one run.

    python bench/vs_transformerlens.py                       # CPU, 2 threads, every task at full size
    python bench/vs_transformerlens.py --device cuda         # GPU (all three libraries in float32)
    python bench/vs_transformerlens.py --quick               # smoke test: 8 prompts (a), layers 0/10/20 (b),
                                                             # 4 prompts x 8 tokens (c), 4 prompts (d), 1 repeat
    [--tasks a,b,c,d] [--repeats 3] [--threads N] [--batch-size 64] [--steer-scale 64] [--json out.json]
    [--kernels-from REV]                                     # and workbench on REV's CPU kernels: a before/after row

Needs ``pip install -e ".[bench]"`` (nnsight; transformer-lens is a core dependency). A library that is missing or
fails is reported as such and the others still run.

The model is the embedded SmolLM2-135M-Instruct GGUF (Q4_1). Workbench runs the file as stored: Q4_1 weights through
its own kernels, float32 activations (``--wb-dtype``), exact numerics. TransformerLens and nnsight run the same
weights dequantized to float32 by transformers (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)``); that
model is saved once as a float32 safetensors copy in a temporary folder (``--hf-dir`` keeps and reuses it), so each
child process loads it in a second instead of dequantizing again. Both sides therefore compute with the very same
weight values (Q4_1 dequantizes exactly), up to the order of float32 sums: the recorded residuals printed below agree
to ~1e-7 relative, and the patching grids (to ~1e-5), lens tokens and greedy generations match.

- TransformerLens 4.x: ``TransformerBridge.boot_transformers(dir, hf_model=model, tokenizer=tok)`` wraps the loaded
  HF model (no download; the bridge switches it to eager attention, which its hooks need for patterns).
- nnsight: ``nnsight.TransformersModel(model, tokenizer=tok, task="text-generation")`` wraps its own copy of the
  same HF model (``LanguageModel`` is a deprecated alias of it in nnsight 0.8); HF's default attention (sdpa).

Every library gets the same token ids (workbench's tokenizer; the HF tokenizer built from the GGUF gives the same
ids, checked and printed), so tokenization is outside every timing. TL and nnsight get their prompts sorted by
length (longest first) and cut into ``--batch-size`` rows per forward, right-padded without an attention mask (exact
for causal attention: no real token sees a pad to its right) for (a), (b), (d), and left-padded with an attention
mask for generation (c), which is how both libraries' ``generate`` expect a padded batch. Workbench gets the prompts
in their order; its batched calls pack them without padding and choose their own batch size.

Tasks (each library does the same work; times exclude loading):

(a) Record every ``hook_resid_post`` (30 layers) at every position of 256 prompts (``datasets/sentiment.jsonl``,
    cycled), ending as float32 tensors on the CPU.
    workbench: ``model.run_batch(ids, record=["blocks.*.hook_resid_post"], logits="last")``, which computes each of the
    80 distinct prompts once (a repeated prompt takes its first copy's results); also with ``share_prefix=False``,
    every prompt computed as TL and nnsight compute them; and ``model.run(ids, record=...)`` one prompt at a time,
    for the batched-vs-one-at-a-time ratio.
    TL: ``bridge.run_with_cache(batch, names_filter=<endswith hook_resid_post>)`` per batch (the bridge computes the
    full logits as well: its ``stop_at_layer`` stops *before* a block, so it cannot skip only the unembedding),
    stacked and moved to the CPU. nnsight: ``with model.trace(batch)`` saving each decoder layer's output, then
    ``tracer.stop()`` (skips the final norm and unembedding), stacked and moved to the CPU.
(b) The README's patching sweep: ``hooks.patching_sweep(model, "The Eiffel Tower is in the city of",
    "The Colosseum is in the city of", answers=(" Paris", " Rome"))``: the clean run's ``hook_resid_pre`` of
    every layer patched into the corrupt run at one (layer, position) cell at a time (30 x 9 = 270 cells), metric
    the last position's logit difference ' Paris' - ' Rome'; plus the clean and corrupt runs.
    TL: ``run_with_cache`` on the clean prompt, then ``run_with_hooks`` on ``--batch-size`` copies of the corrupt
    prompt, one cell per row (each layer's hook overwrites its rows' positions). nnsight: a trace saving each
    layer's input on the clean prompt, then traces over ``--batch-size`` copies of the corrupt prompt that overwrite
    each row's cell in the layer's input in place and compute the metric inside the trace.
(c) Steered greedy generation of 32 new tokens for 32 prompts: ``scale * v`` (``v`` a fixed random unit vector,
    seed 0) added to ``blocks.15.hook_resid_post`` at every position, prompt and generated tokens alike; each
    sequence stops early at an end-of-text/end-of-turn token (ids 0 and 2, as workbench stops).
    workbench: ``model.stream_batch(ids, 32, interventions=[hooks.Steer(name, v, scale)])`` (what
    ``generate_batch`` runs, keeping the token ids for the check). TL: ``with bridge.hooks(fwd_hooks=[(name, add)]):
    bridge.generate(left_padded, attention_mask=mask, do_sample=False, eos_token_id=[0, 2])``, its own KV-cached
    loop -- unless that loop disagrees with its uncached one on a first prompt (it does with TL 4.3 and transformers
    5.24: from the second new token on it sees no context, and ``hf_generate`` does the same), in which case TL is
    timed with ``use_past_kv_cache=False`` (every step re-runs the whole sequence) and the table says so.
    nnsight: ``with model.generate({"input_ids", "attention_mask"}, max_new_tokens=32, do_sample=False)`` and
    ``for _ in tracer.all(): layer.output = layer.output + delta`` (HF's ``generate``).
(d) The logit lens over 64 prompts: every layer's ``resid_post`` at every position through the final RMSNorm (scale
    recomputed from that residual) and the unembedding, softmax, top-10 tokens and probabilities.
    workbench: ``probes.logit_lens_batch(model, prompts)`` (``run_batch`` recording every ``resid_post`` on the device,
    then the final norm, and the unembedding's top-k of every prompt's rows together: on CUDA one fused kernel that
    never writes the logits, ``kernels.lens``); also ``probes.logit_lens(model, ids)`` per prompt (its one-prompt API). TL: ``run_with_cache`` per batch, then ``bridge.ln_final`` and ``bridge.unembed`` per layer.
    nnsight: inside one trace per batch, ``lm_head(model.norm(layer.output)).softmax(-1).topk(10)`` per layer, then
    ``tracer.stop()`` (the canonical nnsight logit lens).

Method: each (library, task) runs in a child process of its own, so its peak memory is that task's alone and no
library's allocator state leaks into another's. A child loads its model, runs the job once (warm-up: compiles,
autotunes, allocates), then ``--repeats`` timed runs; the time is their median. Peak memory is the high-water mark
during the timed runs above the memory in use before the warm-up: on the CPU the process's resident set (VmHWM,
reset after the warm-up through /proc/self/clear_refs; ``ru_maxrss`` where that is unavailable, which then includes
the warm-up), on CUDA ``torch.cuda.max_memory_allocated``. "loaded" is what loading took: the library's imports
beyond torch and its model, weights read once so that memory-mapped ones count (resident set after loading minus
before; on CUDA the allocation). Ratios are workbench's against the faster (smaller) of TL and
nnsight: above 1 means workbench is faster (leaner).

Run it on a quiet machine: on a CPU whose cores are busy with other work, workbench's threaded CPU kernels slow down
far more than torch's BLAS (seen on a shared 2-core machine: a 4-prompt ``run_batch`` took 4.3 s with 2 threads and
0.2-0.3 s with 1); the header prints the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

import torch

TASKS = {
    "a": "record every hook_resid_post",
    "b": "patching sweep (resid_pre, layers x positions)",
    "c": "steered greedy generation",
    "d": "logit lens (resid_post, every layer and position)",
}
# Variants run per task: (key, label). The first workbench variant is the one compared with TL and nnsight.
VARIANTS = {
    "a": [("wb", "workbench (run_batch)"), ("wb_unshared", "workbench (run_batch, share_prefix=False)"),
          ("wb_single", "workbench (run, one prompt at a time)"), ("tl", "transformer-lens"), ("nn", "nnsight")],
    "b": [("wb", "workbench (hooks.patching_sweep)"), ("tl", "transformer-lens"), ("nn", "nnsight")],
    "c": [("wb", "workbench (stream_batch)"), ("tl", "transformer-lens"), ("nn", "nnsight")],
    "d": [("wb", "workbench (logit_lens_batch)"), ("wb_single", "workbench (probes.logit_lens per prompt)"),
          ("tl", "transformer-lens"), ("nn", "nnsight")],
}
SIZES = {
    "full": dict(a_prompts=256, b_layer_step=1, c_prompts=32, c_tokens=32, d_prompts=64),
    "quick": dict(a_prompts=8, b_layer_step=10, c_prompts=4, c_tokens=8, d_prompts=4),
}
CLEAN, CORRUPT, ANSWERS = "The Eiffel Tower is in the city of", "The Colosseum is in the city of", (" Paris", " Rome")
LENS_K = 10


# ------------------------------------------------------------------------------------------------ memory and time

def _rss() -> int:
    """Resident bytes of this process now."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hwm() -> int:
    """Peak resident bytes of this process (since the last reset)."""
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) * 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Memory:
    """Memory in use now, and peak since ``reset_peak``, on the CPU (resident set) or CUDA (allocated)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def now(self) -> int:
        self.sync()
        return torch.cuda.memory_allocated() if self.cuda else _rss()

    def reset_peak(self) -> bool:
        """True when the peak restarts from now (else it includes everything before)."""
        self.sync()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            return True
        return _reset_hwm()

    def peak(self) -> int:
        self.sync()
        return torch.cuda.max_memory_allocated() if self.cuda else _hwm()


def measure(job: Callable[[], Any], memory: Memory, repeats: int) -> tuple[list[float], int, bool, Any]:
    """Warm-up, then ``repeats`` timed runs: (seconds of each, peak bytes above the pre-warm-up use, whether the peak
    excludes the warm-up, the last run's output). Only one run's output is alive at a time."""
    base = memory.now()
    job()  # warm-up; its output is dropped at once
    clean = memory.reset_peak()
    times, out = [], None
    for _ in range(repeats):
        out = None
        memory.sync()
        start = time.perf_counter()
        out = job()
        memory.sync()
        times.append(time.perf_counter() - start)
    return times, memory.peak() - base, clean, out


@torch.no_grad()
def touch(tensors) -> None:
    """Read every tensor once, so weights mapped from a file count in the resident set from the start (the "loaded"
    column) rather than in the first task's peak."""
    for t in tensors:
        if t.is_floating_point():
            t.sum()
        else:
            t.view(torch.uint8).sum()


def batches(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def pad(rows: list[list[int]], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T_max] padded on ``side`` and the 0/1 attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, r in enumerate(rows):
        cols = slice(0, len(r)) if side == "right" else slice(width - len(r), width)
        ids[b, cols] = torch.tensor(r)
        mask[b, cols] = 1
    return ids, mask


def by_length(n: int, ids: list[list[int]]) -> list[int]:
    """Indices of the first n prompts, longest first (TL and nnsight batches: least padding)."""
    return sorted(range(n), key=lambda i: -len(ids[i]))


def cut_at_stop(tokens: list[int], stop_ids: list[int]) -> list[int]:
    for j, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:j]
    return tokens


# -------------------------------------------------------------------------------------------------- the libraries

class Workbench:
    name = "workbench"

    def __init__(self, inputs: dict, args: argparse.Namespace):
        import workbench

        self.model = workbench.load(args.model, device=args.device, dtype=args.wb_dtype)
        touch(w.data for _, w in self.model.runner.weights.named_matrices())
        self.inputs, self.args = inputs, args
        self.resid_post = [f"blocks.{i}.hook_resid_post" for i in range(inputs["n_layers"])]

    def job(self, task: str, variant: str) -> Callable[[], Any]:
        from workbench import hooks, probes

        model, inp = self.model, self.inputs
        if task == "a":
            prompts = inp["prompt_ids"][:inp["sizes"]["a_prompts"]]
            if variant == "wb_single":
                return lambda: [model.run(p, record=self.resid_post) for p in prompts]
            return lambda: model.run_batch(prompts, record=self.resid_post, logits="last",
                                           share_prefix=variant != "wb_unshared")
        if task == "b":
            return lambda: hooks.patching_sweep(model, CLEAN, CORRUPT, answers=ANSWERS, layers=inp["b_layers"],
                                                progress=False)
        if task == "c":
            prompts = inp["prompt_ids"][:inp["sizes"]["c_prompts"]]
            steer = hooks.Steer(inp["steer_hook"], torch.tensor(inp["steer_vector"]), scale=self.args.steer_scale)

            def generate():
                out = [[] for _ in prompts]
                for i, token, _ in model.stream_batch(prompts, inp["sizes"]["c_tokens"], interventions=[steer]):
                    out[i].append(token)
                return out
            return generate
        if task == "d":
            prompts = inp["prompt_ids"][:inp["sizes"]["d_prompts"]]
            if variant == "wb_single":
                return lambda: [probes.logit_lens(model, p, k=LENS_K) for p in prompts]

            return lambda: probes.logit_lens_batch(model, prompts, k=LENS_K)
        raise ValueError(task)

    def summary(self, task: str, variant: str, out: Any) -> dict:
        if task == "a":
            first = [torch.stack([t.activations[n] for n in self.resid_post]) for t in out[:4]]
            return {"first": first, "n": len(out), "elements": sum(v.numel() for t in out for v in t.activations.values())}
        if task == "b":
            return {"grid": out.grid.float(), "clean": out.clean_metric, "corrupt": out.corrupt_metric}
        if task == "c":
            return {"tokens": [cut_at_stop(t, self.inputs["stop_ids"]) for t in out]}
        if task == "d":
            return {"top1": [lens_.top_ids["resid_post"][..., 0].cpu() for lens_ in out]}
        raise ValueError(task)


class _HF:
    """The dequantized float32 HF model on the device, and the batches TL and nnsight run."""

    def __init__(self, inputs: dict, args: argparse.Namespace):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.inputs, self.args, self.device = inputs, args, torch.device(args.device)
        self.tokenizer = AutoTokenizer.from_pretrained(inputs["hf_dir"])
        self.hf = AutoModelForCausalLM.from_pretrained(inputs["hf_dir"], dtype=torch.float32).to(self.device).eval()
        touch(self.hf.parameters())
        self.n_layers = inputs["n_layers"]
        self.pad_id = inputs["pad_id"]

    def right_batches(self, n: int) -> list[tuple[list[int], torch.Tensor]]:
        """(prompt indices, right-padded ids on the device) per batch of the first n prompts, longest first."""
        ids = self.inputs["prompt_ids"]
        return [(chunk, pad([ids[i] for i in chunk], self.pad_id, "right")[0].to(self.device))
                for chunk in batches(by_length(n, ids), self.args.batch_size)]

    def left_batches(self, n: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
        ids = self.inputs["prompt_ids"]
        out = []
        for chunk in batches(by_length(n, ids), self.args.batch_size):
            tokens, mask = pad([ids[i] for i in chunk], self.pad_id, "left")
            out.append((chunk, tokens.to(self.device), mask.to(self.device)))
        return out

    def cells(self) -> list[tuple[int, int]]:
        return [(layer, pos) for layer in self.inputs["b_layers"] for pos in range(len(self.inputs["clean_ids"]))]

    @staticmethod
    def rows_by_layer(chunk: list[tuple[int, int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """For one batch of cells (row r patches cell chunk[r]): layer -> (rows, positions)."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for row, (layer, pos) in enumerate(chunk):
            rows, positions = out.setdefault(layer, ([], []))
            rows.append(row)
            positions.append(pos)
        return {layer: (torch.tensor(r), torch.tensor(p)) for layer, (r, p) in sorted(out.items())}

    def cell_rows(self, chunk: list[tuple[int, int]]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        return {layer: (r.to(self.device), p.to(self.device)) for layer, (r, p) in self.rows_by_layer(chunk).items()}

    def gather(self, stacked: list[tuple[list[int], torch.Tensor]], n: int) -> list[torch.Tensor]:
        """Per prompt (in prompt order) its [layers, T_i, d] rows from batches of [B, layers, T_max, d]."""
        out: list[torch.Tensor | None] = [None] * n
        for chunk, stack in stacked:
            for b, i in enumerate(chunk):
                out[i] = stack[b, :, :len(self.inputs["prompt_ids"][i])]
        return out

    def summary(self, task: str, variant: str, out: Any) -> dict:
        if task == "a":
            return {"first": [x.float() for x in out[:4]], "n": len(out), "elements": sum(x.numel() for x in out)}
        if task == "b":
            return out
        if task == "c":
            return {"tokens": [cut_at_stop(t, self.inputs["stop_ids"]) for t in out]}
        if task == "d":
            return {"top1": [i[..., 0] for _, i in out]}
        raise ValueError(task)

    def generated(self, sequences: torch.Tensor, width: int, chunk: list[int], out: list) -> None:
        for b, i in enumerate(chunk):
            out[i] = sequences[b, width:].tolist()

    def lens_rows(self, logits_fn: Callable[[torch.Tensor], torch.Tensor], resid: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k of the lens for one layer's residual [B, T, d]: ([B, T, k] probs, ids) on the CPU."""
        p, i = logits_fn(resid).softmax(-1).topk(LENS_K)
        return p.cpu(), i.cpu()


class TransformerLens(_HF):
    name = "transformer-lens"

    def __init__(self, inputs: dict, args: argparse.Namespace):
        super().__init__(inputs, args)
        from transformer_lens.model_bridge import TransformerBridge

        self.bridge = TransformerBridge.boot_transformers(inputs["hf_dir"], hf_model=self.hf, tokenizer=self.tokenizer,
                                                          device=args.device, dtype=torch.float32)
        self.bridge.eval()

    @torch.no_grad()
    def kv_cache_works(self) -> bool:
        """Whether the bridge's KV-cached ``generate`` gives the tokens its uncached loop gives (8 greedy tokens of the
        first prompt). TL 4.3 under transformers 5.24 does not: from the second new token on the cached loop sees no
        context (it repeats one token), as does ``hf_generate``. Then generation is timed without the cache."""
        tokens = torch.tensor([self.inputs["prompt_ids"][0]], device=self.device)
        runs = [self.bridge.generate(tokens, max_new_tokens=8, do_sample=False, stop_at_eos=False, use_past_kv_cache=kv,
                                     return_type="tokens", verbose=False) for kv in (True, False)]
        works = torch.equal(runs[0], runs[1])
        self.note = None if works else ("KV-cached generate disagrees with the uncached loop (wrong tokens): timed with "
                                        "use_past_kv_cache=False")
        return works

    def job(self, task: str, variant: str) -> Callable[[], Any]:
        bridge, inp, L = self.bridge, self.inputs, self.n_layers
        post = [f"blocks.{i}.hook_resid_post" for i in range(L)]
        if task == "a":
            n = inp["sizes"]["a_prompts"]
            work = self.right_batches(n)

            @torch.no_grad()
            def record():
                stacked = []
                for chunk, tokens in work:
                    _, cache = bridge.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_resid_post"))
                    stacked.append((chunk, torch.stack([cache[name] for name in post], 1).cpu()))
                return self.gather(stacked, n)
            return record
        if task == "b":
            clean = torch.tensor([inp["clean_ids"]], device=self.device)
            corrupt = torch.tensor([inp["corrupt_ids"]], device=self.device)
            good, bad = inp["answer_ids"]
            layers = inp["b_layers"]

            @torch.no_grad()
            def sweep():
                clean_logits, cache = bridge.run_with_cache(
                    clean, names_filter=lambda name: name.endswith("hook_resid_pre"))
                corrupt_logits = bridge(corrupt)
                donor = {layer: cache[f"blocks.{layer}.hook_resid_pre"][0] for layer in layers}
                values = []
                for chunk in batches(self.cells(), self.args.batch_size):
                    def patch(x, hook, rows, positions, layer):
                        x[rows, positions] = donor[layer][positions]
                        return x
                    fwd = [(f"blocks.{layer}.hook_resid_pre",
                            lambda x, hook, r=rows, p=positions, layer=layer: patch(x, hook, r, p, layer))
                           for layer, (rows, positions) in self.cell_rows(chunk).items()]
                    logits = bridge.run_with_hooks(corrupt.expand(len(chunk), -1), fwd_hooks=fwd,
                                                   return_type="logits")
                    values.append((logits[:, -1, good] - logits[:, -1, bad]).cpu())
                grid = torch.cat(values).view(len(layers), -1)
                metric = lambda logits: float(logits[0, -1, good] - logits[0, -1, bad])  # noqa: E731
                return {"grid": grid, "clean": metric(clean_logits), "corrupt": metric(corrupt_logits)}
            return sweep
        if task == "c":
            n = inp["sizes"]["c_prompts"]
            work = self.left_batches(n)
            delta = (self.args.steer_scale * torch.tensor(inp["steer_vector"])).to(self.device)
            kv_cache = self.kv_cache_works()

            @torch.no_grad()
            def generate():
                out: list = [None] * n
                with bridge.hooks(fwd_hooks=[(inp["steer_hook"], lambda x, hook: x + delta)]):
                    for chunk, tokens, mask in work:
                        seqs = bridge.generate(tokens, max_new_tokens=inp["sizes"]["c_tokens"], do_sample=False,
                                               stop_at_eos=True, eos_token_id=inp["stop_ids"], attention_mask=mask,
                                               use_past_kv_cache=kv_cache, return_type="tokens", verbose=False)
                        self.generated(seqs, tokens.shape[1], chunk, out)
                return out
            return generate
        if task == "d":
            n = inp["sizes"]["d_prompts"]
            work = self.right_batches(n)
            lens = lambda resid: bridge.unembed(bridge.ln_final(resid))  # noqa: E731

            @torch.no_grad()
            def lens_batches():
                stacked = []
                for chunk, tokens in work:
                    _, cache = bridge.run_with_cache(tokens, names_filter=lambda name: name.endswith("hook_resid_post"))
                    tops = [self.lens_rows(lens, cache[name]) for name in post]  # L x ([B, T, k], [B, T, k])
                    stacked.append((chunk, torch.stack([p for p, _ in tops], 1), torch.stack([i for _, i in tops], 1)))
                probs = self.gather([(c, p) for c, p, _ in stacked], n)
                ids = self.gather([(c, i) for c, _, i in stacked], n)
                return list(zip(probs, ids))
            return lens_batches
        raise ValueError(task)


class NNsight(_HF):
    name = "nnsight"

    def __init__(self, inputs: dict, args: argparse.Namespace):
        super().__init__(inputs, args)
        import nnsight

        self.lm = nnsight.TransformersModel(self.hf, tokenizer=self.tokenizer, task="text-generation")
        # an open tracer.all() loop ends by warning that the step after the last was never reached
        warnings.filterwarnings("ignore", message=".*was never reached.*")

    def job(self, task: str, variant: str) -> Callable[[], Any]:
        import nnsight

        lm, inp, L = self.lm, self.inputs, self.n_layers
        layers = lm.model.layers
        if task == "a":
            n = inp["sizes"]["a_prompts"]
            work = self.right_batches(n)

            @torch.no_grad()
            def record():
                stacked = []
                for chunk, tokens in work:
                    with lm.trace(tokens) as tracer:
                        saved = nnsight.save([layers[i].output for i in range(L)])
                        tracer.stop()
                    stacked.append((chunk, torch.stack(saved, 1).cpu()))
                return self.gather(stacked, n)
            return record
        if task == "b":
            clean = torch.tensor([inp["clean_ids"]], device=self.device)
            corrupt = torch.tensor([inp["corrupt_ids"]], device=self.device)
            good, bad = inp["answer_ids"]
            b_layers = inp["b_layers"]

            @torch.no_grad()
            def sweep():
                with lm.trace(clean):
                    donor = nnsight.save({layer: layers[layer].input for layer in b_layers})
                    logits = lm.lm_head.output
                    clean_metric = (logits[0, -1, good] - logits[0, -1, bad]).save()
                with lm.trace(corrupt):
                    logits = lm.lm_head.output
                    corrupt_metric = (logits[0, -1, good] - logits[0, -1, bad]).save()
                values = []
                for chunk in batches(self.cells(), self.args.batch_size):
                    with lm.trace(corrupt.expand(len(chunk), -1)):
                        for layer, (rows, positions) in self.cell_rows(chunk).items():
                            layers[layer].input[rows, positions] = donor[layer][0, positions]
                        logits = lm.lm_head.output
                        metric = (logits[:, -1, good] - logits[:, -1, bad]).save()
                    values.append(metric.cpu())
                grid = torch.cat(values).view(len(b_layers), -1)
                return {"grid": grid, "clean": float(clean_metric), "corrupt": float(corrupt_metric)}
            return sweep
        if task == "c":
            n = inp["sizes"]["c_prompts"]
            work = self.left_batches(n)
            delta = (self.args.steer_scale * torch.tensor(inp["steer_vector"])).to(self.device)
            layer = layers[int(inp["steer_hook"].split(".")[1])]

            @torch.no_grad()
            def generate():
                out: list = [None] * n
                for chunk, tokens, mask in work:
                    with lm.generate(max_new_tokens=inp["sizes"]["c_tokens"], do_sample=False,
                                     eos_token_id=inp["stop_ids"], pad_token_id=self.pad_id) as tracer:
                        with tracer.invoke({"input_ids": tokens, "attention_mask": mask}):
                            for _ in tracer.all():  # every decoding step (ends with a warning: by design)
                                layer.output = layer.output + delta
                        with tracer.invoke():  # what follows an open all() loop goes in an invoke of its own
                            seqs = tracer.result.save()
                    self.generated(seqs, tokens.shape[1], chunk, out)
                return out
            return generate
        if task == "d":
            n = inp["sizes"]["d_prompts"]
            work = self.right_batches(n)

            @torch.no_grad()
            def lens_batches():
                stacked = []
                for chunk, tokens in work:
                    with lm.trace(tokens) as tracer:
                        tops = nnsight.save([tuple(lm.lm_head(lm.model.norm(layers[i].output)).softmax(-1).topk(LENS_K))
                                             for i in range(L)])
                        tracer.stop()
                    stacked.append((chunk, torch.stack([p.cpu() for p, _ in tops], 1),
                                    torch.stack([i.cpu() for _, i in tops], 1)))
                probs = self.gather([(c, p) for c, p, _ in stacked], n)
                ids = self.gather([(c, i) for c, _, i in stacked], n)
                return list(zip(probs, ids))
            return lens_batches
        raise ValueError(task)


LIBRARIES = {"wb": Workbench, "wb_unshared": Workbench, "wb_single": Workbench, "wb_from": Workbench,
             "tl": TransformerLens, "nn": NNsight}


def kernels_of(revision: str) -> Any:
    """bench/common.py's build of ``revision``'s CPU kernels (loaded by path: this script keeps bench/ off sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", Path(__file__).resolve().parent / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common.kernels_from(revision), common.using_kernels


# ------------------------------------------------------------------------------------------------------ the child

def child(args: argparse.Namespace) -> None:
    """Run one (variant, task) and write its times, memory and a summary of its output to --out."""
    torch.set_num_threads(args.threads)
    inputs = torch.load(Path(args.work) / "inputs.pt")
    memory = Memory(args.device)
    before = memory.now()
    started = time.perf_counter()
    library = LIBRARIES[args.child](inputs, args)
    load_seconds = time.perf_counter() - started
    model_bytes = memory.now() - before
    job = library.job(args.task, args.child)
    if args.child == "wb_from":  # the same calls on another revision's CPU kernels
        ops, using_kernels = kernels_of(args.kernels_from)
        calls = job

        def job() -> Any:
            with using_kernels(ops):
                return calls()
    times, peak, clean_peak, out = measure(job, memory, args.repeats)
    summary = library.summary(args.task, args.child, out)
    torch.save({"times": times, "peak_bytes": peak, "peak_excludes_warmup": clean_peak, "model_bytes": model_bytes,
                "load_seconds": load_seconds, "threads": torch.get_num_threads(), "summary": summary,
                "note": getattr(library, "note", None)}, args.out)


# ------------------------------------------------------------------------------------------------------ the parent

def versions() -> dict[str, str]:
    out = {}
    for name in ("torch", "transformers", "transformer-lens", "nnsight", "workbench", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores visible)"


COMPLETE = "hf-copy-complete"


def save_hf_copy(gguf: Path, target: Path) -> float:
    """Dequantize the GGUF with transformers and save it as a float32 HF checkpoint (seconds taken)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # a GGUF-loaded model refuses save_pretrained (it carries the GGUF "quantizer"): copy its float weights into a
    # plain model of the same config
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.save_pretrained(target)
    tokenizer.save_pretrained(target)
    (target / COMPLETE).touch()  # written last: a copy cut short is made again
    return time.perf_counter() - started


def make_inputs(args: argparse.Namespace, work: Path, hf_dir: Path) -> dict:
    """Token ids and everything else every child needs, written to work/inputs.pt."""
    import workbench
    from workbench.probes import load_dataset
    from transformers import AutoTokenizer

    model = workbench.load(args.model, device="cpu")
    c = model.config
    sizes = SIZES["quick" if args.quick else "full"]
    texts = load_dataset("sentiment").prompts
    n = max(sizes["a_prompts"], sizes["c_prompts"], sizes["d_prompts"])
    texts = [texts[i % len(texts)] for i in range(n)]
    prompt_ids = [model.to_ids(t) for t in texts]
    hf_tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    same_ids = all(hf_tokenizer(t)["input_ids"] == ids for t, ids in zip(texts, prompt_ids))
    vector = torch.randn(c.d_model, generator=torch.Generator().manual_seed(0))
    inputs = {
        "hf_dir": str(hf_dir), "n_layers": c.n_layers, "sizes": sizes, "prompt_ids": prompt_ids,
        "clean_ids": model.to_ids(CLEAN), "corrupt_ids": model.to_ids(CORRUPT),
        "answer_ids": [model.tokenize(a, add_bos=False)[0] for a in ANSWERS],
        "b_layers": list(range(0, c.n_layers, sizes["b_layer_step"])),
        "stop_ids": sorted(model.tokenizer.stop_ids), "pad_id": int(next(t for t in (hf_tokenizer.pad_token_id, hf_tokenizer.eos_token_id, 0) if t is not None)),
        "steer_hook": f"blocks.{c.n_layers // 2}.hook_resid_post", "steer_vector": (vector / vector.norm()).tolist(),
        "texts": texts, "hf_tokenizer_same_ids": same_ids, "model_name": c.name, "model_path": str(model.path),
    }
    torch.save(inputs, work / "inputs.pt")
    return inputs


def run_child(args: argparse.Namespace, work: Path, task: str, variant: str) -> dict:
    out = work / f"{task}-{variant}.pt"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", variant, "--task", task, "--work", str(work),
               "--out", str(out), "--device", args.device, "--threads", str(args.threads), "--repeats",
               str(args.repeats), "--batch-size", str(args.batch_size), "--steer-scale", str(args.steer_scale),
               "--wb-dtype", args.wb_dtype] + (["--model", str(Path(args.model).resolve())] if args.model else []) + (
               ["--kernels-from", args.kernels_from] if args.kernels_from else [])
    started = time.perf_counter()
    result = subprocess.run(command, cwd=work, capture_output=True, text=True)
    if result.returncode != 0 or not out.exists():
        lines = [line for line in (result.stderr or result.stdout).strip().splitlines() if line.strip()]
        return {"error": lines[-1] if lines else f"exit status {result.returncode}",
                "stderr_tail": "\n".join(lines[-15:])}
    data = torch.load(out)
    data["wall_seconds"] = time.perf_counter() - started
    return data


def correlation(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.flatten().double(), y.flatten().double()
    return float(torch.corrcoef(torch.stack([x, y]))[0, 1])


def pairs(rows: dict[str, dict]) -> list[tuple[str, str]]:
    names = [n for n in rows if "error" not in rows[n]]
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]


def checks(task: str, rows: dict[str, dict], inputs: dict) -> list[str]:
    """Agreement of the libraries' outputs, as lines to print."""
    s = {name: r["summary"] for name, r in rows.items() if "error" not in r}
    lines = []
    if task == "a":
        for a, b in pairs(rows):
            worst = max(float((x - y).abs().max() / y.abs().max()) for x, y in zip(s[a]["first"], s[b]["first"]))
            lines.append(f"{a} vs {b}: max |diff| / max |x| over the first prompts' resid_post {worst:.2e}; "
                         f"recorded elements {s[a]['elements']:,} vs {s[b]['elements']:,}")
    elif task == "b":
        for name, v in s.items():
            lines.append(f"{name}: clean {v['clean']:.4f}, corrupt {v['corrupt']:.4f}, grid {tuple(v['grid'].shape)} "
                         f"min {float(v['grid'].min()):.3f} max {float(v['grid'].max()):.3f}")
        for a, b in pairs(rows):
            lines.append(f"{a} vs {b}: grid correlation {correlation(s[a]['grid'], s[b]['grid']):.6f}, "
                         f"max |diff| {float((s[a]['grid'] - s[b]['grid']).abs().max()):.2e}")
    elif task == "c":
        for a, b in pairs(rows):
            same = sum(x == y for x, y in zip(s[a]["tokens"], s[b]["tokens"]))
            lines.append(f"{a} vs {b}: identical generations {same}/{len(s[a]['tokens'])}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(inputs["hf_dir"])
        for i in range(min(3, len(inputs["prompt_ids"]), *(len(v["tokens"]) for v in s.values()))):
            lines.append(f"prompt {i}: {inputs['texts'][i]!r}")
            for name, v in s.items():
                lines.append(f"  {name:42} {tokenizer.decode(v['tokens'][i])!r}")
    elif task == "d":
        for a, b in pairs(rows):
            agree = [float((x == y).float().mean()) for x, y in zip(s[a]["top1"], s[b]["top1"])]
            total = sum(x.numel() for x in s[a]["top1"])
            same = sum(int((x == y).sum()) for x, y in zip(s[a]["top1"], s[b]["top1"]))
            lines.append(f"{a} vs {b}: lens top-1 agree at {same}/{total} (layer, position) cells "
                         f"({same / total:.2%}; worst prompt {min(agree):.2%})")
    return lines


def report_task(task: str, rows: dict[str, dict], inputs: dict) -> dict:
    sizes = inputs["sizes"]
    what = {"a": f"{sizes['a_prompts']} prompts", "b": f"{len(inputs['b_layers'])} layers x "
            f"{len(inputs['clean_ids'])} positions", "c": f"{sizes['c_prompts']} prompts x {sizes['c_tokens']} tokens",
            "d": f"{sizes['d_prompts']} prompts"}[task]
    print(f"\n({task}) {TASKS[task]}, {what}")
    print(f"  {'':42}{'seconds':>10}{'peak MiB':>11}{'loaded MiB':>11}")
    out: dict[str, Any] = {"rows": {}}
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:42}  failed: {r['error']}")
            out["rows"][name] = {"error": r["error"]}
            continue
        seconds = statistics.median(r["times"])
        mark = "" if r["peak_excludes_warmup"] else "*"
        print(f"  {name:42}{seconds:>10.3f}{r['peak_bytes'] / 2**20:>10.1f}{mark:1}{r['model_bytes'] / 2**20:>11.1f}")
        if r.get("note"):
            print(f"  {'':42}  note: {r['note']}")
        out["rows"][name] = {"seconds": seconds, "times": r["times"], "peak_bytes": r["peak_bytes"],
                             "peak_excludes_warmup": r["peak_excludes_warmup"], "model_bytes": r["model_bytes"],
                             "load_seconds": r["load_seconds"], "note": r.get("note")}
    if any(not r.get("peak_excludes_warmup", True) for r in rows.values()):
        print("  * peak includes the warm-up (the resident high-water mark could not be reset)")
    labels = dict(VARIANTS[task])
    ours = out["rows"].get(labels["wb"], {})
    others = {k: out["rows"].get(labels[k], {}) for k in ("tl", "nn")}
    others = {k: v for k, v in others.items() if "seconds" in v}
    if "seconds" in ours and others:
        fastest = min(others, key=lambda k: others[k]["seconds"])
        leanest = min(others, key=lambda k: others[k]["peak_bytes"])
        speed = others[fastest]["seconds"] / ours["seconds"]
        mem = others[leanest]["peak_bytes"] / max(ours["peak_bytes"], 1)
        print(f"  workbench vs the faster of TL and nnsight ({labels[fastest]}): {speed:.2f}x the speed; "
              f"peak memory: the leaner ({labels[leanest]}) uses {mem:.2f}x workbench's")
        out["speedup_vs_fastest_other"] = speed
        out["fastest_other"] = labels[fastest]
        out["memory_ratio_vs_leanest_other"] = mem
    unshared = out["rows"].get(labels.get("wb_unshared", ""), {})
    if "seconds" in unshared and others:
        speed = others[fastest]["seconds"] / unshared["seconds"]
        print(f"  {labels['wb_unshared']} vs the faster of TL and nnsight: {speed:.2f}x the speed")
        out["unshared_vs_fastest_other"] = speed
    single = out["rows"].get(labels.get("wb_single", ""), {})
    if "seconds" in ours and "seconds" in single:
        ratio = single["seconds"] / ours["seconds"]
        print(f"  workbench batched vs {labels['wb_single'].removeprefix('workbench ')}: {ratio:.2f}x the speed")
        out["batched_vs_single"] = ratio
    before = next((r for name, r in out["rows"].items() if name.startswith("workbench, CPU kernels of")), {})
    if "seconds" in ours and "seconds" in before:
        ratio = before["seconds"] / ours["seconds"]
        print(f"  workbench vs itself on the other revision's CPU kernels: {ratio:.2f}x the speed")
        out["vs_kernels_from"] = ratio
    out["checks"] = checks(task, rows, inputs)
    for line in out["checks"]:
        print(f"  check: {line}")
    return out


def main() -> None:
    # Run as a script, this folder is sys.path[0]: its kernels.py would shadow the Hugging Face package of that name,
    # which transformers looks for. Nothing here imports from bench/.
    if sys.path and Path(sys.path[0] or ".").resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default 2 on the CPU)")
    parser.add_argument("--tasks", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs after the warm-up (default 3, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke test")
    parser.add_argument("--batch-size", type=int, default=64, help="rows per forward for TL and nnsight")
    parser.add_argument("--steer-scale", type=float, default=64.0, help="steering: scale of the random unit vector")
    parser.add_argument("--wb-dtype", default="float32", help="workbench activation dtype")
    parser.add_argument("--model", default=None, help="the GGUF file (default: the embedded SmolLM2-135M Q4_1)")
    parser.add_argument("--hf-dir", default=None, help="where to keep (and reuse) the dequantized float32 HF copy")
    parser.add_argument("--json", default=None, help="write the results to this file")
    parser.add_argument("--kernels-from", default=None, metavar="REV",
                        help="also run workbench on the CPU kernels of this git revision (a before/after row)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads is None:
        args.threads = 2 if args.device == "cpu" else torch.get_num_threads()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.child:
        child(args)
        return
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        parser.error(f"unknown tasks {bad}; choose from a,b,c,d")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")

    with tempfile.TemporaryDirectory(prefix="vs_transformerlens_") as tmp:
        work = Path(tmp)
        hf_dir = Path(args.hf_dir) if args.hf_dir else work / "hf"
        from workbench.loading import default_model_path

        gguf = Path(args.model or default_model_path())
        if not (hf_dir / COMPLETE).exists():
            seconds = save_hf_copy(gguf, hf_dir)
            print(f"dequantized {gguf.name} to a float32 HF checkpoint in {seconds:.1f} s ({hf_dir})")
        inputs = make_inputs(args, work, hf_dir)
        info = {"versions": versions(), "device": device_name(args.device), "threads": args.threads,
                "repeats": args.repeats, "quick": args.quick, "batch_size": args.batch_size,
                "model": f"{inputs['model_name']} ({gguf.name})", "wb_dtype": args.wb_dtype,
                "steer_scale": args.steer_scale, "hf_tokenizer_same_ids": inputs["hf_tokenizer_same_ids"]}
        print(", ".join(f"{k} {v}" for k, v in info["versions"].items()))
        print(f"device {info['device']}, threads {args.threads}, repeats {args.repeats} (median after one warm-up), "
              f"TL/nnsight batch size {args.batch_size}, workbench activations {args.wb_dtype}, TL/nnsight float32")
        print(f"model {info['model']}; HF tokenizer gives workbench's token ids: {inputs['hf_tokenizer_same_ids']}")
        if args.device == "cpu" and hasattr(os, "getloadavg"):
            load = os.getloadavg()[0]
            info["load_average"] = load
            busy = load > (os.cpu_count() or 1) - args.threads + 0.5
            print(f"load average {load:.2f} on {os.cpu_count()} cores" + (
                ": busy, timings will be noisy (workbench's threaded CPU kernels slow down sharply when their "
                "threads share cores with other work)" if busy else ""))
        results = {"info": info, "tasks": {}}
        for task in tasks:
            rows = {}
            variants = VARIANTS[task][:1] + ([("wb_from", f"workbench, CPU kernels of {args.kernels_from}")]
                                             if args.kernels_from else []) + VARIANTS[task][1:]
            for variant, label in variants:
                print(f"  ({task}) {label} ...", file=sys.stderr, flush=True)
                rows[label] = run_child(args, work, task, variant)
                if "error" in rows[label]:
                    print(rows[label]["stderr_tail"], file=sys.stderr)
            results["tasks"][task] = report_task(task, rows, inputs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
