"""Top-1 agreement and KL of workbench's logits against llama.cpp's (run live, flash attention "auto" as llama.cpp
defaults, 2 threads), in exact and in llama.cpp numerics, on the tuning and held-out prompts. Needs the ``reference``
extra.

The embedded model runs the 30 prompts of ``tests/fixtures/llamacpp_logits.json`` (5 to 437 tokens; the fixture marks
every third ``held_out``: kept out of any tuning of the numerics); each random model (``workbench.synthetic``, llama,
4 layers, d_model 256, in each ``--formats``) runs 30 random token sequences of the same lengths, every third held out.

    python bench/llamacpp_agreement.py [--formats Q4_0 Q4_1 Q8_0 Q4_K_M Q6_K] [--no-embedded] [--threads 2]
    LLAMA_CPP_LIB_PATH=llama.cpp/build/bin python bench/llamacpp_agreement.py --device cuda   # both on a GPU

``--device cuda --cross-check`` adds, for the embedded model: llama.cpp's logits on this machine against the committed
fixture (llama.cpp's CPU build), and ours on CUDA against ours on the CPU: where a gap between the two engines lies.

``--device cuda`` runs ours on CUDA and llama.cpp with every layer on its CUDA backend (``-ngl 99``, its default flash
attention setting "auto"), each prompt in one batch as on the CPU: llama-cpp-python loads the ``libllama.so`` of a llama.cpp built with
``-DGGML_CUDA=ON`` from ``LLAMA_CPP_LIB_PATH`` (the vendored llama.cpp of the same release, so its C API matches). That
llama.cpp runs in a child process that never imports torch: on the H100 machines, a CUDA build of llama.cpp and
torch's libraries in one process crash while loading the model, in either import order.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llamacpp_logits.json"
FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "Q6_K")


GPU_CHILD = r"""
import json, sys
import llama_cpp  # first: with numpy (or torch) loaded before it, llama.cpp's CUDA build crashes loading the model
import numpy as np
request = json.loads(sys.stdin.read())
longest = max(len(ids) for ids in request["prompts"])
llama_cpp.llama_backend_init()
model_params = llama_cpp.llama_model_default_params()
model_params.n_gpu_layers, model_params.use_extra_bufts = request["gpu_layers"], False
model = llama_cpp.llama_model_load_from_file(request["path"].encode(), model_params)
params = llama_cpp.llama_context_default_params()
params.n_ctx, params.n_batch, params.n_ubatch = longest + 16, longest, longest
params.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO
context = llama_cpp.llama_init_from_model(model, params)
n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
logits = {}
for i, ids in enumerate(request["prompts"]):
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(context), True)
    batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for j, token in enumerate(ids):
        batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.seq_id[j][0], batch.logits[j] = token, j, 1, 0, 1
    if llama_cpp.llama_decode(context, batch):
        sys.exit(f"llama_decode failed on prompt {i}")
    llama_cpp.llama_batch_free(batch)
    logits[str(i)] = np.ctypeslib.as_array(llama_cpp.llama_get_logits(context), shape=(len(ids), n_vocab)).copy()
np.savez(request["out"], **logits)
"""


def llamacpp_gpu_logits(path: Path, prompts: list[list[int]], gpu_layers: int = 99) -> list[torch.Tensor]:
    """Every position's logits of each prompt, llama.cpp on its GPU in a process of its own (one batch a prompt;
    ``gpu_layers=0`` for its CPU backend in the same process layout)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "logits.npz"
        request = json.dumps({"path": str(path), "prompts": prompts, "out": str(out), "gpu_layers": gpu_layers})
        run = subprocess.run([sys.executable, "-c", GPU_CHILD], input=request, text=True, capture_output=True,
                             env=os.environ)
        if run.returncode:
            sys.exit(f"llama.cpp on the GPU failed: {run.stderr[-1500:]}")
        with np.load(out, allow_pickle=False) as saved:
            return [torch.from_numpy(saved[str(i)]) for i in range(len(prompts))]


def cross_check(model, reference: list[torch.Tensor]) -> dict:
    """For the embedded model: llama.cpp's ``reference`` logits against the committed fixture of llama.cpp's CPU logits,
    and ``model``'s logits against the same model's on the CPU, each as top-1 agreement and mean and max KL."""
    import workbench
    from safetensors.torch import load_file
    from workbench import parity

    tensors = load_file(str(FIXTURE.with_suffix(".safetensors")))
    on_cpu = workbench.load(model.path, device="cpu")
    fixture_kl, fixture_top1, cpu_kl, cpu_top1 = [], [], [], []
    with torch.inference_mode():
        for i, ids in enumerate(p["ids"] for p in json.loads(FIXTURE.read_text())["prompts"]):
            top = [tensors[f"prompt{i}.{key}"] for key in ("top_ids", "top_logprobs", "tail_logprob")]
            fixture_kl.append(parity.top_kl(*top, reference[i]))
            fixture_top1.append(reference[i].argmax(-1) == top[0][:, 0])
            ours, ours_cpu = model.forward(ids).float().cpu(), on_cpu.forward(ids).float()
            cpu_kl.append(parity.kl_per_position(ours_cpu, ours))
            cpu_top1.append(ours_cpu.argmax(-1) == ours.argmax(-1))
    summary = lambda kl, top1: {"top1": round(torch.cat(top1).double().mean().item(), 5),  # noqa: E731
                                "mean_kl": torch.cat(kl).mean().item(), "max_kl": torch.cat(kl).max().item()}
    return {"llama.cpp here vs the CPU fixture": summary(fixture_kl, fixture_top1),
            f"ours on {model.device.type} vs ours on the CPU": summary(cpu_kl, cpu_top1)}


def agreement(model, prompts: list[list[int]], held_out: list[bool], threads: int, cross: bool = False) -> dict:
    """Per numerics and part (tuning, held out): prompts, positions, top-1 agreement, mean and max KL(llama.cpp ||
    ours) over the whole vocabulary. llama.cpp runs on the CPU beside a CPU model, on its GPU beside a CUDA one."""
    from workbench import parity
    from workbench.kernels import numerics

    if model.device.type == "cuda":
        reference = llamacpp_gpu_logits(model.path, prompts)
    else:
        reference = [torch.from_numpy(parity.capture_llamacpp(model.path, ids, names=lambda n: False,
                                                              threads=threads).tensors["result_output"])
                     for ids in prompts]
    results = {}
    for mode in ("exact", "llamacpp"):
        with numerics(mode), torch.inference_mode():
            ours = [model.forward(ids).float().cpu() for ids in prompts]
        for part, wanted in (("tuning", False), ("held out", True)):
            idx = [i for i, h in enumerate(held_out) if h == wanted]
            kl = torch.cat([parity.kl_per_position(reference[i], ours[i]) for i in idx])
            agree = torch.cat([reference[i].argmax(-1) == ours[i].argmax(-1) for i in idx]).double()
            results[f"{mode}, {part}"] = {"prompts": len(idx), "positions": int(agree.numel()),
                                          "top1": round(agree.mean().item(), 5), "mean_kl": kl.mean().item(),
                                          "max_kl": kl.max().item(),
                                          "identical_logits": all(torch.equal(reference[i], ours[i]) for i in idx)}
    if cross:
        results["cross-check"] = cross_check(model, reference)
    return results


def main() -> None:
    import workbench
    from workbench.synthetic import random_checkpoint, random_config, write_gguf

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=list(FORMATS))
    parser.add_argument("--no-embedded", action="store_true", help="only the random models")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="ours on this device; cuda puts llama.cpp on its GPU too")
    parser.add_argument("--dtype", default="float32", help="our activations' dtype (llama.cpp's are float32)")
    parser.add_argument("--cross-check", action="store_true",
                        help="embedded model: llama.cpp here vs the CPU fixture, ours here vs ours on the CPU")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    fixture = json.loads(FIXTURE.read_text())["prompts"]
    held_out = [p["held_out"] for p in fixture]
    out = {}
    if not args.no_embedded:
        model = workbench.load(None, device=args.device, dtype=args.dtype)
        out["embedded"] = agreement(model, [p["ids"] for p in fixture], held_out, args.threads, args.cross_check)
        print(json.dumps({"embedded": out["embedded"]}, indent=1), flush=True)
    generator = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in args.formats:
            config = random_config("llama", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_mlp=512, n_ctx=1024)
            checkpoint = random_checkpoint(config, fmt, seed=0)
            path = write_gguf(Path(tmp) / f"random-{fmt}.gguf", checkpoint.config, checkpoint.weights)
            model = workbench.load(path, device=args.device, dtype=args.dtype)
            prompts = [torch.randint(1, config.vocab_size, (len(p["ids"]),), generator=generator).tolist()
                       for p in fixture]
            out[fmt] = agreement(model, prompts, held_out, args.threads)
            print(json.dumps({fmt: out[fmt]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
