"""The one table of GGUF format numbers: each format's GGML type number, values per block and bytes per block.

The numbers come from the ``gguf`` package (``GGMLQuantizationType``, ``GGML_QUANT_SIZES``); nothing else in
``workbench.kernels`` writes them down. The Python formats (``define_format``), the C++ CPU kernels (compiled with
them as macros, ``cpu.format_macros``) and the Triton kernels (``triton.formats``) all read them from here, and
``tests/test_formats.py`` checks that every side agrees with this table. (Byte offsets within a block, and the
kernels' arithmetic over 32-value units and 256-value super-blocks, are each format's layout code, not table entries.)

Beside the weight formats the table holds the activation blocks llama.cpp's integer dot products take (Q8_0, Q8_1,
Q8_K): ``FormatSpec.activation`` names the one ggml-cpu quantizes activations to for a weight format (its
``vec_dot_type``). The FP8 formats of Hugging Face checkpoints, which GGUF has no type for, are the table's own rows.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


@dataclass(frozen=True)
class FormatSpec:
    name: str
    ggml_type: int | None  # None: a format GGUF has no type for (FP8)
    block_size: int  # values per block
    type_size: int  # bytes per block
    # "float", "legacy" (32-value blocks), "k-quant" (256-value super-blocks), "microscaling" (MXFP4) or "activation"
    family: str
    activation: str | None = None  # the activation block of llama.cpp numerics against this weight format


def _spec(name: str, family: str, activation: str | None = None, type_size: int | None = None) -> FormatSpec:
    qtype = GGMLQuantizationType[name]
    block_size, gguf_type_size = GGML_QUANT_SIZES[qtype]
    return FormatSpec(name, int(qtype), block_size, gguf_type_size if type_size is None else type_size, family,
                      activation)


SPECS: dict[str, FormatSpec] = {spec.name: spec for spec in (
    _spec("F32", "float"),
    _spec("F16", "float"),
    _spec("BF16", "float"),
    _spec("Q8_0", "legacy", "Q8_0"),
    _spec("Q4_0", "legacy", "Q8_0"),
    _spec("Q4_1", "legacy", "Q8_1"),
    _spec("Q5_0", "legacy", "Q8_0"),
    _spec("Q5_1", "legacy", "Q8_1"),
    _spec("Q2_K", "k-quant", "Q8_K"),
    _spec("Q3_K", "k-quant", "Q8_K"),
    _spec("Q4_K", "k-quant", "Q8_K"),
    _spec("Q5_K", "k-quant", "Q8_K"),
    _spec("Q6_K", "k-quant", "Q8_K"),
    # OCP microscaling: E2M1 values with an E8M0 scale per 32 (GPT-OSS's experts); ggml dots them with Q8_0 blocks
    _spec("MXFP4", "microscaling", "Q8_0"),
    # Activation blocks. gguf still sizes Q8_1 as float32 d and s (40 bytes); ggml has stored both as float16
    # (block_q8_1: 36 bytes) since 2023, and that is the block llama.cpp's numerics compute.
    _spec("Q8_1", "activation", type_size=36),
    _spec("Q8_K", "activation"),
    # Family "fp8": FP8 as Hugging Face folders store it (no GGUF type), E4M3 codes with a float32 scale per 128 values
    # of a row (formats/_fp8.py); FP8_ROW's scales are equal along each row.
    FormatSpec("FP8_ROW", None, 128, 128 + 4, "fp8"),
    FormatSpec("FP8_BLOCK", None, 128, 128 + 4, "fp8"),
)}
# Where this table departs from gguf's GGML_QUANT_SIZES, and why (checked by the tests).
GGUF_EXCEPTIONS = {"Q8_1": "ggml's block_q8_1 holds d and s as float16"}

WEIGHT_FORMATS = tuple(name for name, spec in SPECS.items() if spec.family != "activation")
QUANTIZED_FORMATS = tuple(name for name, spec in SPECS.items() if spec.family in ("legacy", "k-quant", "microscaling"))
K_QUANTS = tuple(name for name, spec in SPECS.items() if spec.family == "k-quant")
LEGACY_FORMATS = tuple(name for name, spec in SPECS.items() if spec.family == "legacy")
FP8_FORMATS = tuple(name for name, spec in SPECS.items() if spec.family == "fp8")
QK = SPECS["Q8_0"].block_size  # values per block of the legacy formats and of Q8_0 / Q8_1
QK_K = SPECS["Q8_K"].block_size  # values per K-quant super-block and of Q8_K


def spec(name: str) -> FormatSpec:
    """The table's row for ``name`` (exact, upper case); ``KeyError`` for a format the table lacks."""
    return SPECS[name]


__all__ = ["FormatSpec", "SPECS", "GGUF_EXCEPTIONS", "WEIGHT_FORMATS", "QUANTIZED_FORMATS", "K_QUANTS",
           "LEGACY_FORMATS", "FP8_FORMATS", "QK", "QK_K", "spec"]
