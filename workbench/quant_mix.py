"""Which GGUF format each matrix of a model gets when a float checkpoint is quantized on load.

A format name (``Q4_K``, ``Q8_0``, ...) puts every matrix in that format: a uniform model for experiments. A
*mix* (``Q3_K_S``, ``Q3_K_M``, ``Q3_K_L``, ``Q4_K_S``, ``Q4_K_M``, ``Q5_K_S``, ``Q5_K_M``) gives each matrix the
format that ``llama-quantize`` gives it for that file type in a dense model. The rules follow
``llama_tensor_get_type`` in llama.cpp's ``src/llama-quant.cpp``:
- the output matrix (the token embedding where the two are tied) is Q6_K;
- in Q4_K_M and Q5_K_M, the value projection and the MLP's down projection are Q6_K in the layers
  ``use_more_bits`` picks: the first and last eighth of the layers and every third layer between them;
- in Q4_K_S, the value projection of the first four layers and the down projection of the first eighth are Q5_K;
- in Q3_K_M, the value projection is Q5_K in the first two layers and Q4_K after them, the down projection Q5_K in
  the first sixteenth and Q4_K after it, and the attention output Q4_K; in Q3_K_L all three are Q5_K;
- in 70B-class models (80 layers with grouped-query attention), value projections left in Q3_K or Q4_K become Q5_K;
- every other matrix takes the mix's base format (Q3_K, Q4_K or Q5_K).

Either way, a matrix whose rows do not fill its format's blocks falls back to a 32-value format, as llama.cpp's
quantizer does, or stays in floats if none fits.

Mixture-of-experts and Falcon models have further rules; this project's architectures have neither.
"""
from __future__ import annotations

from workbench.config import ModelConfig
from workbench.errors import QuantizeError
from workbench.kernels import get_format
from workbench.kernels.formats import QuantFormat

MIXES = {"Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K",
         "Q5_K_M": "Q5_K"}  # the mix's name, its base format
# llama.cpp's fallbacks for rows shorter than a 256-value super-block. It gives Q2_K and Q3_K IQ4_NL, which this
# project does not implement; Q4_0 is the nearest 32-value format.
_ROW_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def check_quantize(quantize: str) -> None:
    """Raise a clear error for a name that is neither a format nor a mix."""
    if quantize.upper() in MIXES:
        return
    try:
        get_format(quantize)
    except ValueError:
        raise QuantizeError(f"unknown quantization {quantize!r}: expected a format (Q8_0, Q4_K, ...) or a mix "
                         f"({', '.join(MIXES)})") from None


def use_more_bits(layer: int, n_layers: int) -> bool:
    """The layers whose sensitive matrices Q4_K_M and Q5_K_M keep in Q6_K (llama.cpp's ``use_more_bits``)."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def matrix_format(quantize: str, name: str, config: ModelConfig, cols: int) -> QuantFormat | None:
    """The format of matrix ``name`` (a llama.cpp tensor name: ``output.weight``, ``blk.3.attn_v.weight``, ...) of
    ``cols`` columns in a model of ``config`` quantized as ``quantize`` (a format or a mix); None where no quantized
    format fits its rows (the matrix then stays in floats)."""
    check_quantize(quantize)
    quantize = quantize.upper()
    fmt = get_format(_mix_format(quantize, name, config) if quantize in MIXES else quantize)
    if cols % fmt.block_size and fmt.name in _ROW_FALLBACK:
        fmt = get_format(_ROW_FALLBACK[fmt.name])
    return fmt if cols % fmt.block_size == 0 else None


def _mix_format(mix: str, name: str, config: ModelConfig) -> str:
    base = MIXES[mix]
    if name == "output.weight" or (config.tied_embeddings and name == "token_embd.weight"):
        return "Q6_K"
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return base
    layer, matrix, n_layers = int(parts[1]), parts[2], config.n_layers
    fmt = base
    if matrix == "attn_v":
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            fmt = "Q6_K"
        elif mix == "Q4_K_S" and layer < 4:
            fmt = "Q5_K"
        elif mix == "Q3_K_M":
            fmt = "Q5_K" if layer < 2 else "Q4_K"
        elif mix == "Q3_K_L":
            fmt = "Q5_K"
        if fmt in ("Q3_K", "Q4_K") and _is_70b(config):  # 8 query heads per value head: more bits for little size
            fmt = "Q5_K"
    elif matrix == "ffn_down":
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n_layers):
            fmt = "Q6_K"
        elif mix == "Q4_K_S" and layer < n_layers // 8:
            fmt = "Q5_K"
        elif mix == "Q3_K_M":
            fmt = "Q5_K" if layer < n_layers // 16 else "Q4_K"
        elif mix == "Q3_K_L":
            fmt = "Q5_K"
    elif matrix == "attn_qkv":  # fused q/k/v (Phi-3)
        fmt = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q4_K", "Q4_K_M": "Q5_K", "Q5_K_M": "Q6_K"}.get(mix, base)
    elif matrix == "attn_output":
        fmt = {"Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mix, base)
    return fmt


def _is_70b(config: ModelConfig) -> bool:
    """llama.cpp's ``LLM_TYPE_70B`` among this project's architectures: 80 layers, and for llama grouped-query
    attention (with one key-value head per query head it is the 65B)."""
    return config.n_layers == 80 and (config.architecture == "qwen2" or
                                      (config.architecture == "llama" and config.n_kv_heads != config.n_heads))
