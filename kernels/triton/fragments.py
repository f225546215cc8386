"""The tensor-core fragments of the fragment kernel (``mma``): the instruction, its loads and lane shuffles. Each
format's reader that unpacks its blocks straight into fragments lives with its family (``legacy.legacy_pair_dots``,
``k_affine.q4_k_fragment_dots``, ``q6_k.q6_k_fragment_dots``).

``mma.sync.m16n8k16`` multiplies a 16x16 tile A by a 16x8 tile B on one warp, each lane holding fixed elements in
its registers (PTX ISA, "Matrix fragments for mma.m16n8k16"): lane ``4 g + t`` holds A's rows ``g`` and ``g + 8`` at
k = ``2t, 2t + 1`` and ``2t + 8, 2t + 9`` (two 16-bit values per register, four registers), B's column ``g`` at the
same k (two registers), and the result's rows ``g``, ``g + 8`` at columns ``2t``, ``2t + 1`` (four float32).
Here A is 16 weight rows and B's columns are 8 rows of activations. Every weight tensor of these kernels holds one
value per lane (shape ``[32 * warps]``), so each lane loads and unpacks exactly the weights of its own A registers:
no tile goes through shared memory to reach the tensor cores, as ``tl.dot``'s operands do. Activations (B) and sums
(C) come in tiles of 8 rows, shape ``[tiles, 32 * warps]``, a lane holding its value of each tile: the weights,
broadcast over the tiles, are unpacked once for one instruction per tile.

Which 16 values of K one instruction covers is free, as long as A and B agree on it. A quant q becomes the 16-bit
float ``MAGIC + q`` (bfloat16 128 + q for q < 128, float16 1024 + q for q < 1024, both exact) with a mask and a byte
permute, so an instruction sums ``(MAGIC + q) x``; a second one with A all ones sums ``x``, and a block's scale and
offset turn the two sums into its exact dot in float32.
- Q4_K: a lane takes 8 consecutive quants of one sub-block of each of its two rows (one 8-byte load) and the 8
  matching activations (one 16-byte load); ``d scale (sum (MAGIC + q) x) - (MAGIC d scale + dmin min) sum x``.
- Q4_0, Q4_1, Q8_0 (32-value blocks of 18, 20 and 34 bytes): a lane takes quant bytes ``4 t .. 4 t + 3`` of each 16
  of a block. Blocks of 18 and 34 bytes are only 2-byte aligned, so the 4 lanes of a row read a pair of blocks as
  aligned words, 16 contiguous bytes per load, and pass each other the words that straddle (``shfl``): one load per
  lane and word instead of two, and no 2-byte loads, since the number of load requests, not DRAM, limits a version
  that loads each lane's words on its own (docs/performance.md, "The fragment kernel"). Q8_0's bytes u = q + 128
  are one plane in float16, and two nibble planes ``16 (MAGIC + u / 16) + (MAGIC + u % 16)`` in bfloat16.
- Q6_K (210-byte super-blocks, every other one 2 bytes past a word): the same aligned loads and shuffles, a lane taking
  values ``4 t ..`` of each 16-value scale group, one instruction per group; its 4 bits of ql and 2 of qh make
  ``q`` in 0..63, and ``d scale (sum (MAGIC + q) x - (MAGIC + 32) sum x)`` is the group's dot.

On CUDA (``USE_ASM``) the loads, permutes and ``mma.sync`` are inline PTX; the interpreter, which runs no PTX, loads
with ``tl.load`` and computes each instruction as the sums it stands for.
"""
import triton
import triton.language as tl

from .bits import f16_halves

# ---------------------------------------------------------------------------------------------
# Loads and the instruction


@triton.jit
def load_words(p, COUNT: tl.constexpr, USE_ASM: tl.constexpr):
    """The ``COUNT`` (1, 2 or 4) int32 words at each uint8 pointer ``p`` (a multiple of ``4 COUNT`` bytes), in one
    load."""
    tl.static_assert(COUNT == 1 or COUNT == 2 or COUNT == 4, "loads of 1, 2 or 4 words")
    # One value per lane, whatever layout the compiler would pick for a [lanes, COUNT] load. One return statement:
    # Triton 3.6 rejects returns of different arity even in branches it never compiles.
    if USE_ASM:
        if COUNT == 1:
            words = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [p], dtype=tl.int32,
                                              is_pure=True, pack=1)
        elif COUNT == 2:
            words = tl.inline_asm_elementwise("ld.global.nc.v2.b32 {$0, $1}, [$2];", "=r,=r,l", [p],
                                              dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
        else:
            words = tl.inline_asm_elementwise("ld.global.nc.v4.b32 {$0, $1, $2, $3}, [$4];", "=r,=r,=r,=r,l", [p],
                                              dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1)
    else:  # word by word, for pointers of any shape
        p = p.to(tl.pointer_type(tl.int32))
        if COUNT == 1:
            words = tl.load(p)
        elif COUNT == 2:
            words = tl.load(p), tl.load(p + 1)
        else:
            words = tl.load(p), tl.load(p + 1), tl.load(p + 2), tl.load(p + 3)
    return words


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
    # Emulated over the lanes of every tile: B and C are [tiles, lanes], A [1, lanes] (the same weights in each tile).
    a0, a1, a2, a3 = _flat(a0, b0), _flat(a1, b0), _flat(a2, b0), _flat(a3, b0)
    x0, x1 = _flat(b0, b0), _flat(b1, b0)
    d0, d1 = _emulated_mma_rows(a0, a2, x0, x1, BF16)
    d2, d3 = _emulated_mma_rows(a1, a3, x0, x1, BF16)
    return (c0 + tl.reshape(d0, b0.shape), c1 + tl.reshape(d1, b0.shape), c2 + tl.reshape(d2, b0.shape),
            c3 + tl.reshape(d3, b0.shape))


@triton.jit
def _flat(v, like):
    """``v`` broadcast to the 2-D shape of ``like``, flattened."""
    return tl.reshape(tl.broadcast_to(v, like.shape), (like.shape[0] * like.shape[1],))


@triton.jit
def plane_mma(top, bottom, x0, x1, c0, c1, c2, c3, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``c`` plus one instruction's sums of ``(MAGIC + q) x`` per tile: ``top`` and ``bottom`` hold 4 quants (bytes,
    below 128 for bfloat16) of the lane's two weight rows, ``x0``, ``x1`` its 4 matching activations of its column in
    each tile."""
    MAGIC_BYTE: tl.constexpr = 0x43 if BF16 else 0x64
    t01, t23 = _magic_pairs(top, MAGIC_BYTE, USE_ASM)
    b01, b23 = _magic_pairs(bottom, MAGIC_BYTE, USE_ASM)
    return mma(t01[None, :], b01[None, :], t23[None, :], b23[None, :], x0, x1, c0, c1, c2, c3, BF16, USE_ASM)


@triton.jit
def column_sum(x0, x1, s0, s1, BF16: tl.constexpr, USE_ASM: tl.constexpr):
    """``s`` plus the sums of one instruction's 4 activations per lane (``x0``, ``x1``) of columns ``2t``, ``2t + 1``:
    an A of all ones."""
    ONES: tl.constexpr = 0x3F803F80 if BF16 else 0x3C003C00
    ones = tl.full(x0.shape, ONES, tl.int32)
    zero = tl.zeros(x0.shape, tl.float32)
    s0, s1, _, _ = mma(ones, ones, ones, ones, x0, x1, s0, s1, zero, zero, BF16, USE_ASM)
    return s0, s1

# ---------------------------------------------------------------------------------------------
# Words across the 4 lanes of a row, for blocks that straddle word boundaries


@triton.jit
def group_lane(v, SOURCE: tl.constexpr, USE_ASM: tl.constexpr):
    """Each lane's value of ``v`` at lane ``t + 1`` (``SOURCE`` = -1, wrapping round) or lane ``SOURCE`` (0-3) of its
    group of 4 lanes (the lanes of one weight row)."""
    tl.static_assert(SOURCE >= -1 and SOURCE <= 3, "the next lane, or lane 0, 1, 2 or 3")
    if USE_ASM:
        lane = tl.arange(0, v.shape[0]) % 32
        source = (lane & 28) | (((lane + 1) & 3) if SOURCE == -1 else SOURCE)
        moved = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [v, source],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        even, odd = tl.split(tl.reshape(v, (v.shape[0] // 4, 2, 2)))  # (t0, t2), (t1, t3)
        t0, t2 = tl.split(even)
        t1, t3 = tl.split(odd)
        if SOURCE == -1:
            moved = tl.reshape(tl.join(tl.join(t1, t3), tl.join(t2, t0)), v.shape)
        else:
            if SOURCE == 0:
                source = t0
            elif SOURCE == 1:
                source = t1
            elif SOURCE == 2:
                source = t2
            else:
                source = t3
            moved = tl.reshape(tl.broadcast_to(source[:, None], (v.shape[0] // 4, 4)), v.shape)
    return moved


@triton.jit
def _funnel(low, high, shift, USE_ASM: tl.constexpr):
    """The 4 bytes ``shift / 8`` (0 or 2) bytes into the 8 of ``low``, ``high``."""
    if USE_ASM:
        word = tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r", [low, high, shift],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        word = tl.where(shift == 0, low, ((low >> 16) & 0xFFFF) | (high << 16))
    return word


@triton.jit
def field_word(r, next_r, next_after, last, shift, USE_ASM: tl.constexpr):
    """The lane's word of a field ``shift / 8`` bytes past the aligned words ``r`` that the 4 lanes of a row loaded
    (16 contiguous bytes): from its own word and the next lane's (``next_r``), which for lane 3 is lane 0's of the
    following 16 bytes (``next_after``)."""
    return _funnel(r, tl.where(last, next_after, next_r), shift, USE_ASM)
