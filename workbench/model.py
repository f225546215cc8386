"""The public model object: load once, then tokenize, forward, generate (and, via workbench.hooks, trace)."""
from __future__ import annotations

import hashlib
import time
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from workbench.errors import WorkbenchError
from workbench.generation import Sampling, generate_tokens
from workbench.kernels import select_kernel
from workbench.kv_cache import KVCache
from workbench.loading import LoadedCheckpoint, load_checkpoint
from workbench.runner import Hooks, Transformer
from workbench.tokenizer import StreamDecoder

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype | None, device: str) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise WorkbenchError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[dtype]


class Model:
    """A loaded model. ``workbench.load()`` makes one."""

    def __init__(self, checkpoint: LoadedCheckpoint, device: str | None = None,
                 dtype: str | torch.dtype | None = None, load_seconds: float | None = None):
        device = device or default_device()
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise WorkbenchError("device 'cuda' asked for, but no CUDA device is available")
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.path = checkpoint.path
        self.metadata = checkpoint.metadata
        self.runner = Transformer(checkpoint.config, checkpoint.weights, device, resolve_dtype(dtype, device))
        self.load_seconds = load_seconds

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    # ------------------------------------------------------------------------------------------ text

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def chat_prompt(self, user_message: str, system: str | None = None) -> str:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": user_message}
        ]
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def to_ids(self, prompt: str | Sequence[int], chat: bool = False) -> list[int]:
        """Token ids of a prompt (text, rendered through the chat template with ``chat``, or ids as given)."""
        if isinstance(prompt, str):
            if not prompt.strip() and not chat:
                raise WorkbenchError("the prompt is empty")
            text = self.chat_prompt(prompt) if chat else prompt
            # a rendered chat template carries its own BOS where the model wants one
            ids = self.tokenize(text, add_bos=False if chat else None)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise WorkbenchError("the prompt is empty")
        if len(ids) > self.config.n_ctx:
            raise WorkbenchError(f"the prompt has {len(ids)} tokens; the context holds {self.config.n_ctx}")
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            raise WorkbenchError(f"token ids out of range 0..{self.config.vocab_size - 1}: {bad[:5]}")
        return ids

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.token_text(int(i)) for i in ids]

    # --------------------------------------------------------------------------------------- forward

    def forward(self, ids: str | Sequence[int] | torch.Tensor, hooks: Hooks | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab_size]``, one row per position."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.runner.forward(torch.tensor(self.to_ids(ids), dtype=torch.long), cache=cache, hooks=hooks)

    def new_cache(self) -> KVCache:
        return self.runner.new_cache()

    def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
               hooks: Hooks | None = None, cache: KVCache | None = None) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, new_text)`` as tokens are generated."""
        sampling = Sampling(temperature, top_k, top_p, seed)
        decoder = StreamDecoder(self.tokenizer)
        ids = self.to_ids(prompt, chat=chat)
        for token in generate_tokens(self.runner, ids, max_new_tokens, sampling, self.tokenizer.stop_ids,
                                     hooks, cache):
            text = "" if token in self.tokenizer.stop_ids else decoder.feed(token)
            yield token, text

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32, **kwargs: Any) -> str:
        """The generated continuation as text (stops at an end-of-turn or end-of-text token)."""
        return "".join(text for _, text in self.stream(prompt, max_new_tokens, **kwargs))

    # ------------------------------------------------------------------------------------------ info

    @cached_property
    def file_sha256(self) -> str:
        """Hash of the model file (or of the checkpoint's safetensors files), for trace fingerprints."""
        h = hashlib.sha256()
        files = [self.path] if self.path.is_file() else sorted(self.path.glob("*.safetensors"))
        for file in files:
            with open(file, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        return h.hexdigest()

    def tensor_formats(self) -> dict[str, str]:
        return {name: w.fmt.name for name, w in self.runner.weights.named_matrices()}

    def kernel_report(self, n_tokens: int = 1) -> dict[str, str]:
        """Which kernel serves each matrix for a forward of ``n_tokens`` tokens on this device."""
        probe = torch.empty(n_tokens, 1, dtype=self.dtype, device=self.device)
        report = {}
        for name, w in self.runner.weights.named_matrices():
            x = probe.expand(n_tokens, w.shape[1])
            report[name] = select_kernel(x, w).name
        return report

    def info(self) -> dict[str, Any]:
        weights = self.runner.weights
        file_bytes = self.path.stat().st_size if self.path.is_file() else None
        formats: dict[str, int] = {}
        for name, fmt in self.tensor_formats().items():
            formats[fmt] = formats.get(fmt, 0) + 1
        kernels_decode = self.kernel_report(1)
        kernels_prefill = self.kernel_report(128)
        return {
            "model": self.config.name,
            "path": str(self.path),
            "config": self.config.to_dict(),
            "parameters": self.config.n_params,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "tensor_formats": formats,
            "weight_bytes": weights.nbytes,
            "file_bytes": file_bytes,
            "load_seconds": self.load_seconds,
            "kernels": {
                name: {"decode": kernels_decode[name], "prefill": kernels_prefill[name], "format": fmt}
                for name, fmt in self.tensor_formats().items()
            },
        }

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.name!r}, arch={c.architecture}, layers={c.n_layers}, d_model={c.d_model}, "
                f"device={self.device}, dtype={str(self.dtype).removeprefix('torch.')})")


def load(path: str | Path | None = None, *, device: str | None = None, dtype: str | torch.dtype | None = None,
         quantize: str | None = None) -> Model:
    """Load a GGUF file or a Hugging Face checkpoint directory; the embedded SmolLM2-135M when no path is given.

    ``quantize`` ("Q4_K", "Q8_0", ...) quantizes a float checkpoint's matrices on load.
    """
    started = time.perf_counter()
    checkpoint = load_checkpoint(path, quantize)
    return Model(checkpoint, device, dtype, load_seconds=time.perf_counter() - started)
