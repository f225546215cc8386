"""Readers of the K-quants with 16-value scales and 2-bit code planes, Q2_K and Q3_K, for every kind of kernel.

Super-blocks of 256 values: Q2_K (84 bytes) 16 scale bytes (4-bit scale low, 4-bit min high, one per 16 values) |
64 bytes of 2-bit codes | f16 d | f16 dmin; Q3_K (110 bytes) 32 bytes of top bits | 64 bytes of low 2 bits laid out
as Q2_K's codes | 12 scale bytes (one 6-bit scale per 16 values) | f16 d. A sub-block of 32 values is
``4 h + j``: bits ``2 j``, ``2 j + 1`` of code bytes ``32 h .. 32 h + 31``.

Besides 32-value units the exact GEMV and the GEMM read them in 64-value chunks (``small_k_chunk_*``): a chunk's 16
code bytes hold four pieces of 16 values, so each byte is loaded once, not once per piece.
"""
import triton
import triton.language as tl

from .bits import (
    byte_floats, byte_tile, dot_chain, dp4a, f16_halves, four_halfwords, halfword_pair_word, halfword_threes,
    halves_dot, load_f16, split8,
)
from .formats import Q2_K, Q2_K_BYTES, Q3_K, Q3_K_BYTES

# ---------------------------------------------------------------------------------------------
# 32-value units, for the exact GEMV and GEMM and the dequantizer (``readers.unit_pieces``): the unit's
# four pieces in value order with the affine map ``(a, b)`` of each, ``weight = a * f + b``.
# One map per 16 values.


@triton.jit
def _small_k_pieces(quants, shift, high, high_shift, HAS_HIGH: tl.constexpr):
    """The four pieces of a Q2_K / Q3_K sub-block: bits ``shift``, ``shift + 1`` of the 32 bytes at ``quants``, with
    bit ``high_shift`` of the 32 bytes at ``high`` above them where HAS_HIGH."""
    shift = shift[:, None, None]  # per unit, over its [units, 2, 2] halfword quads
    low0, low1 = four_halfwords(quants) >> shift, four_halfwords(quants + 8) >> shift
    low2, low3 = four_halfwords(quants + 16) >> shift, four_halfwords(quants + 24) >> shift
    if HAS_HIGH:
        high_shift = high_shift[:, None, None]
        top0, top1 = four_halfwords(high) >> high_shift, four_halfwords(high + 8) >> high_shift
        top2, top3 = four_halfwords(high + 16) >> high_shift, four_halfwords(high + 24) >> high_shift
    else:
        top0, top1, top2, top3 = low0 & 0, low1 & 0, low2 & 0, low3 & 0
    return (halfword_threes(low0, top0), halfword_threes(low1, top1),
            halfword_threes(low2, top2), halfword_threes(low3, top3))


@triton.jit
def small_k_pieces(FMT: tl.constexpr, blockp, sub):
    """The pieces of Q2_K / Q3_K sub-block ``sub`` and the maps of its two 16-value halves, f = 1 + q / 8:
    Q2_K's ``w = d scale q - dmin min = 8 d scale f - (8 d scale + dmin min)``, Q3_K's
    ``w = d scale (q - 4) = 8 d scale f - 12 d scale``."""
    low, high = small_k_planes(FMT, blockp, sub)
    f0, f1, f2, f3 = _small_k_pieces(low, 2 * (sub % 4), high, sub, FMT == Q3_K)
    if FMT == Q2_K:
        d, dmin = load_f16(blockp + 80), load_f16(blockp + 82)
    else:
        d = load_f16(blockp + 108)
    scale_lo, scale_hi, min_lo, min_hi = small_k_scales(FMT, blockp, sub)
    a0, a1 = 8.0 * d * scale_lo.to(tl.float32), 8.0 * d * scale_hi.to(tl.float32)
    if FMT == Q2_K:
        b0, b1 = -(a0 + dmin * min_lo.to(tl.float32)), -(a1 + dmin * min_hi.to(tl.float32))
    else:
        b0, b1 = -1.5 * a0, -1.5 * a1
    return f0, f1, f2, f3, a0, b0, a0, b0, a1, b1, a1, b1


@triton.jit
def _q3_k_scale(scalep, s):
    """Q3_K's signed 6-bit scale s (0..15): low 4 bits in byte s (s < 8) or the high nibble of byte s - 8, top 2 bits
    at bits 2 (s // 4) of byte 8 + s % 4, stored + 32."""
    low = tl.where(s < 8, tl.load(scalep + s % 8).to(tl.int32) & 0xF, tl.load(scalep + s % 8).to(tl.int32) >> 4)
    top = (tl.load(scalep + 8 + s % 4).to(tl.int32) >> (2 * (s // 4))) & 3
    return (low | (top << 4)) - 32



# ---------------------------------------------------------------------------------------------
# Codes and scales of a sub-block, for the integer readers


@triton.jit
def small_k_codes(FMT: tl.constexpr, low, high, sub):
    """The unsigned codes of Q2_K / Q3_K sub-block ``sub`` from its code bytes ``low`` and (Q3_K) top-bit bytes
    ``high``, either 4 bytes to an int32 word or one byte per int32 (each mask repeats per byte): bits ``2 (sub % 4)``,
    ``+ 1`` of each code byte, and for Q3_K bit ``sub`` of each top-bit byte above them (the weight is then
    ``d scale (q - 4)``)."""
    codes = (low >> (2 * (sub % 4))) & 0x03030303
    if FMT == Q3_K:
        codes |= ((high >> sub) & 0x01010101) << 2
    return codes


@triton.jit
def small_k_planes(FMT: tl.constexpr, blockp, sub):
    """Where Q2_K / Q3_K sub-block ``sub`` (0..7) of the super-block at ``blockp`` keeps its bytes: ``(low, high)``
    pointing at its 32 code bytes and (Q3_K) the 32 top-bit bytes (``small_k_codes``)."""
    if FMT == Q2_K:
        low, high = blockp + 16 + 32 * (sub // 4), blockp
    else:
        tl.static_assert(FMT == Q3_K, "Q2_K or Q3_K")
        low, high = blockp + 32 + 32 * (sub // 4), blockp
    return low, high


@triton.jit
def small_k_scales(FMT: tl.constexpr, blockp, sub):
    """The integer scales and mins of values 0-15 and 16-31 of Q2_K / Q3_K sub-block ``sub``:
    ``(scale_lo, scale_hi, min_lo, min_hi)`` (Q3_K's mins are zero)."""
    if FMT == Q2_K:
        first, second = tl.load(blockp + 2 * sub).to(tl.int32), tl.load(blockp + 2 * sub + 1).to(tl.int32)
        scale_lo, scale_hi, min_lo, min_hi = first & 0xF, second & 0xF, first >> 4, second >> 4
    else:
        scale_lo, scale_hi = _q3_k_scale(blockp + 96, 2 * sub), _q3_k_scale(blockp + 96, 2 * sub + 1)
        min_lo, min_hi = scale_lo * 0, scale_hi * 0
    return scale_lo, scale_hi, min_lo, min_hi


@triton.jit
def small_k_sub_block(FMT: tl.constexpr, blockp, sub):
    """``small_k_planes`` and ``small_k_scales`` of sub-block ``sub``:
    ``(low, high, scale_lo, scale_hi, min_lo, min_hi)``."""
    low, high = small_k_planes(FMT, blockp, sub)
    scale_lo, scale_hi, min_lo, min_hi = small_k_scales(FMT, blockp, sub)
    return low, high, scale_lo, scale_hi, min_lo, min_hi

# ---------------------------------------------------------------------------------------------
# 64-value chunks, for the exact GEMV and the GEMM (``readers.chunk_load``)


@triton.jit
def small_k_chunk_load(rowp, first, n_chunks, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """The bytes of Q2_K / Q3_K chunks ``first .. first + BLOCK_U - 1`` of each row in ``rowp`` (as ``k_chunk_load``).

    Chunk c of a super-block is its code bytes ``16 c .. 16 c + 15``: bits ``2 j``, ``2 j + 1`` of byte i are value
    ``128 h + 32 j + 16 l + i`` (h, l = c // 2, c % 2), scale number ``8 h + 2 j + l``, and for Q3_K its top bit is
    bit ``4 h + j`` of top-bit byte ``16 l + i`` (ggml's loop order). Returned as int32 words: the four code words;
    Q2_K then scale bytes ``8 h .. 8 h + 7`` and the word of d, dmin; Q3_K the four top-bit words, the 12 scale bytes
    and the word holding d. Q2_K's 84-byte super-blocks are read in words, Q3_K's 110-byte ones in halfwords.
    """
    chunk = tl.minimum(first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U, n_chunks - 1)
    c = chunk % 4
    if FMT == Q2_K:
        words = (rowp + (chunk // 4) * Q2_K_BYTES).to(tl.pointer_type(tl.int32))
        codes = words + 4 + 4 * c
        raw = (tl.load(codes), tl.load(codes + 1), tl.load(codes + 2), tl.load(codes + 3),
               tl.load(words + 2 * (c // 2)), tl.load(words + 2 * (c // 2) + 1), tl.load(words + 20))
    else:
        tl.static_assert(FMT == Q3_K, "Q2_K or Q3_K")
        blockp = rowp + (chunk // 4) * Q3_K_BYTES
        codes, tops = blockp + 32 + 16 * c, blockp + 16 * (c % 2)
        raw = (halfword_pair_word(codes), halfword_pair_word(codes + 4), halfword_pair_word(codes + 8),
               halfword_pair_word(codes + 12), halfword_pair_word(tops), halfword_pair_word(tops + 4),
               halfword_pair_word(tops + 8), halfword_pair_word(tops + 12), halfword_pair_word(blockp + 96),
               halfword_pair_word(blockp + 100), halfword_pair_word(blockp + 104),
               tl.load((blockp + 108).to(tl.pointer_type(tl.uint16))).to(tl.int32))
    return raw


@triton.jit
def small_k_chunk_start(chunk):
    """Index within the row of value 0 of piece 0 of Q2_K / Q3_K chunk ``chunk`` (``small_k_chunk_load``); piece j's
    16 values follow at ``+ 32 j``."""
    return 256 * (chunk // 4) + 128 * ((chunk % 4) // 2) + 16 * (chunk % 2)


@triton.jit
def small_k_chunk_affine(raw, chunk, FMT: tl.constexpr, j: tl.constexpr):
    """``(a, b)``: weight ``a f + b`` for ``f = 1 + q / 128`` in piece j of the chunks ``small_k_chunk_load`` read."""
    h, l = (chunk % 4) // 2, chunk % 2
    byte_shift = 8 * (2 * (j % 2) + l)  # scale 8 h + 2 j + l is byte 2 (j % 2) + l of the word holding it
    if FMT == Q2_K:  # w = d scale q - dmin min
        d, dmin = f16_halves(raw[6])
        scale_byte = (raw[4 + j // 2] >> byte_shift) & 0xFF
        a = 128.0 * d * (scale_byte & 0xF).to(tl.float32)
        b = -(a + dmin * (scale_byte >> 4).to(tl.float32))
    else:  # w = d scale (q - 4), the signed 6-bit scale as ``_q3_k_scale`` reads it
        d, _ = f16_halves(raw[11])
        low = (raw[8 + j // 2] >> (byte_shift + 4 * h)) & 0xF
        top = (raw[10] >> (byte_shift + 2 * (2 * h + j // 2))) & 3
        scale = 4.0 * d * ((low | (top << 4)) - 32).to(tl.float32)
        a = 32.0 * scale
        b = -(a + scale)
    return a, b


@triton.jit
def small_k_chunk_dots(
    raw, first, xp, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Dots ``[BLOCK_M, BLOCK_N, BLOCK_U]`` of the Q2_K / Q3_K chunks ``small_k_chunk_load`` read (``raw``) with the
    activation rows at ``xp`` (as ``k_chunk_dots``): per piece of 16 values ``a sum(f x) + b sum(x)``."""
    chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    h = (chunk % 4) // 2
    x_start = small_k_chunk_start(first + tl.arange(0, BLOCK_U))
    dots = tl.zeros((xp.shape[0], BLOCK_N, BLOCK_U), tl.float32)
    for j in tl.static_range(4):
        fx = tl.zeros((xp.shape[0], BLOCK_N, BLOCK_U), tl.float32)
        sum_x = tl.zeros((xp.shape[0], BLOCK_U), tl.float32)
        for group in tl.static_range(2):  # values 8 group .. + 7 of the piece: code words 2 group, 2 group + 1
            index = (x_start[:, None] + 32 * j + 8 * group + tl.arange(0, 8)[None, :])[None]
            if EVEN:
                x = tl.load(xp[:, None, None] + index).to(tl.float32)
            else:
                x = tl.load(xp[:, None, None] + index, mask=index < K, other=0.0).to(tl.float32)
            sum_x += tl.sum(x, axis=2)
            if FMT == Q3_K:
                top_a, top_b = raw[4 + 2 * group], raw[5 + 2 * group]
            else:
                top_a, top_b = raw[2 * group], raw[2 * group + 1]
            code_a = small_k_codes(FMT, raw[2 * group], top_a, 4 * h + j) | -0x7F7F7F80  # every byte 0x80 | q
            code_b = small_k_codes(FMT, raw[2 * group + 1], top_b, 4 * h + j) | -0x7F7F7F80
            fx = dot_chain(fx, byte_floats(code_a, code_b, USE_ASM), split8(x), BLOCK_N, BLOCK_U)
        a, b = small_k_chunk_affine(raw, chunk, FMT, j)
        dots += tl.reshape(a, (1, BLOCK_N, BLOCK_U)) * fx + tl.reshape(b, (1, BLOCK_N, BLOCK_U)) * sum_x[:, None, :]
    return dots


@triton.jit
def small_k_chunk_tile(raw, first, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Float32 weights ``[BLOCK_N, 64 * BLOCK_U]`` of the Q2_K / Q3_K chunks ``small_k_chunk_load`` read (``raw``), in
    chunk order: column ``64 u + 16 j + i`` is value i of piece j of chunk ``first + u``, at
    ``small_k_chunk_columns(first, BLOCK_U)`` in the row. For the GEMM, which gathers its activations in that order
    rather than permute the weights."""
    chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    # the outermost join picks the fastest index (see the module docstring): words 0-3 in order
    words = tl.reshape(tl.join(tl.join(raw[0], raw[2]), tl.join(raw[1], raw[3])), (BLOCK_N * BLOCK_U, 1, 4, 1))
    if FMT == Q3_K:
        tops = tl.reshape(tl.join(tl.join(raw[4], raw[6]), tl.join(raw[5], raw[7])), (BLOCK_N * BLOCK_U, 1, 4, 1))
    else:
        tops = words
    sub = 4 * ((chunk % 4) // 2)[:, None, None, None] + tl.arange(0, 4)[None, :, None, None]  # 4 h + piece
    byte = tl.arange(0, 4)[None, None, None, :]
    # [pairs, piece, word, byte]: value 4 word + byte of the piece
    codes = (small_k_codes(FMT, words, tops, sub) >> (8 * byte)) & 0xFF
    f = ((codes << 16) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 128
    a0, b0 = small_k_chunk_affine(raw, chunk, FMT, 0)
    a1, b1 = small_k_chunk_affine(raw, chunk, FMT, 1)
    a2, b2 = small_k_chunk_affine(raw, chunk, FMT, 2)
    a3, b3 = small_k_chunk_affine(raw, chunk, FMT, 3)
    a = tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), (BLOCK_N * BLOCK_U, 4, 1, 1))
    b = tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N * BLOCK_U, 4, 1, 1))
    return tl.reshape(f * a + b, (BLOCK_N, 64 * BLOCK_U))


@triton.jit
def small_k_chunk_columns(first, BLOCK_U: tl.constexpr):
    """Row indices ``[64 * BLOCK_U]`` of ``small_k_chunk_tile``'s columns."""
    column = tl.arange(0, 64 * BLOCK_U)
    return small_k_chunk_start(first + column // 64) + 32 * ((column // 16) % 4) + column % 16

# ---------------------------------------------------------------------------------------------
# Integer dots against Q8 activations, for the llama.cpp-numerics GEMV: the activations come quantized as
# ggml-cpu quantizes them for the weight's type, and each block's or sub-block's dot is an integer sum of
# 4-byte products (``bits.dp4a``), scaled in float32 as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>`` does it.


@triton.jit
def small_k_dots_q8k(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, first, n_units, xq, xd, x_sums,
    BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, USE_ASM: tl.constexpr,
):
    """Dots ``[BLOCK_N, BLOCK_U]`` of Q2_K / Q3_K sub-blocks ``first ..`` (``dot_units``' units) with Q8_K
    activations (as ``k_chunk_dots_q8k``), as ggml sums them: per 16 values ``scale * sum(q x)`` in integers, less
    Q3_K's ``4 scale sum(x)``, then ``d d8`` on the sum and, for Q2_K, ``- dmin d8 sum(min * x_sum)``; units past the
    row get zero activations."""
    unit = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
    sub = unit % 8
    low, high, scale_lo, scale_hi, min_lo, min_hi = small_k_sub_block(FMT, blockp, sub)
    x_unit = first + tl.arange(0, BLOCK_U)
    inside = x_unit < n_units
    dot_lo = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    dot_hi = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    for word in tl.static_range(8):  # values 4 word .. 4 word + 3 of the sub-block
        low_word = halfword_pair_word(low + 4 * word)
        if FMT == Q3_K:
            high_word = halfword_pair_word(high + 4 * word)
        else:
            high_word = low_word
        q = tl.reshape(small_k_codes(FMT, low_word, high_word, sub), (BLOCK_N, BLOCK_U))
        x = tl.load(xq + 8 * x_unit + word, mask=inside, other=0)[None, :]
        if word < 4:
            dot_lo = dp4a(q, x, dot_lo, USE_ASM)
        else:
            dot_hi = dp4a(q, x, dot_hi, USE_ASM)
    x_sum_lo = tl.load(x_sums + 2 * x_unit, mask=inside, other=0)[None, :]
    x_sum_hi = tl.load(x_sums + 2 * x_unit + 1, mask=inside, other=0)[None, :]
    scale_lo, scale_hi = tl.reshape(scale_lo, (BLOCK_N, BLOCK_U)), tl.reshape(scale_hi, (BLOCK_N, BLOCK_U))
    d8 = tl.load(xd + x_unit // 8, mask=inside, other=0.0)[None, :]
    if FMT == Q3_K:
        isum = scale_lo * (dot_lo - 4 * x_sum_lo) + scale_hi * (dot_hi - 4 * x_sum_hi)
        out = d8 * tl.reshape(load_f16(blockp + 108), (BLOCK_N, BLOCK_U)) * isum.to(tl.float32)
    else:
        mins = tl.reshape(min_lo, (BLOCK_N, BLOCK_U)) * x_sum_lo + tl.reshape(min_hi, (BLOCK_N, BLOCK_U)) * x_sum_hi
        out = d8 * tl.reshape(load_f16(blockp + 80), (BLOCK_N, BLOCK_U)) * (scale_lo * dot_lo + scale_hi * dot_hi).to(tl.float32) \
            - d8 * tl.reshape(load_f16(blockp + 82), (BLOCK_N, BLOCK_U)) * mins.to(tl.float32)
    return out

# ---------------------------------------------------------------------------------------------
# Int8 tiles, for the llama.cpp-numerics GEMM: a block's or sub-block's weights as an int8 tile ``[BLOCK_N, 32]``
# for ``tl.dot`` with the int8 activations ``[BLOCK_M, 32]`` (``bits.int8_dot``).


@triton.jit
def small_k_tile_dots_q8k(FMT: tl.constexpr, blockp, x, x_sums, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one Q2_K / Q3_K super-block of each weight row and its 256 Q8_K activations of each row (``x_sums``: their
    16 sums of 16), ggml's integer sums ``(sum_g scale_g dot_g, sum_g min_g xsum_g)`` over the 16-value groups g, int32
    ``[BLOCK_M, BLOCK_N]`` each (Q3_K's dots are of ``q - 4``, its mins zero)."""
    cols = tl.arange(0, 32)
    dots = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    mins = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for sub in tl.static_range(8):
        low, high, scale_lo, scale_hi, min_lo, min_hi = small_k_sub_block(FMT, blockp, sub)
        low = byte_tile(low, cols)
        if FMT == Q3_K:
            q = small_k_codes(FMT, low, byte_tile(high, cols), sub) - 4
        else:
            q = small_k_codes(FMT, low, low, sub)
        dots += halves_dot(tl.load(x[:, None] + 32 * sub + cols[None, :]), q, scale_lo, scale_hi)
        if FMT == Q2_K:
            mins += tl.load(x_sums + 2 * sub)[:, None] * min_lo[None, :] \
                + tl.load(x_sums + 2 * sub + 1)[:, None] * min_hi[None, :]
    return dots, mins
