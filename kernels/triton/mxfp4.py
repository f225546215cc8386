"""Reader of MXFP4 (GPT-OSS's experts) for the exact GEMV, the fused GEMM and the dequantizer (``readers.unit_pieces``).

Block (17 bytes, so only byte-aligned along a row): the E8M0 exponent byte ``e``, then 16 bytes of E2M1 codes, byte j
holding value j (low nibble) and j + 16 (high). ggml reads a code as twice its E2M1 value (0, 1, 2, 3, 4, 6, 8, 12,
bit 3 the sign) against a halved scale ``2**(e - 128)``, which this reader builds from its float bits as ggml does.
"""
import triton
import triton.language as tl


@triton.jit
def _doubled_e2m1(codes):
    """Twice the E2M1 value of each 4-bit code (int32), as float32: exponent bits 1-2, mantissa bit 0, sign bit 3."""
    exponent, mantissa = (codes >> 1) & 3, codes & 1
    magnitude = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
    return tl.where((codes & 8) != 0, -magnitude, magnitude).to(tl.float32)


@triton.jit
def half_scale(e):
    """``2**(e - 128)`` for exponent bytes ``e`` (int32), exact: 2**-128 and 2**-127 are float32 subnormals."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mxfp4_pieces(blockp):
    # Pieces in value order: the low nibbles of bytes 0-7 and 8-15, then their high nibbles; w = scale * f + 0.
    scale = half_scale(tl.load(blockp).to(tl.int32))
    first = tl.load(blockp[:, None] + 1 + tl.arange(0, 8)[None, :]).to(tl.int32)
    second = tl.load(blockp[:, None] + 9 + tl.arange(0, 8)[None, :]).to(tl.int32)
    return (_doubled_e2m1(first & 15), _doubled_e2m1(second & 15), _doubled_e2m1(first >> 4),
            _doubled_e2m1(second >> 4), scale, scale * 0.0)
