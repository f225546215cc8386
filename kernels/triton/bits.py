"""Byte loads and bit unpacking that the format families' readers share (``legacy``, ``k_small``, ``k_affine``,
``q6_k``).

Loads: a block is often only 2-byte aligned, so its words are read with narrow loads and joined in registers
(``four_halfwords``, ``halfword_pair_word``), or with 4- and 16-byte loads where the format's blocks allow it.

Quants become floats without an int->float conversion (which runs at a fraction of the ALU rate): the quant's bits go
under the exponent of 1.0, giving ``1 + q / 2**bits`` exactly (``mantissa_to_f32``, and ``byte_floats``' one byte
permute per value). ``readers`` says how the kernels use such *pieces*.

``tl.join(a, b)`` appends a new innermost axis, so in a nest of joins the outermost join picks the
fastest-varying index of the flattened result.
"""
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# Bit fields and loads


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
def halfword_pair_word(p):
    """The 32-bit word at 2-byte aligned uint8 pointers ``p``, as int32."""
    p = p.to(tl.pointer_type(tl.uint16))
    return tl.load(p).to(tl.int32) | (tl.load(p + 1).to(tl.int32) << 16)


@triton.jit
def halfword_pair(p):
    """The two 32-bit words at 2-byte aligned uint8 pointers ``p`` and ``p + 4``, from four 16-bit loads."""
    p = p.to(tl.pointer_type(tl.uint16))
    h0, h1, h2, h3 = (tl.load(p).to(tl.int32), tl.load(p + 1).to(tl.int32), tl.load(p + 2).to(tl.int32),
                      tl.load(p + 3).to(tl.int32))
    return h0 | (h1 << 16), h2 | (h3 << 16)


@triton.jit
def four_words(p):
    """The 16 bytes at each 16-byte aligned uint8 pointer ``p``, in one vector load, as four int32 tensors."""
    words = tl.load(p.to(tl.pointer_type(tl.int32))[:, None] + tl.arange(0, 4)[None, :])
    even, odd = tl.split(tl.reshape(words, (words.shape[0], 2, 2)))
    w0, w2 = tl.split(even)
    w1, w3 = tl.split(odd)
    return w0, w1, w2, w3


@triton.jit
def flat8(t):
    """``[UNITS, 2, 2, 2]`` -> ``[UNITS, 8]``: the in-register axes of a piece, flattened."""
    return tl.reshape(t, (t.shape[0], 8))

# ---------------------------------------------------------------------------------------------
# Pieces of 8 values as floats ``1 + q / 2**bits``


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
# Chunk arithmetic: bytes as floats ``1 + q / 128`` with one byte permute each, and the GEMV's dot chain


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
def dot_chain(acc, fs, xs, BLOCK_N: tl.constexpr, BLOCK_U: tl.constexpr):
    """``acc + sum_i fs[i] * xs[i]``, one fused multiply-add per value, for (row, chunk) ``fs``, per-(activation row,
    chunk) ``xs`` and ``acc`` ``[BLOCK_M, BLOCK_N, BLOCK_U]``."""
    for i in tl.static_range(len(fs)):
        acc = tl.reshape(fs[i], (1, BLOCK_N, BLOCK_U)) * xs[i][:, None, :] + acc
    return acc

# ---------------------------------------------------------------------------------------------
# Integer products, for llama.cpp numerics


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
def int8_dot(x, q):
    """``x @ q.T`` for int8 activations ``[BLOCK_M, 32]`` and int32 weights ``[BLOCK_N, 32]`` in int8 range, in int32."""
    return tl.dot(x, tl.trans(q.to(tl.int8)), out_dtype=tl.int32)


@triton.jit
def byte_tile(p, cols):
    """The bytes at ``p[:, None] + cols[None, :]`` as int32."""
    return tl.load(p[:, None] + cols[None, :]).to(tl.int32)


@triton.jit
def halves_dot(x, q, scale_a, scale_b):
    """``scale_a * x[:, :16] @ q[:, :16].T + scale_b * x[:, 16:] @ q[:, 16:].T`` (int32) for int8 activations ``x``
    ``[BLOCK_M, 32]``, weights ``q`` ``[BLOCK_N, 32]`` and per-row scales ``[BLOCK_N]``: two products over 32 values
    with the other half's weights zeroed, the int8 tensor-core product taking K = 32 at least."""
    first_half = tl.arange(0, 32)[None, :] < 16
    return int8_dot(x, tl.where(first_half, q, 0)) * scale_a[None, :] \
        + int8_dot(x, tl.where(first_half, 0, q)) * scale_b[None, :]
