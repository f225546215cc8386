"""FP8 checkpoints as Hugging Face folders store them, read into the FP8 formats (``workbench/kernels/formats/_fp8.py``)
and kept in FP8.

``config.json``'s ``quantization_config`` says which kind:

* ``quant_method: "fp8"`` (transformers' ``FineGrainedFP8Config``: DeepSeek-V3, Qwen3-*-FP8): ``X.weight`` in
  float8_e4m3fn ``[out, in]`` and ``X.weight_scale_inv`` float32 (or UE8M0) ``[ceil(out / bo), ceil(in / bi)]`` for
  ``weight_block_size: [bo, bi]``, value = code * scale (the "inverse" is the dequantizing multiplier) -> FP8_BLOCK;
  no block size: one scale per matrix -> FP8_ROW.
* ``quant_method: "compressed-tensors"`` with 8-bit float weights (llm-compressor's FP8 and FP8_DYNAMIC schemes):
  ``X.weight`` float8_e4m3fn and ``X.weight_scale`` ``[out, 1]`` (strategy "channel") or ``[1]`` ("tensor")
  -> FP8_ROW; ``[ceil(out / bo), ceil(in / bi)]`` (strategy "block", ``block_structure: [bo, bi]``) -> FP8_BLOCK.

Modules the quantizer left out (``ignore``, ``modules_to_not_convert``) are stored in bf16 and load as float weights.
Static activation scales (``input_scale``, ``activation_scale``) are not read: the serving numerics quantize
activations per token (FP8_ROW) or per 128 values of a token (FP8_BLOCK) on the fly (docs/fp8.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from workbench.errors import ModelLoadError, shorten
from workbench.kernels.formats import _fp8

# A weight's scale tensor: ``<module>.weight`` + one of these suffixes in place of ``weight``.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")


@dataclass(frozen=True)
class FP8Scheme:
    fmt: str  # "FP8_ROW" or "FP8_BLOCK"
    block: tuple[int, int] | None  # a scale's block (rows, columns); None: one scale per row or per matrix
    scale_name: str  # the scale tensor's suffix


def scheme(cfg: dict[str, Any], source: str) -> FP8Scheme | None:
    """The FP8 scheme of a config.json (None without ``quantization_config``, or ``compression_config`` as older
    compressed-tensors folders name it, and for GPT-OSS's MXFP4 experts); any other quantization is refused."""
    quant = cfg.get("quantization_config") or cfg.get("compression_config")
    if quant is None:
        return None
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == "mxfp4":  # GPT-OSS's MXFP4 experts, which workbench.moe reads (the rest of such a folder is float)
        return None
    if method == "fp8":
        block = quant.get("weight_block_size")
        return FP8Scheme("FP8_ROW", None, "weight_scale_inv") if block is None else \
            FP8Scheme("FP8_BLOCK", _block(block, source), "weight_scale_inv")
    if method == "compressed-tensors":
        weights = [group.get("weights") if isinstance(group, dict) else None
                   for group in (quant.get("config_groups") or {}).values()]
        kinds = {(w.get("type"), w.get("num_bits"), w.get("strategy"), str(w.get("block_structure")))
                 for w in weights if isinstance(w, dict)}
        if len(kinds) != 1 or not all(isinstance(w, dict) for w in weights):
            raise ModelLoadError(f"{source}: compressed-tensors config needs one kind of weight quantization in its "
                                 f"config_groups, got {shorten(list(kinds))}")
        w = weights[0]
        if (w.get("type"), w.get("num_bits")) != ("float", 8):
            raise ModelLoadError(f"{source}: compressed-tensors {w.get('num_bits')}-bit {w.get('type')} weights are "
                                 f"not supported (8-bit float, FP8, is)")
        if w.get("strategy") in ("channel", "tensor"):
            return FP8Scheme("FP8_ROW", None, "weight_scale")
        if w.get("strategy") == "block":
            return FP8Scheme("FP8_BLOCK", _block(w.get("block_structure"), source), "weight_scale")
        raise ModelLoadError(f"{source}: compressed-tensors FP8 strategy {shorten(w.get('strategy'))} is not "
                             f"supported (channel, tensor and block are)")
    raise ModelLoadError(f"{source}: quantization {shorten(method)} is not supported; FP8 checkpoints "
                         f"(quant_method 'fp8' or 'compressed-tensors'), GPT-OSS's MXFP4 ('mxfp4') and float ones are")


def _block(block: Any, source: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ModelLoadError(f"{source}: FP8 block size must be two positive integers, got {shorten(block)}")
    if block[1] % _fp8.GROUP:
        raise ModelLoadError(f"{source}: FP8 block size {list(block)}: its columns must be a multiple of "
                             f"{_fp8.GROUP}")
    return block[0], block[1]


def weight_name(scale_name: str, fp8: FP8Scheme) -> str | None:
    """``X.weight`` for ``X.<scale suffix>`` of this scheme, else None."""
    stem, _, suffix = scale_name.rpartition(".")
    return f"{stem}.weight" if suffix == fp8.scale_name else None


def row_scales(name: str, shape: tuple[int, ...], scale: torch.Tensor, fp8: FP8Scheme, source: str) -> torch.Tensor:
    """A matrix's (or stacked experts') scale tensor as float32 ``[..., out, in / 128]``: a scale per 128 values of
    each row, the layout of the FP8 formats. Each wrong shape, size or non-finite scale is a ModelLoadError."""
    *lead, out, cols = shape
    if cols % _fp8.GROUP:
        raise ModelLoadError(f"{source}: FP8 tensor {name} has {cols} columns; FP8 weights need a multiple of "
                             f"{_fp8.GROUP}")
    groups = cols // _fp8.GROUP
    scale = scale.float()
    got = tuple(scale.shape)
    if fp8.block is None:
        if got in ((*lead, out, 1), (*lead, out)):  # per row
            scale = scale.reshape(*lead, out, 1)
        elif scale.numel() == math.prod(lead):  # per matrix
            scale = scale.reshape(*lead, 1, 1)
        else:
            raise ModelLoadError(f"{source}: FP8 scale of {name} has shape {got}; expected {(*lead, out, 1)} "
                                 f"(per row) or {(*lead, 1)} (per tensor)")
        scale = scale.expand(*lead, out, groups)
    else:
        rows, block_cols = fp8.block
        expected = (*lead, -(-out // rows), -(-cols // block_cols))
        if got != expected:
            raise ModelLoadError(f"{source}: FP8 scale of {name} has shape {got}; blocks of {list(fp8.block)} "
                                 f"need {expected}")
        scale = scale.repeat_interleave(rows, dim=-2)[..., :out, :]
        scale = scale.repeat_interleave(block_cols // _fp8.GROUP, dim=-1)[..., :groups]
    if not bool(torch.isfinite(scale).all()):
        raise ModelLoadError(f"{source}: FP8 scale of {name} holds a non-finite value (nan or inf)")
    return scale
