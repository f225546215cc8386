"""The public model object: load once, then tokenize, forward, generate (and, via workbench.hooks, trace)."""
from __future__ import annotations

import functools
import hashlib
import operator
import os
import platform
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from workbench import hooks as hooks_lib
from workbench.adapters import Adapter, AdapterError, check_term_range, load_adapter
from workbench.devices import check_device, check_devices, free_memory, split_layers
from workbench.errors import WorkbenchError, finite_number, shorten
from workbench.generation import (Sampling, check_max_new_tokens, forget_built_steps, generate_batch_tokens,
                                  generate_tokens)
from workbench.hooks.trace import tensor_sha256
from workbench.kernels import QuantTensor, get_numerics, layer_ops, numerics, select_kernel
from workbench.kernels.linear import Numerics, check_numerics, scoped_numerics
from workbench.kv_cache import BatchKVCache, KVCache, PrefixGroup, prefix_groups
from workbench.loading import LoadedCheckpoint, checkpoint_files, files_sha256, load_checkpoint
from workbench.messages import Prompt, check_messages, continues_answer, conversation, is_messages, is_utf8
from workbench.progress import Progress, check_progress, progress_callback
from workbench.runner import (FINAL_POINTS, LORA_GROUPS, QUERY_ONLY_LORA_GROUPS, BatchLayout, Lora, LoraRows,
                              Transformer, capturable)
from workbench.tokenizer import StreamDecoder
from workbench.weights import STACKS

# Interventions and recorders opened with ``with model.hooks(...)``: per thread and per async task, so
# concurrent calls never see each other's hooks.
_ACTIVE: ContextVar[tuple] = ContextVar("workbench_active_hooks", default=())

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# Which adapters a call runs with: None (the base), a resident adapter's name (at its own scale) or {name: scale}.
AdapterChoice = str | Mapping[str, float] | None
# A batch's: one choice for every prompt, or a list (or tuple) of one choice per prompt.
BatchAdapterChoice = AdapterChoice | Sequence[AdapterChoice]


def layout_adapters(lora: Sequence[Lora | None], prompts: Sequence[int]) -> Lora | LoraRows | None:
    """The adapter terms of a forward over ``prompts`` (``lora[i]`` prompt i's): one choice's where every prompt has
    it, else a choice per sequence."""
    chosen = [lora[i] for i in prompts]
    return chosen[0] if all(terms is chosen[0] for terms in chosen) else LoraRows(tuple(chosen))


def repeated_prompts(ids: Sequence[list[int]], prompt_hooks: Sequence[dict], lora: Sequence[Lora | None]
                     ) -> dict[int, list[int]]:
    """The later copies of each prompt that a batch repeats with nothing of its own (no hooks, the same adapter
    choice), by the first one's index: they take its forward's results instead of a forward of their own."""
    first: dict[tuple, int] = {}
    repeats: dict[int, list[int]] = {}
    for i, x in enumerate(ids):
        if prompt_hooks[i]:
            continue
        key = (tuple(x), id(lora[i]))  # lora_terms builds one object per choice
        if key in first:
            repeats.setdefault(first[key], []).append(i)
        else:
            first[key] = i
    return repeats


def recorded_prompt(prompt: Prompt, ids: list[int]) -> str | list:
    """What a trace records as its prompt: the text, the conversation (as plain dicts), or else the ids."""
    if is_messages(prompt):
        return check_messages(prompt)
    return prompt if isinstance(prompt, str) else list(ids)


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


def check_record_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """What recorded activations are kept in: a floating torch dtype or its name (an integer one would truncate
    them)."""
    chosen = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if chosen not in hooks_lib.trace.FLOAT_DTYPES:  # what a saved trace may hold
        raise WorkbenchError(f"record_dtype must be a floating torch dtype or one of {', '.join(DTYPES)}, "
                             f"got {shorten(dtype)}")
    return chosen


def check_batch_size(batch_size: object) -> None:
    """Prompts a forward takes: a positive integer, or None for as many as fit."""
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise WorkbenchError(f"batch_size must be a positive integer or None, got {batch_size!r}")


def check_logits(logits: object) -> None:
    """Which logits a run keeps: ``"all"`` positions', the ``"last"`` one's, or None."""
    if logits not in ("all", "last", None):
        raise WorkbenchError(f"logits must be 'all', 'last' or None, got {shorten(logits)}")


class Model:
    """A loaded model. ``workbench.load()`` makes one.

    ``numerics`` ("exact", "llamacpp" or None) is what its quantized matmuls compute where no
    ``with workbench.kernels.numerics(...):`` block around a call says otherwise; None: the process default
    (``set_numerics``). A block always wins, so a trace replays in its recorded numerics whatever the model's."""

    def __init__(self, checkpoint: LoadedCheckpoint, device: str | None = None,
                 dtype: str | torch.dtype | None = None, load_seconds: float | None = None,
                 numerics: Numerics | None = None, devices: Sequence[str] | None = None,
                 split: Sequence[int] | None = None):
        self.numerics: Numerics | None = None if numerics is None else check_numerics(numerics)
        if devices is not None and device is not None:
            raise WorkbenchError("give device (one) or devices (a model split over several), not both")
        if split is not None and devices is None:
            raise WorkbenchError("split gives the layers of each of devices=[...]")
        if devices is not None:
            counts = split_layers(checkpoint.weights, devices, split)
            ranges = list(zip(check_devices(devices), counts))
            device = str(ranges[0][0])
        else:
            device = device or default_device()
            check_device(device)
            ranges = None
        self.config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.path = checkpoint.path
        self.metadata = checkpoint.metadata
        self.runner = Transformer(checkpoint.config, checkpoint.weights, device, resolve_dtype(dtype, device),
                                  split=ranges)
        self.load_seconds = load_seconds
        self.adapters: dict[str, Adapter] = {}
        self._lora: dict[tuple, Lora] = {}  # a choice of adapters and scales -> its terms on the device, built once
        self.merged: list[dict[str, Any]] = []  # adapters folded into the weights (merge_adapter), in merge order

    @property
    def device(self) -> torch.device:
        """The device of the embedding (the first layer's, for a model split over devices)."""
        return self.runner.device

    @property
    def devices(self) -> list[tuple[str, range]]:
        """``(device, layers)`` of each layer range: one range unless the model is split over devices."""
        starts = [0, *sorted(self.runner.range_starts), self.config.n_layers]
        return [(str(self.runner.devices[a]), range(a, b)) for a, b in zip(starts, starts[1:])]

    def point_device(self, name: str) -> torch.device:
        """Where a hook point's activation lives (its layer's device): interventions place their tensors there."""
        return self.runner.point_device(name)

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def current_numerics(self) -> Numerics:
        """What this model's matmuls compute in a call made here: the innermost ``numerics()`` block's mode, else the
        model's own ``numerics``, else the process default."""
        return scoped_numerics() or self.numerics or get_numerics()

    def numerics_scope(self):
        """A context manager that runs its block in ``current_numerics()``: the model's own numerics where no
        ``numerics()`` block is open (every call of the model enters it; so do functions that run its weights
        themselves, such as the logit lens)."""
        if self.numerics is None or scoped_numerics() is not None:
            return nullcontext()
        return numerics(self.numerics)

    # -------------------------------------------------------------------------------------- adapters

    def load_adapter(self, path: str | Path, name: str | None = None, scale: float = 1.0) -> Adapter:
        """Make a LoRA adapter (a llama.cpp GGUF adapter or a PEFT folder) resident under ``name`` (default: the file's
        stem), used at ``scale`` when a call names it; checked against this model before it is kept
        (workbench.adapters). Calls choose it with ``adapter=name`` (or mix it: ``adapter={name: scale, ...}``)."""
        name = name if name is not None else Path(path).stem
        if not isinstance(name, str) or not name:
            raise WorkbenchError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self.adapters:
            raise WorkbenchError(f"an adapter named {name!r} is already loaded; unload_adapter({name!r}) first")
        adapter = load_adapter(path, self.config, name, scale)
        self.adapters[name] = adapter
        return adapter

    def unload_adapter(self, name: str) -> None:
        self._adapter(name)
        del self.adapters[name]
        self._lora = {key: lora for key, lora in self._lora.items() if name not in dict(key)}

    def list_adapters(self) -> list[dict[str, Any]]:
        """The resident adapters' summaries, then those merged into the weights (with ``"merged"``: what they were
        re-quantized to)."""
        return [adapter.summary() for adapter in self.adapters.values()] + [dict(entry) for entry in self.merged]

    def merge_adapter(self, name: str, scale: float | None = None) -> dict[str, Any]:
        """Fold a resident adapter into the weights, as llama.cpp's ``llama-export-lora`` does: each adapted matrix
        ``W`` becomes ``dequantize(W) + s * B A``, quantized again into ``W``'s own format (so the model keeps its
        size and kernels, and the merged delta takes that format's rounding). ``scale``: default the adapter's own.
        One-way: the adapter leaves the resident ones (every call now runs with it; reload the model to undo) and is
        listed as merged (``list_adapters``, ``info``, and traces' fingerprints, so that a replay merges it too).
        Returns that record. All or nothing: the new matrices are made before any replaces its old one (so the adapted
        ones are held twice meanwhile), and a sum past the format's range (an AdapterError) changes none."""
        adapter = self._adapter(name)
        scale = adapter.scale if scale is None else finite_number(scale, "adapter scale")
        weights = self.runner.weights
        targets = [(i, proj) for i, layer in enumerate(adapter.layers) for proj in layer]
        missing = [f"layer {i} {proj}" for i, proj in targets if getattr(weights.layers[i], proj) is None]
        if missing:  # a mixture-of-experts MLP has no single matrix to merge into
            raise WorkbenchError(f"adapter {name!r} adapts {missing[0]}, which this model has no matrix for")
        merged = {}  # every matrix quantized before any is replaced: a failure (a sum past the format) changes none
        for i, proj in targets:
            w = getattr(weights.layers[i], proj)
            a, b = (t.to(w.device) for t in adapter.layers[i][proj])
            try:
                merged[i, proj] = QuantTensor.quantize(w.dequantize() + scale * (b @ a), w.fmt)
            except ValueError as err:
                raise AdapterError(f"adapter {name!r} cannot merge into layer {i} {proj}: {err}") from None
        formats = {w.fmt.name for w in merged.values()}
        for (i, proj), w in merged.items():
            setattr(weights.layers[i], proj, w)
        for layer in {i for i, _ in targets}:
            if any(getattr(weights.layers[layer], stacked) is not None for stacked in STACKS):
                weights.layers[layer].fuse_projections()  # stack the new parts (the old stack held the old ones)
        forget_built_steps(self.runner)  # a CUDA graph reads the weights it captured, which are gone
        self.unload_adapter(name)
        record = {**{k: v for k, v in adapter.summary().items() if k != "scale"}, "scale": scale,
                  "merged": f"re-quantized to {', '.join(sorted(formats))}"}
        self.merged.append(record)
        return dict(record)

    def _adapter(self, name: Any) -> Adapter:
        if name not in self.adapters:
            known = ", ".join(map(repr, self.adapters)) or "none (model.load_adapter(path, name=...))"
            raise WorkbenchError(f"unknown adapter {name!r}; loaded: {known}")
        return self.adapters[name]

    def adapter_scales(self, adapter: AdapterChoice) -> dict[str, float]:
        """``{name: scale}`` of a call's adapter choice, checked before any compute; scale-0 adapters are left out (a
        call with none left is the base's forward, bit for bit)."""
        if adapter is None:
            return {}
        if isinstance(adapter, str):
            return {adapter: self._adapter(adapter).scale} if self._adapter(adapter).scale != 0 else {}
        if not isinstance(adapter, Mapping):
            raise WorkbenchError(f"adapter must be None, a name or {{name: scale}}, got {type(adapter).__name__}")
        scales = {}
        for name, scale in adapter.items():
            self._adapter(name)
            if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not torch.isfinite(
                    torch.tensor(float(scale))):
                raise WorkbenchError(f"the scale of adapter {name!r} must be a finite number, got {scale!r}")
            if scale != 0:
                scales[name] = float(scale)
        return scales

    def lora_terms(self, adapter: AdapterChoice) -> Lora | None:
        """The runner's LoRA terms for a call's adapter choice (None: the base), on this model's device and dtype:
        several adapters stacked along the rank, each B times its scale. Built once per choice; no reload between
        calls."""
        scales = self.adapter_scales(adapter)
        if not scales:
            return None
        key = tuple(sorted(scales.items()))
        if key not in self._lora:
            self._lora[key] = [self._layer_lora(i, scales) for i in range(self.config.n_layers)]
        return self._lora[key]

    def _layer_lora(self, i: int, scales: dict[str, float]) -> dict:
        """One layer's terms (``runner.Lora``): per group of projections sharing an input, the adapted ones' A rows
        stacked and their scaled B's transposed as the blocks of one block-diagonal matrix, with each one's rank."""
        terms = {}
        for group in LORA_GROUPS if self.runner.weights.layers[i].wk is not None else QUERY_ONLY_LORA_GROUPS:
            adapted = tuple(p for p in group if any(p in self.adapters[name].layers[i] for name in scales))
            if not adapted:
                continue
            pieces = []  # per adapted projection, each adapter's (name, A, B times the call's scale)
            for p in adapted:
                held = [(name, scale, self.adapters[name].layers[i].get(p)) for name, scale in scales.items()]
                piece = [(name, factors[0], factors[1] * scale) for name, scale, factors in held if factors]
                # a call's scales, or a float16 model, can take a term past its range
                check_term_range(torch.cat([a for _, a, _ in piece]), torch.cat([b for _, _, b in piece], dim=1),
                                 self.dtype, f"layer {i} {p} of {', '.join(repr(name) for name, _, _ in piece)}: ",
                                 "alpha / rank and the call's scale")
                pieces.append(piece)
            a = torch.cat([a for piece in pieces for _, a, _ in piece])
            b_t = torch.block_diag(*[torch.cat([b for _, _, b in piece], dim=1).T for piece in pieces])
            ranks = tuple(sum(a.shape[0] for _, a, _ in piece) for piece in pieces)
            device = self.runner.devices[i]  # the layer's own, in a model split over devices
            terms[group] = (a.to(device, self.dtype), b_t.to(device, self.dtype), adapted, ranks)
        return terms

    def batch_adapters(self, adapter: BatchAdapterChoice, n_prompts: int) -> list[AdapterChoice]:
        """Each prompt's adapter choice in a batch of ``n_prompts``: ``adapter`` for all, or the entries of a list of
        one choice per prompt; all checked before any compute (errors name the prompt)."""
        if not isinstance(adapter, (list, tuple)):
            self.adapter_scales(adapter)
            return [adapter] * n_prompts
        if len(adapter) != n_prompts:
            raise WorkbenchError(f"adapter takes one choice for all prompts or a list of one per prompt "
                                 f"({n_prompts}), got a list of {len(adapter)}")
        for i, choice in enumerate(adapter):
            try:
                self.adapter_scales(choice)
            except WorkbenchError as err:
                raise type(err)(f"prompt {i}: {err}") from None
        return list(adapter)

    def adapter_record(self, adapter: AdapterChoice) -> list[dict[str, Any]]:
        """What a trace keeps of a call's adapters: name, scale, format, file path and sha256."""
        return [{"name": name, "scale": scale, "format": self.adapters[name].format,
                 "path": str(self.adapters[name].path), "sha256": self.adapters[name].sha256}
                for name, scale in self.adapter_scales(adapter).items()]

    # ------------------------------------------------------------------------------------------ text

    def tokenize(self, text: str, add_bos: bool | None = None) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def chat_prompt(self, user_message: str, system: str | None = None) -> str:
        return self.render_messages(conversation(user_message, system))

    def render_messages(self, messages: Sequence[Mapping[str, str]]) -> str:
        """A conversation rendered through the chat template: with the generation prompt after it, or, when the last
        message is the assistant's, that message left open for the model to continue (its prefilled answer)."""
        messages = check_messages(messages)
        prefilled = continues_answer(messages)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=not prefilled,
                                                  continue_final_message=prefilled)

    def to_ids(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt: a text (rendered as one user message through the chat template with ``chat``), a
        conversation (a list of ``{"role", "content"}`` messages, always rendered through the chat template; see
        ``render_messages``), or ids as given."""
        if is_messages(prompt):
            # a rendered chat template carries its own BOS where the model wants one
            ids = self.tokenize(self.render_messages(prompt), add_bos=False)
        elif isinstance(prompt, str):
            if not prompt.strip() and not chat:
                raise WorkbenchError("the prompt is empty")
            if not is_utf8(prompt):
                raise WorkbenchError("the prompt is not valid UTF-8 text (it holds lone surrogates, e.g. from "
                                     "undecodable bytes in a command line)")
            ids = self.tokenize(self.chat_prompt(prompt), add_bos=False) if chat else self.tokenize(prompt)
        else:
            try:
                # int() would read bytes as ids and cut 504.9 to 504: ids are integers, and a bool is no id
                if isinstance(prompt, (bytes, bytearray)) or any(isinstance(t, bool) for t in prompt):
                    raise TypeError
                ids = list(map(operator.index, prompt))
            except TypeError:
                raise WorkbenchError(f"a prompt is a text, a list of integer token ids or a list of messages, got "
                                     f"{shorten(prompt)}") from None
        if not ids:
            raise WorkbenchError("the prompt is empty")
        if len(ids) > self.config.n_ctx:
            raise WorkbenchError(f"the prompt has {len(ids)} tokens; the context holds {self.config.n_ctx}")
        # min and max first: a sweep checks every prompt of every shard on every rank before any compute
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
            raise WorkbenchError(f"token ids out of range 0..{self.config.vocab_size - 1}: {bad[:5]}")
        return ids

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.token_text(int(i)) for i in ids]

    # --------------------------------------------------------------------------------------- forward

    def hook_points(self) -> dict[str, str]:
        """Every hook point name with the shape of its activation (T tokens, S attended slots); the LoRA terms' points
        too while an adapter is loaded."""
        return hooks_lib.point_shapes(self.config, lora=bool(self.adapters))

    @contextmanager
    def hooks(self, interventions: Sequence[Any] = (), record: Sequence[str] | None = None
              ) -> Iterator[hooks_lib.Recorder | None]:
        """Apply interventions (and record) in every call on this model inside the block, in this thread only.

        Yields the recorder (``.activations()`` after the block) when ``record`` is given.
        """
        parsed = hooks_lib.intervention_list(interventions)
        recorder = hooks_lib.Recorder.for_patterns(record, self.config)
        token = _ACTIVE.set(_ACTIVE.get() + ((self, parsed, recorder),))
        try:
            yield recorder
        finally:
            _ACTIVE.reset(token)

    def in_hooks_block(self) -> bool:
        """Whether a ``with model.hooks(...)`` block applies to this model's calls here."""
        return any(model is self for model, _, _ in _ACTIVE.get())

    def hooks_block_specs(self) -> list[dict[str, Any]]:
        """The specs of the interventions that enclosing ``with model.hooks(...)`` blocks apply to this model's calls
        here (a function hook's names its function), outermost first."""
        return [i.to_spec() for model, parsed, _ in _ACTIVE.get() if model is self for i in parsed]

    def _call_hooks(self, interventions: Sequence[Any], record: Sequence[str] | None, prompt_len: int,
                    total_len: int, saes: Sequence[Any] = (), use_error_term: bool = True,
                    taps: Mapping[str, list[hooks_lib.HookFn]] | None = None):
        """Hooks for one call: its own interventions and records, plus those of enclosing ``hooks()`` blocks, and
        ``taps`` after them (a gradient run's), with the SAEs it attaches (``saes``, and those its feature
        interventions need) run at their points."""
        scoped = [(parsed, recorder) for model, parsed, recorder in _ACTIVE.get() if model is self]
        all_interventions = [i for parsed, _ in scoped for i in parsed]
        all_interventions += hooks_lib.intervention_list(interventions)
        attached = self._call_saes(saes, [all_interventions])
        hooks, recorder, specs = hooks_lib.compile_hooks(self, all_interventions, record, prompt_len, total_len)
        outer = [r.hooks() for _, r in scoped if r is not None] + ([taps] if taps else [])
        if outer:
            hooks = hooks_lib.merge_hooks([hooks, *outer])
        hooks = hooks_lib.attach_saes(hooks, attached, _check_flag(use_error_term))
        return hooks or None, recorder, specs

    def _stop_after_recorded(self, names: Sequence[str]) -> int | None:
        """Where a call that keeps no logits stops (``runner.stop_after``): after the deepest block its recorded
        points, or those of enclosing ``hooks()`` blocks, lie in."""
        names = [*names, *(name for model, _, recorder in _ACTIVE.get() if model is self and recorder is not None
                           for name in recorder.names)]
        if not names:
            raise WorkbenchError("logits=None keeps nothing of a run that records nothing: give record")
        return self.runner.stop_after(names)

    def _call_saes(self, saes: Sequence[Any], interventions: Sequence[Sequence[Any]]) -> list[Any]:
        """The SAEs a call attaches, checked against the model: ``saes``, then those its interventions edit features
        of (an intervention's SAE at a hook where ``saes`` has one from the same file is that one)."""
        attached = hooks_lib.check_saes(saes, self.config)
        for items in interventions:
            for intervention in items:
                for sae in intervention.saes():
                    if not any(a is sae or (a.hook == sae.hook and a.source and a.source == sae.source)
                               for a in attached):
                        attached.append(sae)
        return [sae.on(self.device) for sae in hooks_lib.check_saes(attached, self.config)]

    def forward(self, ids: Prompt | torch.Tensor, interventions: Sequence[Any] = (),
                cache: KVCache | None = None, saes: Sequence[Any] = (), use_error_term: bool = True,
                adapter: AdapterChoice = None) -> torch.Tensor:
        """Float32 logits ``[len(ids), vocab_size]``, one row per position."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        ids = self.to_ids(ids)
        if cache is not None:
            self.runner.check_cache(cache)
        start = cache.next_position if cache is not None else 0
        lora = self.lora_terms(adapter)
        with self.numerics_scope():
            hooks, _, _ = self._call_hooks(interventions, None, start + len(ids), start + len(ids), saes,
                                           use_error_term)
            return self.runner.forward(torch.tensor(ids, dtype=torch.long), cache=cache, hooks=hooks, lora=lora)

    def run(self, prompt: Prompt, *, record: Sequence[str] | None = None,
            interventions: Sequence[Any] = (), chat: bool = False, saes: Sequence[Any] = (),
            use_error_term: bool = True, adapter: AdapterChoice = None, logits: str | None = "all") -> hooks_lib.Trace:
        """One forward over the prompt: a Trace with logits and the recorded activations. ``logits`` as in
        ``iter_batch``: every position's, the last one's (``"last"``, ``[1, vocab]``) or none (None: the forward stops
        after the deepest block a recorded point lies in, TransformerLens' ``stop_at_layer``).

        ``saes`` attaches sparse autoencoders or transcoders (``workbench.probes.load_sae``) at their hook points,
        whose own points (``<hook>.hook_sae_acts_post``, ...) can then be recorded and hooked; with ``use_error_term``
        the SAE's error is added back, so that only edits of its points change the output (docs/saes.md).
        ``adapter``: the LoRA adapters to run with (a loaded one's name, or ``{name: scale}``; None: the base model)."""
        check_logits(logits)
        ids = self.to_ids(prompt, chat=chat)
        lora = self.lora_terms(adapter)
        with self.numerics_scope():
            hooks, recorder, specs = self._call_hooks(interventions, record, len(ids), len(ids), saes,
                                                      use_error_term)
            stop = self._stop_after_recorded(recorder.names if recorder else []) if logits is None else None
            out = self.runner.forward(torch.tensor(ids, dtype=torch.long), hooks=hooks, lora=lora,
                                      last_logits_only=logits == "last", stop_at_layer=stop)
            backend = self.backend()
        return hooks_lib.Trace(
            prompt=recorded_prompt(prompt, ids), ids=ids, tokens=self.token_texts(ids),
            logits=None if logits is None else out.cpu(), activations=recorder.activations() if recorder else {},
            interventions=specs, fingerprint=self.fingerprint(), backend=backend, versions=package_versions(),
            chat=chat or is_messages(prompt),
            adapters=self.adapter_record(adapter),
        )

    def run_with_gradients(self, prompt: Prompt, metric: Callable[[torch.Tensor], torch.Tensor],
                           points: Sequence[str], *, interventions: Sequence[Any] = (), chat: bool = False,
                           saes: Sequence[Any] = (), use_error_term: bool = True,
                           adapter: AdapterChoice = None) -> hooks_lib.Gradients:
        """One forward and backward: ``metric(logits)`` (``logits`` float32 ``[positions, vocab]`` on the CPU, as a
        trace holds them; a 0-d tensor computed from them, e.g. ``logits[-1, a] - logits[-1, b]``) and its gradient
        with respect to the activation at each point of ``points`` (names or globs), as the rest of the forward reads
        it (after the call's interventions). The forward computes what ``run`` computes, bit for bit; the weights take
        no gradient. Other arguments as in ``run`` (docs/hooks.md, "Gradients")."""
        ids = self.to_ids(prompt, chat=chat)
        if not callable(metric):
            raise WorkbenchError("metric must be a function of the logits [positions, vocab]")
        taps = hooks_lib.GradientTaps.for_patterns(points, self.config)
        lora = self.lora_terms(adapter)
        with self.numerics_scope():
            hooks, _, _ = self._call_hooks(interventions, None, len(ids), len(ids), saes, use_error_term, taps.hooks())
            with torch.inference_mode(False), torch.enable_grad():  # a caller's inference mode would record no graph
                logits = self.runner.forward(torch.tensor(ids, dtype=torch.long), hooks=hooks, lora=lora).cpu()
                taps.check_fired()
                value = hooks_lib.metric_value(metric, logits)
                gradients = taps.gradients(value)
        return hooks_lib.Gradients(
            ids=ids, tokens=self.token_texts(ids), logits=logits.detach(), metric=float(value.detach()),
            activations={name: taps.activations[name].to("cpu", torch.float32) for name in taps.names},
            gradients=gradients)

    def run_with_gradients_batch(self, prompts: Sequence[Prompt],
                                 metric: Callable[[torch.Tensor], torch.Tensor] | Sequence[Callable],
                                 points: Sequence[str], *, interventions: Sequence[Any] = (),
                                 per_prompt_interventions: Sequence[Sequence[Any]] | None = None,
                                 batch_size: int | None = None, chat: bool = False, saes: Sequence[Any] = (),
                                 use_error_term: bool = True, adapter: BatchAdapterChoice = None
                                 ) -> list[hooks_lib.Gradients]:
        """``run_with_gradients`` over many prompts in batched forwards and backwards: one Gradients per prompt, in the
        prompts' order, each what ``run_with_gradients`` of its prompt alone gives. ``metric`` is one function for
        every prompt or a list of one per prompt, each given its prompt's logits alone (the backward takes the sum of
        the metrics, and no prompt's value depends on another's). ``batch_size`` prompts a forward (None: as many as
        fit a quarter of the free memory with every layer's activations kept for the backward). Other arguments as in
        ``run_batch``."""
        ids = self.batch_ids(prompts, chat)
        metrics = list(metric) if isinstance(metric, (list, tuple)) else [metric] * len(ids)
        if len(metrics) != len(ids) or not all(callable(m) for m in metrics):
            raise WorkbenchError(f"metric must be a function of the logits [positions, vocab], or a list of one per "
                                 f"prompt ({len(ids)}), got {shorten(metric)}")
        names = hooks_lib.GradientTaps.for_patterns(points, self.config).names
        lengths = [len(x) for x in ids]
        lora = [self.lora_terms(c) for c in self.batch_adapters(adapter, len(ids))]
        mode = self.current_numerics()
        with numerics(mode):
            prompt_hooks, _, attached = self._batch_hooks(interventions, per_prompt_interventions, lengths, lengths,
                                                          saes)
        hooks_lib.check_sae_points([n for h in prompt_hooks for n in h] + names, attached)
        use_error_term = _check_flag(use_error_term)
        results: list[hooks_lib.Gradients | None] = [None] * len(ids)
        for layout in self._batches(lengths, batch_size, False, vocab_rows=True, backward=True):
            taps = hooks_lib.GradientTaps(names)
            hooks = self._forward_hooks(self._layout_hooks(prompt_hooks, layout), attached, use_error_term,
                                        taps.hooks())
            with numerics(mode), torch.inference_mode(False), torch.enable_grad():
                packed = torch.tensor([t for i in layout.prompts for t in ids[i]], dtype=torch.long)
                logits = self.runner.forward(packed, hooks=hooks, layout=layout,
                                             lora=layout_adapters(lora, layout.prompts)).cpu()
                taps.check_fired()
                rows = logits.split(list(layout.lengths))
                values = []
                for i, row in zip(layout.prompts, rows):
                    try:
                        values.append(hooks_lib.metric_value(metrics[i], row))
                    except WorkbenchError as err:
                        raise type(err)(f"prompt {i}: {err}") from None
                gradients = taps.gradients(torch.stack(values).sum())

            def own(x: torch.Tensor, name: str, b: int) -> torch.Tensor:  # row b's part, a tensor of its own
                return hooks_lib.batching.row_view(x, name, layout, b).to("cpu", torch.float32, copy=True)

            for b, (i, row, value) in enumerate(zip(layout.prompts, rows, values)):
                results[i] = hooks_lib.Gradients(
                    ids=ids[i], tokens=self.token_texts(ids[i]), logits=row.detach().clone(),
                    metric=float(value.detach()),
                    activations={name: own(taps.activations[name], name, b) for name in names},
                    gradients={name: own(gradients[name], name, b) for name in names})
        return results

    # ---------------------------------------------------------------------------------------- batches

    def run_batch(self, prompts: Sequence[Prompt], **kwargs: Any) -> list[hooks_lib.Trace]:
        """``run`` over many prompts in batched forwards: one Trace per prompt, in the prompts' order, with the shapes
        and meaning ``model.run(prompt)`` gives (docs/batches.md). Keywords as ``iter_batch``."""
        traces: list[hooks_lib.Trace | None] = [None] * (len(prompts) if isinstance(prompts, Sequence) else 0)
        # every trace is kept, so each may view its forward's recorded buffers instead of copying its rows out of them
        for i, trace in self.iter_batch(prompts, **{"own_buffers": False, **kwargs}):
            traces[i] = trace
        return traces

    def iter_batch(self, prompts: Sequence[Prompt], *, record: Sequence[str] | None = None,
                   interventions: Sequence[Any] = (), per_prompt_interventions: Sequence[Sequence[Any]] | None = None,
                   batch_size: int | None = None, chat: bool = False, reduce: str | int | None = None,
                   record_device: str | torch.device = "cpu", record_dtype: torch.dtype = torch.float32,
                   logits: str | None = "all", share_prefix: bool = True, progress: Progress = False,
                   saes: Sequence[Any] = (), use_error_term: bool = True, adapter: BatchAdapterChoice = None,
                   own_buffers: bool = True) -> Iterator[tuple[int, hooks_lib.Trace]]:
        """``(prompt index, Trace)`` as each batched forward finishes (prompts of similar length run together, so not
        in the prompts' order): for more prompts than their traces fit in memory. Everything is validated when this
        is called, before any compute.

        ``interventions`` apply to every prompt, ``per_prompt_interventions[i]`` to prompt i alone; positions are each
        prompt's own. ``batch_size`` prompts go through one forward (None: as many as fit ``batch_bytes``). Recorded
        activations are kept on ``record_device`` in ``record_dtype``; ``reduce`` keeps one row per prompt as they are
        recorded (``"last"``, ``"mean"`` or a position). ``logits="last"`` keeps each prompt's last row alone
        (``[1, vocab]``); ``logits=None`` keeps none, and the forwards stop after the deepest block a recorded point
        lies in (TransformerLens' ``stop_at_layer``): the blocks after it, the final norm and the unembedding do not
        run, nor do hooks there (all of them do for a point after the last block). ``progress``: True for a progress
        bar, or ``fn(done, total)``. ``saes`` and ``use_error_term`` as in ``run``, for every prompt; ``adapter`` as in
        ``run`` for every prompt, or a list of one choice per prompt (prompts of different choices share forwards:
        docs/adapters.md). ``own_buffers``: each trace's activations are copied out of their forward's buffers, so a
        kept trace holds no other prompt's (False: views, no copy, as ``run_batch`` takes them).

        With ``share_prefix``, a prompt repeated with nothing of its own (no interventions, the same adapter) runs
        once, and in each forward the leading tokens that groups of prompts share (a few-shot template, a system
        prompt, a contrastive pair's common start: ``kv_cache.prefix_groups``) are computed once for a forward with
        no interventions: their keys and values seed each prompt's cache row, and their logits and recorded
        activations are each prompt's own (docs/batches.md).
        """
        check_logits(logits)
        ids = self.batch_ids(prompts, chat)
        lengths = [len(x) for x in ids]
        choices = self.batch_adapters(adapter, len(ids))
        lora, adapters = [self.lora_terms(c) for c in choices], [self.adapter_record(c) for c in choices]
        record_dtype = check_record_dtype(record_dtype)
        try:
            record_device = check_device(record_device)
        except WorkbenchError as err:
            raise WorkbenchError(f"record_device: {err}") from None
        points = hooks_lib.Recorder.for_patterns(record, self.config)
        names = points.names if points else []
        hooks_lib.batching.check_reduce(reduce, names, lengths)  # with nothing recorded too: a typo is no no-op
        stop = self._stop_after_recorded(names) if logits is None else None
        recorder = hooks_lib.BatchRecorder(names, record_device, record_dtype, reduce, own_buffers) if names else None
        with self.numerics_scope():  # donor prompts run in the call's numerics
            prompt_hooks, specs, attached = self._batch_hooks(interventions, per_prompt_interventions, lengths,
                                                              lengths, saes)
        hooks_lib.check_sae_points([n for h in prompt_hooks for n in h] + (recorder.names if recorder else []),
                                   attached)
        repeats = repeated_prompts(ids, prompt_hooks, lora) if share_prefix else {}
        layouts = self._batches(lengths, batch_size, progress, vocab_rows=logits == "all", repeats=repeats)
        return self._run_batches(prompts, ids, layouts, prompt_hooks, specs, recorder, logits, stop, chat,
                                 share_prefix, self.current_numerics(), attached, _check_flag(use_error_term), lora,
                                 adapters, repeats)

    def _run_batches(self, prompts, ids, layouts, prompt_hooks, specs, recorder, logits, stop, chat, share_prefix,
                     mode, saes, use_error_term, lora, adapters, repeats) -> Iterator[tuple[int, hooks_lib.Trace]]:
        # each forward enters the numerics taken at the call: a block around a ``yield`` would leak into the reader's code
        with numerics(mode):
            fingerprint, backend, versions = self.fingerprint(), self.backend(), package_versions()

        reduce = recorder.reduce if recorder else None

        def trace(i: int, row_logits: torch.Tensor | None, activations: dict[str, torch.Tensor],
                  batch: dict | None) -> hooks_lib.Trace:
            return hooks_lib.Trace(
                prompt=recorded_prompt(prompts[i], ids[i]), ids=ids[i], tokens=self.token_texts(ids[i]),
                logits=None if row_logits is None else row_logits.clone(), activations=activations,
                interventions=specs[i], fingerprint=fingerprint, backend=backend, versions=versions,
                chat=chat or is_messages(prompts[i]), adapters=adapters[i], reduce=reduce, batch=batch)

        for layout in layouts:
            rows = [ids[i] for i in layout.prompts]
            # what a replay recomputes this forward from, where the rows ran with one adapter choice and no function
            # hook (which no spec rebuilds); its own lists, so that editing a trace's ids leaves it as it ran
            first, forward = layout.prompts[0], None
            if (all(adapters[i] == adapters[first] for i in layout.prompts)
                    and not any(hooks_lib.has_function_hook(specs[i]) for i in layout.prompts)):
                same_specs = all(specs[i] == specs[first] for i in layout.prompts)
                forward = {"rows": [list(r) for r in rows], "logits": logits, "share_prefix": share_prefix,
                           "interventions": None if same_specs else [specs[i] for i in layout.prompts]}
            edits = self._layout_hooks(prompt_hooks, layout)
            hooks = self._forward_hooks(edits, saes, use_error_term, recorder and recorder.hooks())
            # a prefix that prompts share is computed once where their edits are those every prompt makes at every
            # token (runner.capturable: the prefix's tokens take them too) and the recorder keeps whole runs or last rows
            layout_lora = layout_adapters(lora, layout.prompts)
            groups = prefix_groups(rows) if share_prefix and capturable(edits) and not isinstance(
                layout_lora, LoraRows) and (recorder is None or recorder.reduce in (None, "last")) else []
            with torch.inference_mode(not hooks), numerics(mode):
                out = self._forward_rows(rows, layout, hooks or None, logits != "all", groups, layout_lora, stop)
            out = None if logits is None else out  # a recorded point after the last block ran the whole forward
            if out is not None and out.is_cuda:  # each row is cloned out of it below
                out = hooks_lib.batching.pinned_copy(out)
            prefixes = [recorder.take(-1 - g) for g in range(len(groups))] if recorder else []
            prefix_of = {b: prefixes[g] for g, group in enumerate(groups) for b in group.rows} if prefixes else {}
            per_row = ([None] * len(rows) if out is None
                       else out.split(1 if logits == "last" else [len(r) for r in rows]))
            for b, (i, row_logits) in enumerate(zip(layout.prompts, per_row)):
                activations = recorder.take(i) if recorder else {}
                if b in prefix_of and recorder.reduce is None:
                    activations = {name: hooks_lib.join_tokens(name, [prefix_of[b][name], tail])
                                   for name, tail in activations.items()}
                batch = None if forward is None else {**forward, "row": b}
                yield i, trace(i, row_logits, activations, batch)
                for j in repeats.get(i, ()):  # views of the same activations, or copies of its own for iter_batch
                    yield j, trace(j, row_logits, {name: x.clone() if recorder.own_buffers else x
                                                   for name, x in activations.items()} if recorder else {}, batch)

    def _forward_rows(self, rows: list[list[int]], layout: BatchLayout, hooks: dict | None, last_only: bool,
                      groups: Sequence[PrefixGroup] = (), lora: Lora | LoraRows | None = None,
                      stop: int | None = None) -> torch.Tensor | None:
        """Logits of the rows of one planned forward, packed (each row's last alone with ``last_only``); with
        ``stop`` (``runner.forward``'s ``stop_at_layer``), None: the forward stops before that block, for hooks that
        took what they need on the way. Each group's shared prefix is computed once first; a prompt longer than a
        forward takes runs in chunks through a cache, as a long prefill does."""
        longest = max(map(len, rows))
        if groups:
            cache, heads = self.runner.prefill_prefixes(rows, groups, longest, hooks, last_only, lora, stop)
            shared = list(cache.lengths)
            tails = BatchLayout([len(r) - n for r, n in zip(rows, shared)], self.device, layout.prompts, cached=shared)
            out = self.runner.forward(torch.tensor([t for r, n in zip(rows, shared) for t in r[n:]]), cache=cache,
                                      hooks=hooks, layout=tails, last_logits_only=last_only, lora=lora,
                                      stop_at_layer=stop)
            if stop is not None:
                return None
            if last_only:
                return out
            # each grouped row's prefix logits before its own
            heads = heads.split([group.length for group in groups])
            head = {b: heads[g] for g, group in enumerate(groups) for b in group.rows}
            return torch.cat([x for b, tail in enumerate(out.split(tails.lengths))
                              for x in ((head[b], tail) if b in head else (tail,))])
        chunk = self.max_batch_tokens()
        if len(rows) > 1 or longest <= chunk:
            out = self.runner.forward(torch.tensor([t for r in rows for t in r]), hooks=hooks, layout=layout,
                                      last_logits_only=last_only, lora=lora, stop_at_layer=stop)
            return None if stop is not None else out
        cache, pieces = self.runner.new_batch_cache(1, longest), []
        for start in range(0, longest, chunk):
            piece = rows[0][start:start + chunk]
            part = BatchLayout([len(piece)], self.device, layout.prompts, cached=cache.lengths,
                               complete=start + chunk >= longest)
            pieces.append(self.runner.forward(torch.tensor(piece), cache=cache, hooks=hooks, layout=part,
                                              last_logits_only=last_only, lora=lora, stop_at_layer=stop))
        if stop is not None:
            return None
        return pieces[-1] if last_only else torch.cat(pieces)

    def forward_batch(self, prompts: Sequence[Prompt], *, interventions: Sequence[Any] = (),
                      per_prompt_interventions: Sequence[Sequence[Any]] | None = None, batch_size: int | None = None,
                      last_only: bool = False, adapter: BatchAdapterChoice = None) -> list[torch.Tensor]:
        """``forward`` over many prompts in batched forwards: float32 logits per prompt, ``[len(ids), vocab_size]``
        (``[1, vocab_size]``, the last position, with ``last_only``)."""
        traces = self.run_batch(prompts, interventions=interventions, per_prompt_interventions=per_prompt_interventions,
                                batch_size=batch_size, logits="last" if last_only else "all", adapter=adapter)
        return [t.logits for t in traces]

    def run_with_batch_hooks(self, prompts: Sequence[Prompt],
                             hooks: Mapping[str, hooks_lib.HookFn | Sequence[hooks_lib.HookFn]], *, chat: bool = False,
                             batch_size: int | None = None, progress: Progress = False,
                             logits: bool = True) -> torch.Tensor | None:
        """Batched forwards whose hooks see each forward whole, for code that reduces many prompts at once (the logit
        lens of a dataset): ``hooks`` maps hook names (or globs) to ``fn(activation, ctx)``. A token-major point's
        activation holds every prompt of the forward, their tokens one after another (``[N, ...]``); attention
        scores and patterns are ``[B, heads, T_max, S]``, padded past each row's length. ``ctx.layout`` says whose rows
        are which: sequence ``b`` is prompt ``layout.prompts[b]`` and has rows ``layout.rows(b)``; a prompt longer
        than a forward runs alone in chunks, ``layout.cached[0]`` tokens in. A hook may return an edited activation
        of the same shape. (``run_batch`` calls each prompt's hooks on its own slice instead, as ``run`` would; the
        hooks of enclosing ``hooks()`` blocks apply to each prompt that way here too, before these.) Returns each
        prompt's last-position logits, float32 ``[len(prompts), vocab_size]``, on the CPU; with ``logits=False``,
        None: the forwards stop after the last block (no final norm, unembedding or copy to the host, and no hook on
        the final norm or the logits), for hooks that take what they need on the way (the logit lens)."""
        ids = self.batch_ids(prompts, chat)
        if not isinstance(hooks, Mapping):
            raise WorkbenchError(f"hooks must map hook names to functions, got {type(hooks).__name__}")
        batch_hooks: dict[str, list[hooks_lib.HookFn]] = {}
        for pattern, fns in hooks.items():
            fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
            if not fns or not all(callable(fn) for fn in fns):
                raise WorkbenchError(f"hooks[{shorten(pattern)}] must be a function or a list of functions")
            for name in hooks_lib.resolve(pattern, self.config):
                if not logits and name in FINAL_POINTS:
                    raise WorkbenchError(f"hooks[{shorten(pattern)}]: {name} lies after the last block, where a run "
                                         "with logits=False stops")
                batch_hooks.setdefault(name, []).extend(fns)
        lengths = [len(x) for x in ids]
        with self.numerics_scope():
            prompt_hooks, _, attached = self._batch_hooks((), None, lengths, lengths)  # enclosing hooks() blocks'
        last = torch.empty(len(ids), self.config.vocab_size) if logits else None
        with numerics(self.current_numerics()), torch.no_grad():
            for layout in self._batches(lengths, batch_size, progress, vocab_rows=False):
                forward_hooks = self._forward_hooks(self._layout_hooks(prompt_hooks, layout), attached, True,
                                                    batch_hooks)
                out = self._forward_rows([ids[i] for i in layout.prompts], layout, forward_hooks or None, True,
                                         stop=None if logits else self.config.n_layers)
                if logits:
                    last[list(layout.prompts)] = out.float().cpu()
        return last

    def stream_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 32, *,
                     temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                     chat: bool = False, interventions: Sequence[Any] = (),
                     per_prompt_interventions: Sequence[Sequence[Any]] | None = None,
                     batch_size: int | None = None, saes: Sequence[Any] = (), use_error_term: bool = True,
                     adapter: BatchAdapterChoice = None) -> Iterator[tuple[int, int, str]]:
        """Yield ``(prompt index, token_id, new_text)`` as each prompt's tokens are generated, in batched decode steps;
        each prompt stops on its own (an end-of-turn or end-of-text token, or ``max_new_tokens``). Each prompt samples
        from its own generator seeded with ``seed``, so it generates what ``model.stream(prompt, seed=seed)`` does.
        ``adapter`` as in ``iter_batch``: one choice for all, or one per prompt. On CUDA, greedy decoding with no
        interventions or only shared whole-token edits replays one captured decode step per token
        (``generate_batch_tokens``, docs/batches.md "Decoding on CUDA")."""
        sampling = Sampling(temperature, top_k, top_p, seed)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        ids = self.batch_ids(prompts, chat)
        lora = [self.lora_terms(c) for c in self.batch_adapters(adapter, len(ids))]
        lengths = [len(x) for x in ids]
        for i, n in enumerate(lengths):
            if n + max_new_tokens > self.config.n_ctx:
                raise WorkbenchError(f"prompt {i}: {n} tokens + {max_new_tokens} new tokens exceed the context of "
                                     f"{self.config.n_ctx}")
        with self.numerics_scope():
            prompt_hooks, _, attached = self._batch_hooks(interventions, per_prompt_interventions, lengths,
                                                          [n + max_new_tokens for n in lengths], saes)
        hooks_lib.check_sae_points([n for h in prompt_hooks for n in h], attached)
        layouts = self._batches([n + max_new_tokens for n in lengths], batch_size, False, vocab_rows=False)
        return self._batch_stream(ids, max_new_tokens, sampling, prompt_hooks, layouts, self.current_numerics(),
                                  attached, _check_flag(use_error_term), lora)

    def _batch_stream(self, ids: list[list[int]], max_new_tokens: int, sampling: Sampling,
                      prompt_hooks: list[dict], layouts: Iterator[BatchLayout], mode: Numerics, saes: list[Any],
                      use_error_term: bool, lora: list[Lora | None]) -> Iterator[tuple[int, int, str]]:
        decoders = [StreamDecoder(self.tokenizer) for _ in ids]
        generated = [0] * len(ids)
        for layout in layouts:
            hooks = self._forward_hooks(self._layout_hooks(prompt_hooks, layout), saes, use_error_term)
            rows = {i: ids[i] for i in layout.prompts}
            for i, token in generate_batch_tokens(self.runner, rows, max_new_tokens, sampling, self.tokenizer.stop_ids,
                                                  hooks or None, mode, layout_adapters(lora, layout.prompts)):
                generated[i] += 1
                yield i, token, self._generated_text(decoders[i], token, last=generated[i] == max_new_tokens)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int = 32,
                       **kwargs: Any) -> list[str]:
        """Each prompt's generated continuation as text (see ``stream_batch``), in the prompts' order."""
        texts = [""] * len(prompts) if isinstance(prompts, Sequence) else []
        for i, _, text in self.stream_batch(prompts, max_new_tokens, **kwargs):
            texts[i] += text
        return texts

    def new_batch_cache(self, n_rows: int) -> BatchKVCache:
        return self.runner.new_batch_cache(n_rows)

    def batch_ids(self, prompts: Sequence[Prompt], chat: bool = False) -> list[list[int]]:
        """Token ids of every prompt of a batch, checked before any compute (errors name the prompt)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
            raise WorkbenchError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        if prompts and all(isinstance(prompt, Mapping) for prompt in prompts):
            raise WorkbenchError("prompts is one conversation (a list of messages); a batch is a list of prompts: "
                                 "wrap it in a list")
        if not prompts:
            raise WorkbenchError("the list of prompts is empty")
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.to_ids(prompt, chat=chat))
            except (WorkbenchError, TypeError, ValueError) as err:
                raise WorkbenchError(f"prompt {i}: {err}") from None
        return ids

    @staticmethod
    def _layout_hooks(prompt_hooks: list[dict], layout: BatchLayout) -> dict[str, list[hooks_lib.HookFn]]:
        """The hooks of one batched forward's prompts, each prompt's own on that prompt's slice."""
        return hooks_lib.per_prompt_hooks({i: prompt_hooks[i] for i in layout.prompts})

    @staticmethod
    def _forward_hooks(per_prompt: dict[str, list[hooks_lib.HookFn]], saes: list[Any], use_error_term: bool,
                       whole: Mapping[str, list[hooks_lib.HookFn]] | None = None) -> dict[str, list[hooks_lib.HookFn]]:
        """One batched forward's hooks: its prompts' own (``_layout_hooks``), then ``whole``'s (a recorder's, or hooks
        that see the forward whole), with the SAEs attached at their points."""
        return hooks_lib.attach_saes(hooks_lib.merge_hooks([per_prompt, whole or {}]), saes, use_error_term)

    def _batch_hooks(self, interventions: Sequence[Any], per_prompt: Sequence[Sequence[Any]] | None,
                     prompt_lens: list[int], total_lens: list[int], saes: Sequence[Any] = ()
                     ) -> tuple[list[dict], list[list[dict]], list[Any]]:
        """Each prompt's hooks and intervention specs: the enclosing ``hooks()`` blocks', ``interventions`` and its own
        ``per_prompt`` ones, all validated before any compute; and the SAEs the batch attaches."""
        if per_prompt is not None and (not isinstance(per_prompt, (list, tuple))
                                       or len(per_prompt) != len(prompt_lens)):
            raise WorkbenchError(f"per_prompt_interventions needs one list per prompt ({len(prompt_lens)}), got "
                                 f"{shorten(per_prompt)}")
        scoped = [(parsed, recorder) for model, parsed, recorder in _ACTIVE.get() if model is self]
        shared = [i for parsed, _ in scoped for i in parsed] + hooks_lib.intervention_list(interventions)
        own = []
        for i, items in enumerate(per_prompt if per_prompt is not None else [()] * len(prompt_lens)):
            try:
                own.append(hooks_lib.intervention_list(items, "its per_prompt_interventions"))
            except WorkbenchError as err:
                raise type(err)(f"prompt {i}: {err}") from None
        attached = self._call_saes(saes, [shared, *own])
        compiled = hooks_lib.compile_prompt_hooks(self, [shared + x for x in own], prompt_lens, total_lens)
        outer = [r.hooks() for _, r in scoped if r is not None]
        return ([hooks_lib.merge_hooks([hooks, *outer]) for hooks, _ in compiled], [specs for _, specs in compiled],
                attached)

    def _batches(self, lengths: list[int], batch_size: int | None, progress: Progress,
                 vocab_rows: bool, backward: bool = False, repeats: Mapping[int, Sequence[int]] | None = None
                 ) -> Iterator[BatchLayout]:
        """Layouts of the forwards a batch runs in: prompts of similar length together (longest first), each forward
        within ``batch_size`` prompts or, with None, within ``batch_bytes`` of working memory (every layer's, for a
        ``backward``); the later copies in ``repeats`` (``repeated_prompts``) in none, counted done with their first.
        ``batch_size`` and ``progress`` are checked when this is called, the layouts planned as they are read."""
        check_batch_size(batch_size)
        return self._plan_batches(lengths, batch_size, check_progress(progress), vocab_rows, backward, repeats or {})

    def _plan_batches(self, lengths: list[int], batch_size: int | None, progress: Progress,
                      vocab_rows: bool, backward: bool, repeats: Mapping[int, Sequence[int]]
                      ) -> Iterator[BatchLayout]:
        copies = {j for later in repeats.values() for j in later}
        order = sorted((i for i in range(len(lengths)) if i not in copies), key=lambda i: -lengths[i])
        per_token, per_score, budget = self.batch_bytes(vocab_rows, backward)
        update, close = progress_callback(progress, len(lengths), "prompts")
        done, chunk = 0, []
        try:
            for i in order + [None]:
                if i is not None and chunk and batch_size:
                    fits = len(chunk) < batch_size
                elif i is not None and chunk:  # padded tokens, and attention's [B, heads, T_max, T_max] rows
                    tokens = (len(chunk) + 1) * lengths[chunk[0]]
                    fits = tokens <= self.max_batch_tokens() and (
                        tokens * (per_token + per_score * lengths[chunk[0]]) <= budget)
                else:
                    fits = i is not None
                if fits:
                    chunk.append(i)
                    continue
                yield BatchLayout([lengths[j] for j in chunk], self.device, prompts=chunk)
                done += sum(1 + len(repeats.get(j, ())) for j in chunk)
                update(done)
                chunk = [i]
        finally:
            close()

    def max_batch_tokens(self) -> int:
        """The most padded tokens one batched forward takes, whatever the memory budget: the attention rows of a batch
        holding one long prompt grow with its length squared."""
        return 8192 if self.device.type == "cuda" else 2048

    def batch_bytes(self, vocab_rows: bool = True, backward: bool = False) -> tuple[int, int, int]:
        """What a batched forward is sized by when no ``batch_size`` is given: bytes of working memory per token
        (activations, and float32 logits with ``vocab_rows``), per token per attended slot (attention's scores and
        pattern), and the budget: a quarter of the device's free memory. A ``backward`` keeps every layer's."""
        c = self.config
        element = torch.finfo(self.dtype).bits // 8
        layers = c.n_layers if backward else 1
        per_token = layers * element * (6 * c.d_model + 3 * c.d_mlp + 2 * c.n_heads * c.d_head)
        per_token += 8 * c.vocab_size if vocab_rows else 0
        per_score = layers * 12 * c.n_heads
        free = min(free_memory(d) for d in set(self.runner.devices))
        return per_token, per_score, free // 4

    def new_cache(self) -> KVCache:
        return self.runner.new_cache()

    def stream(self, prompt: Prompt, max_new_tokens: int = 32, *, temperature: float = 0.0,
               top_k: int = 0, top_p: float = 1.0, seed: int | None = None, chat: bool = False,
               interventions: Sequence[Any] = (), cache: KVCache | None = None,
               compiled: bool | str | None = None, saes: Sequence[Any] = (), use_error_term: bool = True,
               adapter: AdapterChoice = None) -> Iterator[tuple[int, str]]:
        """Yield ``(token_id, new_text)`` as tokens are generated; interventions act at every step.

        ``compiled`` builds the decode step with ``torch.compile``: True waits for the build, ``"background"`` decodes
        eagerly (on CUDA, replaying a graph of the eager forward) until it is ready (default: ``"background"`` on
        CUDA, False on the CPU, where it pays for long or
        repeated generations, as a build takes seconds even from torch's on-disk cache); see
        :func:`workbench.generation.generate_tokens`. Runs with interventions or a ``cache`` decode eagerly; a
        ``cache`` (of this model, checked here) ends holding the prompt and every token generated, so continuing it
        equals a fresh run on the whole text.
        Everything is validated, and the hooks of enclosing ``hooks()`` blocks and the numerics
        (``current_numerics()``) taken, when this is called, not when iteration starts. ``adapter`` as in ``run``.
        """
        sampling = Sampling(temperature, top_k, top_p, seed)
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        ids = self.to_ids(prompt, chat=chat)
        lora = self.lora_terms(adapter)
        if cache is not None:
            self.runner.check_cache(cache)
        start = cache.next_position if cache is not None else 0
        with self.numerics_scope():
            hooks, _, _ = self._call_hooks(interventions, None, start + len(ids), start + len(ids) + max_new_tokens,
                                           saes, use_error_term)
            tokens = generate_tokens(self.runner, ids, max_new_tokens, sampling, self.tokenizer.stop_ids, hooks,
                                     cache, compiled, lora)
        return self._with_text(tokens, max_new_tokens)

    def _with_text(self, tokens: Iterator[int], max_new_tokens: int) -> Iterator[tuple[int, str]]:
        decoder = StreamDecoder(self.tokenizer)
        for n, token in enumerate(tokens, 1):
            yield token, self._generated_text(decoder, token, last=n == max_new_tokens)

    def _generated_text(self, decoder: StreamDecoder, token: int, last: bool) -> str:
        """A generated token's new text: none for a stop token. The generation's last token (a stop or the
        max_new_tokens-th) also brings out a character left unfinished, as U+FFFD, instead of dropping it."""
        if token in self.tokenizer.stop_ids:
            return decoder.flush()
        text = decoder.feed(token)
        return text + decoder.flush() if last else text

    def generate(self, prompt: Prompt, max_new_tokens: int = 32, **kwargs: Any) -> str:
        """The generated continuation as text (stops at an end-of-turn or end-of-text token)."""
        return "".join(text for _, text in self.stream(prompt, max_new_tokens, **kwargs))

    # ------------------------------------------------------------------------------------------ info

    @cached_property
    def file_sha256(self) -> str:
        """sha256 of the model file (or of the checkpoint's safetensors files, in order), for trace fingerprints;
        noted per machine (``loading.files_sha256``).

        A model built in memory (workbench.synthetic) has no file: the sha256 of its packed tensors' own sha256s (as a
        trace's manifest records them), in order, stands in, taken by several threads at once (hashlib lets go of the
        GIL), so that a model of hundreds of GB is hashed in seconds.
        """
        files = checkpoint_files(self.path)
        if files:
            return files_sha256(files)
        weights = self.runner.weights
        tensors = [w.data for _, w in weights.named_matrices()] + [weights.final_norm] + [
            v for layer in weights.layers for v in vars(layer).values() if isinstance(v, torch.Tensor)]
        with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
            return hashlib.sha256("".join(pool.map(tensor_sha256, tensors)).encode()).hexdigest()

    def fingerprint(self) -> dict[str, Any]:
        merged = {"merged_adapters": [dict(entry) for entry in self.merged]} if self.merged else {}
        return {"sha256": self.file_sha256, "file": self.path.name, "path": str(self.path),
                "architecture": self.config.architecture, "config": self.config.to_dict(),
                "formats": self.tensor_formats(), **merged}

    def backend(self) -> dict[str, Any]:
        kernels = sorted(set(self.kernel_report(1).values()) | set(self.kernel_report(128).values()))
        return {"device": str(self.device), **self._split_info(), "dtype": str(self.dtype).removeprefix("torch."), "kernels": kernels,
                "numerics": self.current_numerics(), "threads": torch.get_num_threads(),
                "machine": platform.machine()}

    def tensor_formats(self) -> dict[str, str]:
        return dict(self._tensor_formats)

    @cached_property
    def _tensor_formats(self) -> dict[str, str]:
        # fixed once loaded; read by every fingerprint check (a patching sweep checks its donor once per cell)
        return {name: w.fmt.name for name, w in self.runner.weights.named_matrices()}

    def kernel_report(self, n_tokens: int = 1) -> dict[str, str]:
        """Which kernel serves each matrix for a forward of ``n_tokens`` tokens on this device, in
        ``current_numerics()``."""
        mode = self.current_numerics()
        probe = torch.empty(n_tokens, 1, dtype=self.dtype, device=self.device)
        chosen: dict[tuple, str] = {}  # selection depends on format, shape and alignment: ask once per kind
        report = {}
        for name, w in self.runner.weights.named_matrices(served=True):
            key = (w.fmt.name, w.shape, w.data.data_ptr() % 16)
            if key not in chosen:
                chosen[key] = select_kernel(probe.expand(n_tokens, w.shape[1]), w, mode).name
            report[name] = chosen[key]
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
            "family": self.config.family(weights),
            "parameters": self.config.n_params,
            "device": str(self.device),
            **self._split_info(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "tensor_formats": formats,
            "merged_adapters": [dict(entry) for entry in self.merged],
            "weight_bytes": weights.nbytes,
            "file_bytes": file_bytes,
            "load_seconds": self.load_seconds,
            "kernels": {
                name: {"decode": kernels_decode[name], "prefill": kernels_prefill[name], "format": fmt}
                for name, fmt in self.tensor_formats().items()
            },
            "layer_ops": layer_ops.implementations(self.device, self.dtype),
            "numerics": self.current_numerics(),
        }

    def _split_info(self) -> dict[str, Any]:
        """The layer ranges of a model split over devices (nothing for one device)."""
        if not self.runner.is_split:
            return {}
        return {"devices": [{"device": d, "layers": [r.start, r.stop - 1]} for d, r in self.devices]}

    def __repr__(self) -> str:
        c = self.config
        return (f"Model({c.name!r}, arch={c.architecture}, layers={c.n_layers}, d_model={c.d_model}, "
                f"device={self.device}, dtype={str(self.dtype).removeprefix('torch.')})")


def load(path: str | Path | None = None, *, device: str | None = None, dtype: str | torch.dtype | None = None,
         quantize: str | None = None, numerics: Numerics | None = None, devices: Sequence[str] | None = None,
         split: Sequence[int] | None = None,
         adapters: Mapping[str, str | Path] | None = None, merge: bool = False) -> Model:
    """Load a GGUF file or a Hugging Face checkpoint directory; the embedded SmolLM2-135M when no path is given.

    ``quantize`` quantizes a float checkpoint's matrices on load: all into one format ("Q4_K", "Q8_0", ...), or each
    into the format llama.cpp's quantizer gives it in a mix ("Q4_K_M", "Q3_K_L", ...;
    ``workbench.quant_mix``). ``numerics`` is what the model's quantized matmuls compute where no
    ``workbench.kernels.numerics(...)`` block says otherwise (``Model.numerics``; None: the process default).

    ``devices`` splits the layers over several devices in contiguous ranges (``["cuda:0", "cuda:1"]``; the embedding
    on the first, the unembedding on the last), ``split`` layers each (default: in proportion to each device's free
    memory; ``workbench.devices.split_layers``). Everything else works as on one device (docs/scaling.md).
    ``adapters``: ``{name: path}`` of LoRA adapters to keep resident (``Model.load_adapter``), or with ``merge`` to
    fold into the weights, re-quantized into each matrix's format (``Model.merge_adapter``)."""
    if numerics is not None:
        check_numerics(numerics)
    if adapters is not None and not isinstance(adapters, Mapping):
        raise WorkbenchError(f"adapters must be a {{name: path}} mapping, got {type(adapters).__name__}")
    started = time.perf_counter()
    checkpoint = load_checkpoint(path, quantize)
    model = Model(checkpoint, device, dtype, load_seconds=time.perf_counter() - started, numerics=numerics,
                  devices=devices, split=split)
    if not isinstance(merge, bool):
        raise WorkbenchError(f"merge must be True or False, got {merge!r}")
    for name, adapter_path in (adapters or {}).items():
        model.load_adapter(adapter_path, name=name)
        if merge:
            model.merge_adapter(name)
    return model


def _check_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise WorkbenchError(f"use_error_term must be True or False, got {value!r}")
    return value


def package_versions() -> dict[str, str]:
    """Versions of the packages a trace's numbers depend on (read once per process: each look-up scans the installed
    distributions)."""
    return dict(_package_versions())


@functools.lru_cache(maxsize=1)
def _package_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {"python": platform.python_version()}
    for name in ("workbench", "torch", "gguf", "tokenizers", "numpy"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions
