"""Triton device functions that unpack GGUF blocks straight into tensor-core fragments, for few rows of activations.

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
  lane and word instead of two, and no 2-byte loads: the number of load requests, not DRAM, limited the first
  version (bench/RESULTS.md, fourteenth session). Q8_0's bytes u = q + 128 are one plane in
  float16, and two nibble planes ``16 (MAGIC + u / 16) + (MAGIC + u % 16)`` in bfloat16.
- Q6_K (210-byte super-blocks, every other one 2 bytes past a word): the same aligned loads and shuffles, a lane taking
  values ``4 t ..`` of each 16-value scale group, one instruction per group; its 4 bits of ql and 2 of qh make
  ``q`` in 0..63, and ``d scale (sum (MAGIC + q) x - (MAGIC + 32) sum x)`` is the group's dot.

On CUDA (``USE_ASM``) the loads, permutes and ``mma.sync`` are inline PTX; the interpreter, which runs no PTX, loads
with ``tl.load`` and computes each instruction as the sums it stands for.
"""
import triton
import triton.language as tl

from .dequant import Q4_0, Q4_1, Q8_0, f16_halves, q4_k_chunk_scales


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


@triton.jit
def _group_lane(v, SOURCE: tl.constexpr, USE_ASM: tl.constexpr):
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
def _field(r, next_r, next_after, last, shift, USE_ASM: tl.constexpr):
    """The lane's word of a field ``shift / 8`` bytes past the aligned words ``r`` that the 4 lanes of a row loaded
    (16 contiguous bytes): from its own word and the next lane's (``next_r``), which for lane 3 is lane 0's of the
    following 16 bytes (``next_after``)."""
    return _funnel(r, tl.where(last, next_after, next_r), shift, USE_ASM)


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
    next0, next1 = _group_lane(r0, -1, USE_ASM), _group_lane(r1, -1, USE_ASM)
    first_low = _field(r0, next0, next1, last, sixteen, USE_ASM)  # bytes 2 + 4 t ..
    d0 = _group_lane(r0, 0, USE_ASM) & 0xFFFF
    if FMT == Q4_0:  # 9 words: d0 q0 .. | .. q0 d1 | q1 ..
        next2 = _group_lane(tl.load(words + 8, mask=t == 0, other=0), -1, USE_ASM)
        d1 = _group_lane(r1, 0, USE_ASM) >> 16
        first_high, second_low = first_low, tl.where(last, next2, next1)  # W[5 + t]
        second_high = second_low
    else:  # 17 words: d0 q0 .. | .. | .. q0 d1 | q1 .. | ..
        r2, r3 = tl.load(words + 8), tl.load(words + 12)
        next2, next3 = _group_lane(r2, -1, USE_ASM), _group_lane(r3, -1, USE_ASM)
        next4 = _group_lane(tl.load(words + 16, mask=t == 0, other=0), -1, USE_ASM)
        first_high = _field(r1, next1, next2, last, sixteen, USE_ASM)  # bytes 18 + 4 t ..
        d1 = _group_lane(r2, 0, USE_ASM) >> 16
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
            top_d, top_m, top_quants = _q4_1_fields(w_ptr, top + 20 * i, valid)
            bottom_d, bottom_m, bottom_quants = _q4_1_fields(w_ptr, bottom + 20 * i, valid)
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


@triton.jit
def _q6_k_row(w_ptr, block, valid, USE_ASM: tl.constexpr):
    """The lane's words (word t of each 16-byte row: ql 0-7, qh 8-11, scales 12) of the Q6_K super-block at even byte
    ``block`` of the 4-byte aligned ``w_ptr``, and its d as float32 (zero where ``valid`` is false).

    Super-block (210 bytes): 128 bytes ql (low 4 bits) | 64 bytes qh (high 2 bits) | 16 int8 scales | f16 d. Every
    other one starts 2 bytes past a word, so the 4 lanes of a row load the aligned words ``W[4 i + t]`` around it and
    pass each other the next word, as ``_pair_fields`` does."""
    t = tl.arange(0, block.shape[0]) % 4
    last = t == 3
    shift = (block & 2).to(tl.int32) * 8
    words = (w_ptr + (block - (block & 2))).to(tl.pointer_type(tl.int32)) + t
    r0, r1, r2, r3 = tl.load(words), tl.load(words + 4), tl.load(words + 8), tl.load(words + 12)
    r4, r5, r6, r7 = tl.load(words + 16), tl.load(words + 20), tl.load(words + 24), tl.load(words + 28)
    r8, r9, r10, r11 = tl.load(words + 32), tl.load(words + 36), tl.load(words + 40), tl.load(words + 44)
    r12, r13 = tl.load(words + 48), tl.load(words + 52, mask=t == 0, other=0)  # d, and the word after the scales
    n0, n1, n2, n3 = (_group_lane(r0, -1, USE_ASM), _group_lane(r1, -1, USE_ASM), _group_lane(r2, -1, USE_ASM),
                      _group_lane(r3, -1, USE_ASM))
    n4, n5, n6, n7 = (_group_lane(r4, -1, USE_ASM), _group_lane(r5, -1, USE_ASM), _group_lane(r6, -1, USE_ASM),
                      _group_lane(r7, -1, USE_ASM))
    n8, n9, n10, n11 = (_group_lane(r8, -1, USE_ASM), _group_lane(r9, -1, USE_ASM), _group_lane(r10, -1, USE_ASM),
                        _group_lane(r11, -1, USE_ASM))
    n12, n13 = _group_lane(r12, -1, USE_ASM), _group_lane(r13, -1, USE_ASM)
    d, _ = f16_halves(_group_lane(r13, 0, USE_ASM) >> shift)
    return (_field(r0, n0, n1, last, shift, USE_ASM), _field(r1, n1, n2, last, shift, USE_ASM),
            _field(r2, n2, n3, last, shift, USE_ASM), _field(r3, n3, n4, last, shift, USE_ASM),
            _field(r4, n4, n5, last, shift, USE_ASM), _field(r5, n5, n6, last, shift, USE_ASM),
            _field(r6, n6, n7, last, shift, USE_ASM), _field(r7, n7, n8, last, shift, USE_ASM),
            _field(r8, n8, n9, last, shift, USE_ASM), _field(r9, n9, n10, last, shift, USE_ASM),
            _field(r10, n10, n11, last, shift, USE_ASM), _field(r11, n11, n12, last, shift, USE_ASM),
            _field(r12, n12, n13, last, shift, USE_ASM), tl.where(valid, d, 0.0))


@triton.jit
def _q6_k_quants(ql, qh, J: tl.constexpr):
    """The 6-bit quants of group ``j`` of a quarter (``_q6_k_quarter``) in one word: the low (j = 0, 1) or high
    (j = 2, 3) nibbles of ``ql`` under bits ``2 j`` of ``qh``."""
    return ((ql >> (4 * (J // 2))) & 0x0F0F0F0F) | (((qh >> (2 * J)) & 0x03030303) << 4)


@triton.jit
def _q6_k_group_scale(scales, d, GROUP: tl.constexpr, USE_ASM: tl.constexpr):
    """``d`` times the int8 scale of 16-value group ``GROUP``: byte ``GROUP % 4`` of the scales word that lane
    ``GROUP // 4`` of the row holds."""
    word = _group_lane(scales, GROUP // 4, USE_ASM)
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
