"""Readers of Q6_K, for every kind of kernel.

Super-block (210 bytes, 2-byte aligned along a row): 128 bytes ql | 64 bytes qh | 16 int8 scales | f16 d. Value
``128 h + 32 k + i`` (h < 2, k < 4, i < 32) is nibble ``k // 2`` of ``ql[64 h + 32 (k % 2) + i]`` with bits ``2 k``,
``2 k + 1`` of ``qh[32 h + i]`` above it; ``w = d * scale[value // 16] * (q - 32)``.
"""
import triton
import triton.language as tl

from .bits import (
    byte_tile, dp4a, field, flat8, four_halfwords, f16_halves, halfword_pair, halves_dot, load_f16, mantissa_to_f32,
)
from .fragments import column_sum, field_word, group_lane, load_words, plane_mma

# ---------------------------------------------------------------------------------------------
# 32-value units, for the exact GEMV and GEMM and the dequantizer (``readers.unit_pieces``): the unit's
# four pieces in value order with the affine map ``(a, b)`` of each, ``weight = a * f + b``.
# A unit is the k = 0..3 pieces of one group of 8 values, each piece with its own map.


@triton.jit
def q6_k_pieces(blockp, half, group):
    # Super-block (210 bytes): 128 bytes ql | 64 bytes qh | 16 int8 scales | f16 d. Value
    # 128 * h + 32 * k + i (h < 2, k < 4, i < 32) is nibble k // 2 of ql[64 * h + 32 * (k % 2) + i]
    # with bits 2k, 2k + 1 of qh[32 * h + i] above it; w = d * scale[value // 16] * (q - 32).
    # The pieces are k = 0..3 for the 8 values i = 8 * group .. + 7; f = 1 + q / 64, so
    # w = 64 d scale * f - 96 d scale.
    d = load_f16(blockp + 208)
    ql_even = four_halfwords(blockp + 64 * half + 8 * group)
    ql_odd = four_halfwords(blockp + 64 * half + 32 + 8 * group)
    qh = four_halfwords(blockp + 128 + 32 * half + 8 * group)
    scalep = (blockp + 192 + 8 * half + group // 2).to(tl.pointer_type(tl.int8))
    a0, b0 = _q6_affine(scalep, d, 0)
    a1, b1 = _q6_affine(scalep, d, 1)
    a2, b2 = _q6_affine(scalep, d, 2)
    a3, b3 = _q6_affine(scalep, d, 3)
    return (
        _q6_piece(ql_even, 0, qh, 0), _q6_piece(ql_odd, 0, qh, 2),
        _q6_piece(ql_even, 4, qh, 4), _q6_piece(ql_odd, 4, qh, 6),
        a0, b0, a1, b1, a2, b2, a3, b3,
    )


@triton.jit
def _q6_affine(scalep, d, k: tl.constexpr):
    ds = d * tl.load(scalep + 2 * k).to(tl.float32)
    return 64.0 * ds, -96.0 * ds


@triton.jit
def _q6_piece(ql, QL_SHIFT: tl.constexpr, qh, QH_SHIFT: tl.constexpr):
    """f = 1 + q / 64 of the 8 values: the low 4 bits from ``ql``'s nibble, the high 2 from ``qh``."""
    byte0 = field(ql, QL_SHIFT, 4, 17) | field(qh, QH_SHIFT, 2, 21)
    byte1 = field(ql, QL_SHIFT + 8, 4, 17) | field(qh, QH_SHIFT + 8, 2, 21)
    return flat8(tl.join(mantissa_to_f32(byte0), mantissa_to_f32(byte1)))

# ---------------------------------------------------------------------------------------------
# Integer dots against Q8 activations, for the llama.cpp-numerics GEMV: the activations come quantized as
# ggml-cpu quantizes them for the weight's type, and each block's or sub-block's dot is an integer sum of
# 4-byte products (``bits.dp4a``), scaled in float32 as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>`` does it.


@triton.jit
def q6_k_dots_q8k(
    rowp, first, n_units, xq, xd, TYPE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """Dots ``[BLOCK_N, BLOCK_U]`` of Q6_K units ``first ..`` (``dot_units``' units: half h, group g of a super-block,
    values ``128 h + 32 k + 8 g + i``) with Q8_K activations (``xq`` int32 words of int8 values, ``xd`` a float32 scale
    per 256). Per 16-value group, ``scale * (sum q x - 32 sum x)`` in integers, then ``d d8`` once per unit; units past
    the row get zero activations."""
    unit = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
    half, group = (unit // 4) % 2, unit % 4
    ql_even = halfword_pair(blockp + 64 * half + 8 * group)
    ql_odd = halfword_pair(blockp + 64 * half + 32 + 8 * group)
    qh = halfword_pair(blockp + 128 + 32 * half + 8 * group)
    scalep = (blockp + 192 + 8 * half + group // 2).to(tl.pointer_type(tl.int8))

    x_unit = first + tl.arange(0, BLOCK_U)
    inside = x_unit < n_units
    x_word = 64 * (x_unit // 8) + 32 * ((x_unit // 4) % 2) + 2 * (x_unit % 4)  # word of value 128 h + 8 g
    isum = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    for k in tl.static_range(4):
        if k % 2 == 0:
            ql = ql_even
        else:
            ql = ql_odd
        dot = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
        x_total = tl.zeros((BLOCK_U,), tl.int32)
        for word in tl.static_range(2):
            # bytes 4 word .. 4 word + 3 of the group: q = nibble k // 2 of ql | bits 2k, 2k + 1 of qh, above it
            q = ((ql[word] >> (4 * (k // 2))) & 0x0F0F0F0F) | (((qh[word] >> (2 * k)) << 4) & 0x30303030)
            x = tl.load(xq + x_word + 8 * k + word, mask=inside, other=0)
            dot = dp4a(tl.reshape(q, (BLOCK_N, BLOCK_U)), x[None, :], dot, USE_ASM)
            x_total = dp4a(tl.full((BLOCK_U,), 0x01010101, tl.int32), x, x_total, USE_ASM)
        scale = tl.reshape(tl.load(scalep + 2 * k).to(tl.int32), (BLOCK_N, BLOCK_U))
        isum += scale * (dot - 32 * x_total[None, :])
    d = tl.reshape(load_f16(blockp + 208), (BLOCK_N, BLOCK_U))
    d8 = tl.load(xd + x_unit // 8, mask=inside, other=0.0)[None, :]
    return d8 * d * isum.to(tl.float32)

# ---------------------------------------------------------------------------------------------
# Int8 tiles, for the llama.cpp-numerics GEMM: a block's or sub-block's weights as an int8 tile ``[BLOCK_N, 32]``
# for ``tl.dot`` with the int8 activations ``[BLOCK_M, 32]`` (``bits.int8_dot``).
# The int8 tensor-core product takes K = 32 at least, so the 16-value groups are dots
# over 32 values with the other group's weights zeroed (``bits.halves_dot``).


@triton.jit
def q6_k_tile_dots_q8k(blockp, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one Q6_K super-block of each weight row and its 256 Q8_K activations of each row, ggml's integer sum
    ``sum_g scale_g sum (q - 32) x`` over the 16-value groups g, int32 ``[BLOCK_M, BLOCK_N]``."""
    cols = tl.arange(0, 32)
    scalep = (blockp + 192).to(tl.pointer_type(tl.int8))
    dots = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for half in tl.static_range(2):
        ql_even = byte_tile(blockp + 64 * half, cols)
        ql_odd = byte_tile(blockp + 64 * half + 32, cols)
        qh = byte_tile(blockp + 128 + 32 * half, cols)
        for k in tl.static_range(4):  # values 128 half + 32 k + i: nibble k // 2 of ql, bits 2k, 2k + 1 of qh
            if k % 2 == 0:
                ql = ql_even
            else:
                ql = ql_odd
            q = (((ql >> (4 * (k // 2))) & 0xF) | (((qh >> (2 * k)) & 3) << 4)) - 32
            xs = tl.load(x[:, None] + 128 * half + 32 * k + cols[None, :])
            group = 8 * half + 2 * k
            dots += halves_dot(xs, q, tl.load(scalep + group).to(tl.int32), tl.load(scalep + group + 1).to(tl.int32))
    return dots

# ---------------------------------------------------------------------------------------------
# Tensor-core fragments, for the fragment kernel (``mma``; ``fragments`` explains the scheme).
# A super-block per step, one instruction per 16-value scale group.


@triton.jit
def _q6_k_row(w_ptr, block, valid, USE_ASM: tl.constexpr):
    """The lane's words (word t of each 16-byte row: ql 0-7, qh 8-11, scales 12) of the Q6_K super-block at even byte
    ``block`` of the 4-byte aligned ``w_ptr``, and its d as float32 (zero where ``valid`` is false).

    Super-block (210 bytes): 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) | 16 int8 scales | f16 d. Every
    other one starts 2 bytes past a word, so the 4 lanes of a row load the aligned words ``W[4 i + t]`` around it and
    pass each other the next word, as ``legacy._pair_fields`` does."""
    t = tl.arange(0, block.shape[0]) % 4
    last = t == 3
    shift = (block & 2).to(tl.int32) * 8
    words = (w_ptr + (block - (block & 2))).to(tl.pointer_type(tl.int32)) + t
    r0, r1, r2, r3 = tl.load(words), tl.load(words + 4), tl.load(words + 8), tl.load(words + 12)
    r4, r5, r6, r7 = tl.load(words + 16), tl.load(words + 20), tl.load(words + 24), tl.load(words + 28)
    r8, r9, r10, r11 = tl.load(words + 32), tl.load(words + 36), tl.load(words + 40), tl.load(words + 44)
    r12, r13 = tl.load(words + 48), tl.load(words + 52, mask=t == 0, other=0)  # d, and the word after the scales
    n0, n1, n2, n3 = (group_lane(r0, -1, USE_ASM), group_lane(r1, -1, USE_ASM), group_lane(r2, -1, USE_ASM),
                      group_lane(r3, -1, USE_ASM))
    n4, n5, n6, n7 = (group_lane(r4, -1, USE_ASM), group_lane(r5, -1, USE_ASM), group_lane(r6, -1, USE_ASM),
                      group_lane(r7, -1, USE_ASM))
    n8, n9, n10, n11 = (group_lane(r8, -1, USE_ASM), group_lane(r9, -1, USE_ASM), group_lane(r10, -1, USE_ASM),
                        group_lane(r11, -1, USE_ASM))
    n12, n13 = group_lane(r12, -1, USE_ASM), group_lane(r13, -1, USE_ASM)
    d, _ = f16_halves(group_lane(r13, 0, USE_ASM) >> shift)
    return (field_word(r0, n0, n1, last, shift, USE_ASM), field_word(r1, n1, n2, last, shift, USE_ASM),
            field_word(r2, n2, n3, last, shift, USE_ASM), field_word(r3, n3, n4, last, shift, USE_ASM),
            field_word(r4, n4, n5, last, shift, USE_ASM), field_word(r5, n5, n6, last, shift, USE_ASM),
            field_word(r6, n6, n7, last, shift, USE_ASM), field_word(r7, n7, n8, last, shift, USE_ASM),
            field_word(r8, n8, n9, last, shift, USE_ASM), field_word(r9, n9, n10, last, shift, USE_ASM),
            field_word(r10, n10, n11, last, shift, USE_ASM), field_word(r11, n11, n12, last, shift, USE_ASM),
            field_word(r12, n12, n13, last, shift, USE_ASM), tl.where(valid, d, 0.0))


@triton.jit
def _q6_k_quants(ql, qh, J: tl.constexpr):
    """The 6-bit quants of group ``j`` of a quarter (``_q6_k_quarter``) in one word: the low (j = 0, 1) or high
    (j = 2, 3) nibbles of ``ql`` under bits ``2 j`` of ``qh``."""
    return ((ql >> (4 * (J // 2))) & 0x0F0F0F0F) | (((qh >> (2 * J)) & 0x03030303) << 4)


@triton.jit
def _q6_k_group_scale(scales, d, GROUP: tl.constexpr, USE_ASM: tl.constexpr):
    """``d`` times the int8 scale of 16-value group ``GROUP``: byte ``GROUP % 4`` of the scales word that lane
    ``GROUP // 4`` of the row holds."""
    word = group_lane(scales, GROUP // 4, USE_ASM)
    return d * ((word << (24 - 8 * (GROUP % 4))) >> 24).to(tl.float32)


@triton.jit
def _q6_k_quarter(acc0, acc1, acc2, acc3, top_a, top_b, top_high, top_scales, top_d, bottom_a, bottom_b, bottom_high,
                  bottom_scales, bottom_d, x_quarter, H: tl.constexpr, HALF: tl.constexpr, BF16: tl.constexpr,
                  USE_ASM: tl.constexpr):
    """``acc`` plus the dots of the 4 scale groups ``8 H + HALF + 2 j`` of a Q6_K super-block (values
    ``128 H + 32 j + 16 HALF ..``, activations from uint8 pointer ``x_quarter``, ``j`` apart by 64 bytes), one
    instruction each: ql word ``a`` (even j) or ``b`` (odd j) and qh word ``high`` make ``q`` in 0..63
    (``_q6_k_quants``); the group's dot is ``d scale (sum (MAGIC + q) x - (MAGIC + 32) sum x)``."""
    MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
    t8 = (tl.arange(0, top_a.shape[0]) % 4) * 8
    for j in tl.static_range(4):
        if j % 2 == 0:
            top_q, bottom_q = _q6_k_quants(top_a, top_high, j), _q6_k_quants(bottom_a, bottom_high, j)
        else:
            top_q, bottom_q = _q6_k_quants(top_b, top_high, j), _q6_k_quants(bottom_b, bottom_high, j)
        x0, x1 = load_words(x_quarter + 64 * j + t8[None, :], 2, USE_ASM)
        zero = tl.zeros(x0.shape, tl.float32)
        c0, c1, c2, c3 = plane_mma(top_q, bottom_q, x0, x1, zero, zero, zero, zero, BF16, USE_ASM)
        s0, s1 = column_sum(x0, x1, zero, zero, BF16, USE_ASM)
        top_scale = _q6_k_group_scale(top_scales, top_d, 8 * H + HALF + 2 * j, USE_ASM)[None, :]
        bottom_scale = _q6_k_group_scale(bottom_scales, bottom_d, 8 * H + HALF + 2 * j, USE_ASM)[None, :]
        acc0 += top_scale * (c0 - (MAGIC + 32.0) * s0)
        acc1 += top_scale * (c1 - (MAGIC + 32.0) * s1)
        acc2 += bottom_scale * (c2 - (MAGIC + 32.0) * s0)
        acc3 += bottom_scale * (c3 - (MAGIC + 32.0) * s1)
    return acc0, acc1, acc2, acc3


@triton.jit
def q6_k_fragment_dots(acc0, acc1, acc2, acc3, w_ptr, top, bottom, x_row, valid, BF16: tl.constexpr,
                       USE_ASM: tl.constexpr):
    """``acc`` (a result fragment per tile) plus the dots of one Q6_K super-block of the lane's rows (at even byte
    offsets ``top``, ``bottom`` of ``w_ptr``) with the activations of its column in each tile (uint8 pointers ``x_row``
    to the super-block's values); nothing where ``valid`` is false. Each 16-value scale group is one instruction, lane t
    taking values ``4 t .. 4 t + 3`` of it."""
    (t0, t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, top_scales, top_d) = _q6_k_row(w_ptr, top, valid, USE_ASM)
    (b0, b1, b2, b3, b4, b5, b6, b7, b8, b9, b10, b11, bottom_scales, bottom_d) = _q6_k_row(w_ptr, bottom, valid,
                                                                                          USE_ASM)
    # quarter (H, HALF): ql rows 4 H + HALF (a) and 4 H + 2 + HALF (b), qh row 8 + 2 H + HALF
    acc0, acc1, acc2, acc3 = _q6_k_quarter(acc0, acc1, acc2, acc3, t0, t2, t8, top_scales, top_d, b0, b2, b8,
                                           bottom_scales, bottom_d, x_row, 0, 0, BF16, USE_ASM)
    acc0, acc1, acc2, acc3 = _q6_k_quarter(acc0, acc1, acc2, acc3, t1, t3, t9, top_scales, top_d, b1, b3, b9,
                                           bottom_scales, bottom_d, x_row + 32, 0, 1, BF16, USE_ASM)
    acc0, acc1, acc2, acc3 = _q6_k_quarter(acc0, acc1, acc2, acc3, t4, t6, t10, top_scales, top_d, b4, b6, b10,
                                           bottom_scales, bottom_d, x_row + 256, 1, 0, BF16, USE_ASM)
    acc0, acc1, acc2, acc3 = _q6_k_quarter(acc0, acc1, acc2, acc3, t5, t7, t11, top_scales, top_d, b5, b7, b11,
                                           bottom_scales, bottom_d, x_row + 288, 1, 1, BF16, USE_ASM)
    return acc0, acc1, acc2, acc3
