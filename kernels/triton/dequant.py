"""Triton device functions that read GGUF blocks in place and unpack them into float32.

Layout of the work. A kernel handles ``BLOCK_N * BLOCK_U`` *units* (32 values of one weight row: a GGUF
block or a part of a super-block), held as 1-D tensors of (row, unit) pairs so the compiler's layout
choice is the same in every Triton version, and every unit is owned by one thread: its bytes are read
with separate narrow loads (blocks are often only 2-byte aligned) and ``tl.join``-ed into registers,
so all per-block work (scales, mins, sums) happens once per unit and no value crosses threads.

A unit's values come out as four *pieces* of 8 consecutive values, ``[units, 8]``, each a
``1 + q / 2**bits`` float made by moving the quant's bits under the exponent of 1.0 (exact, and a few
integer logic ops, where an int->float conversion runs at a fraction of the ALU rate). A weight is then
``a * f + b`` for per-unit (or per-sub-block) ``a`` and ``b``, which lets the GEMV sum ``f * x`` and
``x`` over a piece and apply ``a`` and ``b`` once per piece instead of once per value.

The GEMV and the GEMM read Q4_K and Q5_K differently (``k_chunk_load`` / ``k_chunk_dots`` / ``k_chunk_tile`` at
the end): 64-value chunks in 16-byte loads, one byte permute per value. The exact GEMV and the GEMM (in tiles of up
to 64 rows) read Q2_K and Q3_K in 64-value chunks too (``small_k_chunk_load`` / ``small_k_chunk_dots`` /
``small_k_chunk_tile``): a chunk's 16 code bytes hold four pieces of 16 values, so each byte is loaded once, not once
per piece.

``tl.join(a, b)`` appends a new innermost axis, so in a nest of joins the outermost join picks the
fastest-varying index of the flattened result.
"""
import triton
import triton.language as tl

# GGML type numbers, used as the FMT compile-time constant.
Q4_0 = tl.constexpr(2)
Q4_1 = tl.constexpr(3)
Q5_0 = tl.constexpr(6)
Q5_1 = tl.constexpr(7)
Q8_0 = tl.constexpr(8)
Q2_K = tl.constexpr(10)
Q3_K = tl.constexpr(11)
Q4_K = tl.constexpr(12)
Q5_K = tl.constexpr(13)
Q6_K = tl.constexpr(14)


@triton.jit
def field(bits, POS: tl.constexpr, WIDTH: tl.constexpr, TO: tl.constexpr):
    """The WIDTH-bit field at bit POS of int32 ``bits``, moved to bit TO, all other bits zero."""
    if POS > TO:
        bits = bits >> (POS - TO)
    elif POS < TO:
        bits = bits << (TO - POS)
    return bits & (((1 << WIDTH) - 1) << TO)


@triton.jit
def mantissa_to_f32(bits):
    """``1 + bits / 2**23`` for int32 ``bits`` below 2**23: an exact int->float without a conversion."""
    return (bits | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def nibble(bits, POS: tl.constexpr):
    """``1 + q / 16`` for the 4-bit q at bit POS of ``bits``."""
    return mantissa_to_f32(field(bits, POS, 4, 19))


@triton.jit
def load_f16(p):
    """The float16 at each (2-byte aligned) uint8 pointer, as float32."""
    return tl.load(p.to(tl.pointer_type(tl.float16))).to(tl.float32)


@triton.jit
def f16_halves(word):
    """The two float16 in int32 ``word`` as float32, the low half first."""
    return ((word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32),
            ((word >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def four_halfwords(p):
    """The 16-bit words at uint8 pointers ``p, p + 2, p + 4, p + 6`` as int32 ``[..., 2, 2]`` in memory order."""
    p = p.to(tl.pointer_type(tl.uint16))
    h0, h1, h2, h3 = tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    return tl.join(tl.join(h0, h2), tl.join(h1, h3)).to(tl.int32)


@triton.jit
def two_words(p, shift):
    """The 32-bit words at (4-byte aligned) uint8 pointers ``p, p + 4``, shifted right, as int32 ``[..., 2]``."""
    p = p.to(tl.pointer_type(tl.int32))
    return tl.join(tl.load(p) >> shift, tl.load(p + 1) >> shift)


@triton.jit
def flat8(t):
    """``[UNITS, 2, 2, 2]`` -> ``[UNITS, 8]``: the in-register axes of a piece, flattened."""
    return tl.reshape(t, (t.shape[0], 8))


@triton.jit
def halfword_nibbles(quad, SHIFT: tl.constexpr):
    """Nibble ``SHIFT // 4`` of each of the 8 bytes of a halfword quad: a piece ``[..., 8]``."""
    return flat8(tl.join(nibble(quad, SHIFT), nibble(quad, SHIFT + 8)))


@triton.jit
def _with_top_bit(bits, POS: tl.constexpr, LOW_BITS: tl.constexpr, high, HIGH_POS: tl.constexpr):
    """``1 + q / 2**(LOW_BITS + 1)`` for the q whose low LOW_BITS bits are at bit POS of ``bits`` and whose top bit is
    bit HIGH_POS of ``high``."""
    return mantissa_to_f32(field(bits, POS, LOW_BITS, 22 - LOW_BITS) | field(high, HIGH_POS, 1, 22))


@triton.jit
def halfword_fives(quad, SHIFT: tl.constexpr, high_byte):
    """As ``halfword_nibbles`` for 5-bit values: the top bit of byte i's value is bit i of int32 ``high_byte``."""
    high = tl.join(tl.join(high_byte, high_byte >> 4), tl.join(high_byte >> 2, high_byte >> 6))  # halfword h: >> 2h
    return flat8(tl.join(_with_top_bit(quad, SHIFT, 4, high, 0), _with_top_bit(quad, SHIFT + 8, 4, high, 1)))


@triton.jit
def halfword_threes(quad, high):
    """``1 + q / 8`` for each of the 8 bytes of a halfword quad: q's low 2 bits are the byte's bits 0-1 in ``quad``, its
    top bit bit 0 of the same byte of ``high`` (zero for 2-bit codes)."""
    return flat8(tl.join(_with_top_bit(quad, 0, 2, high, 0), _with_top_bit(quad, 8, 2, high, 8)))


@triton.jit
def word_fives(pair, high_pair):
    """As ``word_nibbles(pair, 0)`` for 5-bit values: the top bit of each byte's value is bit 0 of the same byte of
    ``high_pair``."""
    return flat8(tl.join(
        tl.join(_with_top_bit(pair, 0, 4, high_pair, 0), _with_top_bit(pair, 16, 4, high_pair, 16)),
        tl.join(_with_top_bit(pair, 8, 4, high_pair, 8), _with_top_bit(pair, 24, 4, high_pair, 24)),
    ))


@triton.jit
def word_nibbles(pair, SHIFT: tl.constexpr):
    """Nibble ``SHIFT // 4`` of each of the 8 bytes of a word pair: a piece ``[..., 8]``."""
    return flat8(tl.join(
        tl.join(nibble(pair, SHIFT), nibble(pair, SHIFT + 16)),
        tl.join(nibble(pair, SHIFT + 8), nibble(pair, SHIFT + 24)),
    ))


# ---------------------------------------------------------------------------------------------
# Formats. Each ``<fmt>_pieces`` returns the unit's pieces in value order with the affine map
# ``(a, b)`` of each (``weight = a * f + b``): one per unit, or per 16 values (Q2_K, Q3_K) or per piece (Q6_K).


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
def _halfword_pair_word(p):
    """The 32-bit word at 2-byte aligned uint8 pointers ``p``, as int32."""
    p = p.to(tl.pointer_type(tl.uint16))
    return tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 16)


@triton.jit
def q5_0_pieces(blockp):
    # Block (22 bytes): f16 d | 4 bytes of top bits | 16 bytes of nibbles; w = d * (q - 16) = 32 d * f - 48 d.
    d = load_f16(blockp)
    f0, f1, f2, f3 = _q5_pieces(blockp + 6, _halfword_pair_word(blockp + 2))
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


@triton.jit
def q4_k_pieces(blockp, sub):
    # Super-block (144 bytes): the header, then 128 bytes of codes. Sub-block s (32 values) is nibble s % 2 of the
    # 32 bytes of chunk s // 2.
    quants = blockp + 16 + 32 * (sub // 2)
    shift = 4 * (sub % 2)
    a, b = k_affine(blockp, sub, 16.0)
    return (
        word_nibbles(two_words(quants, shift), 0), word_nibbles(two_words(quants + 8, shift), 0),
        word_nibbles(two_words(quants + 16, shift), 0), word_nibbles(two_words(quants + 24, shift), 0),
        a, b,
    )


@triton.jit
def q5_k_pieces(blockp, sub):
    # Super-block (176 bytes): the header, 32 bytes of top bits (bit s of byte i: value i of sub-block s), then Q4_K's
    # 128 bytes of nibbles.
    quants = blockp + 48 + 32 * (sub // 2)
    high = blockp + 16
    shift = 4 * (sub % 2)
    a, b = k_affine(blockp, sub, 32.0)
    return (
        word_fives(two_words(quants, shift), two_words(high, sub)),
        word_fives(two_words(quants + 8, shift), two_words(high + 8, sub)),
        word_fives(two_words(quants + 16, shift), two_words(high + 16, sub)),
        word_fives(two_words(quants + 24, shift), two_words(high + 24, sub)),
        a, b,
    )


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
def q2_k_pieces(blockp, sub):
    # Super-block (84 bytes): 16 scale bytes (4-bit scale low, 4-bit min high, one per 16 values) | 64 bytes of 2-bit
    # codes (sub-block s = 4 h + j: bits 2j, 2j + 1 of bytes 32 h .. + 32) | f16 d | f16 dmin.
    # w = d * scale * q - dmin * min = 8 d scale * f - (8 d scale + dmin min), f = 1 + q / 8.
    f0, f1, f2, f3 = _small_k_pieces(blockp + 16 + 32 * (sub // 4), 2 * (sub % 4), blockp, 0, False)
    d, dmin = load_f16(blockp + 80), load_f16(blockp + 82)
    first, second = tl.load(blockp + 2 * sub).to(tl.int32), tl.load(blockp + 2 * sub + 1).to(tl.int32)
    a0, a1 = 8.0 * d * (first & 0xF).to(tl.float32), 8.0 * d * (second & 0xF).to(tl.float32)
    b0, b1 = -(a0 + dmin * (first >> 4).to(tl.float32)), -(a1 + dmin * (second >> 4).to(tl.float32))
    return f0, f1, f2, f3, a0, b0, a0, b0, a1, b1, a1, b1


@triton.jit
def _q3_k_scale(scalep, s):
    """Q3_K's signed 6-bit scale s (0..15): low 4 bits in byte s (s < 8) or the high nibble of byte s - 8, top 2 bits
    at bits 2 (s // 4) of byte 8 + s % 4, stored + 32."""
    low = tl.where(s < 8, tl.load(scalep + s % 8).to(tl.int32) & 0xF, tl.load(scalep + s % 8).to(tl.int32) >> 4)
    top = (tl.load(scalep + 8 + s % 4).to(tl.int32) >> (2 * (s // 4))) & 3
    return (low | (top << 4)) - 32


@triton.jit
def q3_k_pieces(blockp, sub):
    # Super-block (110 bytes): 32 bytes of top bits (bit s of byte i: value i of sub-block s) | 64 bytes of low 2 bits
    # laid out as Q2_K's codes | 12 scale bytes (one 6-bit scale per 16 values) | f16 d.
    # w = d * scale * (q - 4) = 8 d scale * f - 12 d scale, f = 1 + q / 8.
    f0, f1, f2, f3 = _small_k_pieces(blockp + 32 + 32 * (sub // 4), 2 * (sub % 4), blockp, sub, True)
    d = load_f16(blockp + 108)
    a0 = 8.0 * d * _q3_k_scale(blockp + 96, 2 * sub).to(tl.float32)
    a1 = 8.0 * d * _q3_k_scale(blockp + 96, 2 * sub + 1).to(tl.float32)
    return f0, f1, f2, f3, a0, -1.5 * a0, a0, -1.5 * a0, a1, -1.5 * a1, a1, -1.5 * a1


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
# Units: 32 values of one row, owned by one thread: a block (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), a sub-block of 32
# (Q2_K, Q3_K, Q4_K, Q5_K), or for Q6_K the k = 0..3 pieces of one group. ``unit`` counts units along the row,
# ``n_units = K // 32``.


@triton.jit
def unit_pieces(FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, unit, n_units):
    """The unit's four pieces and their affine maps: ``(f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3)``."""
    if FMT == Q4_K or FMT == Q5_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        if FMT == Q4_K:
            f0, f1, f2, f3, a, b = q4_k_pieces(blockp, unit % 8)
        else:
            f0, f1, f2, f3, a, b = q5_k_pieces(blockp, unit % 8)
        pieces = f0, f1, f2, f3, a, b, a, b, a, b, a, b
    elif FMT == Q6_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        pieces = q6_k_pieces(blockp, (unit // 4) % 2, unit % 4)
    elif FMT == Q2_K or FMT == Q3_K:
        blockp = rowp + tl.minimum(unit // 8, n_units // 8 - 1) * TYPE_SIZE
        if FMT == Q2_K:
            pieces = q2_k_pieces(blockp, unit % 8)
        else:
            pieces = q3_k_pieces(blockp, unit % 8)
    else:
        blockp = rowp + tl.minimum(unit, n_units - 1) * TYPE_SIZE
        if FMT == Q4_0:
            f0, f1, f2, f3, a, b = q4_0_pieces(blockp)
        elif FMT == Q4_1:
            f0, f1, f2, f3, a, b = q4_1_pieces(blockp)
        elif FMT == Q5_0:
            f0, f1, f2, f3, a, b = q5_0_pieces(blockp)
        elif FMT == Q5_1:
            f0, f1, f2, f3, a, b = q5_1_pieces(blockp)
        else:
            tl.static_assert(FMT == Q8_0, "unsupported format")
            f0, f1, f2, f3, a, b = q8_0_pieces(blockp)
        pieces = f0, f1, f2, f3, a, b, a, b, a, b, a, b
    return pieces


@triton.jit
def piece_start(FMT: tl.constexpr, unit, piece):
    """Index within the row of the first value of piece ``piece`` of ``unit``."""
    if FMT == Q6_K:
        # unit = 8 * super-block + 4 * half + group, piece = k: value 128 * half + 32 * k + 8 * group + i
        start = 256 * (unit // 8) + 128 * ((unit // 4) % 2) + 32 * piece + 8 * (unit % 4)
    else:
        start = 32 * unit + 8 * piece
    return start


@triton.jit
def load_x(xp, first, K):
    """Activations ``xp[first .. first + 7]`` for each row pointer ``xp`` ``[BLOCK_M]`` and unit, as float32
    ``[BLOCK_M, BLOCK_U, 8]``."""
    index = first[:, None] + tl.arange(0, 8)[None, :]
    return tl.load(xp[:, None, None] + index[None], mask=index[None] < K, other=0.0).to(tl.float32)


@triton.jit
def dot_units(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, first, n_units, xp, K,
    BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr,
):
    """For ``BLOCK_N`` weight rows, units ``first .. first + BLOCK_U - 1`` and the activation rows at ``xp``
    (``[BLOCK_M]`` pointers), the dot of each unit's weights with each row's activations,
    ``sum_p a_p * sum(f_p x_p) + b_p * sum(x_p)`` over its pieces p: ``[BLOCK_M, BLOCK_N, BLOCK_U]``.

    ``rowp`` holds the row pointer of each (row, unit) pair, rows slowest, so a thread holds the same
    unit of every weight row and of every activation row: a weight is unpacked once for all activation rows, and
    the activations, loaded once per unit (``[BLOCK_M, BLOCK_U, 8]``), are shared by all weight rows.
    """
    unit = first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U
    x_unit = first + tl.arange(0, BLOCK_U)
    f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3 = unit_pieces(FMT, TYPE_SIZE, rowp, unit, n_units)
    if FMT == Q6_K or FMT == Q2_K or FMT == Q3_K:  # an affine map per 16 values
        dot = _dot_piece(f0, a0, b0, xp, piece_start(FMT, x_unit, 0), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f1, a1, b1, xp, piece_start(FMT, x_unit, 1), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f2, a2, b2, xp, piece_start(FMT, x_unit, 2), K, BLOCK_N, BLOCK_U)
        dot += _dot_piece(f3, a3, b3, xp, piece_start(FMT, x_unit, 3), K, BLOCK_N, BLOCK_U)
    else:
        dot = _dot_shared_affine(f0, f1, f2, f3, a0, b0, xp, 32 * x_unit, K, BLOCK_N, BLOCK_U)
    return dot


@triton.jit
def _pieces_of(f, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """A piece ``[units, 8]`` as ``[1, BLOCK_N, BLOCK_U, 8]``, to broadcast over activation rows."""
    return tl.reshape(f, (1, BLOCK_N, BLOCK_U, 8))


@triton.jit
def _dot_piece(f, a, b, xp, first, K, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """One piece of 8 values starting at ``first`` with its own affine map."""
    x = load_x(xp, first, K)
    fx = tl.sum(_pieces_of(f, BLOCK_N, BLOCK_U) * x[:, None], axis=3)
    return _affine(a, b, fx, tl.sum(x, axis=2), BLOCK_N, BLOCK_U)


@triton.jit
def _dot_shared_affine(f0, f1, f2, f3, a, b, xp, first, K, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """Four pieces of 32 consecutive values starting at ``first`` with one affine map: sum them element-wise
    first (a fused multiply-add per value), then across the 8 values of a piece."""
    x0 = load_x(xp, first, K)
    x1 = load_x(xp, first + 8, K)
    x2 = load_x(xp, first + 16, K)
    x3 = load_x(xp, first + 24, K)
    fx = tl.sum(
        _pieces_of(f0, BLOCK_N, BLOCK_U) * x0[:, None] + _pieces_of(f1, BLOCK_N, BLOCK_U) * x1[:, None]
        + _pieces_of(f2, BLOCK_N, BLOCK_U) * x2[:, None] + _pieces_of(f3, BLOCK_N, BLOCK_U) * x3[:, None],
        axis=3,
    )
    return _affine(a, b, fx, tl.sum(x0 + x1 + x2 + x3, axis=2), BLOCK_N, BLOCK_U)


@triton.jit
def _affine(a, b, fx, x, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``a * fx + b * x`` for per-(row, unit) ``a``, ``b``, per-(activation row, row, unit) ``fx`` and
    per-(activation row, unit) ``x``."""
    return tl.reshape(a, (1, BLOCK_N, BLOCK_U)) * fx + tl.reshape(b, (1, BLOCK_N, BLOCK_U)) * x[:, None, :]


@triton.jit
def weight_tile(
    FMT: tl.constexpr, TYPE_SIZE: tl.constexpr, rowp, unit, n_units, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr
):
    """Float32 weights ``[BLOCK_N, 32 * BLOCK_U]`` in row order, of (row, unit) pairs enumerated rows slowest
    (for Q6_K, ``BLOCK_U`` must cover whole super-blocks)."""
    f0, f1, f2, f3, a0, b0, a1, b1, a2, b2, a3, b3 = unit_pieces(FMT, TYPE_SIZE, rowp, unit, n_units)
    w0 = f0 * a0[:, None] + b0[:, None]
    w1 = f1 * a1[:, None] + b1[:, None]
    w2 = f2 * a2[:, None] + b2[:, None]
    w3 = f3 * a3[:, None] + b3[:, None]
    tile = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [units, 8 (i), 2, 2 (p)]
    tile = tl.permute(tile, (0, 2, 3, 1))  # [units, p, i]: value piece_start(unit, p) + i
    if FMT == Q6_K:
        # Units (half, group) hold pieces k; row order is (half, k, group, i) within a super-block.
        tile = tl.reshape(tile, (BLOCK_N, BLOCK_U // 8, 2, 4, 4, 8))
        tile = tl.permute(tile, (0, 1, 2, 4, 3, 5))
    return tl.reshape(tile, (BLOCK_N, 32 * BLOCK_U))


# ---------------------------------------------------------------------------------------------
# The GEMV's path for Q4_K and Q5_K. Its unit is a whole 32-byte chunk of one super-block's
# quants (64 values: one sub-block in the low nibbles, the next in the high ones), read with two 16-byte
# loads beside one 16-byte load of the super-block's header (and, for Q5_K, two of its fifth bits), and
# unpacked with one integer instruction per value. The integer pipe runs at half the float32 rate, and at a shift and a mask-or per value (the
# pieces above) it, not memory, set the pace of this GEMV (bench/RESULTS.md).


@triton.jit
def four_words(p):
    """The 16 bytes at each 16-byte aligned uint8 pointer ``p``, in one vector load, as four int32 tensors."""
    words = tl.load(p.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :])
    even, odd = tl.split(tl.reshape(words, (words.shape[0], 2, 2)))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def split8(t):
    """``[M, N, 8]`` -> its eight ``[M, N]`` slices along the last axis, in order."""
    even, odd = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], 4, 2)))
    e0, e1 = tl.split(tl.reshape(even, (t.shape[0], t.shape[1], 2, 2)))
    o0, o1 = tl.split(tl.reshape(odd, (t.shape[0], t.shape[1], 2, 2)))
    c0, c4 = tl.split(e0)
    c2, c6 = tl.split(e1)
    c1, c5 = tl.split(o0)
    c3, c7 = tl.split(o1)
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _byte2_float(t, BYTE: tl.constexpr):
    """``0x3F000000 | byte BYTE of t << 16``."""
    if BYTE < 2:
        t = t << (16 - 8 * BYTE)
    elif BYTE > 2:
        t = t >> (8 * BYTE - 16)
    return ((t & 0x00FF0000) | 0x3F000000).to(tl.float32, bitcast=True)


@triton.jit
def nibble_floats(w, top_lo, top_hi, USE_ASM: tl.constexpr):
    """The nibbles of int32 ``w`` as floats ``1 + q / 128``: those of bytes 0-3 low, then high; ``top_lo`` /
    ``top_hi`` (0 or 0x10 in each byte, or 0) are OR-ed into the low / high nibbles' bytes as a fifth bit."""
    lo = (w & 0x0F0F0F0F) | top_lo | -0x7F7F7F80  # every byte 0x80 | its low nibble (and fifth bit)
    hi = ((w >> 4) & 0x0F0F0F0F) | top_hi | -0x7F7F7F80
    return byte_floats(lo, hi, USE_ASM)


@triton.jit
def byte_floats(lo, hi, USE_ASM: tl.constexpr):
    """The bytes ``0x80 | q`` (q < 128) of int32 words ``lo`` then ``hi`` as the 8 floats ``1 + q / 128``.

    Each byte becomes byte 2 of ``0x3F8q0000`` (``0x80 | q`` under the exponent byte of 1.0): on CUDA
    (``USE_ASM``) one ``prmt`` (byte permute) per value; the interpreter, which runs no PTX, computes the same bits
    with shifts and masks.
    """
    if USE_ASM:
        floats = tl.inline_asm_elementwise(
            """
            prmt.b32 $0, $8, $10, 0x7054;
            prmt.b32 $1, $8, $10, 0x7154;
            prmt.b32 $2, $8, $10, 0x7254;
            prmt.b32 $3, $8, $10, 0x7354;
            prmt.b32 $4, $9, $10, 0x7054;
            prmt.b32 $5, $9, $10, 0x7154;
            prmt.b32 $6, $9, $10, 0x7254;
            prmt.b32 $7, $9, $10, 0x7354;
            """,
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r", [lo, hi, tl.full(lo.shape, 0x3F000000, tl.int32)],
            dtype=(tl.float32,) * 8, is_pure=True, pack=1,
        )
    else:
        floats = (
            _byte2_float(lo, 0), _byte2_float(lo, 1), _byte2_float(lo, 2), _byte2_float(lo, 3),
            _byte2_float(hi, 0), _byte2_float(hi, 1), _byte2_float(hi, 2), _byte2_float(hi, 3),
        )
    return floats


@triton.jit
def _dot_chain(acc, fs, xs, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``acc + sum_i fs[i] * xs[i]``, one fused multiply-add per value, for (row, chunk) ``fs``, per-(activation row,
    chunk) ``xs`` and ``acc`` ``[BLOCK_M, BLOCK_N, BLOCK_U]``."""
    for i in tl.static_range(len(fs)):
        acc = tl.reshape(fs[i], (1, BLOCK_N, BLOCK_U)) * xs[i][:, None, :] + acc
    return acc


@triton.jit
def k_chunk_load(rowp, first, n_chunks, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """The bytes of Q4_K / Q5_K chunks ``first .. first + BLOCK_U - 1`` of each row in ``rowp`` (one pointer per (row,
    chunk) pair, rows slowest; chunks past the row re-read the last one): the super-block's first 16 bytes (d, dmin,
    scales) and the chunk's 32 bytes of nibbles, as twelve int32 tensors; for Q5_K then the super-block's 32 bytes of
    fifth bits (bit s of byte i: value i of sub-block s), as eight more."""
    chunk = tl.minimum(first + tl.arange(0, BLOCK_N * BLOCK_U) % BLOCK_U, n_chunks - 1)
    if FMT == Q5_K:
        blockp = rowp + (chunk // 4) * 176
        quants = blockp + 48 + 32 * (chunk % 4)
    else:
        blockp = rowp + (chunk // 4) * 144
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
        fx_lo = _dot_chain(fx_lo, f_a[:4] + f_b[:4], split8(x_lo), BLOCK_N, BLOCK_U)
        fx_hi = _dot_chain(fx_hi, f_a[4:] + f_b[4:], split8(x_hi), BLOCK_N, BLOCK_U)

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
        words = (rowp + (chunk // 4) * 84).to(tl.pointer_type(tl.int32))
        codes = words + 4 + 4 * c
        raw = (tl.load(codes), tl.load(codes + 1), tl.load(codes + 2), tl.load(codes + 3),
               tl.load(words + 2 * (c // 2)), tl.load(words + 2 * (c // 2) + 1), tl.load(words + 20))
    else:
        tl.static_assert(FMT == Q3_K, "Q2_K or Q3_K")
        blockp = rowp + (chunk // 4) * 110
        codes, tops = blockp + 32 + 16 * c, blockp + 16 * (c % 2)
        raw = (_halfword_pair_word(codes), _halfword_pair_word(codes + 4), _halfword_pair_word(codes + 8),
               _halfword_pair_word(codes + 12), _halfword_pair_word(tops), _halfword_pair_word(tops + 4),
               _halfword_pair_word(tops + 8), _halfword_pair_word(tops + 12), _halfword_pair_word(blockp + 96),
               _halfword_pair_word(blockp + 100), _halfword_pair_word(blockp + 104),
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
            fx = _dot_chain(fx, byte_floats(code_a, code_b, USE_ASM), split8(x), BLOCK_N, BLOCK_U)
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


@triton.jit
def chunk_load(rowp, first, n_chunks, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``k_chunk_load`` (Q4_K, Q5_K) or ``small_k_chunk_load`` (Q2_K, Q3_K)."""
    if FMT == Q4_K or FMT == Q5_K:
        raw = k_chunk_load(rowp, first, n_chunks, FMT, BLOCK_N, BLOCK_U)
    else:
        raw = small_k_chunk_load(rowp, first, n_chunks, FMT, BLOCK_N, BLOCK_U)
    return raw


@triton.jit
def chunk_tile(raw, first, FMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``k_chunk_tile`` or ``small_k_chunk_tile`` of the chunks ``chunk_load`` read."""
    if FMT == Q4_K or FMT == Q5_K:
        tile = k_chunk_tile(raw, first, FMT, BLOCK_N, BLOCK_U)
    else:
        tile = small_k_chunk_tile(raw, first, FMT, BLOCK_N, BLOCK_U)
    return tile


@triton.jit
def chunk_columns(first, FMT: tl.constexpr, BLOCK_U: tl.constexpr):
    """Row index of each of ``chunk_tile``'s ``64 * BLOCK_U`` columns: in order for Q4_K and Q5_K, whose chunks are 64
    consecutive values, else ``small_k_chunk_columns``."""
    if FMT == Q4_K or FMT == Q5_K:
        columns = 64 * first + tl.arange(0, 64 * BLOCK_U)
    else:
        columns = small_k_chunk_columns(first, BLOCK_U)
    return columns


# ---------------------------------------------------------------------------------------------
# llama.cpp numerics for the GEMVs: the activations come quantized as ggml-cpu quantizes them for the weight's type
# (Q8_0 / Q8_1 blocks of 32, or Q8_K: an int8 per value, a float32 scale per 256 values, the sums of the int8s per
# 16) and each block's or sub-block's dot is an integer sum of 4-byte products (``dp4a``), scaled in float32 as
# ggml-cpu's ``ggml_vec_dot_<type>_q8_<x>`` does it.


@triton.jit
def dp4a(a, b, acc, USE_ASM: tl.constexpr, SIGNED_A: tl.constexpr = False):
    """``acc`` plus the sum of the products of the 4 bytes of int32 ``a`` (unsigned, or signed with ``SIGNED_A``) with
    the 4 signed bytes of ``b``."""
    if USE_ASM:
        if SIGNED_A:
            return tl.inline_asm_elementwise(
                "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32, is_pure=True, pack=1,
            )
        return tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, acc], dtype=tl.int32, is_pure=True, pack=1,
        )
    for byte in tl.static_range(4):
        if SIGNED_A:
            a_byte = (a << (24 - 8 * byte)) >> 24
        else:
            a_byte = (a >> (8 * byte)) & 0xFF
        acc += a_byte * ((b << (24 - 8 * byte)) >> 24)
    return acc


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
def small_k_sub_block(FMT: tl.constexpr, blockp, sub):
    """Where Q2_K / Q3_K sub-block ``sub`` (0..7) of the super-block at ``blockp`` keeps its bytes, and its integer
    scales: ``(low, high, scale_lo, scale_hi, min_lo, min_hi)``, ``low`` / ``high`` pointing at the 32 code and top-bit
    bytes (``small_k_codes``), the scales and mins of values 0-15 and 16-31 (Q3_K's mins are zero)."""
    if FMT == Q2_K:
        low, high = blockp + 16 + 32 * (sub // 4), blockp
        first, second = tl.load(blockp + 2 * sub).to(tl.int32), tl.load(blockp + 2 * sub + 1).to(tl.int32)
        scale_lo, scale_hi, min_lo, min_hi = first & 0xF, second & 0xF, first >> 4, second >> 4
    else:
        tl.static_assert(FMT == Q3_K, "Q2_K or Q3_K")
        low, high = blockp + 32 + 32 * (sub // 4), blockp
        scale_lo, scale_hi = _q3_k_scale(blockp + 96, 2 * sub), _q3_k_scale(blockp + 96, 2 * sub + 1)
        min_lo, min_hi = scale_lo * 0, scale_hi * 0
    return low, high, scale_lo, scale_hi, min_lo, min_hi


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
        low_word = _halfword_pair_word(low + 4 * word)
        if FMT == Q3_K:
            high_word = _halfword_pair_word(high + 4 * word)
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


@triton.jit
def _halfword_pair(p):
    """The two 32-bit words at 2-byte aligned uint8 pointers ``p`` and ``p + 4``, from four 16-bit loads."""
    p = p.to(tl.pointer_type(tl.uint16))
    h0, h1, h2, h3 = (tl.load(p).to(tl.int32), tl.load(p + 1).to(tl.int32), tl.load(p + 2).to(tl.int32),
                      tl.load(p + 3).to(tl.int32))
    return h0 | (h1 << 16), h2 | (h3 << 16)


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
    ql_even = _halfword_pair(blockp + 64 * half + 8 * group)
    ql_odd = _halfword_pair(blockp + 64 * half + 32 + 8 * group)
    qh = _halfword_pair(blockp + 128 + 32 * half + 8 * group)
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
            q0, q1 = _halfword_pair(blockp + 2 + 8 * pair)
            x0 = tl.load(xq + 8 * x_unit + 2 * pair, mask=inside, other=0)
            x1 = tl.load(xq + 8 * x_unit + 2 * pair + 1, mask=inside, other=0)
            dot = dp4a(tl.reshape(q0, (BLOCK_N, BLOCK_U)), x0[None, :], dot, USE_ASM, SIGNED_A=True)
            dot = dp4a(tl.reshape(q1, (BLOCK_N, BLOCK_U)), x1[None, :], dot, USE_ASM, SIGNED_A=True)
    else:
        # 16 bytes of nibbles: byte j holds value j (low nibble) and j + 16 (high); the weight is d (q - OFFSET) or d q + m
        OFFSET: tl.constexpr = 8 if FMT == Q4_0 else 16 if FMT == Q5_0 else 0
        quants, high = _legacy_layout(FMT, blockp)
        if FMT == Q5_0 or FMT == Q5_1:
            fifths = _halfword_pair_word(high)
        x_total = tl.zeros((BLOCK_U,), tl.int32)
        for pair in tl.static_range(2):  # words 2 pair, 2 pair + 1: bytes 8 pair .. 8 pair + 7
            words = _halfword_pair(quants + 8 * pair)
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
# llama.cpp numerics for many rows of activations (prefill): a block's or sub-block's weights become an int8 tile
# ``[BLOCK_N, 32]`` for ``tl.dot`` with the int8 activations ``[BLOCK_M, 32]`` (tensor cores, exact int32 sums), and
# the scales apply per block as in the GEMV. ``rowp`` points at each weight row's block, ``x`` at each activation
# row's first value of it; the int8 tensor-core product takes K = 32 at least, so Q6_K's 16-value groups are dots
# over 32 values with the other group's weights zeroed.


@triton.jit
def _int8_dot(x, q):
    """``x @ q.T`` for int8 activations ``[BLOCK_M, 32]`` and int32 weights ``[BLOCK_N, 32]`` in int8 range, in int32."""
    return tl.dot(x, tl.trans(q.to(tl.int8)), out_dtype=tl.int32)


@triton.jit
def _byte_tile(p, cols):
    """The bytes at ``p[:, None] + cols[None, :]`` as int32."""
    return tl.load(p[:, None] + cols[None, :]).to(tl.int32)


@triton.jit
def k_chunk_tile_dots_q8k(FMT: tl.constexpr, blockp, x, x_sums, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one Q4_K / Q5_K super-block of each weight row and its 256 Q8_K activations of each row (``x_sums``: their
    16 sums of 16), ggml's integer sums ``(sum_j scale_j dot_j, sum_j min_j xsum_j)`` over the 8 sub-blocks j, int32
    ``[BLOCK_M, BLOCK_N]`` each."""
    words = blockp.to(tl.pointer_type(tl.int32))
    s0, s1, s2 = tl.load(words + 1), tl.load(words + 2), tl.load(words + 3)
    cols = tl.arange(0, 32)
    if FMT == Q5_K:  # bit j of byte i: the fifth bit of value i of sub-block j
        tops, quants = _byte_tile(blockp + 16, cols), blockp + 48
    else:
        quants = blockp + 16
    dots = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    mins = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for chunk in tl.static_range(4):  # sub-blocks 2 chunk (low nibbles) and 2 chunk + 1 (high)
        q = _byte_tile(quants + 32 * chunk, cols)
        q_lo, q_hi = q & 0xF, q >> 4
        if FMT == Q5_K:
            q_lo |= ((tops >> (2 * chunk)) & 1) << 4
            q_hi |= ((tops >> (2 * chunk + 1)) & 1) << 4
        scale_lo, min_lo, scale_hi, min_hi = q4_k_chunk_scales(s0, s1, s2, chunk)
        x_lo = tl.load(x[:, None] + 64 * chunk + cols[None, :])
        x_hi = tl.load(x[:, None] + 64 * chunk + 32 + cols[None, :])
        dots += _int8_dot(x_lo, q_lo) * scale_lo[None, :] + _int8_dot(x_hi, q_hi) * scale_hi[None, :]
        sum_lo = tl.load(x_sums + 4 * chunk) + tl.load(x_sums + 4 * chunk + 1)
        sum_hi = tl.load(x_sums + 4 * chunk + 2) + tl.load(x_sums + 4 * chunk + 3)
        mins += sum_lo[:, None] * min_lo[None, :] + sum_hi[:, None] * min_hi[None, :]
    return dots, mins


@triton.jit
def _halves_dot(x, q, scale_a, scale_b):
    """``scale_a * x[:, :16] @ q[:, :16].T + scale_b * x[:, 16:] @ q[:, 16:].T`` (int32) for int8 activations ``x``
    ``[BLOCK_M, 32]``, weights ``q`` ``[BLOCK_N, 32]`` and per-row scales ``[BLOCK_N]``: two products over 32 values
    with the other half's weights zeroed, the int8 tensor-core product taking K = 32 at least."""
    first_half = tl.arange(0, 32)[None, :] < 16
    return _int8_dot(x, tl.where(first_half, q, 0)) * scale_a[None, :] \
        + _int8_dot(x, tl.where(first_half, 0, q)) * scale_b[None, :]


@triton.jit
def q6_k_tile_dots_q8k(blockp, x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For one Q6_K super-block of each weight row and its 256 Q8_K activations of each row, ggml's integer sum
    ``sum_g scale_g sum (q - 32) x`` over the 16-value groups g, int32 ``[BLOCK_M, BLOCK_N]``."""
    cols = tl.arange(0, 32)
    scalep = (blockp + 192).to(tl.pointer_type(tl.int8))
    dots = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for half in tl.static_range(2):
        ql_even = _byte_tile(blockp + 64 * half, cols)
        ql_odd = _byte_tile(blockp + 64 * half + 32, cols)
        qh = _byte_tile(blockp + 128 + 32 * half, cols)
        for k in tl.static_range(4):  # values 128 half + 32 k + i: nibble k // 2 of ql, bits 2k, 2k + 1 of qh
            if k % 2 == 0:
                ql = ql_even
            else:
                ql = ql_odd
            q = (((ql >> (4 * (k // 2))) & 0xF) | (((qh >> (2 * k)) & 3) << 4)) - 32
            xs = tl.load(x[:, None] + 128 * half + 32 * k + cols[None, :])
            group = 8 * half + 2 * k
            dots += _halves_dot(xs, q, tl.load(scalep + group).to(tl.int32), tl.load(scalep + group + 1).to(tl.int32))
    return dots


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
        low = _byte_tile(low, cols)
        if FMT == Q3_K:
            q = small_k_codes(FMT, low, _byte_tile(high, cols), sub) - 4
        else:
            q = small_k_codes(FMT, low, low, sub)
        dots += _halves_dot(tl.load(x[:, None] + 32 * sub + cols[None, :]), q, scale_lo, scale_hi)
        if FMT == Q2_K:
            mins += tl.load(x_sums + 2 * sub)[:, None] * min_lo[None, :] \
                + tl.load(x_sums + 2 * sub + 1)[:, None] * min_hi[None, :]
    return dots, mins


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
        q = (_byte_tile(quants, cols % 16) >> (4 * (cols[None, :] // 16))) & 0xF
        if FMT == Q5_0 or FMT == Q5_1:
            q |= ((_halfword_pair_word(high)[:, None] >> cols[None, :]) & 1) << 4
        if FMT == Q4_0:
            q -= 8
        elif FMT == Q5_0:
            q -= 16
    return _int8_dot(tl.load(x[:, None] + cols[None, :]), q)
