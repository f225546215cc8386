"""Readers of the 32-value formats Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0, for every kind of kernel.

Blocks: Q4_0 f16 d | 16 bytes of nibbles; Q4_1 f16 d | f16 m | nibbles; Q5_0 f16 d | 4 bytes of fifth bits | nibbles;
Q5_1 f16 d | f16 m | fifth bits | nibbles; Q8_0 f16 d | 32 int8. Byte j of the nibbles holds value j (low nibble) and
j + 16 (high); bit j of the fifth-bit word is value j's top bit. Their sizes (18, 20, 22, 24, 34 bytes) come from the
format table; only Q4_1's and Q5_1's blocks keep 4-byte alignment along a row.
"""
import triton
import triton.language as tl

from .bits import (
    dp4a, f16_halves, field, flat8, four_halfwords, halfword_fives, halfword_nibbles, halfword_pair,
    halfword_pair_word, int8_dot, byte_tile, load_f16, mantissa_to_f32, two_words, word_nibbles,
)
from .formats import Q4_0, Q4_1, Q4_1_BYTES, Q5_0, Q5_1, Q8_0
from .fragments import column_sum, field_word, group_lane, load_words, plane_mma

# ---------------------------------------------------------------------------------------------
# 32-value units, for the exact GEMV and GEMM and the dequantizer (``readers.unit_pieces``): the unit's
# four pieces in value order with the affine map ``(a, b)`` of each, ``weight = a * f + b``.


@triton.jit
def q4_0_pieces(blockp):
    # Block (18 bytes): f16 d | 16 bytes, byte i holds value i (low nibble) and i + 16 (high);
    # w = d * (q - 8) = 16 d * f - 24 d.
    d = load_f16(blockp)
    first, second = four_halfwords(blockp + 2), four_halfwords(blockp + 10)
    a, b = 16.0 * d, -24.0 * d
    return (
        halfword_nibbles(first, 0), halfword_nibbles(second, 0),
        halfword_nibbles(first, 4), halfword_nibbles(second, 4),
        a, b,
    )


@triton.jit
def q4_1_pieces(blockp):
    # Block (20 bytes): f16 d | f16 m | 16 bytes of nibbles as in Q4_0; w = d * q + m = 16 d * f + m - 16 d.
    d = load_f16(blockp)
    m = load_f16(blockp + 2)
    first, second = two_words(blockp + 4, 0), two_words(blockp + 12, 0)
    a = 16.0 * d
    return (
        word_nibbles(first, 0), word_nibbles(second, 0),
        word_nibbles(first, 4), word_nibbles(second, 4),
        a, m - a,
    )


@triton.jit
def _q5_pieces(quants, high_bits):
    # 16 bytes of nibbles as in Q4_0; bit i of the int32 ``high_bits`` is the top bit of value i; f = 1 + q / 32.
    first, second = four_halfwords(quants), four_halfwords(quants + 8)
    return (
        halfword_fives(first, 0, high_bits), halfword_fives(second, 0, high_bits >> 8),
        halfword_fives(first, 4, high_bits >> 16), halfword_fives(second, 4, high_bits >> 24),
    )


@triton.jit
def q5_0_pieces(blockp):
    # Block (22 bytes): f16 d | 4 bytes of top bits | 16 bytes of nibbles; w = d * (q - 16) = 32 d * f - 48 d.
    d = load_f16(blockp)
    f0, f1, f2, f3 = _q5_pieces(blockp + 6, halfword_pair_word(blockp + 2))
    return f0, f1, f2, f3, 32.0 * d, -48.0 * d


@triton.jit
def q5_1_pieces(blockp):
    # Block (24 bytes): f16 d | f16 m | 4 bytes of top bits | 16 bytes of nibbles; w = d * q + m = 32 d * f + m - 32 d.
    d = load_f16(blockp)
    m = load_f16(blockp + 2)
    f0, f1, f2, f3 = _q5_pieces(blockp + 8, tl.load((blockp + 4).to(tl.pointer_type(tl.int32))))
    a = 32.0 * d
    return f0, f1, f2, f3, a, m - a


@triton.jit
def q8_0_pieces(blockp):
    # Block (34 bytes): f16 d | 32 int8; flipping the sign bits maps q to q + 128 in 0..255, so
    # f = 1 + (q + 128) / 256 and w = d * q = 256 d * f - 384 d.
    d = load_f16(blockp)
    p0 = four_halfwords(blockp + 2) ^ 0x8080
    p1 = four_halfwords(blockp + 10) ^ 0x8080
    p2 = four_halfwords(blockp + 18) ^ 0x8080
    p3 = four_halfwords(blockp + 26) ^ 0x8080
    return _q8_piece(p0), _q8_piece(p1), _q8_piece(p2), _q8_piece(p3), 256.0 * d, -384.0 * d


@triton.jit
def _q8_piece(quad):
    return flat8(tl.join(mantissa_to_f32(field(quad, 0, 8, 15)), mantissa_to_f32(field(quad, 8, 8, 15))))

# ---------------------------------------------------------------------------------------------
# Integer dots against Q8 activations, for the llama.cpp-numerics GEMV: the activations come quantized as
# ggml-cpu quantizes them for the weight's type, and each block's or sub-block's dot is an integer sum of
# 4-byte products (``bits.dp4a``), scaled in float32 as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>`` does it.


@triton.jit
def _legacy_layout(FMT: tl.constexpr, blockp):
    """Where a Q4_0 / Q4_1 / Q5_0 / Q5_1 block keeps its 16 bytes of nibbles and (Q5_x) the 32-bit word of fifth bits
    (bit j: value j)."""
    if FMT == Q4_0:
        quants, high = blockp + 2, blockp
    elif FMT == Q4_1:
        quants, high = blockp + 4, blockp
    elif FMT == Q5_0:
        quants, high = blockp + 6, blockp + 2
    else:
        tl.static_assert(FMT == Q5_1, "a legacy 4- or 5-bit format")
        quants, high = blockp + 8, blockp + 4
    return quants, high


@triton.jit
def _spread_bits(bits):
    """Bits 0-3 of int32 ``bits`` as bit 4 of bytes 0-3."""
    return ((bits & 1) | ((bits & 2) << 7) | ((bits & 4) << 14) | ((bits & 8) << 21)) << 4


@triton.jit
def legacy_dots_q8(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, first, n_units, xq, x_scales, x_sums,
    BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Dots ``[BLOCK_N, BLOCK_U]`` of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks ``first ..`` with Q8_0 / Q8_1 activations
    (``xq`` int32 words of int8 values; per 32 values the scale ``x_scales`` and, for Q8_1, ``x_sums`` = scale * sum of
    the int8s, both float16 values in float32): ``d dx sum(q x)``, plus ``m s`` for Q4_1 and Q5_1; blocks past the
    row get zero activations."""
    unit = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    blockp = rowp + tl.minimum(unit, n_units - 1) * TYPE_SIZE
    x_unit = first + tl.arange(0, BLOCK_U)
    inside = x_unit < n_units
    dot = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    if FMT == Q8_0:
        for pair in tl.static_range(4):  # words 2 pair, 2 pair + 1: values 8 pair .. 8 pair + 7
            q0, q1 = halfword_pair(blockp + 2 + 8 * pair)
            x0 = tl.load(xq + 8 * x_unit + 2 * pair, mask=inside, other=0)
            x1 = tl.load(xq + 8 * x_unit + 2 * pair + 1, mask=inside, other=0)
            dot = dp4a(tl.reshape(q0, (BLOCK_N, BLOCK_U)), x0[None, :], dot, USE_ASM, SIGNED_A=True)
            dot = dp4a(tl.reshape(q1, (BLOCK_N, BLOCK_U)), x1[None, :], dot, USE_ASM, SIGNED_A=True)
    else:
        # 16 bytes of nibbles: byte j holds value j (low nibble) and j + 16 (high); the weight is d (q - OFFSET) or d q + m
        OFFSET: tl.constexpr = 8 if FMT == Q4_0 else 16 if FMT == Q5_0 else 0
        quants, high = _legacy_layout(FMT, blockp)
        if FMT == Q5_0 or FMT == Q5_1:
            fifths = halfword_pair_word(high)
        x_total = tl.zeros((BLOCK_U,), tl.int32)
        for pair in tl.static_range(2):  # words 2 pair, 2 pair + 1: bytes 8 pair .. 8 pair + 7
            words = halfword_pair(quants + 8 * pair)
            for half in tl.static_range(2):
                q_lo, q_hi = words[half] & 0x0F0F0F0F, (words[half] >> 4) & 0x0F0F0F0F
                if FMT == Q5_0 or FMT == Q5_1:  # values 8 pair + 4 half .. + 3 and 16 more
                    q_lo |= _spread_bits(fifths >> (8 * pair + 4 * half))
                    q_hi |= _spread_bits(fifths >> (16 + 8 * pair + 4 * half))
                x_lo = tl.load(xq + 8 * x_unit + 2 * pair + half, mask=inside, other=0)
                x_hi = tl.load(xq + 8 * x_unit + 4 + 2 * pair + half, mask=inside, other=0)
                dot = dp4a(tl.reshape(q_lo, (BLOCK_N, BLOCK_U)), x_lo[None, :], dot, USE_ASM)
                dot = dp4a(tl.reshape(q_hi, (BLOCK_N, BLOCK_U)), x_hi[None, :], dot, USE_ASM)
                if OFFSET != 0:
                    ones = tl.full((BLOCK_U,), 0x01010101, tl.int32)
                    x_total = dp4a(ones, x_hi, dp4a(ones, x_lo, x_total, USE_ASM), USE_ASM)
        if OFFSET != 0:
            dot -= OFFSET * x_total[None, :]
    d = tl.reshape(load_f16(blockp), (BLOCK_N, BLOCK_U))
    dx = tl.load(x_scales + x_unit, mask=inside, other=0.0)[None, :]
    out = d * dx * dot.to(tl.float32)
    if FMT == Q4_1 or FMT == Q5_1:
        out += tl.reshape(load_f16(blockp + 2), (BLOCK_N, BLOCK_U)) * tl.load(x_sums + x_unit, mask=inside, other=0.0)[None, :]
    return out

# ---------------------------------------------------------------------------------------------
# Int8 tiles, for the llama.cpp-numerics GEMM: a block's or sub-block's weights as an int8 tile ``[BLOCK_N, 32]``
# for ``tl.dot`` with the int8 activations ``[BLOCK_M, 32]`` (``bits.int8_dot``).


@triton.jit
def legacy_tile_dots_q8(FMT: tl.constexpr, blockp, x):
    """For one Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 block of each weight row and its 32 Q8 activations of each row,
    ``sum q x`` (Q4_0's q less 8, Q5_0's less 16), int32 ``[BLOCK_M, BLOCK_N]``."""
    cols = tl.arange(0, 32)
    if FMT == Q8_0:
        q = tl.load((blockp + 2).to(tl.pointer_type(tl.int8))[:, None] + cols[None, :]).to(tl.int32)
    else:
        # byte i holds value i (low nibble) and i + 16 (high); bit i of the Q5 formats' fifth-bit word is value i's
        quants, high = _legacy_layout(FMT, blockp)
        q = (byte_tile(quants, cols % 16) >> (4 * (cols[None, :] // 16))) & 0xF
        if FMT == Q5_0 or FMT == Q5_1:
            q |= ((halfword_pair_word(high)[:, None] >> cols[None, :]) & 1) << 4
        if FMT == Q4_0:
            q -= 8
        elif FMT == Q5_0:
            q -= 16
    return int8_dot(tl.load(x[:, None] + cols[None, :]), q)

# ---------------------------------------------------------------------------------------------
# Tensor-core fragments, for the fragment kernel (``mma``; ``fragments`` explains the scheme).
# Q4_0, Q4_1 and Q8_0, a pair of blocks per step.


@triton.jit
def _pair_fields(w_ptr, pair, valid, FMT: tl.constexpr, USE_ASM: tl.constexpr):
    """The scales d of a pair of Q4_0 or Q8_0 blocks of the lane's row (zero where ``valid`` is false), and the lane's
    words of quants of each block (``_block_planes``), from the pair at 4-byte aligned byte ``pair`` of ``w_ptr``.

    Blocks: Q4_0 f16 d | 16 bytes (18), Q8_0 f16 d | 32 int8 (34), so the first block's quants sit 2 bytes past a
    word. The 4 lanes of a row read the pair's words as ``W[t], W[4 + t], ...`` (16 contiguous bytes per load, the
    last load only for W[4 L]) and pass the rest between them: ``W[4 i + t + 1]`` is the next lane's ``W[4 i + t]``,
    or for lane 3 lane 0's ``W[4 (i + 1)]``."""
    t = tl.arange(0, pair.shape[0]) % 4
    last = t == 3
    words = (w_ptr + pair).to(tl.pointer_type(tl.int32)) + t
    r0, r1 = tl.load(words), tl.load(words + 4)
    sixteen = tl.full(pair.shape, 16, tl.int32)
    next0, next1 = group_lane(r0, -1, USE_ASM), group_lane(r1, -1, USE_ASM)
    first_low = field_word(r0, next0, next1, last, sixteen, USE_ASM)  # bytes 2 + 4 t ..
    d0 = group_lane(r0, 0, USE_ASM) & 0xFFFF
    if FMT == Q4_0:  # 9 words: d0 q0 .. | .. q0 d1 | q1 ..
        next2 = group_lane(tl.load(words + 8, mask=t == 0, other=0), -1, USE_ASM)
        d1 = group_lane(r1, 0, USE_ASM) >> 16
        first_high, second_low = first_low, tl.where(last, next2, next1)  # W[5 + t]
        second_high = second_low
    else:  # 17 words: d0 q0 .. | .. | .. q0 d1 | q1 .. | ..
        r2, r3 = tl.load(words + 8), tl.load(words + 12)
        next2, next3 = group_lane(r2, -1, USE_ASM), group_lane(r3, -1, USE_ASM)
        next4 = group_lane(tl.load(words + 16, mask=t == 0, other=0), -1, USE_ASM)
        first_high = field_word(r1, next1, next2, last, sixteen, USE_ASM)  # bytes 18 + 4 t ..
        d1 = group_lane(r2, 0, USE_ASM) >> 16
        second_low, second_high = tl.where(last, next3, next2), tl.where(last, next4, next3)  # W[9 + t], W[13 + t]
    d0, d1 = f16_halves(d0 | (d1 << 16))
    return tl.where(valid, d0, 0.0), tl.where(valid, d1, 0.0), first_low, first_high, second_low, second_high


@triton.jit
def _block_planes(top_low, top_high, bottom_low, bottom_high, xa0, xa1, xb0, xb1, FMT: tl.constexpr,
                  BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """A Q4_0, Q4_1 or Q8_0 block's sums C for the lane's two rows, its first 16 values against activations ``xa``
    and its last 16 against ``xb``: ``sum (MAGIC + q) x`` of the nibbles of words ``low`` (low nibbles), ``high``
    (high nibbles; the same word) for the 4-bit formats; for Q8_0 of u = q + 128, bytes ``4 t ..`` of each 16 in
    ``low`` and ``high``, as one plane in float16 and as ``16 (MAGIC + u / 16) + (MAGIC + u % 16)`` in bfloat16,
    where only values below 128 are exact."""
    zero = tl.zeros(xa0.shape, tl.float32)
    if FMT == Q8_0:
        top_low, top_high = top_low ^ -0x7F7F7F80, top_high ^ -0x7F7F7F80  # 0x80808080: signed bytes as q + 128
        bottom_low, bottom_high = bottom_low ^ -0x7F7F7F80, bottom_high ^ -0x7F7F7F80
        if BF16:
            h0, h1, h2, h3 = plane_mma((top_low >> 4) & 0x0F0F0F0F, (bottom_low >> 4) & 0x0F0F0F0F, xa0, xa1,
                                       zero, zero, zero, zero, BF16, USE_ASM)
            h0, h1, h2, h3 = plane_mma((top_high >> 4) & 0x0F0F0F0F, (bottom_high >> 4) & 0x0F0F0F0F, xb0, xb1,
                                       h0, h1, h2, h3, BF16, USE_ASM)
            c0, c1, c2, c3 = plane_mma(top_low & 0x0F0F0F0F, bottom_low & 0x0F0F0F0F, xa0, xa1,
                                       16.0 * h0, 16.0 * h1, 16.0 * h2, 16.0 * h3, BF16, USE_ASM)
            return plane_mma(top_high & 0x0F0F0F0F, bottom_high & 0x0F0F0F0F, xb0, xb1, c0, c1, c2, c3, BF16,
                             USE_ASM)
        c0, c1, c2, c3 = plane_mma(top_low, bottom_low, xa0, xa1, zero, zero, zero, zero, BF16, USE_ASM)
        return plane_mma(top_high, bottom_high, xb0, xb1, c0, c1, c2, c3, BF16, USE_ASM)
    c0, c1, c2, c3 = plane_mma(top_low & 0x0F0F0F0F, bottom_low & 0x0F0F0F0F, xa0, xa1, zero, zero, zero, zero, BF16,
                               USE_ASM)
    return plane_mma((top_high >> 4) & 0x0F0F0F0F, (bottom_high >> 4) & 0x0F0F0F0F, xb0, xb1, c0, c1, c2, c3, BF16,
                     USE_ASM)


@triton.jit
def _block_affine(d, m, FMT: tl.constexpr, BF16: tl.constexpr):
    """``(a, b)`` with ``a C - b S`` a block's dot, C its ``_block_planes`` sums and S the sum of its activations."""
    MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
    if FMT == Q4_1:
        return d, MAGIC * d - m
    if FMT == Q4_0:
        return d, (MAGIC + 8.0) * d
    return d, ((17.0 * MAGIC) if BF16 else MAGIC) * d + 128.0 * d  # Q8_0: q = u - 128


@triton.jit
def _block_dots(acc0, acc1, acc2, acc3, top_d, top_m, top_low, top_high, bottom_d, bottom_m, bottom_low, bottom_high,
                x_row, FMT: tl.constexpr, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``acc`` plus one block's dots, from its scales (and Q4_1 minimums) and the lane's words of quants of its two
    rows, with the activations at uint8 pointer ``x_row``: lane t takes values ``4 t ..`` of the block's first and
    last 16."""
    t8 = (tl.arange(0, top_low.shape[0]) % 4) * 8
    xa0, xa1 = load_words(x_row + t8[None, :], 2, USE_ASM)
    xb0, xb1 = load_words(x_row + 32 + t8[None, :], 2, USE_ASM)
    zero = tl.zeros(xa0.shape, tl.float32)
    s0, s1 = column_sum(xa0, xa1, zero, zero, BF16, USE_ASM)
    s0, s1 = column_sum(xb0, xb1, s0, s1, BF16, USE_ASM)
    c0, c1, c2, c3 = _block_planes(top_low, top_high, bottom_low, bottom_high, xa0, xa1, xb0, xb1, FMT, BF16, USE_ASM)
    top_a, top_b = _block_affine(top_d[None, :], top_m[None, :], FMT, BF16)
    bottom_a, bottom_b = _block_affine(bottom_d[None, :], bottom_m[None, :], FMT, BF16)
    return (acc0 + top_a * c0 - top_b * s0, acc1 + top_a * c1 - top_b * s1,
            acc2 + bottom_a * c2 - bottom_b * s0, acc3 + bottom_a * c3 - bottom_b * s1)


@triton.jit
def _q4_1_fields(w_ptr, block, valid):
    """d and m of a Q4_1 block (f16 d | f16 m | 16 bytes, 4-byte aligned) of the lane's row, zero where ``valid`` is
    false, and the lane's word of quants (bytes ``4 t ..``)."""
    words = (w_ptr + block).to(tl.pointer_type(tl.int32))
    d, m = f16_halves(tl.load(words))
    quants = tl.load(words + 1 + tl.arange(0, block.shape[0]) % 4)
    return tl.where(valid, d, 0.0), tl.where(valid, m, 0.0), quants


@triton.jit
def legacy_pair_dots(acc0, acc1, acc2, acc3, w_ptr, top, bottom, x_row, valid, FMT: tl.constexpr,
                     BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``acc`` (a result fragment per tile) plus the dots of a pair of 32-value Q4_0, Q4_1 or Q8_0 blocks of the lane's
    rows (at 4-byte aligned byte offsets ``top``, ``bottom`` of ``w_ptr``) with the activations of its column in each
    tile (uint8 pointers ``x_row`` to the pair's values); nothing where ``valid`` is false."""
    if FMT == Q4_1:
        for i in tl.static_range(2):
            top_d, top_m, top_quants = _q4_1_fields(w_ptr, top + Q4_1_BYTES * i, valid)
            bottom_d, bottom_m, bottom_quants = _q4_1_fields(w_ptr, bottom + Q4_1_BYTES * i, valid)
            acc0, acc1, acc2, acc3 = _block_dots(acc0, acc1, acc2, acc3, top_d, top_m, top_quants, top_quants,
                                                 bottom_d, bottom_m, bottom_quants, bottom_quants, x_row + 64 * i,
                                                 FMT, BF16, USE_ASM)
    else:
        top_d0, top_d1, top0_low, top0_high, top1_low, top1_high = _pair_fields(w_ptr, top, valid, FMT, USE_ASM)
        bottom_d0, bottom_d1, bottom0_low, bottom0_high, bottom1_low, bottom1_high = _pair_fields(
            w_ptr, bottom, valid, FMT, USE_ASM)
        acc0, acc1, acc2, acc3 = _block_dots(acc0, acc1, acc2, acc3, top_d0, top_d0, top0_low, top0_high,
                                             bottom_d0, bottom_d0, bottom0_low, bottom0_high, x_row, FMT, BF16,
                                             USE_ASM)
        acc0, acc1, acc2, acc3 = _block_dots(acc0, acc1, acc2, acc3, top_d1, top_d1, top1_low, top1_high,
                                             bottom_d1, bottom_d1, bottom1_low, bottom1_high, x_row + 64, FMT, BF16,
                                             USE_ASM)
    return acc0, acc1, acc2, acc3
