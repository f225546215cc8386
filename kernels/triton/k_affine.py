"""Readers of the K-quants with 6-bit scales and mins per 32 values, Q4_K and Q5_K, for every kind of kernel.

Super-blocks of 256 values: f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | for Q5_K 32 bytes of fifth bits
(bit s of byte i: value i of sub-block s) | 128 bytes of nibbles, whose 32-byte chunk c holds sub-block ``2 c`` in
its low nibbles and ``2 c + 1`` in its high ones (144 and 176 bytes, 4-byte aligned along a row).

The GEMV and the GEMM read them in 64-value chunks (``k_chunk_*``): a whole 32-byte chunk of one super-block's
quants (one sub-block in the low nibbles, the next in the high ones), read with two 16-byte loads beside one 16-byte
load of the super-block's header (and, for Q5_K, two of its fifth bits), and unpacked with one integer instruction per
value. The integer pipe runs at half the float32 rate, and at a shift and a mask-or per value (the 32-value units'
pieces) it, not memory, set the pace of the GEMV (docs/performance.md, "The Q4_K GEMV").
"""
import triton
import triton.language as tl

from .bits import (
    byte_tile, dot_chain, dp4a, f16_halves, four_words, int8_dot, load_f16, nibble_floats, split8,
    two_words, word_fives, word_nibbles,
)
from .formats import Q4_K_BYTES, Q5_K, Q5_K_BYTES
from .fragments import column_sum, load_words, plane_mma

# ---------------------------------------------------------------------------------------------
# Scales and mins


@triton.jit
def q4_k_chunk_scales(s0, s1, s2, chunk):
    """Q4_K's 6-bit scales and mins of sub-blocks ``2 * chunk`` and ``2 * chunk + 1`` (chunk 0..3) from its 12
    scale bytes, read as 3 int32 words: ``(scale_lo, min_lo, scale_hi, min_hi)`` as int32.

    Bytes 0-3 of ``s0`` / ``s1`` hold the scales / mins of sub-blocks 0-3 (low 6 bits) and the top 2 bits of
    those of sub-blocks 4-7, whose low 4 bits are the nibbles of ``s2``; a chunk's two sub-blocks sit in one
    half-word of each."""
    shift = (chunk % 2) * 16
    s0, s1, s2 = s0 >> shift, s1 >> shift, s2 >> shift
    low = chunk < 2
    scale_lo = tl.where(low, s0 & 0x3F, (s2 & 0xF) | ((s0 >> 2) & 0x30))
    min_lo = tl.where(low, s1 & 0x3F, ((s2 >> 4) & 0xF) | ((s1 >> 2) & 0x30))
    scale_hi = tl.where(low, (s0 >> 8) & 0x3F, ((s2 >> 8) & 0xF) | ((s0 >> 10) & 0x30))
    min_hi = tl.where(low, (s1 >> 8) & 0x3F, ((s2 >> 12) & 0xF) | ((s1 >> 10) & 0x30))
    return scale_lo, min_lo, scale_hi, min_hi


@triton.jit
def q4_k_chunk_scales_f32(s0, s1, s2, chunk):
    """``q4_k_chunk_scales`` as float32."""
    scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_scales(s0, s1, s2, chunk)
    return scale_lo.to(tl.float32), min_lo.to(tl.float32), scale_hi.to(tl.float32), min_hi.to(tl.float32)


@triton.jit
def k_affine(blockp, sub, STEPS: tl.constexpr):
    # Q4_K / Q5_K super-block: f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | the codes. With f = 1 + q / STEPS,
    # w = d * scale_s * q - dmin * min_s = STEPS d scale_s * f - (STEPS d scale_s + dmin min_s) in sub-block s.
    words = blockp.to(tl.pointer_type(tl.int32))
    s0, s1, s2 = tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_scales_f32(s0, s1, s2, sub // 2)
    odd = sub % 2 == 1
    scale, minimum = tl.where(odd, scale_hi, scale_lo), tl.where(odd, min_hi, min_lo)
    a = STEPS * load_f16(blockp) * scale
    return a, -(a + load_f16(blockp + 2) * minimum)

# ---------------------------------------------------------------------------------------------
# 32-value units, for the exact GEMV and GEMM and the dequantizer (``readers.unit_pieces``): the unit's
# four pieces in value order with the affine map ``(a, b)`` of each, ``weight = a * f + b``.


@triton.jit
def k_affine_pieces(FMT: tl.constexpr, blockp, sub):
    # Sub-block s (32 values) is nibble s % 2 of the 32 bytes of chunk s // 2, after the header (and Q5_K's 32 bytes of
    # top bits: bit s of byte i, value i of sub-block s); f = 1 + q / 16 (Q4_K) or 1 + q / 32 (Q5_K).
    if FMT == Q5_K:
        quants = blockp + 48 + 32 * (sub // 2)
        high = blockp + 16
    else:
        quants = blockp + 16 + 32 * (sub // 2)
    shift = 4 * (sub % 2)
    if FMT == Q5_K:
        a, b = k_affine(blockp, sub, 32.0)
        f0 = word_fives(two_words(quants, shift), two_words(high, sub))
        f1 = word_fives(two_words(quants + 8, shift), two_words(high + 8, sub))
        f2 = word_fives(two_words(quants + 16, shift), two_words(high + 16, sub))
        f3 = word_fives(two_words(quants + 24, shift), two_words(high + 24, sub))
    else:
        a, b = k_affine(blockp, sub, 16.0)
        f0, f1 = word_nibbles(two_words(quants, shift), 0), word_nibbles(two_words(quants + 8, shift), 0)
        f2, f3 = word_nibbles(two_words(quants + 16, shift), 0), word_nibbles(two_words(quants + 24, shift), 0)
    return f0, f1, f2, f3, a, b

# ---------------------------------------------------------------------------------------------
# 64-value chunks, for the GEMV and the GEMM (``readers.chunk_load``)


@triton.jit
def k_chunk_load(rowp, first, n_chunks, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """The bytes of Q4_K / Q5_K chunks ``first .. first + BLOCK_U - 1`` of each row in ``rowp`` (one pointer per (row,
    chunk) pair, rows slowest; chunks past the row re-read the last one): the super-block's first 16 bytes (d, dmin,
    scales) and the chunk's 32 bytes of nibbles, as twelve int32 tensors; for Q5_K then the super-block's 32 bytes of
    fifth bits (bit s of byte i: value i of sub-block s), as eight more."""
    chunk = tl.minimum(first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U, n_chunks - 1)
    if FMT == Q5_K:
        blockp = rowp + (chunk // 4) * Q5_K_BYTES
        quants = blockp + 48 + 32 * (chunk % 4)
    else:
        blockp = rowp + (chunk // 4) * Q4_K_BYTES
        quants = blockp + 16 + 32 * (chunk % 4)
    header0, s0, s1, s2 = four_words(blockp)
    q0, q1, q2, q3 = four_words(quants)
    q4, q5, q6, q7 = four_words(quants + 16)
    raw = (header0, s0, s1, s2, q0, q1, q2, q3, q4, q5, q6, q7)
    if FMT == Q5_K:
        t0, t1, t2, t3 = four_words(blockp + 16)
        t4, t5, t6, t7 = four_words(blockp + 32)
        raw = raw + (t0, t1, t2, t3, t4, t5, t6, t7)
    return raw


@triton.jit
def _fifth_bits(raw, word, chunk, FMT: tl.constexpr):
    """For quant word ``word`` of the chunks in ``raw``, the fifth bits of its low- and high-nibble values as 0x10 in
    each byte (Q5_K), or zeros (Q4_K)."""
    if FMT == Q5_K:
        top = raw[12 + word] >> (2 * (chunk % 4))  # sub-blocks 2c (low nibbles) and 2c + 1 (high)
        top_lo, top_hi = (top & 0x01010101) << 4, (top & 0x02020202) << 3
    else:
        top_lo, top_hi = 0, 0
    return top_lo, top_hi


@triton.jit
def q4_k_chunk_header(raw, first, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``(d, dmin, scale_lo, min_lo, scale_hi, min_hi)`` as float32 for the chunks ``k_chunk_load`` read (``raw``):
    the super-block's two float16 factors and the 6-bit scales and mins of the chunk's two sub-blocks."""
    header0, s0, s1, s2 = raw[0], raw[1], raw[2], raw[3]
    chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    d, dmin = f16_halves(header0)
    return (d, dmin) + q4_k_chunk_scales_f32(s0, s1, s2, chunk % 4)


@triton.jit
def k_chunk_dots(
    raw, first, xp, K, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN: tl.constexpr,
):
    """Dots ``[BLOCK_M, BLOCK_N, BLOCK_U]`` of the chunks ``k_chunk_load`` read (``raw``) with the activation rows at
    ``xp`` (``[BLOCK_M]`` pointers).

    With ``EVEN`` every chunk is in the row (no bounds checks on the activations). In sub-block s,
    ``w = d scale_s q - dmin min_s = 128 d scale_s f - (128 d scale_s + dmin min_s)`` for ``f = 1 + q / 128``.
    """
    d, dmin, scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_header(raw, first, BLOCK_N, BLOCK_U)
    chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U

    x_chunk = 64 * (first + tl.arange(0, BLOCK_U))
    fx_lo = tl.zeros((xp.shape[0], BLOCK_N, BLOCK_U), tl.float32)
    fx_hi = tl.zeros((xp.shape[0], BLOCK_N, BLOCK_U), tl.float32)
    sum_x_lo = tl.zeros((xp.shape[0], BLOCK_U), tl.float32)
    sum_x_hi = tl.zeros((xp.shape[0], BLOCK_U), tl.float32)
    for pair in tl.static_range(4):  # words 2 * pair, 2 * pair + 1: values 8 * pair .. + 7 of both sub-blocks
        index = (x_chunk[:, None] + 8 * pair + tl.arange(0, 8)[None, :])[None]
        if EVEN:
            x_lo = tl.load(xp[:, None, None] + index).to(tl.float32)
            x_hi = tl.load(xp[:, None, None] + index + 32).to(tl.float32)
        else:
            x_lo = tl.load(xp[:, None, None] + index, mask=index < K, other=0.0).to(tl.float32)
            x_hi = tl.load(xp[:, None, None] + index + 32, mask=index + 32 < K, other=0.0).to(tl.float32)
        sum_x_lo += tl.sum(x_lo, axis=2)
        sum_x_hi += tl.sum(x_hi, axis=2)
        top_lo_a, top_hi_a = _fifth_bits(raw, 2 * pair, chunk, FMT)
        top_lo_b, top_hi_b = _fifth_bits(raw, 2 * pair + 1, chunk, FMT)
        f_a = nibble_floats(raw[4 + 2 * pair], top_lo_a, top_hi_a, USE_ASM)
        f_b = nibble_floats(raw[5 + 2 * pair], top_lo_b, top_hi_b, USE_ASM)
        fx_lo = dot_chain(fx_lo, f_a[:4] + f_b[:4], split8(x_lo), BLOCK_N, BLOCK_U)
        fx_hi = dot_chain(fx_hi, f_a[4:] + f_b[4:], split8(x_hi), BLOCK_N, BLOCK_U)

    a_lo = tl.reshape(128.0 * d * scale_lo, (1, BLOCK_N, BLOCK_U))
    a_hi = tl.reshape(128.0 * d * scale_hi, (1, BLOCK_N, BLOCK_U))
    b_lo = -(a_lo + tl.reshape(dmin * min_lo, (1, BLOCK_N, BLOCK_U)))
    b_hi = -(a_hi + tl.reshape(dmin * min_hi, (1, BLOCK_N, BLOCK_U)))
    return a_lo * fx_lo + b_lo * sum_x_lo[:, None, :] + a_hi * fx_hi + b_hi * sum_x_hi[:, None, :]


@triton.jit
def k_chunk_tile(raw, first, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Float32 weights ``[BLOCK_N, 64 * BLOCK_U]``, in row order, of the chunks ``k_chunk_load`` read (``raw``): for
    the GEMM, whose few rows of activations cannot amortize ``weight_tile``'s narrow loads.

    Byte ``4 j + b`` of a chunk is word j's byte b: value ``4 j + b`` in its low nibble, ``32 + 4 j + b`` in its high
    one, so the words unpack along axes (nibble, word, byte) in value order. For the 4-bit (Q4_K) or 5-bit (Q5_K) q,
    ``f = 1 + q / STEPS`` and ``w = STEPS d scale f - (STEPS d scale + dmin min)`` per sub-block (nibble), STEPS = 2**bits.
    """
    BITS: tl.constexpr = 5 if FMT == Q5_K else 4
    STEPS: tl.constexpr = 1 << BITS
    d, dmin, scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_header(raw, first, BLOCK_N, BLOCK_U)
    a = tl.join(STEPS * d * scale_lo, STEPS * d * scale_hi)  # [pairs, nibble]
    b = -(a + tl.join(dmin * min_lo, dmin * min_hi))
    # words in order: the outermost join picks the fastest index (see the module docstring)
    words = tl.join(
        tl.join(tl.join(raw[4], raw[8]), tl.join(raw[6], raw[10])),
        tl.join(tl.join(raw[5], raw[9]), tl.join(raw[7], raw[11])),
    )
    words = tl.reshape(words, (BLOCK_N * BLOCK_U, 1, 8, 1))
    shift = 4 * tl.arange(0, 2)[:, None, None] + 8 * tl.arange(0, 4)[None, None, :]  # [nibble, 1, byte]
    quants = (words >> shift[None]) & 0xF  # [pairs, nibble, word, byte]
    if FMT == Q5_K:  # bit 2 c + nibble of the same byte of the fifth bits, for chunk c
        tops = tl.join(
            tl.join(tl.join(raw[12], raw[16]), tl.join(raw[14], raw[18])),
            tl.join(tl.join(raw[13], raw[17]), tl.join(raw[15], raw[19])),
        )
        tops = tl.reshape(tops, (BLOCK_N * BLOCK_U, 1, 8, 1))
        chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
        top_shift = 2 * (chunk % 4)[:, None, None, None] + tl.arange(0, 2)[None, :, None, None] \
            + 8 * tl.arange(0, 4)[None, None, None, :]
        quants |= ((tops >> top_shift) & 1) << 4
    f = ((quants << (23 - BITS)) | 0x3F800000).to(tl.float32, bitcast=True)
    w = f * a[:, :, None, None] + b[:, :, None, None]
    return tl.reshape(w, (BLOCK_N, 64 * BLOCK_U))

# ---------------------------------------------------------------------------------------------
# Integer dots against Q8 activations, for the llama.cpp-numerics GEMV: the activations come quantized as
# ggml-cpu quantizes them for the weight's type, and each block's or sub-block's dot is an integer sum of
# 4-byte products (``bits.dp4a``), scaled in float32 as ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>`` does it.


@triton.jit
def k_chunk_dots_q8k(
    raw, first, n_chunks, xq, xd, x_sums, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
    USE_ASM: tl.constexpr, EVEN: tl.constexpr,
):
    """Dots ``[BLOCK_N, BLOCK_U]`` of the Q4_K / Q5_K chunks ``k_chunk_load`` read (``raw``) with Q8_K activations:
    ``xq`` int32 words of int8 values, ``xd`` a float32 scale per 256 values, ``x_sums`` an int32 sum per 16 values.

    Chunk c of a super-block holds sub-blocks 2c (low nibbles) and 2c + 1 (high), so its dot is
    ``d8 (d sc_lo sum_lo + d sc_hi sum_hi) - d8 dmin (m_lo x_sum_lo + m_hi x_sum_hi)`` for the integer dots ``sum``.
    With ``EVEN`` every chunk is in the row; otherwise the re-read chunks past it get zero activations.
    """
    d, dmin, scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_header(raw, first, BLOCK_N, BLOCK_U)
    chunk = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U

    x_chunk = first + tl.arange(0, BLOCK_U)
    inside = x_chunk < n_chunks
    sum_lo = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    sum_hi = tl.zeros((BLOCK_N, BLOCK_U), tl.int32)
    for word in tl.static_range(8):  # bytes 4 word .. 4 word + 3 of the chunk: values 4 word .. + 3 of both sub-blocks
        top_lo, top_hi = _fifth_bits(raw, word, chunk, FMT)
        q_lo = tl.reshape((raw[4 + word] & 0x0F0F0F0F) | top_lo, (BLOCK_N, BLOCK_U))
        q_hi = tl.reshape(((raw[4 + word] >> 4) & 0x0F0F0F0F) | top_hi, (BLOCK_N, BLOCK_U))
        if EVEN:
            x_lo = tl.load(xq + 16 * x_chunk + word)
            x_hi = tl.load(xq + 16 * x_chunk + 8 + word)
        else:
            x_lo = tl.load(xq + 16 * x_chunk + word, mask=inside, other=0)
            x_hi = tl.load(xq + 16 * x_chunk + 8 + word, mask=inside, other=0)
        sum_lo = dp4a(q_lo, x_lo[None, :], sum_lo, USE_ASM)
        sum_hi = dp4a(q_hi, x_hi[None, :], sum_hi, USE_ASM)
    d8 = tl.load(xd + x_chunk // 4, mask=inside, other=0.0)[None, :]
    x_sum_lo = (tl.load(x_sums + 4 * x_chunk, mask=inside, other=0)
                + tl.load(x_sums + 4 * x_chunk + 1, mask=inside, other=0)).to(tl.float32)[None, :]
    x_sum_hi = (tl.load(x_sums + 4 * x_chunk + 2, mask=inside, other=0)
                + tl.load(x_sums + 4 * x_chunk + 3, mask=inside, other=0)).to(tl.float32)[None, :]
    # Integers below 2**24 throughout, so these float sums are exact, as ggml's integer sums are.
    dots = tl.reshape(scale_lo, (BLOCK_N, BLOCK_U)) * sum_lo.to(tl.float32) \
        + tl.reshape(scale_hi, (BLOCK_N, BLOCK_U)) * sum_hi.to(tl.float32)
    mins = tl.reshape(min_lo, (BLOCK_N, BLOCK_U)) * x_sum_lo + tl.reshape(min_hi, (BLOCK_N, BLOCK_U)) * x_sum_hi
    return d8 * tl.reshape(d, (BLOCK_N, BLOCK_U)) * dots - d8 * tl.reshape(dmin, (BLOCK_N, BLOCK_U)) * mins

# ---------------------------------------------------------------------------------------------
# Int8 tiles, for the llama.cpp-numerics GEMM: a block's or sub-block's weights as an int8 tile ``[BLOCK_N, 32]``
# for ``tl.dot`` with the int8 activations ``[BLOCK_M, 32]`` (``bits.int8_dot``).


@triton.jit
def k_chunk_tile_dots_q8k(FMT: tl.constexpr, blockp, x, x_sums, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one Q4_K / Q5_K super-block of each weight row and its 256 Q8_K activations of each row (``x_sums``: their
    16 sums of 16), ggml's integer sums ``(sum_j scale_j dot_j, sum_j min_j xsum_j)`` over the 8 sub-blocks j, int32
    ``[BLOCK_M, BLOCK_N]`` each."""
    words = blockp.to(tl.pointer_type(tl.int32))
    s0, s1, s2 = tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    cols = tl.arange(0, 32)
    if FMT == Q5_K:  # bit j of byte i: the fifth bit of value i of sub-block j
        tops, quants = byte_tile(blockp + 16, cols), blockp + 48
    else:
        quants = blockp + 16
    dots = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    mins = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for chunk in tl.static_range(4):  # sub-blocks 2 chunk (low nibbles) and 2 chunk + 1 (high)
        q = byte_tile(quants + 32 * chunk, cols)
        q_lo, q_hi = q & 0xF, q >> 4
        if FMT == Q5_K:
            q_lo |= ((tops >> (2 * chunk)) & 1) << 4
            q_hi |= ((tops >> (2 * chunk + 1)) & 1) << 4
        scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_scales(s0, s1, s2, chunk)
        x_lo = tl.load(x[:, None] + 64 * chunk + cols[None, :])
        x_hi = tl.load(x[:, None] + 64 * chunk + 32 + cols[None, :])
        dots += int8_dot(x_lo, q_lo) * scale_lo[None, :] + int8_dot(x_hi, q_hi) * scale_hi[None, :]
        sum_lo = tl.load(x_sums + 4 * chunk) + tl.load(x_sums + 4 * chunk + 1)
        sum_hi = tl.load(x_sums + 4 * chunk + 2) + tl.load(x_sums + 4 * chunk + 3)
        mins += sum_lo[:, None] * min_lo[None, :] + sum_hi[:, None] * min_hi[None, :]
    return dots, mins

# ---------------------------------------------------------------------------------------------
# Tensor-core fragments, for the fragment kernel (``mma``; ``fragments`` explains the scheme).
# Q4_K, a super-block per step.


@triton.jit
def nibble_sub_block_sums(top0, top1, bottom0, bottom1, x0, x1, x2, x3, SHIFT: tl.constexpr, BF16: tl.constexpr,
                          USE_ASM: tl.constexpr):
    """For 8 bytes of quants of the lane's two weight rows (words ``top0, top1`` and ``bottom0, bottom1``), the nibbles
    at bit ``SHIFT`` of each byte (one sub-block), and the lane's 8 matching activations (words ``x0..x3``): the sums
    of ``(MAGIC + q) x`` as a result fragment ``(c0, c1, c2, c3)``, and those of ``x`` (columns ``2t``, ``2t + 1``)."""
    zero = tl.zeros(x0.shape, tl.float32)
    c0, c1, c2, c3 = plane_mma((top0 >> SHIFT) & 0x0F0F0F0F, (bottom0 >> SHIFT) & 0x0F0F0F0F, x0, x1,
                               zero, zero, zero, zero, BF16, USE_ASM)
    c0, c1, c2, c3 = plane_mma((top1 >> SHIFT) & 0x0F0F0F0F, (bottom1 >> SHIFT) & 0x0F0F0F0F, x2, x3,
                               c0, c1, c2, c3, BF16, USE_ASM)
    s0, s1 = column_sum(x0, x1, zero, zero, BF16, USE_ASM)
    s0, s1 = column_sum(x2, x3, s0, s1, BF16, USE_ASM)
    return c0, c1, c2, c3, s0, s1


@triton.jit
def _q4_k_header(block, valid, USE_ASM: tl.constexpr):
    """A Q4_K super-block's d and dmin as float32 (zero where ``valid`` is false), and its 12 scale bytes as 3 words."""
    header, s0, s1, s2 = load_words(block, 4, USE_ASM)
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
    """``acc`` (a result fragment per tile) plus the dots of one Q4_K super-block of the lane's rows (uint8 pointers
    ``top``, ``bottom`` to it) with the activations of its column in each tile (uint8 pointers ``x_lane`` to the
    super-block's values, moved on by the lane's ``16 t`` bytes); nothing where ``valid`` is false.

    Super-block (144 bytes): f16 d | f16 dmin | 12 bytes of 6-bit scales and mins | 4 chunks of 32 bytes, whose low
    nibbles are sub-block ``2 c`` and high nibbles sub-block ``2 c + 1``. Lane t takes bytes ``8 t .. 8 t + 7`` of each
    chunk: values ``8 t .. 8 t + 7`` of both its sub-blocks."""
    MAGIC: tl.constexpr = 128.0 if BF16 else 1024.0
    lane_t = (tl.arange(0, top.shape[0]) % 4) * 8
    top_d, top_dmin, top_s0, top_s1, top_s2 = _q4_k_header(top, valid, USE_ASM)
    bottom_d, bottom_dmin, bottom_s0, bottom_s1, bottom_s2 = _q4_k_header(bottom, valid, USE_ASM)
    for chunk in tl.static_range(4):
        top0, top1 = load_words(top + 16 + 32 * chunk + lane_t, 2, USE_ASM)
        bottom0, bottom1 = load_words(bottom + 16 + 32 * chunk + lane_t, 2, USE_ASM)
        top_scales = q4_k_chunk_scales(top_s0, top_s1, top_s2, chunk)  # scale, min of the low, then high sub-block
        bottom_scales = q4_k_chunk_scales(bottom_s0, bottom_s1, bottom_s2, chunk)
        for half in tl.static_range(2):
            x0, x1, x2, x3 = load_words(x_lane + 128 * chunk + 64 * half, 4, USE_ASM)
            c0, c1, c2, c3, s0, s1 = nibble_sub_block_sums(top0, top1, bottom0, bottom1, x0, x1, x2, x3, 4 * half,
                                                           BF16, USE_ASM)
            top_a, top_b = _sub_block_affine(top_d, top_dmin, top_scales[2 * half], top_scales[2 * half + 1], MAGIC)
            bottom_a, bottom_b = _sub_block_affine(bottom_d, bottom_dmin, bottom_scales[2 * half],
                                                   bottom_scales[2 * half + 1], MAGIC)
            acc0 += top_a[None, :] * c0 - top_b[None, :] * s0
            acc1 += top_a[None, :] * c1 - top_b[None, :] * s1
            acc2 += bottom_a[None, :] * c2 - bottom_b[None, :] * s0
            acc3 += bottom_a[None, :] * c3 - bottom_b[None, :] * s1
    return acc0, acc1, acc2, acc3
