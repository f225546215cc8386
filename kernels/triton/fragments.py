"""Triton device functions that unpack GGUF blocks straight into tensor-core fragments, for few rows of activations.

``mma.sync.m16n8k16`` multiplies a 16x16 tile A by a 16x8 tile B on one warp, each lane holding fixed elements in
its registers (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane ``4 g + t`` holds A's rows ``g`` and ``g + 8`` at
k = ``2t, 2t + 1`` and ``2t + 8, 2t + 9`` (two 16-bit values per register, four registers), B's column ``g`` at the
same k (two registers), and the result's rows ``g``, ``g + 8`` at columns ``2t``, ``2t + 1`` (four float32).
Here A is 16 weight rows and B's columns are up to 8 rows of activations. Every tensor of these kernels holds one
value per lane (shape ``[32 * warps]``), so each lane loads and unpacks exactly the weights of its own A registers:
no tile goes through shared memory to reach the tensor cores, as ``tl.dot``'s operands do.

Which 16 values of K one instruction covers is free, as long as A and B agree on it: a lane takes 8 consecutive
quants of one sub-block of each of its two rows (one 8-byte load) and the 8 matching activations (one 16-byte load).
A 4-bit quant q becomes the 16-bit float ``MAGIC + q`` (bfloat16 128 + q, float16 1024 + q, both exact) with a mask
and a byte permute, so a sub-block's instruction sums ``(MAGIC + q) x``; a second one with A all ones sums ``x``, and
``d scale (sum (MAGIC + q) x) - (MAGIC d scale + dmin min) sum x`` is the sub-block's exact dot in float32.

On CUDA (``USE_ASM``) the loads, permutes and ``mma.sync`` are inline PTX; the interpreter, which runs no PTX, loads
with ``tl.load`` and computes each instruction as the sums it stands for.
"""
import triton
import triton.language as tl

from .dequant import f16_halves, four_words, q4_k_chunk_scales


@triton.jit
def load_words2(p, USE_ASM: tl.constexpr):
    """The two int32 words at each 8-byte aligned uint8 pointer ``p``, in one load."""
    if USE_ASM:
        return tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [p],
                                         dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    words = p.to(tl.pointer_type(tl.int32))
    return tl.load(words), tl.load(words + 1)


@triton.jit
def load_words4(p, USE_ASM: tl.constexpr):
    """The four int32 words at each 16-byte aligned uint8 pointer ``p``, in one load."""
    if USE_ASM:  # one value per lane, whatever layout the compiler would pick for a [lanes, 4] load
        return tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                         dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    return four_words(p)


@triton.jit
def _magic_pairs(quants, MAGIC_BYTE: tl.constexpr, USE_ASM: tl.constexpr):
    """Bytes 0, 1 and bytes 2, 3 of ``quants`` (each below 128) as two registers of two 16-bit floats ``MAGIC + q``:
    each byte goes under the float's top byte ``MAGIC_BYTE``."""
    if USE_ASM:
        return tl.inline_asm_elementwise(
            "prmt.b32 $0, $2, $3, 0x4140; prmt.b32 $1, $2, $3, 0x4342;", "=r,=r,r,r",
            [quants, tl.full(quants.shape, MAGIC_BYTE * 0x01010101, tl.int32)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    magic = MAGIC_BYTE * 0x01000100
    return ((quants & 0xFF) | ((quants & 0xFF00) << 8) | magic,
            ((quants >> 16) & 0xFF) | ((quants >> 8) & 0xFF0000) | magic)


@triton.jit
def _float_pair(r, BF16: tl.constexpr):
    """The two 16-bit floats of int32 ``r``, low half first, as float32."""
    if BF16:
        return (r << 16).to(tl.float32, bitcast=True), (r & -65536).to(tl.float32, bitcast=True)
    return f16_halves(r)


@triton.jit
def _lane_values(r0, r1, BF16: tl.constexpr):
    """A lane's four k values of one fragment row (registers ``r0``, ``r1``) as float32 ``[warps, 8, 4, 4]``:
    (warp, g, t, value)."""
    v0, v1 = _float_pair(r0, BF16)
    v2, v3 = _float_pair(r1, BF16)
    values = tl.join(tl.join(v0, v1), tl.join(v2, v3))
    return tl.reshape(values, (values.shape[0] // 32, 8, 4, 4))


@triton.jit
def _emulated_mma_rows(a_lo, a_hi, b0, b1, BF16: tl.constexpr):
    """One set of A rows (g or g + 8) times B, as the result's two columns ``2t``, ``2t + 1`` of each lane."""
    a = _lane_values(a_lo, a_hi, BF16)  # [warp, g, t, value]
    b = _lane_values(b0, b1, BF16)  # [warp, column, t, value]
    d = tl.sum(tl.sum(a[:, :, None, :, :] * b[:, None, :, :, :], axis=4), axis=3)  # [warp, g, column]
    even, odd = tl.split(tl.reshape(d, (d.shape[0], 8, 4, 2)))
    return tl.reshape(even, (d.shape[0] * 32,)), tl.reshape(odd, (d.shape[0] * 32,))


@triton.jit
def mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``D = A B + C`` on one warp's m16n8k16 fragments (see the module docstring), bfloat16 or float16 inputs,
    float32 sums."""
    if USE_ASM:
        if BF16:
            return tl.inline_asm_elementwise(
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};", "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    d0, d1 = _emulated_mma_rows(a0, a2, b0, b1, BF16)
    d2, d3 = _emulated_mma_rows(a1, a3, b0, b1, BF16)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3


@triton.jit
def nibble_sub_block_sums(top0, top1, bottom0, bottom1, x0, x1, x2, x3, SHIFT: tl.constexpr, BF16: tl.constexpr,
                          USE_ASM: tl.constexpr):
    """For 8 bytes of quants of the lane's two weight rows (words ``top0, top1`` and ``bottom0, bottom1``), the nibbles
    at bit ``SHIFT`` of each byte (one sub-block), and the lane's 8 matching activations (words ``x0..x3``): the sums
    of ``(MAGIC + q) x`` as a result fragment ``(c0, c1, c2, c3)``, and those of ``x`` (columns ``2t``, ``2t + 1``)."""
    MAGIC_BYTE: tl.constexpr = 0x43 if BF16 else 0x64
    ONES: tl.constexpr = 0x3F803F80 if BF16 else 0x3C003C00
    t01, t23 = _magic_pairs((top0 >> SHIFT) & 0x0F0F0F0F, MAGIC_BYTE, USE_ASM)
    t45, t67 = _magic_pairs((top1 >> SHIFT) & 0x0F0F0F0F, MAGIC_BYTE, USE_ASM)
    b01, b23 = _magic_pairs((bottom0 >> SHIFT) & 0x0F0F0F0F, MAGIC_BYTE, USE_ASM)
    b45, b67 = _magic_pairs((bottom1 >> SHIFT) & 0x0F0F0F0F, MAGIC_BYTE, USE_ASM)
    zero = tl.zeros(top0.shape, tl.float32)
    ones = tl.full(top0.shape, ONES, tl.int32)
    c0, c1, c2, c3 = mma(t01, b01, t23, b23, x0, x1, zero, zero, zero, zero, BF16, USE_ASM)
    c0, c1, c2, c3 = mma(t45, b45, t67, b67, x2, x3, c0, c1, c2, c3, BF16, USE_ASM)
    s0, s1, _, _ = mma(ones, ones, ones, ones, x0, x1, zero, zero, zero, zero, BF16, USE_ASM)
    s0, s1, _, _ = mma(ones, ones, ones, ones, x2, x3, s0, s1, zero, zero, BF16, USE_ASM)
    return c0, c1, c2, c3, s0, s1


@triton.jit
def _q4_k_header(block, valid, USE_ASM: tl.constexpr):
    """A Q4_K super-block's d and dmin as float32 (zero where ``valid`` is false), and its 12 scale bytes as 3 words."""
    header, s0, s1, s2 = load_words4(block, USE_ASM)
    d, dmin = f16_halves(header)
    return tl.where(valid, d, 0.0), tl.where(valid, dmin, 0.0), s0, s1, s2


@triton.jit
def _sub_block_affine(d, dmin, scale, minimum, MAGIC: tl.constexpr):
    """``(a, b)`` with ``a sum (MAGIC + q) x - b sum x`` the dot of a sub-block of 6-bit ``scale`` and ``minimum``."""
    a = d * scale.to(tl.float32)
    return a, MAGIC * a + dmin * minimum.to(tl.float32)


@triton.jit
def q4_k_fragment_dots(acc0, acc1, acc2, acc3, top, bottom, x_lane, valid, BF16: tl.constexpr,
                       USE_ASM: tl.constexpr):
    """``acc`` (a result fragment) plus the dots of one Q4_K super-block of the lane's rows (uint8 pointers ``top``,
    ``bottom`` to it) with the activations of its column (uint8 pointer ``x_lane`` to the super-block's values, moved
    on by the lane's ``16 t`` bytes); nothing where ``valid`` is false.

    Super-block (144 bytes): f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | 4 chunks of 32 bytes, whose
    low nibbles are sub-block ``2 c`` and high nibbles sub-block ``2 c + 1``. Lane t takes bytes ``8 t .. 8 t + 7`` of
    each chunk: values ``8 t .. 8 t + 7`` of both its sub-blocks."""
    MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
    lane_t = (tl.arange(0, top.shape[0]) % 4) * 8
    top_d, top_dmin, top_s0, top_s1, top_s2 = _q4_k_header(top, valid, USE_ASM)
    bottom_d, bottom_dmin, bottom_s0, bottom_s1, bottom_s2 = _q4_k_header(bottom, valid, USE_ASM)
    for chunk in tl.static_range(4):
        top0, top1 = load_words2(top + 16 + 32 * chunk + lane_t, USE_ASM)
        bottom0, bottom1 = load_words2(bottom + 16 + 32 * chunk + lane_t, USE_ASM)
        top_scales = q4_k_chunk_scales(top_s0, top_s1, top_s2, chunk)  # scale, min of the low, then high sub-block
        bottom_scales = q4_k_chunk_scales(bottom_s0, bottom_s1, bottom_s2, chunk)
        for half in tl.static_range(2):
            x0, x1, x2, x3 = load_words4(x_lane + 128 * chunk + 64 * half, USE_ASM)
            c0, c1, c2, c3, s0, s1 = nibble_sub_block_sums(top0, top1, bottom0, bottom1, x0, x1, x2, x3, 4 * half,
                                                           BF16, USE_ASM)
            top_a, top_b = _sub_block_affine(top_d, top_dmin, top_scales[2 * half], top_scales[2 * half + 1], MAGIC)
            bottom_a, bottom_b = _sub_block_affine(bottom_d, bottom_dmin, bottom_scales[2 * half],
                                                   bottom_scales[2 * half + 1], MAGIC)
            acc0 += top_a * c0 - top_b * s0
            acc1 += top_a * c1 - top_b * s1
            acc2 += bottom_a * c2 - bottom_b * s0
            acc3 += bottom_a * c3 - bottom_b * s1
    return acc0, acc1, acc2, acc3
