"""The format table (``workbench.kernels.formats.table``) as the Triton kernels see it.

Device side: each format's GGML type number as a ``tl.constexpr`` (``Q4_0`` ... ``Q6_K``), the value of the ``FMT``
parameter every kernel takes and compares against, and its bytes per block (``Q4_0_BYTES`` ...) for the readers that
step over blocks themselves. The llama.cpp-numerics code tells the K-quants by ``FMT >= Q2_K``, which the table's
numbering allows among the formats it reads (checked below; MXFP4, type 39, is not one of them). Host side: the
``Layout`` of each format the kernels read, and which kernels read which.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton.language as tl

from ..formats.table import SPECS

Q4_0 = tl.constexpr(SPECS["Q4_0"].ggml_type)
Q4_1 = tl.constexpr(SPECS["Q4_1"].ggml_type)
Q5_0 = tl.constexpr(SPECS["Q5_0"].ggml_type)
Q5_1 = tl.constexpr(SPECS["Q5_1"].ggml_type)
Q8_0 = tl.constexpr(SPECS["Q8_0"].ggml_type)
Q2_K = tl.constexpr(SPECS["Q2_K"].ggml_type)
Q3_K = tl.constexpr(SPECS["Q3_K"].ggml_type)
Q4_K = tl.constexpr(SPECS["Q4_K"].ggml_type)
Q5_K = tl.constexpr(SPECS["Q5_K"].ggml_type)
Q6_K = tl.constexpr(SPECS["Q6_K"].ggml_type)
MXFP4 = tl.constexpr(SPECS["MXFP4"].ggml_type)

Q4_0_BYTES = tl.constexpr(SPECS["Q4_0"].type_size)
Q4_1_BYTES = tl.constexpr(SPECS["Q4_1"].type_size)
Q5_0_BYTES = tl.constexpr(SPECS["Q5_0"].type_size)
Q5_1_BYTES = tl.constexpr(SPECS["Q5_1"].type_size)
Q8_0_BYTES = tl.constexpr(SPECS["Q8_0"].type_size)
Q2_K_BYTES = tl.constexpr(SPECS["Q2_K"].type_size)
Q3_K_BYTES = tl.constexpr(SPECS["Q3_K"].type_size)
Q4_K_BYTES = tl.constexpr(SPECS["Q4_K"].type_size)
Q5_K_BYTES = tl.constexpr(SPECS["Q5_K"].type_size)
Q6_K_BYTES = tl.constexpr(SPECS["Q6_K"].type_size)
MXFP4_BYTES = tl.constexpr(SPECS["MXFP4"].type_size)


@dataclass(frozen=True)
class Layout:
    """What the kernels take from the format table for a GGUF format, checked against the ``QuantFormat`` at launch."""

    ggml_type: int
    block_size: int
    type_size: int
    word_bytes: int  # width of the kernel's loads; every block starts at a multiple of it


# The width of each format's narrowest loads (the alignment its packed data needs), in the order the kernels register.
_WORD_BYTES = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 2, "Q5_1": 4, "Q8_0": 2, "Q2_K": 2, "Q3_K": 2, "Q4_K": 4, "Q5_K": 4,
               "Q6_K": 2, "MXFP4": 1}
LAYOUTS: dict[str, Layout] = {
    name: Layout(SPECS[name].ggml_type, SPECS[name].block_size, SPECS[name].type_size, word_bytes)
    for name, word_bytes in _WORD_BYTES.items()
}
# The GEMV, the GEMM and the dequantizer read them all; the llama.cpp-numerics kernels all but MXFP4 (whose matmuls
# there run exact numerics, with the warning ``linear`` gives).
SUPPORTED_FORMATS = tuple(LAYOUTS)
# llama.cpp quantizes their activations to Q8_K, the others' to Q8_0 / Q8_1
K_QUANTS = tuple(name for name in SUPPORTED_FORMATS if SPECS[name].activation == "Q8_K")
# The formats with tensor-core fragment readers (``mma``); the others (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K) hand batched
# decode to the GEMM.
MMA_FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
LLAMACPP_FORMATS = tuple(name for name in SUPPORTED_FORMATS if name != "MXFP4")

if min(SPECS[name].ggml_type for name in K_QUANTS) <= max(
        SPECS[name].ggml_type for name in LLAMACPP_FORMATS if name not in K_QUANTS):
    raise ImportError("the Triton kernels tell K-quants by FMT >= Q2_K, which the format table's numbering breaks")
