"""Layer-by-layer parity with llama.cpp: its named intermediate tensors beside our hook points.

llama.cpp names the tensors of its graph as it builds them (``cb(cur, "attn_norm", il)`` in
``src/models/llama.cpp``, ``qwen2.cpp``, ``qwen3.cpp`` and ``src/llama-graph.cpp``); its evaluation callback
(``cb_eval`` in the context parameters) sees each one, ``"<name>-<layer>"``, after it is computed. ``capture_llamacpp``
runs a prompt through llama-cpp-python's low-level API with that callback; ``compare`` lines each tensor up with the
hook point it equals (``LLAMACPP_POINTS``) and reports, point by point in the forward's order, the largest absolute and
relative difference, the KL divergence of the logits, and the first point where the two part. ``control_vector_point``
settles where a control vector's ``direction.N`` acts, from the tensors it changes.

llama.cpp's norms come out multiplied by their weight; our ``ln*.hook_normalized`` is before the weight, so the
weight is applied to ours before comparing. Both engines lay a token's values out alike (ggml's ``ne = [d_head,
heads, T]`` is our ``[T, heads, d_head]``).
"""
from __future__ import annotations

import ctypes
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from workbench.errors import WorkbenchError
from workbench.runner import gguf_head_order

INSTALL_HINT = "pip install 'workbench[reference]'  (llama-cpp-python, built from source; see docs/faithfulness.md)"

# A point parts from llama.cpp where its largest difference exceeds this share of llama.cpp's largest value there.
DEFAULT_TOLERANCE = 0.05


LAST = -1  # an occurrence: the last tensor of that name in its layer


@dataclass(frozen=True)
class PointMap:
    """A llama.cpp tensor (``name`` without its layer suffix; ``occurrence`` counts same-named tensors of one layer
    from 0, or is ``LAST``) and the hook point (``{i}`` for the layer) whose value it is; ``weight`` names the norm weight to apply to
    the recorded value first (``attn_norm``, ``mlp_norm`` or ``final_norm``)."""

    ggml: str
    point: str
    occurrence: int = 0
    weight: str | None = None


# In the order llama.cpp computes them; a name its graph gives several tensors of a layer is told apart by
# occurrence. "ffn_out" is the MLP's output; with a control vector, a second "ffn_out" is the residual sum before the
# vector is added ("l_out" after it, our resid_post). Qwen3's "Qcur_normed" (the
# normed queries before the rope) has no hook point; nor has the pattern, which llama.cpp's default flash attention
# never forms.
LLAMACPP_POINTS: tuple[PointMap, ...] = (
    PointMap("inp_embd", "hook_embed"),
    PointMap("attn_norm", "blocks.{i}.ln1.hook_normalized", weight="attn_norm"),
    # the last "Qcur" of a layer is the rotated queries (before it: the projection, with its bias added, viewed as
    # heads, each named "Qcur" too); likewise "Kcur", and "Vcur" without the rope
    PointMap("Qcur", "blocks.{i}.attn.hook_rot_q", occurrence=LAST),
    PointMap("Kcur", "blocks.{i}.attn.hook_rot_k", occurrence=LAST),
    PointMap("Vcur", "blocks.{i}.attn.hook_v", occurrence=LAST),
    PointMap("kqv_out", "blocks.{i}.attn.hook_z"),
    PointMap("attn_out", "blocks.{i}.hook_attn_out"),
    PointMap("ffn_inp", "blocks.{i}.hook_resid_mid"),
    PointMap("ffn_norm", "blocks.{i}.ln2.hook_normalized", weight="mlp_norm"),
    PointMap("ffn_gate", "blocks.{i}.mlp.hook_pre"),
    PointMap("ffn_up", "blocks.{i}.mlp.hook_pre_linear"),
    PointMap("ffn_swiglu", "blocks.{i}.mlp.hook_post"),
    PointMap("ffn_out", "blocks.{i}.hook_mlp_out"),
    PointMap("l_out", "blocks.{i}.hook_resid_post"),
    PointMap("result_norm", "ln_final.hook_normalized", weight="final_norm"),
    PointMap("result_output", "hook_logits"),
)
_BY_NAME = {(p.ggml, p.occurrence): p for p in LLAMACPP_POINTS}


def split_name(ggml_name: str) -> tuple[str, int | None]:
    """``"attn_norm-3"`` -> ``("attn_norm", 3)``; ``"result_norm"`` -> ``("result_norm", None)``."""
    base, _, layer = ggml_name.rpartition("-")
    return (base, int(layer)) if base and layer.isdigit() else (ggml_name, None)


def hook_point(ggml_name: str, occurrence: int = 0, last: bool = True) -> PointMap | None:
    """The mapping of a captured tensor's name (the ``occurrence``-th of that name in its layer, ``last`` if no later
    one was captured), with the layer filled in (None: a tensor with no hook point)."""
    base, layer = split_name(ggml_name)
    found = _BY_NAME.get((base, occurrence)) or (_BY_NAME.get((base, LAST)) if last else None)
    if found is None:
        return None
    return PointMap(ggml_name, found.point.format(i=layer), occurrence, found.weight)


def mapped_tensors(keys: Sequence[str]) -> list[tuple[str, PointMap]]:
    """Captured keys (``"Qcur-3"``, repeats as ``"Qcur-3#2"``, in the order computed) that map to hook points, with
    their mappings."""
    counts: dict[str, int] = {}
    for key in keys:
        name = key.partition("#")[0]
        counts[name] = counts.get(name, 0) + 1
    out = []
    for key in keys:
        name, _, repeat = key.partition("#")
        occurrence = int(repeat or 0)
        mapped = hook_point(name, occurrence, last=occurrence == counts[name] - 1)
        if mapped is not None:
            out.append((key, mapped))
    return out


@dataclass
class PointDiff:
    ggml: str  # llama.cpp's tensor name
    point: str  # our hook point
    layer: int | None
    max_abs: float  # largest |ours - llama.cpp|
    max_rel: float  # max_abs over llama.cpp's largest |value| there
    shape: list[int]


@dataclass
class ParityReport:
    """Point by point, in the forward's order; the logits' KL(llama.cpp || ours) per position; the first point whose
    relative difference passes ``tolerance``."""

    tokens: int
    points: list[PointDiff]
    mean_kl: float
    max_kl: float
    top1_agreement: float
    tolerance: float
    first_parting: str | None
    numerics: str = "exact"
    llamacpp: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def by_layer(self) -> dict[int | None, list[PointDiff]]:
        layers: dict[int | None, list[PointDiff]] = {}
        for p in self.points:
            layers.setdefault(p.layer, []).append(p)
        return layers


# ------------------------------------------------------------------------------------------- comparison


def kl_per_position(reference_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || ours) of the softmax of each row, in float64."""
    ref = reference_logits.double().log_softmax(-1)
    ours = logits.double().log_softmax(-1)
    return (ref.exp() * (ref - ours)).sum(-1)


def top_kl(top_ids: torch.Tensor, top_logprobs: torch.Tensor, tail_logprob: torch.Tensor,
           logits: torch.Tensor) -> torch.Tensor:
    """KL(reference || ours) per position over the reference's top tokens (``top_ids``, their ``top_logprobs``) plus
    one bucket for the rest (``tail_logprob``): what a fixture that stores only the top of each distribution allows."""
    ours = logits.double().log_softmax(-1)
    ours_top = ours.gather(-1, top_ids.long())
    ours_tail = torch.log1p(-ours_top.exp().sum(-1).clamp(max=1 - 1e-12))
    ref_top, ref_tail = top_logprobs.double(), tail_logprob.double()
    return (ref_top.exp() * (ref_top - ours_top)).sum(-1) + ref_tail.exp() * (ref_tail - ours_tail)


def compare(captured: dict[str, np.ndarray], recorded: dict[str, torch.Tensor], norm_weights: dict[str, Any],
            tolerance: float = DEFAULT_TOLERANCE) -> ParityReport:
    """Line up llama.cpp's ``captured`` tensors (name -> ``[T, ...]`` float array, names as ``capture_llamacpp`` keys
    them: ``"ffn_out-3"``, a repeat as ``"ffn_out-3#1"``) with the ``recorded`` hook points. ``norm_weights`` maps
    ``"attn_norm"``/``"mlp_norm"`` to a per-layer list of weights and ``"final_norm"`` to one weight."""
    points, kl = [], None
    for key, mapped in mapped_tensors(list(captured)):
        if mapped.point not in recorded:
            continue
        theirs, name = captured[key], mapped.ggml
        ours = recorded[mapped.point].detach().double()
        _, layer = split_name(name)
        if mapped.weight is not None:
            weight = norm_weights[mapped.weight]
            ours = ours * torch.as_tensor(weight if layer is None else weight[layer]).double().reshape(-1)
        theirs_t = torch.from_numpy(np.asarray(theirs, dtype=np.float64))
        if theirs_t.numel() != ours.numel():
            raise WorkbenchError(f"llama.cpp's {name} holds {theirs_t.numel()} values, our {mapped.point} "
                                 f"{ours.numel()} (shape {list(ours.shape)})")
        theirs_t = theirs_t.reshape(ours.shape)
        diff = (ours - theirs_t).abs().max().item()
        scale = theirs_t.abs().max().item()
        points.append(PointDiff(name, mapped.point, layer, diff, diff / scale if scale else math.inf * diff,
                                list(ours.shape)))
        if mapped.point == "hook_logits":
            kl = (theirs_t, ours)
    if kl is None:
        raise WorkbenchError("the capture holds no logits (result_output)")
    per_position = kl_per_position(*kl)
    agree = (kl[0].argmax(-1) == kl[1].argmax(-1)).double().mean().item()
    first = next((p.ggml for p in points if p.max_rel > tolerance), None)
    return ParityReport(tokens=int(kl[0].shape[0]), points=points, mean_kl=per_position.mean().item(),
                        max_kl=per_position.max().item(), top1_agreement=agree, tolerance=tolerance,
                        first_parting=first)


def record_points(model, ids: Sequence[int], captured_names: Sequence[str]) -> dict[str, torch.Tensor]:
    """Our activations at the hook points the captured tensors map to, from one run of ``ids``, laid out as llama.cpp
    lays them out."""
    wanted = list(dict.fromkeys(mapped.point for _, mapped in mapped_tensors(captured_names)))
    trace = model.run(list(ids), record=[p for p in wanted if p != "hook_logits"])
    recorded = {**trace.activations, "hook_logits": trace.logits}
    if model.config.rope_interleaved:  # q/k hooks show heads in Hugging Face's order; llama.cpp keeps the file's
        recorded = {name: gguf_head_order(x) if name.endswith(("hook_rot_q", "hook_rot_k")) else x
                    for name, x in recorded.items()}
    return recorded


def norm_weights(model) -> dict[str, Any]:
    w = model.runner.weights
    return {"attn_norm": [layer.attn_norm.cpu() for layer in w.layers],
            "mlp_norm": [layer.mlp_norm.cpu() for layer in w.layers], "final_norm": w.final_norm.cpu()}


# ---------------------------------------------------------------------------------------------- llama.cpp


def require_llama_cpp():
    """The ``llama_cpp`` module, or a WorkbenchError saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise WorkbenchError(f"workbench parity needs llama-cpp-python: {INSTALL_HINT}") from None
    return llama_cpp


class _GgmlTensor(ctypes.Structure):
    """The head of ``struct ggml_tensor`` (ggml.h) up to its name: what the callback reads."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


_GGML_F32, _GGML_F16 = 0, 1


def _ggml_library(llama_cpp) -> ctypes.CDLL:
    """The ggml beside the ``libllama`` llama-cpp-python loaded: its own, or a build's under ``LLAMA_CPP_LIB_PATH``."""
    lib = Path(os.environ.get("LLAMA_CPP_LIB_PATH") or Path(llama_cpp.__file__).parent / "lib")
    found = sorted(lib.glob("libggml-base.*")) or sorted(lib.glob("libggml.*"))
    if not found:
        raise WorkbenchError(f"no libggml-base next to llama_cpp ({lib})")
    ggml = ctypes.CDLL(str(found[0]))
    ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    ggml.ggml_backend_tensor_get.restype = None
    ggml.ggml_nbytes.argtypes = [ctypes.c_void_p]
    ggml.ggml_nbytes.restype = ctypes.c_size_t
    return ggml


def _read_tensor(ggml: ctypes.CDLL, pointer: int) -> np.ndarray | None:
    """A F32/F16 tensor's values as float32, outermost axis first (``[ne3, ne2, ne1, ne0]``, squeezed to the
    dimensions the tensor uses), read through the backend (so from a GPU buffer too)."""
    t = _GgmlTensor.from_address(pointer)
    if t.type not in (_GGML_F32, _GGML_F16):
        return None
    n_bytes = ggml.ggml_nbytes(pointer)
    raw = np.empty(n_bytes, dtype=np.uint8)
    ggml.ggml_backend_tensor_get(pointer, raw.ctypes.data, 0, n_bytes)
    dtype = np.float32 if t.type == _GGML_F32 else np.float16
    shape = tuple(int(n) for n in reversed(t.ne))
    strides = tuple(int(s) for s in reversed(t.nb))
    values = np.lib.stride_tricks.as_strided(raw.view(dtype), shape=shape, strides=strides, writeable=False)
    return np.array(values, dtype=np.float32)  # writable, its own memory


@dataclass
class LlamaCppRun:
    """What ``capture_llamacpp`` returns: tensors by name (``"l_out-3"``; a second tensor of one name in a layer as
    ``"ffn_out-3#1"``), each ``[T, ...]`` in our layout, and the context llama.cpp ran with."""

    tensors: dict[str, np.ndarray]
    settings: dict[str, Any]


# llama.cpp calls its log callback whenever it logs, for the life of the process: the callback must outlive every call
_SILENCE: list[Any] = []


def without_extra_buffer_types() -> None:
    """Make ``llama_cpp.Llama`` load models without ggml's extra CPU buffer types (its repacked / AMX weight layouts):
    with them, llama-cpp-python 0.3.36's first ``llama_decode`` crashed (SIGSEGV) on the machine these fixtures were
    made on, the embedded model too. ``Llama()`` takes no such option, so its default model parameters are changed; the
    plain CPU kernels compute the same products."""
    require_llama_cpp()
    import llama_cpp.llama_cpp as low

    default = low.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    low.llama_model_default_params = params


def load_llamacpp_model(path: str | Path, extra_buffers: bool = False) -> Any:
    """A GGUF loaded by llama.cpp's own loader (``llama_model_free`` it after use), its logging silenced.

    ``extra_buffers``: ggml's extra CPU buffer types, which repack weights for AMX or other CPU kernels; the AMX one
    crashes where the kernel refuses a process the tile registers (the development machine), and the plain CPU
    kernels compute the same products."""
    llama_cpp = require_llama_cpp()
    path = Path(path)
    if not path.is_file():
        raise WorkbenchError(f"no GGUF file at {path}")
    llama_cpp.llama_backend_init()
    if not _SILENCE:
        _SILENCE.append(llama_cpp.llama_log_callback(lambda level, text, data: None))
    llama_cpp.llama_log_set(_SILENCE[0], ctypes.c_void_p())
    model_params = llama_cpp.llama_model_default_params()
    model_params.use_extra_bufts = extra_buffers
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise WorkbenchError(f"llama.cpp cannot load {path} (it logs its reason with verbose logging; "
                             f"e.g. `python -c \"import llama_cpp; llama_cpp.Llama('{path}')\"`)")
    return model


def capture_llamacpp(path: str | Path, ids: Sequence[int], names: Callable[[str], bool] | None = None,
                     threads: int = 2, flash_attention: str = "auto", control_vector: dict[int, np.ndarray] | None = None,
                     kv_type: str = "f16", extra_buffers: bool = False) -> LlamaCppRun:
    """Run ``ids`` through llama.cpp in one batch, every position's logits out, and keep the named tensors the
    evaluation callback sees (those ``names(base_name)`` accepts; None: every one ``LLAMACPP_POINTS`` maps).

    ``control_vector`` maps a layer N (>= 1) to its ``direction.N``, applied as llama.cpp's ``--control-vector``
    does. ``flash_attention`` is llama.cpp's setting (``"auto"``, its default, ``"on"`` or ``"off"``); ``kv_type`` its
    cache type (``"f16"``, its default, or ``"f32"``)."""
    llama_cpp = require_llama_cpp()
    ggml = _ggml_library(llama_cpp)
    wanted = names or (lambda base: any(base == p.ggml for p in LLAMACPP_POINTS))
    model = load_llamacpp_model(path, extra_buffers)
    tensors: dict[str, np.ndarray] = {}
    seen: dict[str, int] = {}
    errors: list[str] = []

    def callback(pointer, ask, _data) -> bool:
        t = _GgmlTensor.from_address(pointer)
        name = t.name.decode(errors="replace")
        if not wanted(split_name(name)[0]):
            return False
        if ask:
            return True
        try:
            values = _read_tensor(ggml, pointer)
        except Exception as err:  # an exception must not cross into C
            errors.append(f"{name}: {err}")
            return True
        if values is not None:
            count = seen.get(name, 0)
            seen[name] = count + 1
            tensors[name if count == 0 else f"{name}#{count}"] = values
        return True

    c_callback = llama_cpp.ggml_backend_sched_eval_callback(callback)
    params = llama_cpp.llama_context_default_params()
    n = len(ids)
    params.n_ctx = max(64, n)
    params.n_batch = params.n_ubatch = max(32, n)
    params.n_threads = params.n_threads_batch = threads
    params.cb_eval = c_callback
    params.cb_eval_user_data = None
    params.flash_attn_type = {"auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO, "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                              "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED}[flash_attention]
    params.type_k = params.type_v = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32}[kv_type]
    ctx = llama_cpp.llama_init_from_model(model, params)
    try:
        if not ctx:
            raise WorkbenchError(f"llama.cpp could not create a context for {path}")
        n_embd = llama_cpp.llama_model_n_embd(model)
        if control_vector:
            n_layer = llama_cpp.llama_model_n_layer(model)
            if 0 in control_vector:
                raise WorkbenchError("llama.cpp keeps no control vector slot for layer 0")
            data = np.zeros((n_layer - 1, n_embd), dtype=np.float32)  # from layer 1
            for layer, direction in control_vector.items():
                data[layer - 1] = direction
            code = llama_cpp.llama_set_adapter_cvec(ctx, data.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                                    data.size, n_embd, 1, n_layer - 1)
            if code:
                raise WorkbenchError(f"llama.cpp refused the control vector (code {code})")
        batch = llama_cpp.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(token), i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, 1
            code = llama_cpp.llama_decode(ctx, batch)
        finally:
            llama_cpp.llama_batch_free(batch)
        if code:
            raise WorkbenchError(f"llama.cpp could not evaluate the prompt (llama_decode returned {code})")
        if errors:
            raise WorkbenchError(f"reading llama.cpp's tensors failed: {errors[0]}")
        n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n, n_vocab)).copy()
        tensors["result_output"] = logits
        flash = llama_cpp.llama_flash_attn_type_name(params.flash_attn_type)
    finally:
        if ctx:
            llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    settings = {"llama_cpp_python": llama_cpp.__version__, "threads": threads, "flash_attention": flash_attention,
                "flash_attention_name": flash.decode() if flash else None, "kv_type": kv_type,
                "extra_buffers": extra_buffers}
    return LlamaCppRun({k: _to_tokens_first(v) for k, v in tensors.items()}, settings)


def _to_tokens_first(values: np.ndarray) -> np.ndarray:
    """ggml's ``[ne3, ne2, ne1, ne0]`` without its unused outer axes: ``[T, heads, d_head]``, ``[T, d]``..."""
    while values.ndim > 2 and values.shape[0] == 1:
        values = values[0]
    return values


def parity(model, prompt: str | Sequence[int], tolerance: float = DEFAULT_TOLERANCE, threads: int = 2,
           flash_attention: str = "auto") -> ParityReport:
    """llama.cpp beside ``model`` on one prompt, layer by layer (in ``model.current_numerics()``)."""
    if not model.path.is_file():
        raise WorkbenchError("parity runs llama.cpp on the model's GGUF file; this model has none")
    ids = model.to_ids(prompt)
    run = capture_llamacpp(model.path, ids, threads=threads, flash_attention=flash_attention)
    with model.numerics_scope():
        recorded = record_points(model, ids, list(run.tensors))
        report = compare(run.tensors, recorded, norm_weights(model), tolerance)
        report.numerics = model.current_numerics()
    report.llamacpp = run.settings
    return report


def control_vector_point(model, prompt: str | Sequence[int], layer: int, threads: int = 2,
                         scale: float = 1.0) -> dict[str, Any]:
    """Where llama.cpp adds a control vector's ``direction.<layer>``: run the prompt with and without one (a random
    direction of norm ``scale`` at that layer alone) and find the first captured tensor it changes, and the hook
    point that tensor is, and whether the change is exactly the direction at every position."""
    if layer < 1 or layer >= model.config.n_layers:
        raise WorkbenchError(f"llama.cpp control vectors steer layers 1..{model.config.n_layers - 1}, not {layer}")
    ids = model.to_ids(prompt)
    direction = np.random.default_rng(0).standard_normal(model.config.d_model).astype(np.float32)
    direction *= scale / np.linalg.norm(direction)
    plain = capture_llamacpp(model.path, ids, threads=threads).tensors
    steered = capture_llamacpp(model.path, ids, threads=threads, control_vector={layer: direction}).tensors
    mapping = dict(mapped_tensors(list(plain)))
    for key in plain:
        if key in steered and not np.array_equal(plain[key], steered[key]):
            mapped = mapping.get(key)
            delta = steered[key] - plain[key]
            rounding = 4 * np.finfo(np.float32).eps * (np.abs(plain[key]).max() + scale)  # of the one float32 sum
            return {"layer": layer, "first_changed": key, "hook_point": mapped.point if mapped else None,
                    "delta_is_direction": bool(np.abs(delta - direction[None, :]).max() <= rounding)}
    raise WorkbenchError("the control vector changed none of llama.cpp's captured tensors")


def format_report(report: ParityReport) -> str:
    """The report as text: one line per layer (its largest relative difference, and where), then the logits."""
    lines = [f"{report.tokens} tokens, numerics {report.numerics}; llama.cpp {report.llamacpp.get('llama_cpp_python')}"
             f" (flash attention {report.llamacpp.get('flash_attention')}, KV cache {report.llamacpp.get('kv_type')})"]
    for layer, points in report.by_layer().items():
        worst = max(points, key=lambda p: p.max_rel)
        where = "embed/final" if layer is None else f"layer {layer:>3}"
        worst_by_name: dict[str, float] = {}
        for p in points:
            base = split_name(p.ggml)[0]
            worst_by_name[base] = max(worst_by_name.get(base, 0.0), p.max_rel)
        cells = "  ".join(f"{name} {rel:.1e}" for name, rel in worst_by_name.items())
        lines.append(f"{where}: max rel {worst.max_rel:.2e} at {worst.point} (abs {worst.max_abs:.2e}) | {cells}")
    lines.append(f"logits: mean KL {report.mean_kl:.2e}, max KL {report.max_kl:.2e}, top-1 agreement "
                 f"{100 * report.top1_agreement:.1f} %")
    lines.append(f"first point past {report.tolerance:g} relative: {report.first_parting or 'none'}")
    return "\n".join(lines)
