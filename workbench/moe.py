"""Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS), computed as llama.cpp's ``build_moe_ffn`` does.

A router scores every expert for each token; the top ``n_experts_used`` run, and their outputs are summed with the
router's weights. The experts' matrices stay as the GGUF stores them, one packed tensor per kind stacked over experts
(``ffn_gate_exps`` ``[n_experts * d_expert, d_model]`` ...); each expert is a row range of it, a view, so only the
chosen experts' bytes are read, by the same quantized kernels as any other matrix. The tokens of a forward are
grouped by expert: one matmul per active expert over the tokens that chose it; a decode step on CUDA instead runs each
stacked matrix once over all (token, slot) pairs (``run_experts_by_pair``), with no host sync (docs/families.md).
"""
from __future__ import annotations

import dataclasses
import itertools
import re
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

import workbench.kernels.experts as expert_kernels
from workbench.architectures import ARCHITECTURES
from workbench.config import MoEConfig, config_float, config_int
from workbench.errors import HookError, ModelLoadError
from workbench.kernels import QuantTensor, layer_ops, linear, linear_parts, linear_segments
from workbench.kernels.tracing import tracks_grad

# The hook points of an MoE block's MLP, in the order the forward reaches them (they replace mlp.hook_pre,
# mlp.hook_pre_linear and mlp.hook_post, which a token has once per chosen expert here).
MOE_POINTS: dict[str, str] = {
    "mlp.hook_router_logits": "[T, n_experts]",
    "mlp.hook_expert_indices": "[T, top_k]",
    "mlp.hook_expert_weights": "[T, top_k]",
    "mlp.hook_expert_out": "[T, top_k, d_model]",
}
SHARED_POINTS: dict[str, str] = {"mlp.hook_shared_expert_out": "[T, d_model]"}
# Gemma 4's block runs the dense MLP and the experts side by side: the dense branch's output (after its own norm) and
# the experts' input norm come before the MoE points, the experts' weighted sum (after its own norm) after them.
DENSE_BRANCH_POINTS: dict[str, str] = {"mlp.hook_dense_out": "[T, d_model]", "ln2_experts.hook_scale": "[T, 1]",
                                       "ln2_experts.hook_normalized": "[T, d_model]"}
EXPERTS_BRANCH_POINTS: dict[str, str] = {"mlp.hook_experts_out": "[T, d_model]"}
# The MLP points of a dense block, which an MoE block does not have.
DENSE_MLP_POINTS = ("mlp.hook_pre", "mlp.hook_pre_linear", "mlp.hook_post")

# llama.cpp clamps the sum of the chosen weights before dividing by it (the smallest normal float16).
_MIN_WEIGHT_SUM = 6.103515625e-5


def with_moe_points(dense_points: dict[str, str], moe: MoEConfig | None) -> dict[str, str]:
    """A block's hook points with their shapes: the dense block's, with the MLP's points replaced for an MoE block
    (or, where the dense MLP stays beside the experts, followed by the experts' points)."""
    if moe is None:
        return dense_points
    out = {}
    after_mlp = next(p for p in ("ln2_post.hook_scale", "hook_mlp_out") if p in dense_points)
    for name, shape in dense_points.items():
        if name == after_mlp:
            out.update({**DENSE_BRANCH_POINTS, **MOE_POINTS, **EXPERTS_BRANCH_POINTS} if moe.dense_mlp else MOE_POINTS)
            if moe.d_shared_expert:
                out.update(SHARED_POINTS)
        if moe.dense_mlp or name not in DENSE_MLP_POINTS:
            out[name] = shape
    return out


@dataclass
class MoEWeights:
    """One block's experts: the router, the stacked expert matrices as stored, and Qwen2-MoE's shared expert."""

    router: QuantTensor  # ffn_gate_inp [n_experts, d_model]
    down: QuantTensor  # ffn_down_exps [n_experts * d_model, d_expert]
    gate: QuantTensor | None = None  # ffn_gate_exps [n_experts * d_expert, d_model]
    up: QuantTensor | None = None  # ffn_up_exps [n_experts * d_expert, d_model]
    # or both in one: ffn_gate_up_exps [n_experts * 2 * d_expert, d_model], each expert's gate rows then its up rows
    gate_up: QuantTensor | None = None
    shared_gate: QuantTensor | None = None  # ffn_gate_shexp [d_shared_expert, d_model]
    shared_up: QuantTensor | None = None
    shared_down: QuantTensor | None = None  # [d_model, d_shared_expert]
    shared_router: QuantTensor | None = None  # ffn_gate_inp_shexp [1, d_model]
    # Gemma 4: the router input's scale ffn_gate_inp.scale [d_model], each expert's weight's ffn_down_exps.scale
    # [n_experts] (float32)
    router_scale: torch.Tensor | None = None
    expert_scale: torch.Tensor | None = None
    # GPT-OSS's biases (float32): the router's [n_experts], each expert's gate and up [n_experts, d_expert], down's
    # [n_experts, d_model]
    router_bias: torch.Tensor | None = None
    gate_bias: torch.Tensor | None = None
    up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    # per expert: its (gate, up, down) as views of the stacked matrices' rows
    experts: list[tuple[QuantTensor, QuantTensor, QuantTensor]] = field(init=False, repr=False)

    def __post_init__(self):
        n_experts = self.router.shape[0]
        if self.gate_up is not None:
            pairs = [_rows(self.gate_up, e, n_experts) for e in range(n_experts)]
            self.experts = [(_rows(pair, 0, 2), _rows(pair, 1, 2), _rows(self.down, e, n_experts))
                            for e, pair in enumerate(pairs)]
        else:
            self.experts = [tuple(_rows(w, e, n_experts) for w in (self.gate, self.up, self.down))
                            for e in range(n_experts)]

    def matrices(self) -> Iterator[tuple[str, QuantTensor]]:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, QuantTensor):
                yield f.name, value

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for _, w in self.matrices())

    def map(self, fn_matrix: Callable[[QuantTensor], QuantTensor],
            fn_vector: Callable[[torch.Tensor], torch.Tensor] = lambda v: v) -> "MoEWeights":
        vectors = {name: fn_vector(v) for name in VECTORS if (v := getattr(self, name)) is not None}
        return MoEWeights(**{name: fn_matrix(w) for name, w in self.matrices()}, **vectors)


VECTORS = ("router_scale", "expert_scale", "router_bias", "gate_bias", "up_bias", "down_bias")


def _rows(w: QuantTensor, e: int, n_experts: int) -> QuantTensor:
    """Expert ``e``'s matrix: its rows of the stacked ``w``, a view of the same bytes."""
    rows = w.shape[0] // n_experts
    return QuantTensor(w.data[e * rows:(e + 1) * rows], w.fmt, (rows, w.shape[1]))


def moe_mlp(x: torch.Tensor, w: MoEWeights, moe: MoEConfig, point, names: dict[str, str], layer: int,
            router_input: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor:
    """The MoE MLP of normalized ``x`` ``[T, d_model]``, through its hook points (``point(name, value, layer)``; the
    forward fires ``hook_mlp_out`` on what it returns). The router reads ``router_input`` where the family routes on
    something else than the experts' input (Gemma 4: ``gemma4_router_input``).

    The routing is computed in float32 from the router logits (plus the router's bias, GPT-OSS): probabilities
    (softmax over all experts, or sigmoid), the top ``n_experts_used`` by probability, their probabilities as weights
    (normalized to sum to one where the model does so, then times each expert's scale where it has one); or, for
    ``softmax_weight``, the top logits, weighted by a softmax over them. A hook that replaces the chosen experts gets
    their weights from the same probabilities."""
    # the router in float32 whatever the activations' dtype: a choice between experts turns on small differences
    routed = x if router_input is None else router_input
    logits = linear(routed.float(), w.router)
    if w.router_bias is not None:
        logits = logits + w.router_bias
    logits = point(names["mlp.hook_router_logits"], logits, layer)
    if moe.gating == "softmax":
        probs = logits.softmax(dim=-1)
    elif moe.gating == "sigmoid":
        probs = logits.sigmoid()
    else:  # "softmax_weight": the top logits choose, a softmax over them weighs (below)
        probs = logits
    indices = probs.topk(moe.n_experts_used, dim=-1).indices
    if point.wants(names["mlp.hook_expert_indices"]):
        indices = point(names["mlp.hook_expert_indices"], indices, layer)
        if indices.numel() and not (0 <= int(indices.min()) and int(indices.max()) < moe.n_experts):
            raise HookError(f"a hook on {names['mlp.hook_expert_indices']} chose experts outside "
                            f"0..{moe.n_experts - 1}")
    weights = probs.gather(-1, indices)
    if moe.gating == "softmax_weight":  # a softmax over the chosen experts' logits alone
        weights = weights.softmax(dim=-1)
    if moe.normalize_weights:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(_MIN_WEIGHT_SUM)
    if moe.weights_scale != 1.0:
        weights = weights * moe.weights_scale
    if w.expert_scale is not None:
        weights = weights * w.expert_scale[indices]
    weights = point(names["mlp.hook_expert_weights"], weights, layer)
    expert_out = point(names["mlp.hook_expert_out"], run_experts(x, indices, w, moe, activation), layer)
    out = (expert_out * weights.to(expert_out.dtype)[..., None]).sum(dim=1)
    if w.shared_router is not None:
        gate, up = linear_parts(x, (w.shared_gate, w.shared_up))
        shared = linear(layer_ops.swiglu(gate, up), w.shared_down) * linear(x, w.shared_router).sigmoid()
        out = out + point(names["mlp.hook_shared_expert_out"], shared, layer)
    return out


def gemma4_router_input(resid: torch.Tensor, w: MoEWeights, eps: float) -> torch.Tensor:
    """What Gemma 4's router reads: the residual stream RMS-normalized (no weight), times its learned scale and
    1/sqrt(d_model), in float32 (llama.cpp's ``ggml_rms_norm``, ``ggml_scale``, ``ggml_mul``)."""
    x = resid.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * (resid.shape[-1] ** -0.5) * w.router_scale


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's activation (llama.cpp's ``swiglu_oai``): the gate clamped from above, the up projection both ways."""
    gate = gate.clamp(max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up.clamp(-limit, limit) + 1)


def run_experts(x: torch.Tensor, indices: torch.Tensor, w: MoEWeights, moe: MoEConfig,
                activation: str = "silu") -> torch.Tensor:
    """Each chosen expert's gated output (SwiGLU, GeGLU for ``activation`` "gelu_tanh", GPT-OSS's clamped SwiGLU where
    ``moe`` sets a limit) for its token, ``[T, k, d_model]`` (unweighted; with its biases where the model has them).

    The (token, slot) pairs are grouped by expert, so each active expert runs once, on all its tokens: its rows of the
    stacked matrices are read once per forward, and experts no token chose are not read at all. The gate and up
    projections of every group take one kernel call, the down projections another (``linear_segments``: on the CPU,
    one parallel region each, as llama.cpp's ``mul_mat_id``), and the activation one pass over all pairs. A single
    token (decode) keeps its slot order: no sort. Decode on CUDA goes by pair instead (``run_experts_by_pair``)."""
    n_tokens, k = indices.shape
    if decodes_by_pair(x, indices, w):  # decode on CUDA: the pairs as they are, no host sync
        return run_experts_by_pair(x, indices, w, moe, activation)
    flat = indices.reshape(-1)
    if n_tokens == 1:  # a hook may choose an expert twice: it then runs twice
        experts, counts, order, tokens = flat.tolist(), [1] * k, None, x
    else:
        order = torch.argsort(flat, stable=True)
        per_expert = torch.bincount(flat, minlength=len(w.experts)).tolist()  # the host needs the group sizes
        experts = [e for e, count in enumerate(per_expert) if count]
        counts = [per_expert[e] for e in experts]
        tokens = x.index_select(0, order // k)
    starts = list(itertools.accumulate(counts, initial=0))[:-1]  # each group's first pair (and token row, sorted)
    token_starts = [0] * k if order is None else starts
    gate_w, up_w, down_w = zip(*(w.experts[e] for e in experts))
    gate, up = linear_segments(tokens, gate_w + up_w, token_starts * 2, counts * 2).split(n_tokens * k)
    pair_experts = flat if order is None else flat[order]
    out = linear_segments(expert_hidden(gate, up, pair_experts, w, moe, activation), down_w, starts, counts)
    out = with_down_bias(out, pair_experts, w)
    if order is not None:  # back to (token, slot) order
        out = torch.empty_like(out).index_copy_(0, order, out)
    return out.view(n_tokens, k, x.shape[1])


def expert_hidden(gate: torch.Tensor, up: torch.Tensor, experts: torch.Tensor, w: MoEWeights, moe: MoEConfig,
                  activation: str) -> torch.Tensor:
    """The experts' gated activation of pairs' gate and up projections, ``experts`` each row's expert (for the biases
    where the model has them): GPT-OSS's clamped SwiGLU where ``moe`` sets a limit, else GeGLU for ``activation``
    "gelu_tanh", else SwiGLU."""
    if w.gate_bias is not None:
        gate, up = gate + w.gate_bias[experts].to(gate.dtype), up + w.up_bias[experts].to(up.dtype)
    if moe.swiglu_limit is not None:
        return clamped_swiglu(gate, up, moe.swiglu_alpha, moe.swiglu_limit)
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    return layer_ops.swiglu(gate, up)


def with_down_bias(out: torch.Tensor, experts: torch.Tensor, w: MoEWeights) -> torch.Tensor:
    """Pairs' down projections plus each row's expert's down bias, where the model has them."""
    return out if w.down_bias is None else out + w.down_bias[experts].to(out.dtype)


# ------------------------------------------------------------------------------------------------- CUDA decode


def decodes_by_pair(x: torch.Tensor, indices: torch.Tensor, w: MoEWeights) -> bool:
    """Whether ``run_experts`` takes ``run_experts_by_pair``: on CUDA, for experts it reads, where there are no more
    (token, slot) pairs than experts. Each pair reads its expert's rows, so past that the grouped path, which reads
    each active expert once, reads less (it costs a host sync and launches per active expert)."""
    return (x.is_cuda and indices.numel() <= len(w.experts) and not tracks_grad(x)
            and by_pair_supported(w, x.device))


def by_pair_supported(w: MoEWeights, device: torch.device) -> bool:
    """Whether ``run_experts_by_pair`` takes these experts with activations on ``device``."""
    matrices = (w.gate, w.up, w.gate_up, w.down)
    return all(expert_kernels.by_expert_supported(m, device) for m in matrices if m is not None)


def run_experts_by_pair(x: torch.Tensor, indices: torch.Tensor, w: MoEWeights, moe: MoEConfig,
                        activation: str = "silu") -> torch.Tensor:
    """``run_experts`` as llama.cpp's ``mul_mat_id`` computes it for decode: one launch per stacked matrix over all
    (token, slot) pairs (``linear_by_expert``), each pair reading its expert's rows, the routing left on the device
    (no host sync: a CUDA graph can hold it). A pair per output row, so the same bits as the grouped path's GEMV."""
    n_tokens, k = indices.shape
    n_experts = len(w.experts)
    experts = indices.reshape(-1)
    pairs = torch.arange(experts.numel(), device=x.device)
    tokens = pairs // k
    if w.gate_up is not None:  # each expert's gate rows, then its up rows
        gate, up = expert_kernels.linear_by_expert(x, w.gate_up, n_experts, experts, tokens).chunk(2, dim=-1)
    else:
        gate = expert_kernels.linear_by_expert(x, w.gate, n_experts, experts, tokens)
        up = expert_kernels.linear_by_expert(x, w.up, n_experts, experts, tokens)
    hidden = expert_hidden(gate, up, experts, w, moe, activation)
    out = with_down_bias(expert_kernels.linear_by_expert(hidden, w.down, n_experts, experts, pairs), experts, w)
    return out.view(n_tokens, k, x.shape[1])


def routing_matrix(indices: torch.Tensor, weights: torch.Tensor, n_experts: int) -> torch.Tensor:
    """The routing of a block as ``[T, n_experts]``: each token's weight on each expert, zero where not chosen (from
    the recorded ``hook_expert_indices`` and ``hook_expert_weights``)."""
    dense = torch.zeros(indices.shape[0], n_experts, dtype=torch.float32)
    return dense.scatter_add_(1, indices.long().cpu(), weights.float().cpu())


# ------------------------------------------------------------------------------------------------- loading

# llama.cpp's tensor names of an MoE block (after ``blk.N.``)
ROUTER, GATE, UP, DOWN = "ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"
GATE_UP = "ffn_gate_up_exps.weight"
ROUTER_SCALE, EXPERT_SCALE = "ffn_gate_inp.scale", "ffn_down_exps.scale"  # Gemma 4
ROUTER_BIAS = "ffn_gate_inp.bias"  # GPT-OSS
EXPERT_BIASES = {"gate_bias": "ffn_gate_exps.bias", "up_bias": "ffn_up_exps.bias", "down_bias": "ffn_down_exps.bias"}
SHARED = {"shared_gate": "ffn_gate_shexp.weight", "shared_up": "ffn_up_shexp.weight",
          "shared_down": "ffn_down_shexp.weight", "shared_router": "ffn_gate_inp_shexp.weight"}

# Hugging Face names (after ``model.layers.N.``) of the router and shared expert; experts are matched by _HF_EXPERT.
_HF_NAMES = {
    "block_sparse_moe.gate.weight": ROUTER,  # Mixtral
    "mlp.gate.weight": ROUTER,  # Qwen2-MoE, Qwen3-MoE
    "mlp.router.weight": ROUTER,  # GPT-OSS
    "mlp.router.bias": ROUTER_BIAS,
    "mlp.shared_expert.gate_proj.weight": SHARED["shared_gate"],
    "mlp.shared_expert.up_proj.weight": SHARED["shared_up"],
    "mlp.shared_expert.down_proj.weight": SHARED["shared_down"],
    "mlp.shared_expert_gate.weight": SHARED["shared_router"],
    "router.proj.weight": ROUTER,  # Gemma 4
    "router.scale": ROUTER_SCALE,
    "router.per_expert_scale": EXPERT_SCALE,
}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_HF_EXPERT_KIND = {"w1": GATE, "w3": UP, "w2": DOWN, "gate_proj": GATE, "up_proj": UP, "down_proj": DOWN}
# transformers' own in-memory layout, [n_experts, 2 * d_expert, d_model] and [n_experts, d_model, d_expert]; GPT-OSS's
# [n_experts, d_model, 2 * d_expert] (gate and up in alternate columns) and [n_experts, d_expert, d_model], with biases
_HF_FUSED = re.compile(r"model\.layers\.(\d+)\.(?:mlp\.)?experts\.(gate_up_proj|down_proj)(_bias|\.weight)?")
# Released GPT-OSS folders keep the experts in MXFP4: per matrix ``*_blocks`` [n_experts, rows, cols / 32, 16] (value 2j
# of a block in the low nibble of byte j, 2j + 1 in the high one) and ``*_scales`` [n_experts, rows, cols / 32] (E8M0
# exponent bytes); rows are outputs, gate_up_proj's alternating gate and up.
_HF_MXFP4 = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)_(blocks|scales)")


def hf_config(cfg: dict[str, Any], architecture: str) -> MoEConfig | None:
    """The MoE part of a Hugging Face config.json (None for a dense model); a family's fixed settings as llama.cpp fixes
    them, GPT-OSS's SwiGLU constants from the config."""
    n_experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not n_experts or cfg.get("enable_moe_block") is False:
        return None
    if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
        raise ModelLoadError("MoE models with dense layers between the sparse ones are not supported")
    config = MoEConfig(
        n_experts=config_int(n_experts),
        n_experts_used=config_int(cfg["top_k_experts" if "top_k_experts" in cfg else "num_experts_per_tok"]),
        d_expert=config_int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"]),
        # Mixtral and Gemma 4 always normalize; the Qwen configs say whether they do
        normalize_weights=bool(cfg.get("norm_topk_prob", architecture in ("llama", "gemma4"))),
        d_shared_expert=config_int(cfg.get("shared_expert_intermediate_size") or 0),
        dense_mlp=bool(cfg.get("enable_moe_block")),
    )
    fixed = {**ARCHITECTURES[architecture].moe,
             **{field: config_float(cfg[field]) for field in _HF_SWIGLU if field in cfg}}
    return dataclasses.replace(config, **fixed) if fixed else config


_HF_SWIGLU = ("swiglu_limit", "swiglu_alpha")  # GPT-OSS's config.json names them as MoEConfig does


def gguf_config(key: Callable[[str, Any], Any], architecture: str, d_mlp: int) -> MoEConfig | None:
    """The MoE part of a GGUF's metadata (``key(name, default)`` reads ``{arch}.{name}``), as llama.cpp reads it for
    Mixtral (llama with experts), Qwen2-MoE, Qwen3-MoE, Gemma 4 and GPT-OSS: its graph fixes their routing (softmax,
    weights normalized but for qwen2moe, unscaled), so a file's expert_gating_func, expert_weights_norm and
    expert_weights_scale change nothing there, nor here."""
    n_experts = config_int(key("expert_count", 0))
    if not n_experts:
        if architecture.endswith("moe"):
            raise ModelLoadError(f"{architecture}: metadata key '{architecture}.expert_count' is missing")
        return None
    config = MoEConfig(
        n_experts=n_experts, n_experts_used=config_int(key("expert_used_count", None)),
        d_expert=config_int(key("expert_feed_forward_length", d_mlp)),
        normalize_weights=architecture != "qwen2moe",
        # llama.cpp reads the shared expert's width for qwen2moe only (a Qwen3-MoE GGUF may carry the key unused)
        d_shared_expert=config_int(key("expert_shared_feed_forward_length", 0)) if architecture == "qwen2moe" else 0,
        dense_mlp=architecture == "gemma4",
    )
    fixed = ARCHITECTURES[architecture].moe
    return dataclasses.replace(config, **fixed) if fixed else config


def hf_tensor(name: str, tensor: torch.Tensor, experts: dict[str, dict[int, torch.Tensor]], layout: str = "split",
              mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] | None = None) -> dict[str, torch.Tensor] | None:
    """The llama.cpp tensors a Hugging Face MoE tensor gives (None: not an MoE tensor), for the family's expert
    ``layout`` (``Architecture.hf_expert_layout``). Per-expert matrices are collected into ``experts`` (by stacked
    name, then expert) for ``stack_experts``; MXFP4 blocks and scales into ``mxfp4`` (by layer and matrix) for
    ``hf_mxfp4_experts``."""
    if mxfp4 is not None and (match := _HF_MXFP4.fullmatch(name)):
        layer, kind, part = match.groups()
        mxfp4.setdefault((layer, kind), {})[part] = tensor
        return {}
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _HF_NAMES:
        mapped = _HF_NAMES[parts[3]]
        return {f"blk.{parts[2]}.{mapped}": tensor}
    if match := _HF_EXPERT.fullmatch(name):
        layer, expert, kind = match.groups()
        if kind in _HF_EXPERT_KIND:
            experts.setdefault(f"blk.{layer}.{_HF_EXPERT_KIND[kind]}", {})[int(expert)] = tensor
            return {}
    if match := _HF_FUSED.fullmatch(name):
        layer, kind, suffix = match.groups()
        p = f"blk.{layer}."
        if layout == "interleaved":  # as llama.cpp's converter splits GPT-OSS's: gate the even columns, up the odd
            if suffix == "_bias":
                if kind == "down_proj":
                    return {p + EXPERT_BIASES["down_bias"]: tensor}
                return {p + EXPERT_BIASES["gate_bias"]: tensor[..., ::2],
                        p + EXPERT_BIASES["up_bias"]: tensor[..., 1::2]}
            tensor = tensor.transpose(-1, -2)
            if kind == "down_proj":
                return {p + DOWN: tensor.contiguous()}
            return {p + GATE: tensor[:, ::2].contiguous(), p + UP: tensor[:, 1::2].contiguous()}
        if suffix == "_bias":
            return None
        if kind == "down_proj":
            return {p + DOWN: tensor}
        gate, up = tensor.chunk(2, dim=1)
        return {p + GATE: gate, p + UP: up}
    return None


def ggml_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """ggml's MXFP4 blocks ``[..., 17]`` from a Hugging Face folder's ``blocks`` ``[..., 16]`` and ``scales`` ``[...]``:
    the exponent byte first, then the codes moved so that byte j holds values j and j + 16 (the same bytes llama.cpp's
    converter writes)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., 32] in value order
    return torch.cat((scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)


def hf_mxfp4_experts(mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]], source: str) -> dict[str, QuantTensor]:
    """The stacked MXFP4 expert matrices of the collected blocks and scales, kept packed (gate and up split by rows as
    the converter splits them); a missing half or a malformed shape is named."""
    out = {}
    for (layer, kind), parts in mxfp4.items():
        name = f"model.layers.{layer}.mlp.experts.{kind}"
        for part in ("blocks", "scales"):
            if part not in parts:
                raise ModelLoadError(f"{source}: {name}_{part} is missing")
        blocks, scales = parts["blocks"], parts["scales"]
        if (blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() != 4 or blocks.shape[-1] != 16
                or blocks.shape[:-1] != scales.shape):
            raise ModelLoadError(f"{source}: {name}_blocks {tuple(blocks.shape)} {blocks.dtype} and _scales "
                                 f"{tuple(scales.shape)} {scales.dtype} are not MXFP4 (uint8 [n, rows, blocks, 16] and "
                                 f"[n, rows, blocks])")
        packed = ggml_mxfp4_blocks(blocks, scales)  # [n, rows, cols / 32, 17]
        n, rows, n_blocks, _ = packed.shape
        parts_by_name = {DOWN: packed} if kind == "down_proj" else {GATE: packed[:, ::2], UP: packed[:, 1::2]}
        for gguf, matrix in parts_by_name.items():
            rows = matrix.shape[1]
            out[f"blk.{layer}.{gguf}"] = QuantTensor(matrix.reshape(n * rows, -1), "MXFP4", (n * rows, 32 * n_blocks))
    return out


def stack_experts(experts: dict[str, dict[int, torch.Tensor]], source: str) -> dict[str, torch.Tensor]:
    """Each collected kind's per-expert matrices as one ``[n_experts, rows, cols]`` tensor, as the converter stacks
    them; a missing expert is named."""
    out = {}
    for name, by_expert in experts.items():
        missing = sorted(set(range(max(by_expert) + 1)) - set(by_expert))
        if missing:
            raise ModelLoadError(f"{source}: expert {missing[0]} of {name} is missing")
        out[name] = torch.stack([by_expert[e] for e in range(len(by_expert))])
    return out


def assemble(prefix: str, d_model: int, moe: MoEConfig, get, source: str, biases: bool = False) -> MoEWeights:
    """One block's MoEWeights from ``get(gguf_name, shape)`` (as the loader's ``_assemble``), every shape checked;
    with ``biases`` (GPT-OSS), the router's and the experts'."""

    def matrix(name: str, shape: tuple[int, ...]) -> QuantTensor:
        tensor = get(prefix + name, shape)
        if tensor is None:
            raise ModelLoadError(f"{source}: tensor {prefix}{name} is missing")
        return tensor

    n, f, s = moe.n_experts, moe.d_expert, moe.d_shared_expert
    if get(prefix + GATE_UP, (n, 2 * f, d_model)) is not None:  # llama.cpp's converter fuses Gemma 4's
        gate_up = dict(gate_up=matrix(GATE_UP, (n, 2 * f, d_model)))
    else:
        gate_up = dict(gate=matrix(GATE, (n, f, d_model)), up=matrix(UP, (n, f, d_model)))
    if moe.dense_mlp:
        gate_up.update(router_scale=matrix(ROUTER_SCALE, (d_model,)).dequantize().reshape(d_model),
                       expert_scale=matrix(EXPERT_SCALE, (n,)).dequantize().reshape(n))
    shared = {}
    if s:
        shared = dict(shared_gate=matrix(SHARED["shared_gate"], (s, d_model)),
                      shared_up=matrix(SHARED["shared_up"], (s, d_model)),
                      shared_down=matrix(SHARED["shared_down"], (d_model, s)),
                      shared_router=_one_row(lambda shape: matrix(SHARED["shared_router"], shape), d_model))
    if biases:
        shared.update(router_bias=matrix(ROUTER_BIAS, (n,)).dequantize().reshape(n),
                      **{field: matrix(name, (n, d_model if field == "down_bias" else f)).dequantize()
                         for field, name in EXPERT_BIASES.items()})
    return MoEWeights(router=matrix(ROUTER, (n, d_model)), down=matrix(DOWN, (n, d_model, f)), **gate_up, **shared)


def _one_row(matrix: Callable[[tuple[int, ...]], QuantTensor], cols: int) -> QuantTensor:
    """A ``[1, cols]`` tensor that files store as either shape: llama.cpp's converter writes the shared expert's gate
    ``[1, d_model]``, its quantizer ``[d_model]``."""
    try:
        return matrix((1, cols))
    except ModelLoadError:
        return matrix((cols,))


def gguf_tensors(prefix: str, w: MoEWeights) -> list[tuple[str, QuantTensor | torch.Tensor, tuple[int, ...]]]:
    """The GGUF tensors of one block's experts, with their torch-order shapes (for a writer; biases as float
    tensors)."""
    n = w.router.shape[0]
    out = [(ROUTER, w.router, w.router.shape)]
    for name, m in ((GATE, w.gate), (UP, w.up), (GATE_UP, w.gate_up), (DOWN, w.down)):
        if m is not None:
            out.append((name, m, (n, m.shape[0] // n, m.shape[1])))
    for attr, name in SHARED.items():
        m = getattr(w, attr)
        if m is not None:
            out.append((name, m, m.shape))
    biases = {"router_bias": ROUTER_BIAS, **EXPERT_BIASES}
    out += [(name, b, tuple(b.shape)) for field, name in biases.items() if (b := getattr(w, field)) is not None]
    return [(prefix + name, m, shape) for name, m, shape in out]
