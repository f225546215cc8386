// y = x @ W.T computed straight from GGUF blocks, for workbench.kernels.cpu.
//
// Two numerics:
//   exact:    each weight block is dequantized into a small float buffer and multiplied
//             against fp32 activations with fp32 accumulation, i.e. x @ dequantize(W).T up to
//             fp32 rounding. For larger batches a panel of rows is dequantized and handed to
//             the BLAS (at::mm). Q6_K's and Q3_K's single rows on AVX-512 take the activations
//             in 24-bit block floating point and multiply in integers (digit_dot), and so do
//             batches of 12-256 rows on AMX's int8 tiles (tile_matmul).
//   llamacpp: activations are first quantized to Q8_0 / Q8_1 / Q8_K as ggml-cpu does and each
//             block product is an integer dot product scaled in float, as ggml's vec_dot functions.
//
// The code is plain C++ over a few AVX2 primitives (with a portable fallback); the exact dot products
// also have AVX-512 code (16 lanes, and table lookups for the 4-bit formats). cpu.py compiles it for the
// widest vector ISA the CPU has (AVX-512 with or without VNNI, AVX2+FMA, or none).
//
// The formats' GGML type numbers and block sizes are not written here: cpu.py passes the format table
// (kernels/formats/table.py) as macros, WB_<FORMAT>_TYPE, WB_<FORMAT>_VALUES and WB_<FORMAT>_BYTES for every weight
// format below and for the activation blocks Q8_0, Q8_1 and Q8_K.
#include <torch/library.h>
#include <torch/types.h>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if !defined(WB_Q8_0_TYPE) || !defined(WB_Q8_K_VALUES)
#error "the format table's macros are missing: build this file through workbench.kernels.cpu"
#endif

// A format's numbers from the format table.
#define WB_FORMAT(F) static constexpr int kType = WB_##F##_TYPE, kValues = WB_##F##_VALUES, kBytes = WB_##F##_BYTES

namespace {

constexpr int kQK = WB_Q8_0_VALUES;   // values per block of the legacy formats and of Q8_0 / Q8_1
constexpr int kQKK = WB_Q8_K_VALUES;  // values per K-quant super-block and of Q8_K

inline float half_at(const void* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return c10::detail::fp16_ieee_to_fp32_value(bits);
}

inline uint16_t float_to_half(float v) { return c10::detail::fp16_ieee_from_fp32_value(v); }

// ---------------------------------------------------------------------------------------------
// Activation blocks of the llama.cpp numerics (byte layouts as ggml's block_q8_0/_1/_K).

struct BlockQ8_0 {
  WB_FORMAT(Q8_0);
  uint16_t d;  // fp16
  int8_t qs[kQK];
};
struct BlockQ8_1 {
  WB_FORMAT(Q8_1);
  uint16_t d;  // fp16
  uint16_t s;  // fp16 of d * sum(qs)
  int8_t qs[kQK];
};
struct BlockQ8_K {
  WB_FORMAT(Q8_K);
  float d;
  int8_t qs[kQKK];
  int16_t bsums[kQKK / 16];
};
static_assert(sizeof(BlockQ8_0) == BlockQ8_0::kBytes && sizeof(BlockQ8_1) == BlockQ8_1::kBytes &&
                  sizeof(BlockQ8_K) == BlockQ8_K::kBytes && BlockQ8_0::kValues == kQK && BlockQ8_1::kValues == kQK,
              "the activation blocks' layout (ggml's block_q8_0 / _1 / _K) disagrees with the format table");

float abs_max(const float* x, int n) {
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}

// ggml-cpu's x86 quantize_row_q8_0/_1: scale 127/amax, round half to even.
template <class Block>
void quantize_q8_block(const float* x, Block& y) {
  const float amax = abs_max(x, kQK);
  const float d = amax / 127.0f;
  const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
  int sum = 0;
  for (int j = 0; j < kQK; ++j) {
    y.qs[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
    sum += y.qs[j];
  }
  y.d = float_to_half(d);
  if constexpr (std::is_same_v<Block, BlockQ8_1>) y.s = float_to_half(d * static_cast<float>(sum));
}

// ggml's quantize_row_q8_K_ref: the signed extreme maps to -127, round half to even.
void quantize_q8_k_block(const float* x, BlockQ8_K& y) {
  float amax = 0.0f, max = 0.0f;
  for (int j = 0; j < kQKK; ++j) {
    if (std::fabs(x[j]) > amax) {
      amax = std::fabs(x[j]);
      max = x[j];
    }
  }
  std::memset(&y, 0, sizeof(y));
  if (amax == 0.0f) return;
  const float iscale = -127.0f / max;
  for (int j = 0; j < kQKK; ++j) y.qs[j] = static_cast<int8_t>(std::min(127.0f, std::nearbyint(iscale * x[j])));
  for (int g = 0; g < kQKK / 16; ++g) {
    int sum = 0;
    for (int j = 0; j < 16; ++j) sum += y.qs[16 * g + j];
    y.bsums[g] = static_cast<int16_t>(sum);
  }
  y.d = 1.0f / iscale;
}

template <class Block>
void quantize_row(const float* x, int64_t k, Block* y) {
  if constexpr (std::is_same_v<Block, BlockQ8_K>) {
    for (int64_t b = 0; b < k / kQKK; ++b) quantize_q8_k_block(x + b * kQKK, y[b]);
  } else {
    for (int64_t b = 0; b < k / kQK; ++b) quantize_q8_block(x + b * kQK, y[b]);
  }
}

// ---------------------------------------------------------------------------------------------
// A few vector primitives, AVX2+FMA when compiled for it, plain loops otherwise.
//   Bytes:  32 int8 values (the integer values of a group of 32 weights)
//   Floats: 8 fp32 lanes
//   Ints:   8 int32 lanes; lanes 0-3 sum bytes 0-15 and lanes 4-7 bytes 16-31 of a dot_bytes_scaled

#if defined(__AVX2__) && defined(__FMA__)
using Bytes = __m256i;
using Floats = __m256;
using Ints = __m256i;

inline Bytes load_bytes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// Low nibbles of p[0..16) followed by their high nibbles.
inline Bytes nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}
inline Bytes and_bytes(Bytes a, uint8_t mask) { return _mm256_and_si256(a, _mm256_set1_epi8(static_cast<char>(mask))); }
inline Bytes shr_bytes(Bytes a, int n) { return and_bytes(_mm256_srli_epi16(a, n), 0xFF >> n); }
inline Bytes shl_bytes(Bytes a, int n) { return and_bytes(_mm256_slli_epi16(a, n), (0xFF << n) & 0xFF); }
inline Bytes or_bytes(Bytes a, Bytes b) { return _mm256_or_si256(a, b); }
inline Bytes sub_bytes(Bytes a, int8_t c) { return _mm256_sub_epi8(a, _mm256_set1_epi8(c)); }
// Byte j = table[a[j]] for a 16-entry table and indices 0..15.
inline Bytes lookup_bytes(Bytes a, const int8_t* table) {
  const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table));
  return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), a);
}
// Byte j = value where bit j of the little-endian 32-bit word at p is set, else 0.
inline Bytes bits_to_bytes(const uint8_t* p, uint8_t value) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return and_bytes(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), value);
}

inline Floats zeros() { return _mm256_setzero_ps(); }
inline Floats broadcast(float v) { return _mm256_set1_ps(v); }
inline Floats load_floats(const float* p) { return _mm256_loadu_ps(p); }
inline void store_floats(float* p, Floats v) { _mm256_storeu_ps(p, v); }
inline Floats fmadd(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
inline Floats add(Floats a, Floats b) { return _mm256_add_ps(a, b); }
inline Floats mul(Floats a, Floats b) { return _mm256_mul_ps(a, b); }
inline float hsum(Floats v) {
  __m128 r = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  r = _mm_add_ps(r, _mm_movehl_ps(r, r));
  return _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)));
}
// Values 8i .. 8i+8 of q as floats.
inline Floats bytes_to_floats(Bytes q, int i) {
  const __m128i half = i < 2 ? _mm256_castsi256_si128(q) : _mm256_extracti128_si256(q, 1);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(i % 2 ? _mm_srli_si128(half, 8) : half));
}

inline Ints zero_ints() { return _mm256_setzero_si256(); }
// Products of q and y summed in groups of 4 bytes (ggml's mul_sum_i8_pairs), lanes 0-3 times lo and lanes 4-7 times
// hi, in one multiply-add of the byte pairs' sums. With kUnsigned the values q are known to be >= 0 and multiply y as
// they are, without moving q's signs onto y.
template <bool kUnsigned = false>
inline Ints dot_bytes_scaled(Bytes q, const int8_t* y, int lo, int hi) {
  const __m256i yv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y));
  const __m256i pairs = kUnsigned ? _mm256_maddubs_epi16(q, yv)
                                  : _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(yv, q));
  return _mm256_madd_epi16(pairs, _mm256_setr_epi16(lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi));
}
inline Ints add_ints(Ints a, Ints b) { return _mm256_add_epi32(a, b); }
inline Ints load_ints(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Floats ints_to_floats(Ints v) { return _mm256_cvtepi32_ps(v); }

#else  // portable fallback with the same semantics

struct Bytes { int8_t v[32]; };
struct Floats { float v[8]; };
struct Ints { int32_t v[8]; };

inline Bytes load_bytes(const uint8_t* p) { Bytes r; std::memcpy(r.v, p, 32); return r; }
inline Bytes nibbles(const uint8_t* p) {
  Bytes r;
  for (int j = 0; j < 16; ++j) { r.v[j] = p[j] & 0x0F; r.v[j + 16] = p[j] >> 4; }
  return r;
}
inline Bytes and_bytes(Bytes a, uint8_t mask) { for (auto& b : a.v) b = static_cast<int8_t>(static_cast<uint8_t>(b) & mask); return a; }
inline Bytes shr_bytes(Bytes a, int n) { for (auto& b : a.v) b = static_cast<int8_t>(static_cast<uint8_t>(b) >> n); return a; }
inline Bytes shl_bytes(Bytes a, int n) { for (auto& b : a.v) b = static_cast<int8_t>(static_cast<uint8_t>(b) << n); return a; }
inline Bytes or_bytes(Bytes a, Bytes b) { for (int j = 0; j < 32; ++j) a.v[j] |= b.v[j]; return a; }
inline Bytes sub_bytes(Bytes a, int8_t c) { for (auto& b : a.v) b = static_cast<int8_t>(b - c); return a; }
inline Bytes lookup_bytes(Bytes a, const int8_t* table) { for (auto& b : a.v) b = table[b & 0x0F]; return a; }
inline Bytes bits_to_bytes(const uint8_t* p, uint8_t value) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  Bytes r;
  for (int j = 0; j < 32; ++j) r.v[j] = static_cast<int8_t>((bits >> j) & 1 ? value : 0);
  return r;
}

inline Floats zeros() { return Floats{}; }
inline Floats broadcast(float v) { Floats r; for (auto& x : r.v) x = v; return r; }
inline Floats load_floats(const float* p) { Floats r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline void store_floats(float* p, Floats v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Floats fmadd(Floats a, Floats b, Floats c) { for (int l = 0; l < 8; ++l) c.v[l] = std::fma(a.v[l], b.v[l], c.v[l]); return c; }
inline Floats add(Floats a, Floats b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
inline Floats mul(Floats a, Floats b) { for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l]; return a; }
inline float hsum(Floats v) { float s = 0.0f; for (float x : v.v) s += x; return s; }
inline Floats bytes_to_floats(Bytes q, int i) { Floats r; for (int l = 0; l < 8; ++l) r.v[l] = q.v[8 * i + l]; return r; }

inline Ints zero_ints() { return Ints{}; }
template <bool kUnsigned = false>
inline Ints dot_bytes_scaled(Bytes q, const int8_t* y, int lo, int hi) {
  Ints r{};
  for (int j = 0; j < 32; ++j) r.v[j / 4] += q.v[j] * y[j] * (j < 16 ? lo : hi);
  return r;
}
inline Ints add_ints(Ints a, Ints b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
inline Ints load_ints(const int32_t* p) { Ints r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline Floats ints_to_floats(Ints v) { Floats r; for (int l = 0; l < 8; ++l) r.v[l] = static_cast<float>(v.v[l]); return r; }
#endif

// ---------------------------------------------------------------------------------------------
// Weight formats. Every block is a run of groups of 32 weights; group(block, g) gives a group's
// integer values q with its float scale and offset: w[j] = scale * q[j] + offset, where values 16..31
// may have their own (Q2_K, Q3_K and Q6_K scale every 16 values). These are gguf's dequantization
// formulas (with one rounding less where the reference rounds twice).
// dot(block, act, acc, mins) adds ggml's vec_dot contribution of one block against its Q8 activation
// block: integer products in acc (per lane, scaled in float as ggml does) and the min/offset terms in mins.

struct Group {
  Bytes q;
  float scale_lo, scale_hi;    // of values 0..15 and 16..31
  float offset_lo, offset_hi;
  Group(Bytes q, float scale, float offset) : Group(q, scale, scale, offset, offset) {}
  Group(Bytes q, float scale_lo, float scale_hi, float offset_lo, float offset_hi)
      : q(q), scale_lo(scale_lo), scale_hi(scale_hi), offset_lo(offset_lo), offset_hi(offset_hi) {}
};

// 6-bit scale and min of sub-block j of a Q4_K super-block (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Legacy 32-value blocks against Q8_0 / Q8_1 activations: acc += (d_w * d_x) * sum(q * q8).
template <bool kUnsigned = false, class Act>
inline void dot_legacy(const Group& g, float dw, const Act& y, Floats& acc) {
  acc = fmadd(broadcast(dw * half_at(&y.d)), ints_to_floats(dot_bytes_scaled<kUnsigned>(g.q, y.qs, 1, 1)), acc);
}

#if defined(__AVX512F__)
// 0, stride, 2 stride, .. 15 stride: the byte offsets of a gather of 16 strided words.
inline __m512i strided_lanes(int stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(stride));
}

// The 32-bit words at the starts of 16 consecutive blocks of kBytes bytes, in one gather: where a legacy format keeps
// its halves (Q4_0's d, Q4_1's d and m). Converted a block at a time, each half cost two shuffles on the port the
// nibble lookups need, 27 % of a Q4_1 dot product's samples; gathered, the rows a second rose 1.26-1.32x for Q4_1 and
// 1.09-1.24x for Q4_0 (bench/cpu_builds.py, 2 threads, the embedded model's shapes and 1024 x 8448).
template <int kBytes>
inline __m512i block_words16(const uint8_t* b) {
  return _mm512_i32gather_epi32(strided_lanes(kBytes), b, 1);
}
inline __m512 low_halves(__m512i words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)); }
inline __m512 high_halves(__m512i words) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))); }
#endif

struct Q4_0 {
  WB_FORMAT(Q4_0);
  using Act = BlockQ8_0;
  static Group group(const uint8_t* b, int) { const float d = half_at(b); return {sub_bytes(nibbles(b + 2), 8), d, 0.0f}; }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) { dot_legacy(group(b, 0), half_at(b), y, acc); }
  // Byte j holds value j (low nibble) and j + 16 (high): w = d * q - 8 d, rounded once as d * (q - 8) is.
  static void affines(const uint8_t* b, float* scale, float* offset) {
    scale[0] = half_at(b);
    offset[0] = -8.0f * half_at(b);
  }
#if defined(__AVX512F__)
  // affines of 16 consecutive blocks at once
  static void affines16(const uint8_t* b, float* scale, float* offset) {
    const __m512 d = low_halves(block_words16<kBytes>(b));
    _mm512_storeu_ps(scale, d);
    _mm512_storeu_ps(offset, _mm512_mul_ps(d, _mm512_set1_ps(-8.0f)));
  }
#endif
  template <class Dot>
  static void nibble_runs(const uint8_t* b, const float* scale, const float* offset, int64_t pos, Dot& dot) {
    const auto table = Dot::table(scale[0], offset[0]);
    dot.run(b + 2, table, pos, table, pos + 16);
  }
};

struct Q4_1 {
  WB_FORMAT(Q4_1);
  using Act = BlockQ8_1;
  static Group group(const uint8_t* b, int) { const float d = half_at(b); return {nibbles(b + 4), d, half_at(b + 2)}; }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float& mins) {
    dot_legacy<true>(group(b, 0), half_at(b), y, acc);
    mins += half_at(b + 2) * half_at(&y.s);
  }
  static void affines(const uint8_t* b, float* scale, float* offset) {
    scale[0] = half_at(b);
    offset[0] = half_at(b + 2);
  }
#if defined(__AVX512F__)
  static void affines16(const uint8_t* b, float* scale, float* offset) {
    const __m512i words = block_words16<kBytes>(b);
    _mm512_storeu_ps(scale, low_halves(words));
    _mm512_storeu_ps(offset, high_halves(words));
  }
#endif
  template <class Dot>
  static void nibble_runs(const uint8_t* b, const float* scale, const float* offset, int64_t pos, Dot& dot) {
    const auto table = Dot::table(scale[0], offset[0]);
    dot.run(b + 4, table, pos, table, pos + 16);
  }
};

// Q5_x: the fifth bit of value j is bit j of the 32-bit qh.
struct Q5_0 {
  WB_FORMAT(Q5_0);
  using Act = BlockQ8_0;
  static Group group(const uint8_t* b, int) {
    const float d = half_at(b);
    return {sub_bytes(or_bytes(nibbles(b + 6), bits_to_bytes(b + 2, 0x10)), 16), d, 0.0f};
  }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) { dot_legacy(group(b, 0), half_at(b), y, acc); }
};

struct Q5_1 {
  WB_FORMAT(Q5_1);
  using Act = BlockQ8_1;
  static Group group(const uint8_t* b, int) {
    const float d = half_at(b);
    return {or_bytes(nibbles(b + 8), bits_to_bytes(b + 4, 0x10)), d, half_at(b + 2)};
  }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float& mins) {
    dot_legacy<true>(group(b, 0), half_at(b), y, acc);
    mins += half_at(b + 2) * half_at(&y.s);
  }
};

struct Q8_0 {
  WB_FORMAT(Q8_0);
  using Act = BlockQ8_0;
  static Group group(const uint8_t* b, int) { const float d = half_at(b); return {load_bytes(b + 2), d, 0.0f}; }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) { dot_legacy(group(b, 0), half_at(b), y, acc); }
};

// MXFP4: the exponent byte e, then Q4_0's nibbles. Each code indexes ggml's table of doubled E2M1 values, and the scale
// is halved to match: w = kvalue[q] * 2^(e - 128), the float built from its bits (ggml_e8m0_to_fp32_half).
constexpr int8_t kFp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : static_cast<uint32_t>(e - 1) << 23;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

struct MXFP4 {
  WB_FORMAT(MXFP4);
  using Act = BlockQ8_0;
  static Group group(const uint8_t* b, int) { return {lookup_bytes(nibbles(b + 1), kFp4Values), e8m0_half(b[0]), 0.0f}; }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) { dot_legacy(group(b, 0), e8m0_half(b[0]), y, acc); }
  static void affines(const uint8_t* b, float* scale, float* offset) {
    scale[0] = e8m0_half(b[0]);
    offset[0] = 0.0f;  // not read: the table is kFp4Values times the scale
  }
  template <class Dot>
  static void nibble_runs(const uint8_t* b, const float* scale, const float*, int64_t pos, Dot& dot) {
    const auto table = Dot::table(kFp4Values, scale[0]);
    dot.run(b + 1, table, pos, table, pos + 16);
  }
};

// The K-quants with a 6-bit scale and min per sub-block of 32 (Q4_K, Q5_K): d, dmin (fp16), 12 bytes of scales and
// mins, then the codes, which F::values(block, g) reads for sub-block g.
template <class F>
struct AffineK {
  using Act = BlockQ8_K;
  // Sub-block g's weights are scale * q + offset.
  static void affine(const uint8_t* b, int g, float& scale, float& offset) {
    int sc, m;
    scale_min_k4(g, b + 4, sc, m);
    scale = half_at(b) * static_cast<float>(sc);
    offset = -half_at(b + 2) * static_cast<float>(m);
  }
#if defined(__AVX512F__)
  // All 8 sub-blocks' scales and offsets, the numbers affine gives: the 6-bit fields unpacked in the four 32-bit lanes
  // of one vector as scales_and_mins does (lanes: scales 0-3, scales 4-7, mins 0-3, mins 4-7), then widened and
  // multiplied by d and -dmin in one vector. Unpacked in scalar registers and reloaded as a vector, the fields stalled
  // on the store and cost 27 % of a Q4_K dot product (1.34-1.40x the rows a second with the decode left out).
  static void affines(const uint8_t* b, float scale[8], float offset[8]) {
    const __m512 products = affine_vector(b);
    _mm256_storeu_ps(scale, _mm512_castps512_ps256(products));
    _mm256_storeu_ps(offset, _mm512_extractf32x8_ps(products, 1));
  }
  // Lanes 0-7: the sub-blocks' scales, lanes 8-15 their offsets.
  static __m512 affine_vector(const uint8_t* b) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 4));  // 12 bytes and 4 of the codes
    const __m128i sources = _mm_shuffle_epi32(packed, _MM_SHUFFLE(2, 1, 2, 0));        // p0, p2, p1, p2
    const __m128i tops = _mm_shuffle_epi32(packed, _MM_SHUFFLE(1, 1, 0, 0));           // p0, p0, p1, p1
    const __m128i low6 = _mm_and_si128(sources, _mm_set1_epi32(0x3f3f3f3f));
    const __m128i low4 = _mm_and_si128(_mm_srlv_epi32(sources, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi32(0x0f0f0f0f));
    const __m128i top2 = _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(tops, 6), _mm_set1_epi32(0x03030303)), 4);
    const __m128i fields = _mm_blend_epi32(low6, _mm_or_si128(low4, top2), 0b1010);
    const __m512 d_dmin = _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_loadu_si32(b)));  // lanes 0, 1: d, dmin
    const __m512i eight_each = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512 factors = _mm512_mul_ps(_mm512_permutexvar_ps(eight_each, d_dmin),  // d x 8, -dmin x 8
                                         _mm512_setr_ps(1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(fields)), factors);
  }
  // The scales and offsets of affine_vector(b) for each 16 values, as codes() gives them.
  static void affines_by_16(const uint8_t* b, float* scale, float* offset) {
    const __m512 products = affine_vector(b);
    const __m512i twice = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    _mm512_storeu_ps(scale, _mm512_permutexvar_ps(twice, products));
    _mm512_storeu_ps(offset, _mm512_permutexvar_ps(_mm512_add_epi32(twice, _mm512_set1_epi32(8)), products));
  }
#endif
  // Bytes 0-7: the 6-bit scales of sub-blocks 0-7, bytes 8-15 their mins (scale_min_k4's j < 4 and j >= 4 cases), the
  // rest 0: the fields unpacked four at a time.
  static std::array<uint8_t, 32> scales_and_mins(const uint8_t* b) {
    uint32_t packed[3];
    std::memcpy(packed, b + 4, sizeof(packed));
    constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kTop2 = 0x03030303;
    const uint32_t fields[8] = {packed[0] & kLow6, (packed[2] & kLow4) | ((packed[0] >> 6) & kTop2) << 4,
                                packed[1] & kLow6, ((packed[2] >> 4) & kLow4) | ((packed[1] >> 6) & kTop2) << 4};
    std::array<uint8_t, 32> bytes;
    std::memcpy(bytes.data(), fields, sizeof(fields));
    return bytes;
  }
  static Group group(const uint8_t* b, int g) {
    float scale, offset;
    affine(b, g, scale, offset);
    return {F::values(b, g), scale, offset};
  }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float& mins) {
    const std::array<uint8_t, 32> fields = scales_and_mins(b);
    Ints sumi = zero_ints();
    int summ = 0;
    for (int g = 0; g < 8; ++g) {
      sumi = add_ints(sumi, dot_bytes_scaled<true>(F::values(b, g), y.qs + 32 * g, fields[g], fields[g]));
      summ += fields[8 + g] * (y.bsums[2 * g] + y.bsums[2 * g + 1]);
    }
    acc = fmadd(broadcast(y.d * half_at(b)), ints_to_floats(sumi), acc);
    mins += -y.d * half_at(b + 2) * static_cast<float>(summ);
  }
};

// The 4-bit codes of sub-block g in 128 bytes of nibbles at qs: the low (even g) or high (odd g) nibbles of
// qs[32 (g / 2) .. + 32).
inline Bytes sub_block_nibbles(const uint8_t* qs, int g) {
  const Bytes raw = load_bytes(qs + 32 * (g / 2));
  return g % 2 ? shr_bytes(raw, 4) : and_bytes(raw, 0x0F);
}

// Q4_K: 128 bytes of nibbles.
struct Q4_K : AffineK<Q4_K> {
  WB_FORMAT(Q4_K);
  static Bytes values(const uint8_t* b, int g) { return sub_block_nibbles(b + 16, g); }
  // Chunk c (32 bytes): low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
  template <class Dot>
  static void nibble_runs(const uint8_t* b, const float* scale, const float* offset, int64_t pos, Dot& dot) {
    for (int c = 0; c < 4; ++c) {
      const auto lo_table = Dot::table(scale[2 * c], offset[2 * c]);
      const auto hi_table = Dot::table(scale[2 * c + 1], offset[2 * c + 1]);
      const uint8_t* quants = b + 16 + 32 * c;
      dot.run(quants, lo_table, pos + 64 * c, hi_table, pos + 64 * c + 32);
      dot.run(quants + 16, lo_table, pos + 64 * c + 16, hi_table, pos + 64 * c + 48);
    }
  }
};

// Bit `bit` of each of the 32 bytes at p, moved to bit `to`.
inline Bytes bit_of_bytes(const uint8_t* p, int bit, int to) {
  return shl_bytes(and_bytes(shr_bytes(load_bytes(p), bit), 1), to);
}
// Bits 2j, 2j + 1 of each of the 32 bytes at p.
inline Bytes crumbs(const uint8_t* p, int j) { return and_bytes(shr_bytes(load_bytes(p), 2 * j), 3); }

#if defined(__AVX512BW__)
// Two 32-byte decodes side by side in a 64-byte vector, for the codes() of the K-quants: 32 bytes at p in both halves,
// and shifted right by `low` bits in the low half and `high` bits in the high one (within each byte once masked).
inline __m512i both_halves(const uint8_t* p) {
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// Shift counts of 16-bit lanes: `low` in the low half of a vector, `high` in the high one.
inline __m512i per_half(int low, int high) {
  return _mm512_inserti64x4(_mm512_set1_epi16(static_cast<int16_t>(low)), _mm256_set1_epi16(static_cast<int16_t>(high)),
                            1);
}
inline __m512i shifted_halves(__m512i bytes, int low, int high) { return _mm512_srlv_epi16(bytes, per_half(low, high)); }
// crumbs(j) and crumbs(j + 1) of 32 bytes given in both halves.
inline __m512i crumb_pairs(__m512i bytes, int j) {
  return _mm512_and_si512(shifted_halves(bytes, 2 * j, 2 * j + 2), _mm512_set1_epi8(3));
}
// Bits g and g + 1 of 32 bytes given in both halves, moved to bit `to`.
inline __m512i bit_pairs(__m512i bytes, int g, int to) {
  return _mm512_slli_epi16(_mm512_and_si512(shifted_halves(bytes, g, g + 1), _mm512_set1_epi8(1)), to);
}
#endif

// Q5_K: 32 bytes of fifth bits (bit g of byte l: value l of sub-block g), then Q4_K's nibbles.
struct Q5_K : AffineK<Q5_K> {
  WB_FORMAT(Q5_K);
  static Bytes values(const uint8_t* b, int g) {
    return or_bytes(sub_block_nibbles(b + 48, g), bit_of_bytes(b + 16, g, 4));
  }
#if defined(__AVX512BW__)
  static constexpr bool kCodeOffsets = true;
  // The 256 codes as values() gives them, two sub-blocks (64 bytes) a step: a chunk's low and high nibbles side by
  // side, each half with its fifth bits shifted down from its own bit of the 32 bytes of highs.
  static void codes(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    const __m512i highs = both_halves(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m512i nibbles =
          _mm512_and_si512(shifted_halves(both_halves(b + 48 + 32 * c), 0, 4), _mm512_set1_epi8(0x0F));
      _mm512_storeu_si512(q + 64 * c, _mm512_or_si512(nibbles, bit_pairs(highs, 2 * c, 4)));
    }
    affines_by_16(b, scale, offset);
  }
#endif
};

// Q2_K: 16 bytes of 4-bit scales (low nibble) and mins (high), one byte per 16 values; 64 bytes of 2-bit codes, group
// g = 4 * half + j in bits 2j, 2j + 1 of bytes 32 * half .. + 32; d, dmin. Value = d * scale * q - dmin * min.
struct Q2_K {
  WB_FORMAT(Q2_K);
  using Act = BlockQ8_K;
  static Bytes values(const uint8_t* b, int g) { return crumbs(b + 16 + 32 * (g / 4), g % 4); }
  static Group group(const uint8_t* b, int g) {
    const float d = half_at(b + 80), dmin = half_at(b + 82);
    const int lo = b[2 * g], hi = b[2 * g + 1];
    return {values(b, g), d * static_cast<float>(lo & 0x0F), d * static_cast<float>(hi & 0x0F),
            -dmin * static_cast<float>(lo >> 4), -dmin * static_cast<float>(hi >> 4)};
  }
  // As ggml's AVX2 code: the mins' products with the activations' 16-value sums first, lane l taking mins 2l and
  // 2l + 1, then the codes' products, both into the float lanes.
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) {
    int32_t min_sums[8];
    for (int l = 0; l < 8; ++l)
      min_sums[l] = (b[2 * l] >> 4) * y.bsums[2 * l] + (b[2 * l + 1] >> 4) * y.bsums[2 * l + 1];
    acc = fmadd(broadcast(-y.d * half_at(b + 82)), ints_to_floats(load_ints(min_sums)), acc);
    Ints sumi = zero_ints();
    for (int g = 0; g < 8; ++g)
      sumi = add_ints(sumi, dot_bytes_scaled<true>(values(b, g), y.qs + 32 * g, b[2 * g] & 0x0F, b[2 * g + 1] & 0x0F));
    acc = fmadd(broadcast(y.d * half_at(b + 80)), ints_to_floats(sumi), acc);
  }
#if defined(__AVX512BW__)
  static constexpr bool kCodeOffsets = true;
  // The 256 codes as values() gives them, two groups a step, and each 16 values' scale and offset as group() has them.
  static void codes(const uint8_t* b, int8_t* q, float* scale, float* offset) {
    for (int half = 0; half < 2; ++half) {
      const __m512i lows = both_halves(b + 16 + 32 * half);
      for (int j = 0; j < 4; j += 2) _mm512_storeu_si512(q + 32 * (4 * half + j), crumb_pairs(lows, j));
    }
    const __m512i fields = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    _mm512_storeu_ps(scale, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(fields, _mm512_set1_epi32(0x0F))),
                                          _mm512_set1_ps(half_at(b + 80))));
    _mm512_storeu_ps(offset, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(fields, 4)),
                                           _mm512_set1_ps(-half_at(b + 82))));
  }
#endif
};

// Q3_K: 32 bytes of high bits (bit g of byte l: value l of group g), 64 bytes of 2-bit lows laid out as Q2_K's codes,
// 12 bytes of 6-bit scales stored + 32 (one per 16 values), d. Value = d * scale * (q - 4), q the 3-bit code.
struct Q3_K {
  WB_FORMAT(Q3_K);
  using Act = BlockQ8_K;
  static Bytes values(const uint8_t* b, int g) {
    return sub_bytes(or_bytes(crumbs(b + 32 + 32 * (g / 4), g % 4), bit_of_bytes(b, g, 2)), 4);
  }
  // Scale s: low 4 bits in byte s (s < 8) or the high nibble of byte s - 8; top 2 bits at bit 2 (s / 4) of byte
  // 8 + s % 4.
  static int scale(const uint8_t* b, int s) {
    const uint8_t* scales = b + 96;
    const int low = s < 8 ? scales[s] & 0x0F : scales[s - 8] >> 4;
    return (low | ((scales[8 + s % 4] >> (2 * (s / 4))) & 3) << 4) - 32;
  }
  static Group group(const uint8_t* b, int g) {
    const float d = half_at(b + 108);
    return {values(b, g), d * static_cast<float>(scale(b, 2 * g)), d * static_cast<float>(scale(b, 2 * g + 1)), 0.0f,
            0.0f};
  }
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) {
    Ints sumi = zero_ints();
    for (int g = 0; g < 8; ++g)
      sumi = add_ints(sumi, dot_bytes_scaled(values(b, g), y.qs + 32 * g, scale(b, 2 * g), scale(b, 2 * g + 1)));
    acc = fmadd(broadcast(y.d * half_at(b + 108)), ints_to_floats(sumi), acc);
  }
#if defined(__AVX512BW__)
  static constexpr int kCodeOffsetBits = 2;  // values() is the code 0..7 minus 4
  // Half-block h's codes 0..7 (values() plus 4) in two 64-byte vectors of two groups each (groups 4h and 4h + 1, then
  // 4h + 2 and 4h + 3).
  static void unsigned_codes(const uint8_t* b, int half, __m512i* quarters) {
    const __m512i highs = both_halves(b);
    const __m512i lows = both_halves(b + 32 + 32 * half);
    for (int j = 0; j < 2; ++j)
      quarters[j] = _mm512_or_si512(crumb_pairs(lows, 2 * j), bit_pairs(highs, 4 * half + 2 * j, 2));
  }
  // The 256 codes as values() gives them, two groups a step, and the 16 scales as group() has them.
  static void codes(const uint8_t* b, int8_t* q, float* scale) {
    for (int half = 0; half < 2; ++half) {
      __m512i quarters[2];
      unsigned_codes(b, half, quarters);
      for (int j = 0; j < 2; ++j)
        _mm512_storeu_si512(q + 128 * half + 64 * j, _mm512_sub_epi8(quarters[j], _mm512_set1_epi8(4)));
    }
    _mm512_storeu_ps(scale, scales(b));
  }
  // d times each 16 values' scale: the 6-bit fields of scale() for all 16 in the bytes of one vector.
  static __m512 scales(const uint8_t* b) {
    const __m128i packed = _mm_maskz_loadu_epi8(0x0FFF, b + 96);  // the 12 bytes of scales, nothing past the block
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low_bytes = _mm_shuffle_epi8(packed, _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
    const __m128i low = _mm_mask_blend_epi8(0xFF00, _mm_and_si128(low_bytes, nibble),
                                            _mm_and_si128(_mm_srli_epi16(low_bytes, 4), nibble));
    const __m128i top_bytes = _mm_shuffle_epi8(packed, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i top = _mm_and_si128(_mm_srlv_epi32(top_bytes, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    const __m512i scales = _mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm_or_si128(low, _mm_slli_epi16(top, 4))),
                                            _mm512_set1_epi32(32));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(scales), _mm512_set1_ps(half_at(b + 108)));
  }
#endif
};

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), d.
// Group g = 4 * half + quarter (ggml's dequantize_row_q6_K order).
struct Q6_K {
  WB_FORMAT(Q6_K);
  using Act = BlockQ8_K;
  static Bytes values(const uint8_t* b, int g) {
    const int half = g / 4, quarter = g % 4;
    const Bytes low_bits = load_bytes(b + 64 * half + 32 * (quarter % 2));
    const Bytes low = quarter < 2 ? and_bytes(low_bits, 0x0F) : shr_bytes(low_bits, 4);
    const Bytes high = shl_bytes(and_bytes(shr_bytes(load_bytes(b + 128 + 32 * half), 2 * quarter), 3), 4);
    return sub_bytes(or_bytes(low, high), 32);
  }
  static int scale(const uint8_t* b, int g, int part) { return reinterpret_cast<const int8_t*>(b + 192)[2 * g + part]; }
  static Group group(const uint8_t* b, int g) {
    const float d = half_at(b + 208);
    return {values(b, g), d * static_cast<float>(scale(b, g, 0)), d * static_cast<float>(scale(b, g, 1)), 0.0f, 0.0f};
  }
#if defined(__AVX512BW__)
  static constexpr int kCodeOffsetBits = 5;  // values() is the code 0..63 minus 32
  // Half-block h's codes, 0..63 (values() plus 32), in two 64-byte vectors of two groups each (groups 4h and 4h + 1,
  // then 4h + 2 and 4h + 3): bits 0-3 from the nibbles, bits 4-5 from the 2-bit highs shifted into place (the shift
  // of each 32-byte half of a vector set on its own), where values() takes eight 32-byte steps per group.
  static void unsigned_codes(const uint8_t* b, int half, __m512i* quarters) {
    const __m512i nibble = _mm512_set1_epi8(0x0F), six_bits = _mm512_set1_epi8(0x3F);
    constexpr int kNibbleOrHigh = 0xE4;  // ternary logic: c ? a : b
    const __m512i lows = _mm512_loadu_si512(b + 64 * half);
    const __m512i highs = both_halves(b + 128 + 32 * half);
    quarters[0] = _mm512_and_si512(
        _mm512_ternarylogic_epi32(lows, _mm512_sllv_epi16(highs, per_half(4, 2)), nibble, kNibbleOrHigh), six_bits);
    quarters[1] = _mm512_and_si512(
        _mm512_ternarylogic_epi32(_mm512_srli_epi16(lows, 4), shifted_halves(highs, 0, 2), nibble, kNibbleOrHigh),
        six_bits);
  }
  // Two groups a 64-byte vector, with unsigned_codes(): each 32-bit lane holds the integer it holds in the 32-byte
  // form below (the same products, their sums in another order), the two halves added at the end; the signed codes'
  // products as the unsigned 6-bit codes' minus 32 times the activations' (no 64-byte form of the sign moves).
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) {
    const __m512i bias = _mm512_set1_epi8(32);
    // the 16 scales as 16-bit words, and for groups (2k, 2k + 1) the words lo, hi, lo, hi eight times each
    const __m512i scales = _mm512_castsi256_si512(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    const __m512i spread = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                            1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i sumi = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {
      __m512i quarters[2];
      unsigned_codes(b, half, quarters);
      for (int pair = 0; pair < 2; ++pair) {
        const int k = 2 * half + pair;  // groups 2k and 2k + 1
        const __m512i yv = _mm512_loadu_si512(y.qs + 64 * k);
        const __m512i pairs = _mm512_sub_epi16(_mm512_maddubs_epi16(quarters[pair], yv),
                                               _mm512_maddubs_epi16(bias, yv));
        const __m512i word_scales = _mm512_permutexvar_epi16(_mm512_add_epi16(spread, _mm512_set1_epi16(4 * k)),
                                                             scales);
        sumi = _mm512_add_epi32(sumi, _mm512_madd_epi16(pairs, word_scales));
      }
    }
    const Ints folded = _mm256_add_epi32(_mm512_castsi512_si256(sumi), _mm512_extracti64x4_epi64(sumi, 1));
    acc = fmadd(broadcast(y.d * half_at(b + 208)), ints_to_floats(folded), acc);
  }
#else
  static void dot(const uint8_t* b, const Act& y, Floats& acc, float&) {
    Ints sumi = zero_ints();
    for (int g = 0; g < 8; ++g)
      sumi = add_ints(sumi, dot_bytes_scaled(values(b, g), y.qs + 32 * g, scale(b, g, 0), scale(b, g, 1)));
    acc = fmadd(broadcast(y.d * half_at(b + 208)), ints_to_floats(sumi), acc);
  }
#endif
#if defined(__AVX512BW__)
  // The 256 codes (as values() gives them) and a scale per 16 values, a half-block (four groups) at a time.
  static void codes(const uint8_t* b, int8_t* q, float* scale) {
    const __m512i bias = _mm512_set1_epi8(32);
    for (int half = 0; half < 2; ++half) {
      __m512i quarters[2];
      unsigned_codes(b, half, quarters);
      _mm512_storeu_si512(q + 128 * half, _mm512_sub_epi8(quarters[0], bias));
      _mm512_storeu_si512(q + 128 * half + 64, _mm512_sub_epi8(quarters[1], bias));
    }
    _mm512_storeu_ps(scale, scales(b));
  }
  // d times each 16 values' scale
  static __m512 scales(const uint8_t* b) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(sc), _mm512_set1_ps(half_at(b + 208)));
  }
#endif
};

template <class Fn>
auto visit_format(int64_t ggml_type, Fn&& fn) {
  switch (ggml_type) {
    case Q4_0::kType: return fn(Q4_0{});
    case Q4_1::kType: return fn(Q4_1{});
    case Q5_0::kType: return fn(Q5_0{});
    case Q5_1::kType: return fn(Q5_1{});
    case Q8_0::kType: return fn(Q8_0{});
    case Q2_K::kType: return fn(Q2_K{});
    case Q3_K::kType: return fn(Q3_K{});
    case Q4_K::kType: return fn(Q4_K{});
    case Q5_K::kType: return fn(Q5_K{});
    case Q6_K::kType: return fn(Q6_K{});
    case MXFP4::kType: return fn(MXFP4{});
  }
  TORCH_CHECK(false, "workbench cpu kernels: unsupported GGML type ", ggml_type);
}

// What this build reads for ggml_type: {values per block, bytes per block, GGML type of its activation blocks}, for
// the tests to check against the format table.
std::vector<int64_t> format_layout(int64_t ggml_type) {
  return visit_format(ggml_type, [](auto format) {
    using F = decltype(format);
    return std::vector<int64_t>{F::kValues, F::kBytes, F::Act::kType};
  });
}

// The 32 float weights of a group, as four vectors of 8.
inline void group_floats(const Group& g, Floats w[4]) {
  for (int i = 0; i < 4; ++i)
    w[i] = fmadd(bytes_to_floats(g.q, i), broadcast(i < 2 ? g.scale_lo : g.scale_hi), broadcast(i < 2 ? g.offset_lo : g.offset_hi));
}

// ---------------------------------------------------------------------------------------------
// Exact numerics.

// The widest float vector the build has for the exact dot products: 16 lanes with AVX-512, else Floats.
#if defined(__AVX512F__)
using WideFloats = __m512;
constexpr int kWideLanes = 16;
inline WideFloats wide_zeros() { return _mm512_setzero_ps(); }
inline WideFloats wide_load(const float* p) { return _mm512_loadu_ps(p); }
inline void wide_store(float* p, WideFloats v) { _mm512_storeu_ps(p, v); }
inline WideFloats fmadd(WideFloats a, WideFloats b, WideFloats c) { return _mm512_fmadd_ps(a, b, c); }
inline float wide_sum(WideFloats a, WideFloats b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
// The 32 float weights of a group as two vectors of 16 (values 16..31 take the _hi scale and offset), as group_floats.
inline void group_floats(const Group& g, WideFloats w[2]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(g.q), _mm256_extracti128_si256(g.q, 1)};
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(halves[i])),
                           _mm512_set1_ps(i == 0 ? g.scale_lo : g.scale_hi),
                           _mm512_set1_ps(i == 0 ? g.offset_lo : g.offset_hi));
}
#else
using WideFloats = Floats;
constexpr int kWideLanes = 8;
inline WideFloats wide_zeros() { return zeros(); }
inline WideFloats wide_load(const float* p) { return load_floats(p); }
inline void wide_store(float* p, WideFloats v) { store_floats(p, v); }
inline float wide_sum(WideFloats a, WideFloats b) { return hsum(add(a, b)); }
#endif

// out[m * ldo] = dot(weight row, x[m]) for TM activation rows: each weight group is decoded once
// and used for all TM rows; two accumulators per row hide the FMA latency.
// The dot products read a thread's weight rows one after another, block by block: each block asks for the bytes
// kPrefetchBytes ahead of it, so that the memory always has the next few KB in flight. Asked a block at a time, not a
// row at a time: a whole row's lines asked at once overflow the core's queue of misses, and the extra ones are dropped
// (asking for the row two ahead that way: 0.47-0.79x the rows a second from DRAM, 2 threads, 151936 x 2048 in Q4_K,
// Q4_1, Q8_0, Q6_K; docs/performance.md). 2 KB ahead ran 1.00-1.13x as fast as 1 or 4 KB, 8 KB no faster than 4.
// Prefetches never fault, so past the matrix's end they cost nothing. The bits are the same.
constexpr int64_t kPrefetchBytes = 2048;
template <int64_t kAhead = kPrefetchBytes>
inline void prefetch_block(const uint8_t* block, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(block + kAhead + b);
}

// A row of blocks a span of kSpan blocks at a time, for the dot products that decode a span into memory before they
// multiply: decode(i, block, n) for the n blocks from block i of the span (n = kBatch while that many remain, then 1),
// their bytes prefetched ahead, then use(first, span, count) with the span's first block index, its bytes and its
// number of blocks.
template <class F, int64_t kSpan, int64_t kBatch, class Decode, class Use>
inline void for_each_span(const uint8_t* wrow, int64_t k, const Decode& decode, const Use& use) {
  const int64_t blocks = k / F::kValues;
  for (int64_t first = 0; first < blocks; first += kSpan) {
    const uint8_t* span = wrow + first * F::kBytes;
    const int64_t count = std::min(kSpan, blocks - first);
    for (int64_t i = 0, n; i < count; i += n) {
      n = i + kBatch <= count ? kBatch : 1;
      prefetch_block(span + i * F::kBytes, n * F::kBytes);
      decode(i, span + i * F::kBytes, n);
    }
    use(first, span, count);
  }
}

template <class F, int TM>
void dot_rows_exact(const uint8_t* wrow, const float* x, int64_t k, float* out, int64_t ldo) {
  constexpr int kVectors = 32 / kWideLanes;
  WideFloats acc[TM][2];
  for (auto& row : acc) row[0] = row[1] = wide_zeros();
  for (int64_t b = 0; b < k / F::kValues; ++b) {
    prefetch_block(wrow + b * F::kBytes, F::kBytes);
    for (int g = 0; g < F::kValues / 32; ++g) {
      WideFloats w[kVectors];
      group_floats(F::group(wrow + b * F::kBytes, g), w);
      const float* xg = x + b * F::kValues + 32 * g;
      for (int m = 0; m < TM; ++m)
        for (int i = 0; i < kVectors; ++i)
          acc[m][i % 2] = fmadd(w[i], wide_load(xg + m * k + kWideLanes * i), acc[m][i % 2]);
    }
  }
  for (int m = 0; m < TM; ++m) out[m * ldo] = wide_sum(acc[m][0], acc[m][1]);
}

#if defined(__AVX512F__)
// AVX-512 path of the 4-bit formats (those with nibble_runs): a group's 16 possible weights (scale * q +
// offset for q = 0..15, the multiply-add group_floats does) fill one vector, and _mm512_permutexvar_ps
// looks a lane's weight up by the low 4 bits of its index, so a byte zero-extended to a lane needs no
// mask: 16 weights cost a permute (and a shift for high nibbles) instead of two conversions and an FMA.
template <int TM>
struct NibbleDot {
  const float* x;
  int64_t k;
  __m512 acc[TM][2];

  NibbleDot(const float* x, int64_t k) : x(x), k(k) {
    for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  }
  static __m512 table(float scale, float offset) {
    const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_fmadd_ps(q, _mm512_set1_ps(scale), _mm512_set1_ps(offset));
  }
  // A table of 16 integer values times scale (MXFP4's E2M1 codes).
  static __m512 table(const int8_t* values, float scale) {
    const __m512i q = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(scale));
  }
  // The 16 bytes at q16: low nibbles are values lo_pos .. lo_pos + 15 of the row, high nibbles hi_pos ...
  void run(const uint8_t* q16, __m512 lo_table, int64_t lo_pos, __m512 hi_table, int64_t hi_pos) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16)));
    const __m512 lo = _mm512_permutexvar_ps(q, lo_table);
    const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), hi_table);
    for (int m = 0; m < TM; ++m) {
      acc[m][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + m * k + lo_pos), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + m * k + hi_pos), acc[m][1]);
    }
  }
};

// nibble_row's runs written out: a row of weights dequantized through the dot products' tables, the values
// group_floats gives (the same multiply-add of each code, or MXFP4's product).
struct NibbleStore {
  float* row;
  static __m512 table(float scale, float offset) { return NibbleDot<1>::table(scale, offset); }
  static __m512 table(const int8_t* values, float scale) { return NibbleDot<1>::table(values, scale); }
  void run(const uint8_t* q16, __m512 lo_table, int64_t lo_pos, __m512 hi_table, int64_t hi_pos) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q16)));
    _mm512_storeu_ps(row + lo_pos, _mm512_permutexvar_ps(q, lo_table));
    _mm512_storeu_ps(row + hi_pos, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), hi_table));
  }
};

template <class F, class = void>
constexpr bool kHasAffines16 = false;
template <class F>
constexpr bool kHasAffines16<F, std::void_t<decltype(&F::affines16)>> = F::kValues == 32;

template <class F, class = void>
constexpr bool kHasNibbleRuns = false;
template <class F>
constexpr bool kHasNibbleRuns<F, std::void_t<decltype(&F::template nibble_runs<NibbleDot<1>>)>> = true;

// dot_rows_exact for the 4-bit formats: even and odd blocks feed separate accumulators, so one row of activations
// still has four independent FMA chains. The blocks' scales and offsets (F::affines, for each group of 32; affines16
// for 16 blocks at once where a format has it) are decoded first, a span of blocks at a time, into memory: the tables
// then take them as broadcast loads, where decoded alongside they cost shuffles on the port the lookups need (1.4x the
// rows a second, Q4_K, one thread).
// Inlined into its caller always, as code_row: a call would keep the caller's accumulators in memory, stored at every
// step.
template <class F, class Runs>
[[gnu::always_inline]] inline void nibble_row(const uint8_t* wrow, int64_t k, Runs& even, Runs& odd) {
  constexpr int kGroups = F::kValues / 32;
  constexpr int64_t kSpan = 8192 / F::kValues;  // blocks a span; even, so that blocks keep their accumulators
  static_assert(kSpan % 2 == 0);
  alignas(64) float scale[kSpan * kGroups], offset[kSpan * kGroups];
  const auto decode = [&](int64_t i, const uint8_t* block, int64_t n) {
    if constexpr (kHasAffines16<F>) {
      if (n == 16) return F::affines16(block, scale + i, offset + i);
    }
    F::affines(block, scale + i * kGroups, offset + i * kGroups);
  };
  const auto multiply = [&](int64_t first, const uint8_t* span, int64_t count) {
    const auto runs = [&](int64_t i, Runs& dot) {
      F::nibble_runs(span + i * F::kBytes, scale + i * kGroups, offset + i * kGroups, (first + i) * F::kValues, dot);
    };
    int64_t i = 0;
    for (; i + 1 < count; i += 2) {
      runs(i, even);
      runs(i + 1, odd);
    }
    if (i < count) runs(i, even);
  };
  for_each_span<F, kSpan, kHasAffines16<F> ? 16 : 1>(wrow, k, decode, multiply);
}

template <class F, int TM>
void dot_rows_nibbles(const uint8_t* wrow, const float* x, int64_t k, float* out, int64_t ldo) {
  NibbleDot<TM> even(x, k), odd(x, k);
  nibble_row<F>(wrow, k, even, odd);
  for (int m = 0; m < TM; ++m)
    out[m * ldo] = wide_sum(_mm512_add_ps(even.acc[m][0], even.acc[m][1]), _mm512_add_ps(odd.acc[m][0], odd.acc[m][1]));
}
#endif

#if defined(__AVX512BW__)
template <class F, class = void>
constexpr bool kHasCodes = false;
template <class F>
constexpr bool kHasCodes<F, std::void_t<decltype(&F::codes)>> = true;
template <class F, class = void>
constexpr bool kCodeOffsets = false;
template <class F>
constexpr bool kCodeOffsets<F, std::void_t<decltype(F::kCodeOffsets)>> = F::kCodeOffsets;

// The weights of a row in a format with codes() (AVX-512: the K-quants but Q4_K), scale * code with a scale per 16
// (Q3_K, Q6_K) or scale * code + offset where the format has kCodeOffsets (Q2_K, Q5_K), 32 at a time as
// use(low, high, pos) takes them: values pos .. pos + 15 and the next 16, as floats. A span of blocks is decoded first
// into bytes and per-16 scales in memory, 64 codes a vector step, then each 16 weights are widened straight from there
// (a load and one conversion, where a group in a register costs two extractions more) with the multiply-add
// group_floats does, so the weights are the same floats. Q6_K's codes() took its dot products to 1.7-1.8x the rows a
// second (1 thread 2048 x 2048; 2 threads 151936 x 2048), Q2_K's, Q3_K's and Q5_K's to 1.8-3.0x (2 threads, 14336 x
// 4096 and 4096 x 14336). The loop walks pointers, where indices cost integer shifts on the ports the conversions
// need: 1.07-1.12x the rows a second (1 thread 2048 x 2048; 2 threads 16384 x 2048, and 5 rows of 1024 x 9216).
template <class F, class Use>
[[gnu::always_inline]] inline void code_row(const uint8_t* wrow, int64_t k, const Use& use) {
  constexpr int64_t kSpan = std::max<int64_t>(1, 4096 / F::kValues);  // blocks a span
  alignas(64) int8_t q[kSpan * F::kValues];
  alignas(64) float scale[kSpan * F::kValues / 16];
  alignas(64) float offset[kCodeOffsets<F> ? kSpan * F::kValues / 16 : 1];
  const auto decode = [&](int64_t i, const uint8_t* block, int64_t) {
    if constexpr (kCodeOffsets<F>) {
      F::codes(block, q + i * F::kValues, scale + i * F::kValues / 16, offset + i * F::kValues / 16);
    } else {
      F::codes(block, q + i * F::kValues, scale + i * F::kValues / 16);
    }
  };
  const auto multiply = [&](int64_t first, const uint8_t*, int64_t count) {
    int64_t pos = first * F::kValues;
    const float* scales = scale;
    const float* offsets = offset;
    for (const int8_t *codes = q, *end = q + count * F::kValues; codes < end;
         codes += 32, pos += 32, scales += 2, offsets += kCodeOffsets<F> ? 2 : 0) {
      __m512 w[2];
      for (int i = 0; i < 2; ++i) {
        const __m512 widened = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(codes + 16 * i))));
        w[i] = _mm512_fmadd_ps(widened, _mm512_set1_ps(scales[i]),
                               kCodeOffsets<F> ? _mm512_set1_ps(offsets[i]) : _mm512_setzero_ps());
      }
      use(w[0], w[1], pos);
    }
  };
  for_each_span<F, kSpan, 1>(wrow, k, decode, multiply);
}

// dot_rows_exact for the formats with codes(): the same multiply-adds in the same order, so the same bits.
template <class F, int TM>
void dot_rows_codes(const uint8_t* wrow, const float* x, int64_t k, float* out, int64_t ldo) {
  __m512 acc[TM][2];  // values 0-15 and 16-31 of each 32, as dot_rows_exact's two accumulators
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  code_row<F>(wrow, k, [&](__m512 low, __m512 high, int64_t pos) {
    for (int m = 0; m < TM; ++m) {
      acc[m][0] = _mm512_fmadd_ps(low, _mm512_loadu_ps(x + m * k + pos), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + m * k + pos + 16), acc[m][1]);
    }
  });
  for (int m = 0; m < TM; ++m) out[m * ldo] = wide_sum(acc[m][0], acc[m][1]);
}
#endif

#if defined(__AVX512BW__)
// The exact dot products of Q6_K and Q3_K as integer dot products. Converting each code to float and multiplying it
// by its scale held their dot products to about half the rows a second of llama.cpp's integer ones (the float
// conversions and multiplies take the two vector ports). Here each 16 activations are integers m times a power of two
// 2^e, e chosen so that their largest |m| lies in [2^22, 2^23) (each value rounded to the nearest multiple of 2^e, so
// off by at most 2^-23 of the largest), and m is split into three bytes: the byte products with the codes, summed four
// at a time into 32-bit lanes (AVX-512 VNNI's vpdpbusd, or its two-instruction form), are exact, and so is their sum
// over 8 values; a sum's float conversion and its multiply-add by d * scale * 2^e are the only roundings.
// docs/faithfulness.md gives the bound this meets; docs/performance.md the speed.
//
// The formats that take it: a scale per 16 values (F::scales) and unsigned codes under 128 (F::unsigned_codes) that
// are values() plus 2^F::kCodeOffsetBits.
template <class F, class = void>
constexpr bool kDigitDots = false;
template <class F>
constexpr bool kDigitDots<F, std::void_t<decltype(F::kCodeOffsetBits)>> = true;

// Half-block h's unsigned codes (F::unsigned_codes: values 0..63 and 64..127 of it) in two vectors whose 32-bit lanes
// 2s and 2s + 1 hold values of sub-block 8h + s, the first vector values 0..7 of each 16, the second 8..15 (the order
// ActDigits writes the activations' digits in).
template <class F>
inline void paired_codes(const uint8_t* b, int half, __m512i& first, __m512i& second) {
  __m512i quarters[2];
  F::unsigned_codes(b, half, quarters);
  first = _mm512_permutex2var_epi64(quarters[0], _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), quarters[1]);
  second = _mm512_permutex2var_epi64(quarters[0], _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15), quarters[1]);
}

inline __m512i dot_bytes4(__m512i acc, __m512i u8, __m512i s8) {
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u8, s8);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u8, s8), _mm512_set1_epi16(1)));
#endif
}

// The lanes of v that hold a NaN or an infinity (quiet or signalling NaN, +inf, -inf).
inline __mmask16 non_finite_lanes(__m512 v) { return _mm512_fpclass_ps_mask(v, 0x99); }

// The n vectors of values v as integers m, |m| <= 2^23 - 1, times 2^(e - 23), where 2^e is the power of two above
// their largest magnitude (e = 0 for zeros, at least -100 so that 2^(e - 23) stays a normal float), each rounded to
// the nearest multiple, ties to even. Returns e, or nothing where a value is a NaN or an infinity.
template <int n>
inline std::optional<int> block_integers(const __m512 (&v)[n], __m512i (&m)[n]) {
  __m512 largest = _mm512_setzero_ps();
  for (int h = 0; h < n; ++h) {
    if (non_finite_lanes(v[h])) return std::nullopt;
    largest = _mm512_max_ps(largest, _mm512_abs_ps(v[h]));
  }
  int e = 0;
  std::frexp(_mm512_reduce_max_ps(largest), &e);  // largest magnitude in [2^(e-1), 2^e)
  e = std::max(e, -100);
  const __m512i limit = _mm512_set1_epi32((1 << 23) - 1);
  for (int h = 0; h < n; ++h) {
    m[h] = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(std::ldexp(1.0f, 23 - e))));
    m[h] = _mm512_max_epi32(_mm512_min_epi32(m[h], limit), _mm512_sub_epi32(_mm512_setzero_si512(), limit));
  }
  return e;
}

// The activation rows of one call in digits, prepared once before the threads multiply. A row of k values holds:
// the bytes of m (bits 16-23 signed, 8-15 and 0-7 unsigned) in the order paired_codes() gives the codes, k each;
// minus the sum of m over each 32-bit lane's 8 values, which digit_dot scales by the codes' offset (k / 8 int32); and
// 2^e of each 16 values (k / 16 floats). A row with a NaN or an infinity is marked unusable and takes the
// float dot products.
class ActDigits {
 public:
  // The rows of x [m, k] that `wanted` marks.
  ActDigits(const float* x, int64_t m, int64_t k, const std::vector<char>& wanted)
      : k_(k), row_bytes_(3 * k + k / 2 + k / 4), slot_(m, -1) {
    int64_t slots = 0;
    for (int64_t i = 0; i < m; ++i)
      if (wanted[i]) slot_[i] = slots++;
    data_ = torch::empty({slots, row_bytes_}, torch::kUInt8);
    bytes_ = data_.data_ptr<uint8_t>();
    usable_.resize(slots);
    for (int64_t i = 0; i < m; ++i)
      if (slot_[i] >= 0) usable_[slot_[i]] = prepare(x + i * k, bytes_ + slot_[i] * row_bytes_);
  }
  // The digits of row i where they were prepared and are usable, else nullptr.
  const uint8_t* row(int64_t i) const {
    const int64_t slot = slot_[i];
    return slot >= 0 && usable_[slot] ? bytes_ + slot * row_bytes_ : nullptr;
  }

 private:
  bool prepare(const float* x, uint8_t* row) const {
    const int64_t k = k_;
    int32_t* sums = reinterpret_cast<int32_t*>(row + 3 * k);
    float* powers = reinterpret_cast<float*>(row + 3 * k + k / 2);
    for (int64_t j = 0; j < k / 16; ++j) {
      const __m512 v[1] = {_mm512_loadu_ps(x + 16 * j)};
      __m512i ms[1];
      const std::optional<int> e = block_integers(v, ms);
      if (!e) return false;
      powers[j] = std::ldexp(1.0f, *e - 23);
      const __m512i m = ms[0];
      // values 0..7 of sub-block s of half-block h go to bytes 8s.. of the first 64, values 8..15 of the second
      uint8_t* first = row + 128 * (j / 8) + 8 * (j % 8);
      const __m128i bytes[3] = {_mm512_cvtepi32_epi8(_mm512_srai_epi32(m, 16)),
                                _mm512_cvtepi32_epi8(_mm512_srli_epi32(m, 8)), _mm512_cvtepi32_epi8(m)};
      for (int d = 0; d < 3; ++d) {
        _mm_storel_epi64(reinterpret_cast<__m128i*>(first + d * k), bytes[d]);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(first + d * k + 64), _mm_unpackhi_epi64(bytes[d], bytes[d]));
      }
      // lane 2s: values 0..3 and 8..11; lane 2s + 1: values 4..7 and 12..15
      const __m512i pairs = _mm512_add_epi32(m, _mm512_shuffle_i32x4(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
      sums[16 * (j / 8) + 2 * (j % 8)] = -_mm512_mask_reduce_add_epi32(0x000F, pairs);
      sums[16 * (j / 8) + 2 * (j % 8) + 1] = -_mm512_mask_reduce_add_epi32(0x00F0, pairs);
    }
    return true;
  }

  int64_t k_, row_bytes_;
  std::vector<int64_t> slot_;  // each row's place in data_, -1 where not prepared
  torch::Tensor data_;
  uint8_t* bytes_;  // data_'s: its data_ptr checks the type and storage at every call, and row() runs per weight row
  std::vector<char> usable_;
};

// Reading 4 KB ahead where the float dot products read 2 KB: 1.3x the rows a second of 2 KB from memory (2 threads,
// 151936 x 2048), 8 KB no faster.
constexpr int64_t kDigitPrefetchBytes = 4096;

// The dot product of one weight row with one activation row given in digits. Only for single rows: from four rows
// the float dot products' one decode of a weight serves them all for less (0.83x their rows a second as digits).
template <class F>
float digit_dot(const uint8_t* wrow, const uint8_t* digits, int64_t k) {
  static_assert(F::kValues == 256, "two half-blocks of 128 values a block");
  __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // one accumulator a half-block
  const __m512i zero = _mm512_setzero_si512();
  const __m512i lane_scale = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const int32_t* sums = reinterpret_cast<const int32_t*>(digits + 3 * k);
  const float* powers = reinterpret_cast<const float*>(digits + 3 * k + k / 2);
  for (int64_t b = 0; b < k / F::kValues; ++b) {
    const uint8_t* block = wrow + b * F::kBytes;
    prefetch_block<kDigitPrefetchBytes>(block, F::kBytes);
    const __m512 scales = _mm512_mul_ps(F::scales(block), _mm512_loadu_ps(powers + 16 * b));
    for (int half = 0; half < 2; ++half) {
      __m512i first, second;
      paired_codes<F>(block, half, first, second);
      const int64_t n = F::kValues * b + 128 * half;
      const auto bytes = [&](int d, int which) { return _mm512_loadu_si512(digits + d * k + n + 64 * which); };
      // the codes are unsigned, values() plus 2^kCodeOffsetBits: the sums start from minus that times m's sums
      const __m512i offsets = _mm512_slli_epi32(_mm512_loadu_si512(sums + n / 8), F::kCodeOffsetBits);
      // m's low two bytes are unsigned and the codes under 128, so either side of vpdpbusd takes them
      const __m512i low =
          dot_bytes4(dot_bytes4(offsets, bytes(2, 0), first), bytes(2, 1), second);
      const __m512i mid = dot_bytes4(dot_bytes4(zero, bytes(1, 0), first), bytes(1, 1), second);
      const __m512i high = dot_bytes4(dot_bytes4(zero, first, bytes(0, 0)), second, bytes(0, 1));
      // |sum| < 8 * 32 * 2^23 = 2^31: the 32-bit sum of the three is exact (wrapping in between does no harm)
      const __m512i sum =
          _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(high, 16), _mm512_slli_epi32(mid, 8)), low);
      const __m512 lane_scales =
          _mm512_permutexvar_ps(_mm512_add_epi32(lane_scale, _mm512_set1_epi32(8 * half)), scales);
      acc[half] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), lane_scales, acc[half]);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
}
#endif

// The fused dot products of one weight row with TM activation rows.
template <class F, int TM>
void dot_rows(const uint8_t* wrow, const float* x, int64_t k, float* out, int64_t ldo) {
#if defined(__AVX512F__)
  if constexpr (kHasNibbleRuns<F>) return dot_rows_nibbles<F, TM>(wrow, x, k, out, ldo);
#endif
#if defined(__AVX512BW__)
  if constexpr (kHasCodes<F>) return dot_rows_codes<F, TM>(wrow, x, k, out, ldo);
#endif
  dot_rows_exact<F, TM>(wrow, x, k, out, ldo);
}

constexpr int kRowTile = 4;  // activation rows sharing one decode of the weights


// Parallel over output features (rows of W), in chunks of at least ~64K multiply-adds that the threads take in turn
// from a shared counter, as ggml's mul_mat hands out its chunks: a thread held up (descheduled on a machine shared with
// other work, or waking late) then delays the region by about a chunk, where an even split into one range per thread
// made the others wait for its whole range. Which thread computes a row does not change its bits.
constexpr int64_t kChunksPerThread = 16;
template <class Body>
void parallel_rows(int64_t n, int64_t work_per_row, const Body& body) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, work_per_row));
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (n + grain - 1) / grain);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) body(0, n);
    return;
  }
  const int64_t chunk = std::max(grain, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t begin; (begin = next.fetch_add(chunk)) < n;) body(begin, std::min(n, begin + chunk));
  });
}

#if !defined(__AVX512BW__)
class ActDigits {};  // only the AVX-512 builds take activations in digits
#endif

// The rows of x that matmul_rows_exact multiplies one at a time (past its tiles of kRowTile) in a call of m rows from
// row `first`, marked in `single`.
void mark_single_rows(int64_t first, int64_t m, std::vector<char>& single) {
  std::fill_n(single.begin() + first + m / kRowTile * kRowTile, m % kRowTile, 1);
}

// The digits of x's rows that `wanted` marks, for a call of these formats: where one of them takes digits (AVX-512
// builds), else none.
std::unique_ptr<ActDigits> digits_for(const torch::Tensor& x, const std::vector<int64_t>& ggml_types,
                                      const std::vector<char>& wanted) {
#if defined(__AVX512BW__)
  const bool takes_digits = std::any_of(ggml_types.begin(), ggml_types.end(), [](int64_t type) {
    return visit_format(type, [](auto format) { return kDigitDots<decltype(format)>; });
  });
  if (takes_digits && std::find(wanted.begin(), wanted.end(), 1) != wanted.end())
    return std::make_unique<ActDigits>(x.data_ptr<float>(), x.size(0), x.size(1), wanted);
#endif
  return nullptr;
}

// out[i * ldo + r] for weight rows r in [begin, end) and every activation row i: tiles of kRowTile rows, then the rest
// one at a time, as digits where `digits` has row digit_row + i of them.
template <class F>
void matmul_rows_exact(const float* x, int64_t m, int64_t k, const uint8_t* w, int64_t begin, int64_t end, float* out,
                       int64_t ldo, const ActDigits* digits = nullptr, int64_t digit_row = 0) {
  const int64_t row_bytes = k / F::kValues * F::kBytes;
  for (int64_t r = begin; r < end; ++r) {
    const uint8_t* wrow = w + r * row_bytes;
    int64_t i = 0;
    for (; i + kRowTile <= m; i += kRowTile) dot_rows<F, kRowTile>(wrow, x + i * k, k, out + i * ldo + r, ldo);
    for (; i < m; ++i) {
#if defined(__AVX512BW__)
      if constexpr (kDigitDots<F>) {
        if (const uint8_t* d = digits ? digits->row(digit_row + i) : nullptr) {
          out[i * ldo + r] = digit_dot<F>(wrow, d, k);
          continue;
        }
      }
#endif
      dot_rows<F, 1>(wrow, x + i * k, k, out + i * ldo + r, ldo);
    }
  }
}

// Rows of W as floats, the values group_floats gives. The formats the dot products decode a span at a time (the 4-bit
// formats' tables, the K-quants' codes) are dequantized the same way: the panel products of 32 rows ran 1.06-1.14x as
// fast for Q4_K, Q5_K and Q6_K (4096 x 2048, 2 threads), the legacy 4-bit formats' as fast as a group at a time.
template <class F>
void dequantize_rows(const uint8_t* w, int64_t rows, int64_t k, float* out) {
  constexpr int kVectors = 32 / kWideLanes;  // the widest vectors: half the conversions and stores with AVX-512
  const int64_t row_bytes = k / F::kValues * F::kBytes;
  parallel_rows(rows, k, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
#if defined(__AVX512F__)
      if constexpr (kHasNibbleRuns<F>) {
        NibbleStore store{out + r * k};
        nibble_row<F>(w + r * row_bytes, k, store, store);
        continue;
      }
#endif
#if defined(__AVX512BW__)
      if constexpr (kHasCodes<F>) {
        float* row = out + r * k;
        code_row<F>(w + r * row_bytes, k, [row](__m512 low, __m512 high, int64_t pos) {
          _mm512_storeu_ps(row + pos, low);
          _mm512_storeu_ps(row + pos + 16, high);
        });
        continue;
      }
#endif
      for (int64_t b = 0; b < k / F::kValues; ++b) {
        for (int g = 0; g < F::kValues / 32; ++g) {
          WideFloats v[kVectors];
          group_floats(F::group(w + r * row_bytes + b * F::kBytes, g), v);
          for (int i = 0; i < kVectors; ++i)
            wide_store(out + r * k + b * F::kValues + 32 * g + kWideLanes * i, v[i]);
        }
      }
    }
  });
}

// out [M, rows] (a view) = x [M, K] @ dequantize(W).T for W of rows x K: panels of W dequantized for at::mm.
template <class F>
void panel_matmul(const torch::Tensor& x, const uint8_t* w, int64_t rows, torch::Tensor out) {
  const int64_t cols = x.size(1), row_bytes = cols / F::kValues * F::kBytes;
  // A panel of ~1 MiB of floats stays in L2 between its dequantization and its product, which few rows of x (a
  // memory-bound product) need; from 64 rows the product is bound by arithmetic, and ~4 MiB panels (a quarter of the
  // BLAS calls, each packing x once) ran 1.07-1.41x as fast on the embedded model's shapes at 64-1272 rows (2 threads).
  const int64_t panel_floats = x.size(0) >= 64 ? (1 << 20) : (1 << 18);
  // Each thread dequantizes its own panels and multiplies them on its own (the BLAS runs single-threaded inside a
  // parallel region): a panel never leaves its core's cache, and a call is one parallel region instead of two a panel.
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows / 64));
  const int64_t panels = std::max(threads, (rows * cols + panel_floats - 1) / panel_floats);
  const int64_t panel_rows = (rows + panels - 1) / panels;
  // the caller's thread-local state (inference mode, the dispatcher's keys below autograd) for the pool's threads
  const at::ThreadLocalState caller;
  auto multiply = [&](int64_t first, int64_t last) {
    at::ThreadLocalStateGuard guard(caller);
    torch::Tensor panel = torch::empty({panel_rows, cols}, x.options());
    for (int64_t p = first; p < last; ++p) {
      const int64_t start = p * panel_rows, count = std::min(panel_rows, rows - start);
      if (count <= 0) break;
      torch::Tensor part = panel.narrow(0, 0, count);
      dequantize_rows<F>(w + start * row_bytes, count, cols, part.data_ptr<float>());
      torch::Tensor target = out.narrow(1, start, count);
      at::mm_out(target, x, part.t());
    }
  };
  if (threads <= 1 || at::in_parallel_region()) {
    multiply(0, panels);
    return;
  }
  at::parallel_for(0, panels, 1, multiply);
}

#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
// ---------------------------------------------------------------------------------------------
// AMX: batches as integer tiles.
//
// From kTileMinBatch rows of x up to kTileMaxBatch, the formats with one scale and offset per 32 values multiply on
// AMX's int8 tiles instead of the fused dot products or dequantized panels and the BLAS. Each 32 values of a row of x
// become 24-bit block floating point, as the digits of single rows do (block_integers): integers m, |m| < 2^23, times
// 2^(e - 23), 2^e the power of two above the 32's largest magnitude. m's three bytes (the top signed, the others
// unsigned) make three 16 x 32-byte tiles of 16 rows; a weight's 32 integer codes (F::group's q) for 16 weight rows
// make one 8 x 64-byte tile. A tile product sums 32 byte products a (row, weight row) in int32, exactly; the three
// sums are combined and scaled by the group's scale times 2^(e - 23) in float32, and the offset times the 32 rounded
// values' sum added.
// docs/faithfulness.md gives the bound this meets; docs/performance.md the speed.

// Rows of x past which the BLAS on dequantized panels is as fast (2 threads, the embedded model's shapes: 1.1-1.4x
// the panels' speed at 24-128 rows, 1.0-1.16x at 256, 0.84-1.13x at 384-512): the tiles do a third of their products'
// work for each 32 values (three digits), and then store, convert and scale every 32's sums.
constexpr int64_t kTileMaxBatch = 256;
// Rows of x from which the tiles beat the fused dot products (1.2-1.4x at 12 rows, 1.5-1.8x at 16-23; 0.8-0.9x at 8).
constexpr int64_t kTileMinBatch = 12;

// The formats whose F::group has one scale and offset for all its 32 values (not Q2_K, Q3_K and Q6_K: a scale a 16).
template <class F>
constexpr bool kTileCodes = !std::is_same_v<F, Q2_K> && !std::is_same_v<F, Q3_K> && !std::is_same_v<F, Q6_K>;

// Linux lends a process the tile registers' state once it asks (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Tiles 0-2: the int32 sums of the three digits (16 x 16), 3-5: the digits (16 rows x 32 bytes), 6: the codes
// (8 rows x 64 bytes: 4 values of 16 weight rows a row). Set on each thread before it multiplies.
void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes[16] = {64, 64, 64, 32, 32, 32, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 8};
  } config;
  _tile_loadconfig(&config);
}

// The rows of x [m, k] as tiles, for each 16 rows (zeros past m) and each 32 values: the three digit tiles, each 16
// rows of 32 bytes, then each row's 2^(e - 23) and the sum of its 32 rounded values (16 floats each). Unusable where
// a row holds a NaN or an infinity: the call takes the panels.
class ActTiles {
 public:
  static constexpr int64_t kUnitBytes = 3 * 512 + 2 * 64;
  ActTiles(const float* x, int64_t m, int64_t k) : units_(k / 32), groups_((m + 15) / 16) {
    data_ = torch::empty({groups_ * units_ * kUnitBytes}, torch::kUInt8);
    bytes_ = data_.data_ptr<uint8_t>();
    // the last group's rows past m, zeros (every other byte is written below): an output row of theirs is never stored
    for (int64_t u = 0, pad = groups_ * 16 - m; pad > 0 && u < units_; ++u) {
      uint8_t* tiles = bytes_ + ((groups_ - 1) * units_ + u) * kUnitBytes;
      for (int d = 0; d < 3; ++d) std::memset(tiles + 512 * d + 32 * (16 - pad), 0, 32 * pad);
      float* power = reinterpret_cast<float*>(tiles + 3 * 512);
      std::fill_n(power + 16 - pad, pad, 0.0f);
      std::fill_n(power + 32 - pad, pad, 0.0f);
    }
    std::atomic<bool> finite{true};
    parallel_rows(m, k, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        if (!prepare(x + i * k, i)) finite = false;
    });
    usable_ = finite;
  }
  bool usable() const { return usable_; }
  int64_t groups() const { return groups_; }
  const uint8_t* unit(int64_t group, int64_t u) const {
    return bytes_ + (group * units_ + u) * kUnitBytes;
  }

 private:
  bool prepare(const float* x, int64_t i) {
    for (int64_t u = 0; u < units_; ++u) {
      const __m512 v[2] = {_mm512_loadu_ps(x + 32 * u), _mm512_loadu_ps(x + 32 * u + 16)};
      __m512i m[2];
      const std::optional<int> e = block_integers(v, m);
      if (!e) return false;
      uint8_t* tiles = bytes_ + ((i / 16) * units_ + u) * kUnitBytes + 32 * (i % 16);
      float* power = reinterpret_cast<float*>(tiles - 32 * (i % 16) + 3 * 512) + i % 16;
      int64_t sum = 0;
      for (int h = 0; h < 2; ++h) {
        sum += _mm512_reduce_add_epi32(m[h]);
        // m's three bytes, each cut to its low byte by the conversion
        const __m512i bytes[3] = {_mm512_srai_epi32(m[h], 16), _mm512_srli_epi32(m[h], 8), m[h]};
        for (int d = 0; d < 3; ++d)
          _mm_storeu_si128(reinterpret_cast<__m128i*>(tiles + 512 * d + 16 * h), _mm512_cvtepi32_epi8(bytes[d]));
      }
      power[0] = std::ldexp(1.0f, *e - 23);
      power[16] = static_cast<float>(sum) * power[0];  // |sum| < 2^28: one rounding
    }
    return true;
  }

  int64_t units_, groups_;
  torch::Tensor data_;
  uint8_t* bytes_;  // data_'s: its data_ptr checks the type and storage at every call, and unit() runs per tile
  bool usable_ = false;
};

// The codes tile of 32 values (unit u) of `valid` weight rows from wrow (rows of row_bytes, zeros past valid), with
// their scales and offsets: F::group row by row, then 16 x 8 words turned into 8 x 16. The legacy formats gather their
// fields straight from the blocks instead (legacy_codes_tile): for Q4_1, this path took 0.27 ms of a 1536 x 576
// call's 0.44 at 32 rows (one thread), the gathers 0.15.
template <class F>
void codes_tile(const uint8_t* wrow, int64_t row_bytes, int64_t u, int64_t valid, uint8_t* tile, float* scale,
                float* offset) {
  constexpr int64_t kGroups = F::kValues / 32;
  alignas(64) uint8_t codes[16 * 32] = {};
  for (int64_t r = 0; r < 16; ++r) {
    scale[r] = offset[r] = 0.0f;
    if (r >= valid) continue;
    const Group g = F::group(wrow + r * row_bytes + u / kGroups * F::kBytes, u % kGroups);
    _mm256_store_si256(reinterpret_cast<__m256i*>(codes + 32 * r), g.q);
    scale[r] = g.scale_lo;
    offset[r] = g.offset_lo;
  }
  for (int j = 0; j < 8; ++j)
    _mm512_store_si512(tile + 64 * j, _mm512_i32gather_epi32(strided_lanes(32), codes + 4 * j, 1));
}

// Words 0-3 (16 bytes from p) of 16 rows row_bytes apart, transposed: out[j] holds word j of rows 0, 1, .., 15, as four
// gathers give them, from 16 loads and two rounds of unpacks (each 128-bit lane l holds rows 4 l .. 4 l + 3).
inline void words_of_16_rows(const uint8_t* p, int64_t row_bytes, __m512i out[4]) {
  __m512i z[4];
  for (int q = 0; q < 4; ++q) {
    z[q] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + q * row_bytes)));
    for (int l = 1; l < 4; ++l)
      z[q] = _mm512_inserti32x4(z[q], _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (4 * l + q) * row_bytes)),
                                l);
  }
  const __m512i a = _mm512_unpacklo_epi32(z[0], z[1]), b = _mm512_unpackhi_epi32(z[0], z[1]);
  const __m512i c = _mm512_unpacklo_epi32(z[2], z[3]), d = _mm512_unpackhi_epi32(z[2], z[3]);
  out[0] = _mm512_unpacklo_epi64(a, c);
  out[1] = _mm512_unpackhi_epi64(a, c);
  out[2] = _mm512_unpacklo_epi64(b, d);
  out[3] = _mm512_unpackhi_epi64(b, d);
}

// The same for the legacy 32-value blocks (Q4_0, Q4_1, Q8_0), 16 weight rows' words a gather: the halves at the
// block's start, then the codes' words; those of 16 valid rows by words_of_16_rows instead (1.0-1.11x the rows a second
// at 12-64 rows, bench/cpu_builds.py).
template <class F>
void legacy_codes_tile(const uint8_t* wrow, int64_t row_bytes, int64_t u, int64_t valid, uint8_t* tile, float* scale,
                       float* offset) {
  const __mmask16 rows = static_cast<__mmask16>((1u << valid) - 1);
  const __m512i starts = strided_lanes(static_cast<int>(row_bytes));
  const uint8_t* block = wrow + u * F::kBytes;
  const auto words = [&](int64_t at) {
    return _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), rows, starts, block + at, 1);
  };
  const __m512i halves = words(0);
  _mm512_store_ps(scale, low_halves(halves));
  _mm512_store_ps(offset, std::is_same_v<F, Q4_1> ? high_halves(halves) : _mm512_setzero_ps());
  __m512i w[8];
  if constexpr (std::is_same_v<F, Q8_0>) {
    if (valid == 16) {
      words_of_16_rows(block + 2, row_bytes, w);
      words_of_16_rows(block + 18, row_bytes, w + 4);
    } else {
      for (int j = 0; j < 8; ++j) w[j] = words(2 + 4 * j);
    }
    for (int j = 0; j < 8; ++j) _mm512_store_si512(tile + 64 * j, w[j]);
  } else {  // byte i of the nibbles holds value i (low) and value i + 16 (high)
    constexpr int kNibbles = std::is_same_v<F, Q4_1> ? 4 : 2;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_set1_epi8(std::is_same_v<F, Q4_0> ? 8 : 0);  // Q4_0's codes are q - 8
    if (valid == 16) {
      words_of_16_rows(block + kNibbles, row_bytes, w);
    } else {
      for (int j = 0; j < 4; ++j) w[j] = words(kNibbles + 4 * j);
    }
    for (int j = 0; j < 4; ++j) {
      const __m512i v = w[j];
      _mm512_store_si512(tile + 64 * j, _mm512_sub_epi8(_mm512_and_si512(v, low4), shift));
      _mm512_store_si512(tile + 64 * (4 + j), _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi32(v, 4), low4), shift));
    }
  }
}

// out [M, rows] (a view, rows of ldo floats) = x @ dequantize(W).T for x in tiles: each thread takes 16 weight rows at
// a time, lays their codes out as tiles with their scales and offsets, and multiplies every 16 rows of x by them.
template <class F>
void tile_matmul(const ActTiles& act, int64_t m, const uint8_t* w, int64_t rows, int64_t k, float* out, int64_t ldo) {
  constexpr int64_t kPanelUnit = 512 + 2 * 64;  // codes tile, 16 scales, 16 offsets
  const int64_t units = k / 32, row_bytes = k / F::kValues * F::kBytes;
  // Each thread sets its tiles and buffers up once and takes 16 weight rows at a time from a shared counter.
  const int64_t weight_tiles = (rows + 15) / 16;
  std::atomic<int64_t> next{0};
  const auto multiply = [&](int64_t, int64_t) {
    configure_tiles();
    struct alignas(64) Line { uint8_t bytes[64]; };  // the aligned loads and stores below need 64-byte lines
    std::vector<Line> lines(units * kPanelUnit / 64);
    uint8_t* panel = lines.data()->bytes;
    alignas(64) int32_t sums[3][3][256];
    for (int64_t t; (t = next.fetch_add(1)) < weight_tiles;) {
      const int64_t valid = std::min<int64_t>(16, rows - 16 * t);
      const uint8_t* wrow = w + 16 * t * row_bytes;
      for (int64_t u = 0; u < units; ++u) {
        uint8_t* unit = panel + u * kPanelUnit;
        float* scale = reinterpret_cast<float*>(unit + 512);
        if constexpr (std::is_same_v<F, Q4_0> || std::is_same_v<F, Q4_1> || std::is_same_v<F, Q8_0>)
          legacy_codes_tile<F>(wrow, row_bytes, u, valid, unit, scale, scale + 16);
        else
          codes_tile<F>(wrow, row_bytes, u, valid, unit, scale, scale + 16);
      }
      for (int64_t group = 0; group < act.groups(); ++group) {
        __m512 acc[16];
        for (__m512& a : acc) a = _mm512_setzero_ps();
        // only the group's rows of x: a decode step's last group is often part padding (and the loop's bound at run
        // time alone made every batch 1.0-1.15x faster, bit for bit: bench/cpu_builds.py, 12-200 rows)
        const int rows_here = static_cast<int>(std::min<int64_t>(16, m - 16 * group));
        const auto add_unit = [&](int64_t u) {
          const int32_t(*s)[256] = sums[u % 3];
          const float* scale = reinterpret_cast<const float*>(panel + u * kPanelUnit + 512);
          const float* power = reinterpret_cast<const float*>(act.unit(group, u) + 3 * 512);
          const __m512 scales = _mm512_load_ps(scale), offsets = _mm512_load_ps(scale + 16);
          for (int r = 0; r < rows_here; ++r) {
            const __m512 top = _mm512_cvtepi32_ps(_mm512_load_si512(s[0] + 16 * r));
            const __m512 mid = _mm512_cvtepi32_ps(_mm512_load_si512(s[1] + 16 * r));
            const __m512 low = _mm512_cvtepi32_ps(_mm512_load_si512(s[2] + 16 * r));
            const __m512 sum =
                _mm512_fmadd_ps(top, _mm512_set1_ps(65536.0f), _mm512_fmadd_ps(mid, _mm512_set1_ps(256.0f), low));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(scales, _mm512_set1_ps(power[r])), acc[r]);
            if constexpr (!std::is_same_v<F, Q4_0> && !std::is_same_v<F, Q8_0>)  // the formats with an offset
              acc[r] = _mm512_fmadd_ps(offsets, _mm512_set1_ps(power[16 + r]), acc[r]);
          }
        };
        for (int64_t u = 0; u < units; ++u) {
          const uint8_t* digits = act.unit(group, u);
          _tile_loadd(6, panel + u * kPanelUnit, 64);
          _tile_loadd(3, digits, 32);
          _tile_loadd(4, digits + 512, 32);
          _tile_loadd(5, digits + 1024, 32);
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_dpbssd(0, 3, 6);
          _tile_dpbusd(1, 4, 6);
          _tile_dpbusd(2, 5, 6);
          // the float work of an earlier unit while the products run: after the stores it waited on them (this order
          // 1.05-1.15x the rows a second at 24-64 rows)
          if (u > 1) add_unit(u - 2);
          _tile_stored(0, sums[u % 3][0], 64);
          _tile_stored(1, sums[u % 3][1], 64);
          _tile_stored(2, sums[u % 3][2], 64);
        }
        if (units > 1) add_unit(units - 2);
        add_unit(units - 1);
        const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
        for (int r = 0; r < rows_here; ++r)
          _mm512_mask_storeu_ps(out + (16 * group + r) * ldo + 16 * t, lanes, acc[r]);
      }
    }
    _tile_release();
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), weight_tiles);
  if (threads <= 1 || at::in_parallel_region())
    multiply(0, 1);
  else
    at::parallel_for(0, threads, 1, multiply);
}
#endif

#if !defined(__AMX_INT8__) || !defined(__AMX_TILE__)
class ActTiles {};  // only the AMX builds take activations in tiles
#endif

// Whether m rows of x multiply a weight of format F on the tiles: the AMX build, a CPU that lends the tile state, a
// scale a 32, and kTileMinBatch to kTileMaxBatch rows.
template <class F>
bool takes_tiles(int64_t m) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if constexpr (kTileCodes<F>) return m >= kTileMinBatch && m <= kTileMaxBatch && tiles_permitted();
#endif
  return false;
}

// out [M, rows] (a view) = x [M, K] @ dequantize(W).T on the tiles where takes_tiles and x allow (x's tiles made on
// first use, for every weight of the call), else on panels.
template <class F>
void batch_matmul(const torch::Tensor& x, const uint8_t* w, int64_t rows, torch::Tensor out,
                  std::unique_ptr<ActTiles>& tiles) {
#if defined(__AMX_INT8__) && defined(__AMX_TILE__)
  if constexpr (kTileCodes<F>) {
    if (takes_tiles<F>(x.size(0))) {
      if (!tiles) tiles = std::make_unique<ActTiles>(x.data_ptr<float>(), x.size(0), x.size(1));
      if (tiles->usable())
        return tile_matmul<F>(*tiles, x.size(0), w, rows, x.size(1), out.data_ptr<float>(), out.stride(0));
    }
  }
#endif
  panel_matmul<F>(x, w, rows, out);
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& packed, int64_t rows, int64_t cols, int64_t block_values,
                  int64_t block_bytes) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "workbench cpu kernels: tensors must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "workbench cpu kernels: x must be a contiguous 2-D float32 tensor, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == cols, "workbench cpu kernels: x has ", x.size(1), " features, weight has ", cols);
  TORCH_CHECK(cols % block_values == 0, "workbench cpu kernels: row length ", cols, " is not a multiple of ", block_values);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == rows && packed.size(1) == cols / block_values * block_bytes,
              "workbench cpu kernels: packed weight must be contiguous uint8 [", rows, ", ",
              cols / block_values * block_bytes, "], got ", packed.sizes());
}

// body(p, lo, hi) for rows [lo, hi) of part p, where part p holds the rows first_row[p] .. first_row[p + 1] - 1 of
// an output side by side with the others (q, k and v): every part's rows in one parallel region.
template <class Body>
void parallel_side_by_side(const std::vector<int64_t>& first_row, int64_t work_per_row, const Body& body) {
  parallel_rows(first_row.back(), work_per_row, [&](int64_t begin, int64_t end) {
    for (size_t p = 0; p + 1 < first_row.size(); ++p) {
      const int64_t lo = std::max(begin, first_row[p]), hi = std::min(end, first_row[p + 1]);
      if (lo < hi) body(p, lo - first_row[p], hi - first_row[p]);
    }
  });
}

// The float32 values of packed [rows, bytes a row] (GGUF type ggml_type, rows of cols values), as the exact kernels
// multiply them: for products these kernels do not take (a gradient's grad @ dequantize(W)).
torch::Tensor dequantize(const torch::Tensor& packed, int64_t ggml_type, int64_t cols) {
  return visit_format(ggml_type, [&](auto format) {
    using F = decltype(format);
    check_inputs(torch::empty({0, cols}), packed, packed.size(0), cols, F::kValues, F::kBytes);
    torch::Tensor out = torch::empty({packed.size(0), cols});
    dequantize_rows<F>(packed.data_ptr<uint8_t>(), packed.size(0), cols, out.data_ptr<float>());
    return out;
  });
}

// x [M, K] float32 @ dequantize(W).T for each weight W = packed[p] (GGUF type ggml_types[p], rows[p] x K), the
// results side by side: [M, sum of rows]. Several weights of one input (q, k, v) thus take one call and one
// parallel region. From panel_min_batch rows of x on, panels of each W are dequantized for at::mm instead; with AMX the
// formats with a scale a 32 take the tiles from kTileMinBatch to kTileMaxBatch rows (batch_matmul).
torch::Tensor linear_exact(const torch::Tensor& x, at::TensorList packed, c10::IntArrayRef ggml_types,
                           c10::IntArrayRef rows, int64_t cols, int64_t panel_min_batch) {
  const size_t parts = packed.size();
  TORCH_CHECK(parts > 0 && ggml_types.size() == parts && rows.size() == parts,
              "workbench cpu kernels: one type and row count per packed weight");
  std::vector<int64_t> first_row(parts + 1, 0);  // each part's first output column
  for (size_t p = 0; p < parts; ++p) {
    visit_format(ggml_types[p], [&](auto format) {
      using F = decltype(format);
      check_inputs(x, packed[p], rows[p], cols, F::kValues, F::kBytes);
    });
    first_row[p + 1] = first_row[p] + rows[p];
  }
  const int64_t m = x.size(0), n = first_row[parts];
  torch::Tensor out = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  // Below panel_min_batch rows the parts that do not take the tiles share one parallel region of fused dot products.
  std::vector<size_t> fused;
  std::vector<int64_t> fused_types, fused_first{0};
  for (size_t p = 0; p < parts; ++p) {
    if (m >= panel_min_batch || visit_format(ggml_types[p], [&](auto f) { return takes_tiles<decltype(f)>(m); }))
      continue;
    fused.push_back(p);
    fused_types.push_back(ggml_types[p]);
    fused_first.push_back(fused_first.back() + rows[p]);
  }
  if (!fused.empty()) {
    std::vector<char> single(m, 0);
    mark_single_rows(0, m, single);
    const std::unique_ptr<ActDigits> digits = digits_for(x, fused_types, single);
    parallel_side_by_side(fused_first, cols * m, [&](size_t j, int64_t lo, int64_t hi) {
      const size_t p = fused[j];
      visit_format(ggml_types[p], [&](auto format) {
        matmul_rows_exact<decltype(format)>(xp, m, cols, packed[p].data_ptr<uint8_t>(), lo, hi, outp + first_row[p],
                                            n, digits.get());
      });
    });
  }
  std::unique_ptr<ActTiles> tiles;
  for (size_t p = 0; p < parts; ++p) {
    if (std::find(fused.begin(), fused.end(), p) != fused.end()) continue;
    visit_format(ggml_types[p], [&](auto format) {
      batch_matmul<decltype(format)>(x, packed[p].data_ptr<uint8_t>(), rows[p], out.narrow(1, first_row[p], rows[p]),
                                     tiles);
    });
  }
  return out;
}

// The first output row of each part of a segmented call ([parts + 1], the last the total), with each part's rows
// x_first[p] .. x_first[p] + x_count[p] checked to lie in x.
std::vector<int64_t> segment_starts(const torch::Tensor& x, c10::IntArrayRef x_first, c10::IntArrayRef x_count) {
  const size_t parts = x_first.size();
  std::vector<int64_t> out_first(parts + 1, 0);
  for (size_t p = 0; p < parts; ++p) {
    TORCH_CHECK(x_first[p] >= 0 && x_count[p] >= 0 && x_first[p] + x_count[p] <= x.size(0),
                "workbench cpu kernels: rows ", x_first[p], " + ", x_count[p], " are outside x's ", x.size(0));
    out_first[p + 1] = out_first[p] + x_count[p];
  }
  return out_first;
}

// body(j, lo, hi) for the weight rows [lo, hi) of the j-th of n_parts parts of `rows` rows each, all (part, weight row)
// pairs in one parallel region, a part's rows at a time.
template <class Body>
void parallel_part_rows(int64_t n_parts, int64_t rows, int64_t work_per_row, const Body& body) {
  parallel_rows(n_parts * rows, work_per_row, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end;) {
      const int64_t lo = i % rows, hi = std::min(rows, lo + end - i);
      body(i / rows, lo, hi);
      i += hi - lo;
    }
  });
}

// Each weight times its own rows of x, as llama.cpp's mul_mat_id runs a token's experts: rows x_first[p] ..
// x_first[p] + x_count[p] of x [M, K] float32 @ dequantize(packed[p]).T (GGUF type ggml_types[p], rows x K), stacked in
// part order: [sum of x_count, rows]. The parts of fewer than panel_min_batch rows of x that do not take the tiles
// share one parallel region and linear_exact's fused dot products; the others take its tiles or panels. Either way
// each output has the bits linear_exact gives on that part's rows alone.
torch::Tensor linear_exact_segments(const torch::Tensor& x, at::TensorList packed, c10::IntArrayRef ggml_types,
                                    int64_t rows, int64_t cols, c10::IntArrayRef x_first, c10::IntArrayRef x_count,
                                    int64_t panel_min_batch) {
  const size_t parts = packed.size();
  TORCH_CHECK(parts > 0 && ggml_types.size() == parts && x_first.size() == parts && x_count.size() == parts,
              "workbench cpu kernels: one type, first row and row count of x per packed weight");
  std::vector<size_t> fused;  // the parts of the shared parallel region
  for (size_t p = 0; p < parts; ++p) {
    visit_format(ggml_types[p], [&](auto format) {
      using F = decltype(format);
      check_inputs(x, packed[p], rows, cols, F::kValues, F::kBytes);
    });
    if (x_count[p] > 0 && x_count[p] < panel_min_batch &&
        !visit_format(ggml_types[p], [&](auto f) { return takes_tiles<decltype(f)>(x_count[p]); }))
      fused.push_back(p);
  }
  const std::vector<int64_t> out_first = segment_starts(x, x_first, x_count);
  torch::Tensor out = torch::empty({out_first[parts], rows}, x.options());
  const float* xp = x.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int64_t mean_count = std::max<int64_t>(1, out_first[parts] / static_cast<int64_t>(parts));
  const int64_t n_fused = static_cast<int64_t>(fused.size());
  std::vector<int64_t> fused_types;
  std::vector<char> single(x.size(0), 0);
  for (const size_t p : fused) {
    fused_types.push_back(ggml_types[p]);
    mark_single_rows(x_first[p], x_count[p], single);
  }
  const std::unique_ptr<ActDigits> digits = digits_for(x, fused_types, single);
  parallel_part_rows(n_fused, rows, cols * mean_count, [&](int64_t j, int64_t lo, int64_t hi) {
    const size_t p = fused[j];
    visit_format(ggml_types[p], [&](auto format) {
      matmul_rows_exact<decltype(format)>(xp + x_first[p] * cols, x_count[p], cols, packed[p].data_ptr<uint8_t>(), lo,
                                          hi, outp + out_first[p] * rows, rows, digits.get(), x_first[p]);
    });
  });
  for (size_t p = 0; p < parts; ++p) {
    if (x_count[p] == 0 || std::find(fused.begin(), fused.end(), p) != fused.end()) continue;
    std::unique_ptr<ActTiles> tiles;
    visit_format(ggml_types[p], [&](auto format) {
      batch_matmul<decltype(format)>(x.narrow(0, x_first[p], x_count[p]), packed[p].data_ptr<uint8_t>(), rows,
                                     out.narrow(0, out_first[p], x_count[p]), tiles);
    });
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// llama.cpp numerics.

// out[i * ldo + r] for weight rows r in [begin, end) and the m rows of quantized activations xq.
template <class F>
void matmul_rows_llamacpp(const typename F::Act* xq, int64_t m, int64_t k, const uint8_t* w, int64_t begin, int64_t end,
                          float* out, int64_t ldo) {
  const int64_t nblocks = k / F::kValues, row_bytes = nblocks * F::kBytes;
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t i = 0; i < m; ++i) {
      Floats acc = zeros();
      float mins = 0.0f;
      for (int64_t b = 0; b < nblocks; ++b) {
        if (i == 0) prefetch_block(w + r * row_bytes + b * F::kBytes, F::kBytes);
        F::dot(w + r * row_bytes + b * F::kBytes, xq[i * nblocks + b], acc, mins);
      }
      out[i * ldo + r] = hsum(acc) + mins;
    }
  }
}

template <class Act>
constexpr int act_block_values() {
  return std::is_same_v<Act, BlockQ8_K> ? kQKK : kQK;
}

template <class Act>
torch::Tensor quantize_activations_as(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  constexpr int values = act_block_values<Act>();
  TORCH_CHECK(k % values == 0, "workbench cpu kernels: row length ", k, " is not a multiple of ", values);
  auto blocks = torch::empty({m, k / values * static_cast<int64_t>(sizeof(Act))}, x.options().dtype(torch::kUInt8));
  const float* xp = x.data_ptr<float>();
  auto* yp = reinterpret_cast<Act*>(blocks.data_ptr<uint8_t>());
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) quantize_row(xp + i * k, k, yp + i * (k / values));
  });
  return blocks;
}

// x @ W.T for each W of packed (all of ggml_type), side by side as linear_exact gives them: x quantized once for the
// type, then every (weight, row) pair in one parallel region (q, k and v in one call, as for linear_exact).
torch::Tensor linear_llamacpp(const torch::Tensor& x, at::TensorList packed, int64_t ggml_type, c10::IntArrayRef rows,
                              int64_t cols) {
  return visit_format(ggml_type, [&](auto format) {
    using F = decltype(format);
    const size_t parts = packed.size();
    TORCH_CHECK(parts > 0 && rows.size() == parts, "workbench cpu kernels: one row count per packed weight");
    std::vector<int64_t> first_row(parts + 1, 0);  // each part's first output column
    for (size_t p = 0; p < parts; ++p) {
      check_inputs(x, packed[p], rows[p], cols, F::kValues, F::kBytes);
      first_row[p + 1] = first_row[p] + rows[p];
    }
    const int64_t m = x.size(0), n = first_row[parts];
    const torch::Tensor xq = quantize_activations_as<typename F::Act>(x);
    const auto* xqp = reinterpret_cast<const typename F::Act*>(xq.data_ptr<uint8_t>());
    torch::Tensor out = torch::empty({m, n}, x.options());
    float* outp = out.data_ptr<float>();
    parallel_side_by_side(first_row, cols * m, [&](size_t p, int64_t lo, int64_t hi) {
      matmul_rows_llamacpp<F>(xqp, m, cols, packed[p].data_ptr<uint8_t>(), lo, hi, outp + first_row[p], n);
    });
    return out;
  });
}

// linear_exact_segments in llama.cpp numerics, for weights of one type: x quantized once, then each weight on its own
// rows of it in one parallel region, each output with the bits linear_llamacpp gives on that part's rows alone.
torch::Tensor linear_llamacpp_segments(const torch::Tensor& x, at::TensorList packed, int64_t ggml_type, int64_t rows,
                                       int64_t cols, c10::IntArrayRef x_first, c10::IntArrayRef x_count) {
  return visit_format(ggml_type, [&](auto format) {
    using F = decltype(format);
    const size_t parts = packed.size();
    TORCH_CHECK(parts > 0 && x_first.size() == parts && x_count.size() == parts,
                "workbench cpu kernels: one first row and row count of x per packed weight");
    for (size_t p = 0; p < parts; ++p) check_inputs(x, packed[p], rows, cols, F::kValues, F::kBytes);
    const std::vector<int64_t> out_first = segment_starts(x, x_first, x_count);
    const torch::Tensor xq = quantize_activations_as<typename F::Act>(x);
    const auto* xqp = reinterpret_cast<const typename F::Act*>(xq.data_ptr<uint8_t>());
    const int64_t nblocks = cols / F::kValues;
    torch::Tensor out = torch::empty({out_first[parts], rows}, x.options());
    float* outp = out.data_ptr<float>();
    const int64_t mean_count = std::max<int64_t>(1, out_first[parts] / static_cast<int64_t>(parts));
    parallel_part_rows(static_cast<int64_t>(parts), rows, cols * mean_count, [&](int64_t p, int64_t lo, int64_t hi) {
      matmul_rows_llamacpp<F>(xqp + x_first[p] * nblocks, x_count[p], cols, packed[p].data_ptr<uint8_t>(), lo, hi,
                              outp + out_first[p] * rows, rows);
    });
    return out;
  });
}

// The activation blocks llama.cpp numerics use against weights of ggml_type, as bytes [M, n_blocks * block_bytes].
torch::Tensor quantize_activations(const torch::Tensor& x, int64_t ggml_type) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "workbench cpu kernels: x must be a contiguous 2-D float32 tensor");
  return visit_format(ggml_type, [&](auto format) { return quantize_activations_as<typename decltype(format)::Act>(x); });
}


// ---------------------------------------------------------------------------------------------
// The forward's small per-token ops: one op call each where torch takes four to six. In an eager decode step these
// ops cost their calls, not their arithmetic. Each product and sum is rounded to float32 on its own (no contraction
// into fused multiply-adds), as the separate torch ops round them.

void check_floats(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == dim,
              "workbench cpu kernels: ", name, " must be a contiguous ", dim, "-D float32 CPU tensor, got ",
              t.scalar_type(), " ", t.sizes());
}

// RMSNorm of each row of x [rows, d] into scale [rows] and out [rows, d]: scale = 1 / sqrt(mean(x^2) + eps) (squares
// rounded to float32, summed in double), and out = (x * scale) * weight. With delta (and total), of the residual sum
// total = x + delta instead, each row summed in the same parallel region as its norm.
__attribute__((optimize("fp-contract=off")))
void rms_norm_rows(const float* xp, const float* dp, float* tp, const float* wp, float* sp, float* op, int64_t rows,
                   int64_t d, double eps) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * d;
      if (dp != nullptr) {
        float* tr = tp + t * d;
        for (int64_t i = 0; i < d; ++i) {
          tr[i] = xr[i] + dp[t * d + i];
        }
        xr = tr;
      }
      double sum = 0.0;
      for (int64_t i = 0; i < d; ++i) {
        const float square = xr[i] * xr[i];
        sum += square;
      }
      const float mean = static_cast<float>(sum / static_cast<double>(d));
      const float s = 1.0f / std::sqrt(mean + static_cast<float>(eps));
      sp[t] = s;
      for (int64_t i = 0; i < d; ++i) {
        const float normalized = xr[i] * s;
        op[t * d + i] = normalized * wp[i];
      }
    }
  });
}

void check_norm(const torch::Tensor& x, const torch::Tensor& weight) {
  check_floats(x, "x", 2);
  check_floats(weight, "weight", 1);
  TORCH_CHECK(weight.size(0) == x.size(1), "workbench cpu kernels: rms_norm weight has ", weight.size(0),
              " values for rows of ", x.size(1));
}

// RMSNorm of x [T, d] (rms_norm_rows): its scale [T, 1] and output.
std::tuple<torch::Tensor, torch::Tensor> rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_norm(x, weight);
  torch::Tensor scale = torch::empty({x.size(0), 1}, x.options()), out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), nullptr, nullptr, weight.data_ptr<float>(), scale.data_ptr<float>(),
                out.data_ptr<float>(), x.size(0), x.size(1), eps);
  return {scale, out};
}

// The residual sum x + delta [T, d] and rms_norm of it: the sum, its scale and the output.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x,
                                                                     const torch::Tensor& delta,
                                                                     const torch::Tensor& weight, double eps) {
  check_norm(x, weight);
  check_floats(delta, "delta", 2);
  TORCH_CHECK(delta.sizes() == x.sizes(), "workbench cpu kernels: add_rms_norm adds ", delta.sizes(), " to ",
              x.sizes());
  torch::Tensor total = torch::empty_like(x), scale = torch::empty({x.size(0), 1}, x.options()),
                out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), delta.data_ptr<float>(), total.data_ptr<float>(), weight.data_ptr<float>(),
                scale.data_ptr<float>(), out.data_ptr<float>(), x.size(0), x.size(1), eps);
  return {total, scale, out};
}

void check_gate_up(const torch::Tensor& gate, const torch::Tensor& up, const char* op) {
  TORCH_CHECK(gate.device().is_cpu() && gate.scalar_type() == torch::kFloat32 && gate.dim() == 2 &&
                  up.sizes() == gate.sizes() && up.scalar_type() == torch::kFloat32 && gate.stride(1) == 1 &&
                  up.stride(1) == 1,
              "workbench cpu kernels: ", op, " needs float32 gate and up [T, d] of one shape, rows contiguous, got ",
              gate.sizes(), ", ", up.sizes());
}

// silu(gate) * up for gate and up [T, d] (rows may be strided, as the two halves of a fused gate/up output): silu is
// ATen's own kernel, so the bits of the torch formula.
torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  check_gate_up(gate, up, "swiglu");
  torch::Tensor out = at::silu(gate);
  TORCH_CHECK(out.is_contiguous(), "workbench cpu kernels: swiglu's silu came out strided");
  float* op = out.data_ptr<float>();
  const float* up_p = up.data_ptr<float>();
  const int64_t rows = gate.size(0), d = gate.size(1), up_stride = up.stride(0);
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < d; ++i) {
        op[t * d + i] *= up_p[t * up_stride + i];
      }
    }
  });
  return out;
}

// The index of a row's largest value, the first of equal ones, a NaN counting as the largest (torch.argmax's choice):
// each AVX-512 lane keeps its best value and the first index that had it, where ATen's reduction ran 1.2-2.3 ns a
// value on the development machine (0.36 ms a greedy token over a 151,936-word vocabulary).
int64_t argmax_row(const float* v, int64_t n) {
  int64_t i = 0, best_at = 0;
  float best = v[0];
#if defined(__AVX512F__)
  if (n >= 32) {
    __m512 lane_best = _mm512_loadu_ps(v);
    __m512i lane_at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = lane_at;
    __mmask16 nan = _mm512_cmp_ps_mask(lane_best, lane_best, _CMP_UNORD_Q);
    for (i = 16; i + 16 <= n; i += 16) {
      at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
      const __m512 value = _mm512_loadu_ps(v + i);
      const __mmask16 greater = _mm512_cmp_ps_mask(value, lane_best, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
      lane_best = _mm512_mask_mov_ps(lane_best, greater, value);
      lane_at = _mm512_mask_mov_epi32(lane_at, greater, at);
    }
    if (nan) {
      for (int64_t j = 0;; ++j)
        if (std::isnan(v[j])) return j;
    }
    best = _mm512_reduce_max_ps(lane_best);
    const __mmask16 holders = _mm512_cmp_ps_mask(lane_best, _mm512_set1_ps(best), _CMP_EQ_OQ);
    best_at = _mm512_mask_reduce_min_epi32(holders, lane_at);
  }
#endif
  for (; i < n; ++i) {
    if (std::isnan(v[i])) return i;
    if (v[i] > best) {
      best = v[i];
      best_at = i;
    }
  }
  return best_at;
}

// argmax_row of each row of x [rows, n] (float32, rows contiguous; n below 2^31): a greedy pick's token.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1 && x.size(1) > 0 &&
                  x.size(1) < (int64_t{1} << 31),
              "workbench cpu kernels: argmax_rows needs float32 [rows, n] with rows contiguous, got ", x.sizes());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  torch::Tensor out = torch::empty({rows}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * stride, n);
  });
  return out;
}

// exp of 16 values by ggml's polynomial (v_expf, below, is the same for one value), for arguments at most 0: below
// -104 (where float32's exp is 0) the result is 0.
#if defined(__AVX512BW__)
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 r = _mm512_set1_ps(0x1.8p23f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(0x1.715476p+0f), r), r);
  const __m512 b =
      _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.7f7d1cp-20f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0x1.62e4p-1f), x));
  const __m512 u = _mm512_mul_ps(b, b);
  const __m512 j = _mm512_fmadd_ps(
      _mm512_fmadd_ps(_mm512_fmadd_ps(_mm512_set1_ps(0x1.0e4020p-7f), b, _mm512_set1_ps(0x1.573e2ep-5f)), u,
                      _mm512_fmadd_ps(_mm512_set1_ps(0x1.555e66p-3f), b, _mm512_set1_ps(0x1.fffdb6p-2f))),
      u, _mm512_fmadd_ps(_mm512_set1_ps(0x1.ffffecp-1f), b, _mm512_set1_ps(1.0f)));
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-104.0f), _CMP_LT_OQ);
  return _mm512_maskz_scalef_ps(static_cast<__mmask16>(~tiny), j, n);
}
#endif
inline float v_expf(float v);

// The k largest values of a row (best first; of equal ones the first) and the softmax probability of each,
// exp(value - max) / sum(exp(row - max)), in one read of the row: a block of 1024 values (in L1) gives its maximum and
// the values above the k-th best so far, then the sum of its exponentials from its own maximum, merged into the row's
// (rescaled to the larger maximum). False for a row holding a NaN or an infinity.
bool top_k_softmax_row(const float* v, int64_t n, int64_t k, float* probs, int64_t* ids) {
  constexpr int64_t kBlock = 1024;
  std::vector<float> best(k);
  int64_t filled = 0;
  float threshold = -INFINITY;  // the k-th best once k are held
  const auto offer = [&](float x, int64_t i) {
    int64_t at = filled < k ? filled++ : k - 1;
    while (at > 0 && best[at - 1] < x) {  // after equal values: the first of equal ones ranks higher
      best[at] = best[at - 1];
      ids[at] = ids[at - 1];
      --at;
    }
    best[at] = x;
    ids[at] = i;
    if (filled == k) threshold = best[k - 1];
  };
  float row_max = -INFINITY;
  double row_sum = 0.0;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    int64_t i = start;
    float block_max = -INFINITY;
#if defined(__AVX512BW__)
    __m512 lanes_max = _mm512_set1_ps(-INFINITY);
    __mmask16 bad = 0;
    for (; i + 16 <= end; i += 16) {
      const __m512 x = _mm512_loadu_ps(v + i);
      lanes_max = _mm512_max_ps(lanes_max, x);
      bad |= non_finite_lanes(x);
      __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(threshold), _CMP_GT_OQ);
      while (above) {  // lanes in order: offers come by ascending index
        const int lane = __builtin_ctz(above);
        above &= above - 1;
        if (v[i + lane] > threshold) offer(v[i + lane], i + lane);
      }
    }
    if (bad) return false;
    block_max = _mm512_reduce_max_ps(lanes_max);
#endif
    for (int64_t j = i; j < end; ++j) {
      if (!std::isfinite(v[j])) return false;
      block_max = std::max(block_max, v[j]);
      if (v[j] > threshold) offer(v[j], j);
    }
    float block_sum = 0.0f;
    i = start;
#if defined(__AVX512BW__)
    __m512 lanes_sum = _mm512_setzero_ps();
    for (; i + 16 <= end; i += 16)
      lanes_sum = _mm512_add_ps(lanes_sum, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(v + i),
                                                                          _mm512_set1_ps(block_max))));
    block_sum = _mm512_reduce_add_ps(lanes_sum);
#endif
    for (int64_t j = i; j < end; ++j) block_sum += v_expf(v[j] - block_max);
    if (block_max > row_max) {
      row_sum = row_sum * std::exp(static_cast<double>(row_max) - block_max) + block_sum;
      row_max = block_max;
    } else {
      row_sum += block_sum * std::exp(static_cast<double>(block_max) - row_max);
    }
  }
  if (filled < k) return false;
  for (int64_t j = 0; j < k; ++j)
    probs[j] = static_cast<float>(std::exp(static_cast<double>(best[j]) - row_max) / row_sum);
  return true;
}

// top_k_softmax_row of each row of logits [rows, n] (float32, rows contiguous): (probs [rows, k], ids [rows, k]), a
// row that holds a NaN or an infinity marked by ids -1 (the caller takes softmax's own answer for it).
std::tuple<torch::Tensor, torch::Tensor> top_k_softmax(const torch::Tensor& logits, int64_t k) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1 && k >= 1 &&
                  k <= logits.size(1),
              "workbench cpu kernels: top_k_softmax needs float32 [rows, n] with rows contiguous and 1 <= k <= n, got ",
              logits.sizes(), ", k ", k);
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  torch::Tensor probs = torch::empty({rows, k}, logits.options());
  torch::Tensor ids = torch::empty({rows, k}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  float* pp = probs.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (!top_k_softmax_row(lp + r * stride, n, k, pp + r * k, ip + r * k)) std::fill_n(ip + r * k, k, -1);
  });
  return {probs, ids};
}

// Rope of rows x [rows, D] into out: out = x * cos + partner(x) * sin with cos and sin [rows / heads, D] (the
// runner's rotation(): cos at both values of a pair, sin signed for each value), the partner of value i being i ^ 1
// (adjacent pairs) or i +- D/2 (the two halves of each head).
__attribute__((optimize("fp-contract=off")))
void rope_rows(const float* xp, const float* cp, const float* sp, float* op, int64_t rows, int64_t heads, int64_t d,
               bool interleaved) {
  const int64_t half = d / 2;
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float *xr = xp + row * d, *c = cp + row / heads * d, *s = sp + row / heads * d;
      float* o = op + row * d;
      if (interleaved) {
        for (int64_t i = 0; i < d; i += 2) {
          const float a0 = xr[i] * c[i], b0 = xr[i + 1] * s[i];
          const float a1 = xr[i + 1] * c[i + 1], b1 = xr[i] * s[i + 1];
          o[i] = a0 + b0;
          o[i + 1] = a1 + b1;
        }
      } else {
        for (int64_t i = 0; i < half; ++i) {
          const float a = xr[i] * c[i], b = xr[i + half] * s[i];
          o[i] = a + b;
        }
        for (int64_t i = half; i < d; ++i) {
          const float a = xr[i] * c[i], b = xr[i - half] * s[i];
          o[i] = a + b;
        }
      }
    }
  });
}

void check_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_floats(x, "x", 3);
  check_floats(cos, "cos", 3);
  check_floats(sin, "sin", 3);
  TORCH_CHECK(x.size(2) % 2 == 0 && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0) && cos.size(1) == 1 &&
              cos.size(2) == x.size(2),
              "workbench cpu kernels: rope needs x [T, H, D] (D even) and cos, sin [T, 1, D], got ", x.sizes(), ", ",
              cos.sizes(), ", ", sin.sizes());
}

// Rope of x [T, H, D] (rope_rows) with cos and sin [T, 1, D].
torch::Tensor rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved) {
  check_rope(x, cos, sin);
  torch::Tensor out = torch::empty_like(x);
  rope_rows(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>(),
            x.size(0) * x.size(1), x.size(1), x.size(2), interleaved);
  return out;
}

// rope_attention's attention (see there), from the rotated queries q [N, H, D] and keys k [N, KV, D] and the values
// v [N, KV * D] of the sequences packed at bounds: the runner's padded attention (layout.pad, BatchKVCache.write,
// layer_ops.attention_scores, softmax, layer_ops.attend, layout.unpad), the same ATen ops on the same views. One
// sequence is a batch of one (its cache buffers given a leading axis): its padding is none, its views the runner's
// views of one prompt's tensors.
torch::Tensor batch_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const c10::optional<torch::Tensor>& key_cache,
                              const c10::optional<torch::Tensor>& value_cache, c10::IntArrayRef starts, double divisor,
                              const c10::optional<torch::Tensor>& blocked, c10::IntArrayRef bounds) {
  const int64_t n = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k.size(1);
  const int64_t batch = static_cast<int64_t>(bounds.size()) - 1;
  TORCH_CHECK(key_cache.has_value() == value_cache.has_value() && (blocked.has_value() || batch == 1) && batch >= 1 &&
                  static_cast<int64_t>(starts.size()) == batch && bounds[0] == 0 && bounds[batch] == n,
              "workbench cpu kernels: rope_attention's batch needs a mask, the bounds of its ", n,
              " packed rows and a start for each sequence");
  int64_t width = 0;
  bool uniform = true;
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(bounds[b + 1] >= bounds[b], "workbench cpu kernels: rope_attention's bounds must not decrease");
    width = std::max(width, bounds[b + 1] - bounds[b]);
    uniform = uniform && bounds[b + 1] - bounds[b] == bounds[1];
  }
  // without a cache, each sequence's keys and values padded to the longest's tokens (zeros past its own), as
  // layout.pad gives them
  const torch::Tensor kb = key_cache.has_value() ? *key_cache : torch::zeros({batch, kv_heads, width, d}, q.options());
  const torch::Tensor vb = value_cache.has_value() ? *value_cache : torch::zeros_like(kb);
  check_floats(kb, "key_cache", 4);
  check_floats(vb, "value_cache", 4);
  TORCH_CHECK(kb.sizes() == vb.sizes() && kb.size(0) == batch && kb.size(1) == kv_heads && kb.size(3) == d,
              "workbench cpu kernels: rope_attention's batch cache buffers ", kb.sizes(), " and ", vb.sizes(),
              " do not hold ", batch, " sequences of ", kv_heads, " key heads of ", d);
  const int64_t capacity = kb.size(2);
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(starts[b] >= 0 && starts[b] + width <= capacity, "workbench cpu kernels: rope_attention's cache "
                "buffers ", kb.sizes(), " have no slots ", starts[b], " to ", starts[b] + width, " for sequence ", b);
  // every sequence's slots up to the longest's after the write (the mask hides those past a sequence's own)
  const int64_t slots = blocked.has_value() ? blocked->size(-1) : starts[0] + width;
  TORCH_CHECK(!blocked.has_value() || (blocked->scalar_type() == torch::kBool && slots <= capacity),
              "workbench cpu kernels: rope_attention's mask must be a bool tensor of at most ", capacity,
              " slots, got ", blocked->scalar_type(), " ", blocked->sizes());
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(starts[b] + width <= slots, "workbench cpu kernels: rope_attention's sequence ", b, " has no slots ",
                starts[b], " to ", starts[b] + width, " of ", slots);
  // the cache's write: each sequence's tokens after its own slots, then zeros up to the longest's tokens
  float *kbp = kb.data_ptr<float>(), *vbp = vb.data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = bounds[b + 1] - bounds[b];
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t t = 0; t < width; ++t) {
        float *key = kbp + ((b * kv_heads + h) * capacity + starts[b] + t) * d, *value = vbp + (key - kbp);
        if (t < length) {
          std::memcpy(key, kp + ((bounds[b] + t) * kv_heads + h) * d, d * sizeof(float));
          std::memcpy(value, vp + ((bounds[b] + t) * kv_heads + h) * d, d * sizeof(float));
        } else {
          std::fill_n(key, d, 0.0f);
          std::fill_n(value, d, 0.0f);
        }
      }
    }
  }
  // layout.pad of the queries: [B, T_max, H, D], zeros past each sequence's end
  torch::Tensor padded;
  if (uniform) {
    padded = q.view({batch, width, heads, d});
  } else {
    std::vector<int64_t> rows(batch * width);
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < width; ++t) rows[b * width + t] = t < bounds[b + 1] - bounds[b] ? bounds[b] + t : n;
    padded = at::cat({q, q.new_zeros({1, heads, d})}).index({torch::tensor(rows)}).view({batch, width, heads, d});
  }
  const torch::Tensor keys = kb.narrow(2, 0, slots), values = vb.narrow(2, 0, slots);
  // layer_ops.attention_scores, softmax and layer_ops.attend
  const int64_t rows = batch * kv_heads, group = heads / kv_heads;
  const torch::Tensor q_grouped = padded.transpose(-3, -2).reshape({rows, group * width, d});
  const torch::Tensor dots = at::bmm(q_grouped, keys.reshape({rows, slots, d}).transpose(1, 2));
  // the division and the mask in one pass over the scores (ATen's div and masked_fill, the same bits, made one
  // prompt's decode 5 % slower)
  const torch::Tensor scores = dots.view({batch, heads, width, slots});
  const torch::Tensor mask =
      blocked.has_value() ? blocked->expand({batch, 1, width, slots}).contiguous() : torch::Tensor();
  float* sp = scores.data_ptr<float>();
  const bool* bp = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  const float scale_divisor = static_cast<float>(divisor);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < width * slots; ++i) {
        float& score = sp[((b * heads + h) * width * slots) + i];
        score = (bp != nullptr && bp[b * width * slots + i]) ? -INFINITY : score / scale_divisor;
      }
  const torch::Tensor pattern = at::_softmax(scores, -1, false);
  const torch::Tensor z = at::bmm(pattern.reshape({rows, group * width, slots}), values.reshape({rows, slots, d}))
                              .view({batch, heads, width, d})
                              .transpose(-3, -2);
  // layout.unpad
  const torch::Tensor flat = z.reshape({batch * width, heads, d});
  if (uniform) return flat;
  std::vector<int64_t> packed;
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t t = 0; t < bounds[b + 1] - bounds[b]; ++t) packed.push_back(b * width + t);
  return flat.index({torch::tensor(packed)});
}

// Attention of the queries q [T, H * D] over a layer's keys and values, from the projections q, k [T, KV * D] and
// v [T, KV * D] as the runner's eager forward computes it where no hook lies between them (one call instead of ~25):
// with q_norm and k_norm [D] (Qwen3's), each head of q and k through its RMSNorm (rms_norm, epsilon eps); the rope of
// q and k (rope_rows) with cos and sin [T, 1, D]; with a cache, the new keys and values written into its
// buffers [KV, capacity, D] at slots [start, start + T) and every slot up to them attended over (KVCache.write),
// without one, the new ones alone; then layer_ops.attention_scores, softmax and layer_ops.attend, step by step the
// same ATen ops on the same views (query head h reads kv head h / (H / KV)), so the same bits. Scores are divided by
// divisor and -inf where blocked [T, S] is true. starts holds start alone. Returns z [T, H, D].
//
// A batch (bounds given): q, k and v hold B sequences packed one after another, sequence b the rows bounds[b] to
// bounds[b + 1]; the cache buffers are [B, KV, capacity, D] (BatchKVCache's), sequence b's tokens taking slots
// starts[b] onwards; blocked is [B, 1, T_max, S], T_max the longest sequence's tokens. Without a cache, each sequence
// attends over its own new tokens (starts all 0, blocked [T_max, T_max]). The sequences are padded to T_max tokens
// with zeros as the runner pads them (batch_attention). Returns z [N, H, D], packed.
torch::Tensor rope_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved,
                             const c10::optional<torch::Tensor>& key_cache,
                             const c10::optional<torch::Tensor>& value_cache, c10::IntArrayRef starts, double divisor,
                             const c10::optional<torch::Tensor>& blocked, const c10::optional<torch::Tensor>& q_norm,
                             const c10::optional<torch::Tensor>& k_norm, double eps, c10::IntArrayRef bounds) {
  check_floats(cos, "cos", 3);
  check_floats(sin, "sin", 3);
  torch::Tensor qc = q.contiguous(), kc = k.contiguous();
  const torch::Tensor vc = v.contiguous();
  check_floats(qc, "q", 2);
  check_floats(kc, "k", 2);
  check_floats(vc, "v", 2);
  const int64_t tokens = qc.size(0), d = cos.size(2), heads = qc.size(1) / d, kv_heads = kc.size(1) / d;
  TORCH_CHECK(d % 2 == 0 && cos.sizes() == sin.sizes() && cos.size(0) == tokens && cos.size(1) == 1 &&
                  qc.size(1) == heads * d && kc.size(1) == kv_heads * d && vc.sizes() == kc.sizes() && kv_heads > 0 &&
                  heads % kv_heads == 0 && kc.size(0) == tokens,
              "workbench cpu kernels: rope_attention needs q [T, H * D], k and v [T, KV * D] (KV dividing H) and cos, "
              "sin [T, 1, D] (D even), got ", qc.sizes(), ", ", kc.sizes(), ", ", vc.sizes(), ", ", cos.sizes(), ", ",
              sin.sizes());
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "workbench cpu kernels: rope_attention takes q and k's norms "
              "together");
  if (q_norm.has_value()) {  // layer_ops.rms_norm of each head, [T, heads, d] as [T * heads, d]
    qc = std::get<1>(rms_norm(qc.view({tokens * heads, d}), *q_norm, eps)).view({tokens, heads * d});
    kc = std::get<1>(rms_norm(kc.view({tokens * kv_heads, d}), *k_norm, eps)).view({tokens, kv_heads * d});
  }
  torch::Tensor q_rot = torch::empty({tokens, heads, d}, qc.options()), k_rot = torch::empty({tokens, kv_heads, d},
                                                                                            kc.options());
  rope_rows(qc.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q_rot.data_ptr<float>(),
            tokens * heads, heads, d, interleaved);
  rope_rows(kc.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), k_rot.data_ptr<float>(),
            tokens * kv_heads, kv_heads, d, interleaved);
  if (!bounds.empty())
    return batch_attention(q_rot, k_rot, vc, key_cache, value_cache, starts, divisor, blocked, bounds);
  TORCH_CHECK(starts.size() == 1, "workbench cpu kernels: rope_attention takes one start without a batch, got ",
              starts.size());
  if (key_cache.has_value()) {
    check_floats(*key_cache, "key_cache", 3);
    check_floats(*value_cache, "value_cache", 3);
  }
  if (blocked.has_value())
    TORCH_CHECK(blocked->scalar_type() == torch::kBool && blocked->dim() == 2 && blocked->size(0) == tokens &&
                blocked->size(1) == starts[0] + tokens,
                "workbench cpu kernels: rope_attention's mask must be a bool [T, S] = [", tokens, ", ",
                starts[0] + tokens, "], got ", blocked->scalar_type(), " ", blocked->sizes());
  const auto one_row = [](const c10::optional<torch::Tensor>& buffer) {
    return buffer.has_value() ? c10::optional<torch::Tensor>(buffer->unsqueeze(0)) : buffer;
  };
  const std::array<int64_t, 2> whole{0, tokens};
  return batch_attention(q_rot, k_rot, vc, one_row(key_cache), one_row(value_cache), starts, divisor, blocked, whole);
}

// A decoder block of llama's form where no hook lies inside it, from its input stream x [T, d_model] and that
// stream's first norm normalized: q, k and v (linear_exact of weights[0..2]; plus the biases qkv_bias, Qwen2's; each
// head of q and k through its RMSNorm qk_norm, Qwen3's), rope_attention (cache and mask as there), the output projection
// (weights[3]), the residual sum with the second norm (mlp_norm), gate and up (weights[4..5]), swiglu and the down
// projection (weights[6]). Each step is the call the runner's eager forward makes for it, on the same tensors, so the
// bits are the same. Returns the stream after attention and the MLP's output.
std::tuple<torch::Tensor, torch::Tensor> one_block(
    const torch::Tensor& x, const torch::Tensor& normalized, at::TensorList weights, c10::IntArrayRef ggml_types,
    c10::IntArrayRef rows, at::TensorList qkv_bias, at::TensorList qk_norm, const torch::Tensor& mlp_norm, double eps,
    const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved, const c10::optional<torch::Tensor>& key_cache,
    const c10::optional<torch::Tensor>& value_cache, c10::IntArrayRef starts, double divisor,
    const c10::optional<torch::Tensor>& blocked, c10::IntArrayRef bounds, int64_t panel_min_batch) {
  const auto project = [&](const torch::Tensor& input, size_t first, size_t count) {
    return linear_exact(input, weights.slice(first, count), ggml_types.slice(first, count), rows.slice(first, count),
                        input.size(1), panel_min_batch);
  };
  const int64_t tokens = x.size(0), n_q = rows[0], n_kv = rows[1];
  const torch::Tensor qkv = project(normalized, 0, 3);
  torch::Tensor parts[3] = {qkv.narrow(1, 0, n_q), qkv.narrow(1, n_q, n_kv), qkv.narrow(1, n_q + n_kv, rows[2])};
  for (size_t p = 0; p < qkv_bias.size(); ++p) parts[p] = parts[p] + qkv_bias[p];
  const auto norm = [&](size_t p) {
    return qk_norm.empty() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(qk_norm[p]);
  };
  const torch::Tensor z = rope_attention(parts[0], parts[1], parts[2], cos, sin, interleaved, key_cache, value_cache,
                                         starts, divisor, blocked, norm(0), norm(1), eps, bounds);
  const torch::Tensor attn_out = project(z.reshape({tokens, n_q}), 3, 1);
  auto [mid, scale, mlp_in] = add_rms_norm(x, attn_out, mlp_norm, eps);
  const torch::Tensor gate_up = project(mlp_in, 4, 2);
  const torch::Tensor hidden = swiglu(gate_up.narrow(1, 0, rows[4]), gate_up.narrow(1, rows[4], rows[5]));
  return {mid, project(hidden, 6, 1)};
}

// A run of n consecutive blocks of llama's form with no hook inside them nor between them (one_block each), from the
// first one's input stream x [T, d_model] and its first norm normalized; between two blocks the residual sum with the
// next one's first norm (attn_norms[l - 1] before block l: add_rms_norm, as the runner takes it). Block l's arguments
// are its slice of each list: 7 weights (wq, wk, wv, wo, w_gate, w_up, w_down) with their GGUF types and rows, 3
// biases and 2 qk norms where given, its mlp_norm, cos, sin, mask and cache buffers (none without a cache). starts and
// bounds are rope_attention's: a batch's sequences packed (bounds) in a batch cache. One op call for a decode step's
// blocks instead of one a block and the Python between them, with the same bits. Returns the last block's stream after
// attention and its MLP's output, whose sum the runner takes with the norm after it.
std::tuple<torch::Tensor, torch::Tensor> blocks_exact(
    const torch::Tensor& x, const torch::Tensor& normalized, at::TensorList weights, c10::IntArrayRef ggml_types,
    c10::IntArrayRef rows, at::TensorList qkv_bias, at::TensorList qk_norm, at::TensorList attn_norms,
    at::TensorList mlp_norms, double eps, at::TensorList cos, at::TensorList sin, bool interleaved,
    at::TensorList key_caches, at::TensorList value_caches, c10::IntArrayRef starts, double divisor,
    const c10::List<c10::optional<torch::Tensor>>& blocked, c10::IntArrayRef bounds, int64_t panel_min_batch) {
  const size_t n = mlp_norms.size();
  TORCH_CHECK(n > 0 && weights.size() == 7 * n && ggml_types.size() == 7 * n && rows.size() == 7 * n,
              "workbench cpu kernels: blocks_exact takes wq, wk, wv, wo, w_gate, w_up and w_down for each of ", n,
              " blocks, got ", weights.size(), " weights");
  TORCH_CHECK((qkv_bias.empty() || qkv_bias.size() == 3 * n) && (qk_norm.empty() || qk_norm.size() == 2 * n) &&
                  attn_norms.size() == n - 1 && cos.size() == n && sin.size() == n && blocked.size() == n &&
                  key_caches.size() == value_caches.size() && (key_caches.empty() || key_caches.size() == n),
              "workbench cpu kernels: blocks_exact needs for each of ", n, " blocks its q, k and v biases (or none), q "
              "and k norms (or none), mlp norm, cos, sin, mask and cache buffers (or none), and the first norms of "
              "all but the first");
  torch::Tensor stream = x, input = normalized, mlp_out;
  for (size_t l = 0; l < n; ++l) {
    if (l > 0) std::tie(stream, std::ignore, input) = add_rms_norm(stream, mlp_out, attn_norms[l - 1], eps);
    const auto cache = [&](at::TensorList buffers) {
      return buffers.empty() ? c10::optional<torch::Tensor>() : c10::optional<torch::Tensor>(buffers[l]);
    };
    std::tie(stream, mlp_out) = one_block(
        stream, input, weights.slice(7 * l, 7), ggml_types.slice(7 * l, 7), rows.slice(7 * l, 7),
        qkv_bias.empty() ? qkv_bias : qkv_bias.slice(3 * l, 3), qk_norm.empty() ? qk_norm : qk_norm.slice(2 * l, 2),
        mlp_norms[l], eps, cos[l], sin[l], interleaved, cache(key_caches), cache(value_caches), starts, divisor,
        blocked.get(l), bounds, panel_min_batch);
  }
  return {stream, mlp_out};
}

// LoRA terms of a group of projections sharing the input x [T, in] (runner.add_lora): each output outs[p] plus its
// term B_p (A_p x), rounded to float32 before the sum as the two matmuls' result is, side by side in one [T, O]. a [R, in] holds the parts' A rows
// stacked, b_t [R, O] their B's transposed as the blocks of a block-diagonal matrix (part p's rows start at the sum
// of the previous parts' ranks, its columns at the sum of their widths): only the nonzero blocks are read, each row
// of a block a contiguous run. Made for few rows (decode): each row of A and of B_p^T is read once for all tokens. The
// expansion is split over threads from parallel_work multiply-adds a thread on: a parallel region costs a small
// group more than its arithmetic.
torch::Tensor lora_add(const torch::Tensor& x, const torch::Tensor& a, const torch::Tensor& b_t,
                                    at::TensorList outs, at::IntArrayRef ranks, int64_t parallel_work) {
  check_floats(x, "x", 2);
  check_floats(a, "a", 2);
  check_floats(b_t, "b_t", 2);
  const int64_t tokens = x.size(0), k = x.size(1), rank = a.size(0), n_parts = static_cast<int64_t>(outs.size());
  TORCH_CHECK(n_parts > 0 && a.size(1) == k && b_t.size(0) == rank && static_cast<int64_t>(ranks.size()) == n_parts,
              "workbench cpu kernels: lora_add needs x [T, K], a [R, K], b_t [R, O] and a rank per output, got ",
              x.sizes(), ", ", a.sizes(), ", ", b_t.sizes(), " and ", ranks.size(), " ranks for ", n_parts, " outputs");
  std::vector<int64_t> col_start(n_parts + 1, 0), rank_start(n_parts + 1, 0);
  for (int64_t p = 0; p < n_parts; ++p) {
    const torch::Tensor& out = outs[p];
    TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == torch::kFloat32 && out.dim() == 2 &&
                out.size(0) == tokens && out.stride(1) == 1 && ranks[p] > 0,
                "workbench cpu kernels: lora_add output ", p, " must be float32 [T, width] rows of contiguous values");
    col_start[p + 1] = col_start[p] + out.size(1);
    rank_start[p + 1] = rank_start[p] + ranks[p];
  }
  const int64_t cols = b_t.size(1);
  TORCH_CHECK(col_start[n_parts] == cols && rank_start[n_parts] == rank,
              "workbench cpu kernels: lora_add outputs of ", col_start[n_parts], " values and ranks of ",
              rank_start[n_parts], " for b_t ", b_t.sizes());
  const float *xp = x.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b_t.data_ptr<float>();
  // the shrink, t = A x [T, R]
  std::vector<float> t(tokens * rank);
  for (int64_t r = 0; r < rank; ++r) {
    const float* ar = ap + r * k;
    for (int64_t m = 0; m < tokens; ++m) {
      const float* xr = xp + m * k;
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < k; ++i) sum += ar[i] * xr[i];
      t[m * rank + r] = sum;
    }
  }
  torch::Tensor result = torch::empty({tokens, cols}, x.options());
  float* rp = result.data_ptr<float>();
  // the expansion over the columns of b_t (every part's in turn), a block of them at a time: term = sum_c t_c B^T_c,
  // then out + term
  constexpr int64_t kBlock = 256;
  const int64_t max_rank = *std::max_element(ranks.begin(), ranks.end());
  const int64_t grain = std::max<int64_t>(kBlock, parallel_work / std::max<int64_t>(tokens * max_rank, 1));
  at::parallel_for(0, cols, grain, [&](int64_t begin, int64_t end) {
    float term[kBlock];
    for (int64_t p = 0; p < n_parts; ++p) {
      const int64_t r0 = rank_start[p], kp = ranks[p];
      const float* base = outs[p].data_ptr<float>();
      const int64_t base_stride = outs[p].stride(0);
      for (int64_t first = std::max(begin, col_start[p]); first < std::min(end, col_start[p + 1]); first += kBlock) {
        const int64_t n = std::min({kBlock, end - first, col_start[p + 1] - first}), j = first - col_start[p];
        for (int64_t m = 0; m < tokens; ++m) {
          std::fill(term, term + n, 0.0f);
          for (int64_t c = 0; c < kp; ++c) {
            const float tc = t[m * rank + r0 + c];
            const float* br = bp + (r0 + c) * cols + first;
            for (int64_t i = 0; i < n; ++i) term[i] += tc * br[i];
          }
          const float* bm = base + m * base_stride + j;
          float* rm = rp + m * cols + first;
          for (int64_t i = 0; i < n; ++i) rm[i] = bm[i] + term[i];
        }
      }
    }
  });
  return result;
}

// libm's expf, as llama.cpp numerics take it (llamacpp_ops._expf): the float64 exp rounded to float32
inline float expf_libm(float x) { return static_cast<float>(std::exp(static_cast<double>(x))); }

// llama.cpp numerics' attention for fewer than 64 query tokens: ggml-cpu's flash_attn_ext_f16_one_chunk (ops.cpp), one
// key at a time per query row, as llamacpp_ops._one_chunk transcribes it (its docstring has the details).
namespace one_chunk {

constexpr int64_t kDotStep = 64;   // GGML_F16_DOT_STEP: four registers of sixteen float32 lanes
constexpr int64_t kLanes = 16;
constexpr int64_t kF16Step = 128;  // GGML_F16_STEP: values past the last full step take the scalar F32 path

// e rounded once to F16, as a native F16 fused multiply-add rounds: through float32 rounded to odd, which F16's
// round-to-nearest then rounds as it would round e itself (float32 has more than two bits beyond F16's)
inline c10::Half half_once(double e) {
  float f = static_cast<float>(e);
  if (static_cast<double>(f) != e) {
    if (std::fabs(static_cast<double>(f)) > std::fabs(e)) f = std::nextafter(f, 0.0f);
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    bits |= 1u;
    std::memcpy(&f, &bits, sizeof bits);
  }
  return c10::Half(f);
}

#if defined(__AVX512F__)
inline __m512 load_halves16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_halves16(c10::Half* p, __m512 x) {  // rounded to nearest even, as c10::Half(float) rounds
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
inline __m256 load_halves8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_halves8(c10::Half* p, __m256 x) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// acc = acc * factor rounded to F16: ``factor16`` (the factor as an F16) on the first ``full`` values, the F32 path's
// ``factor`` on the rest
inline void scale_f16(c10::Half* acc, int64_t full, int64_t dv, float factor16, float factor) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i < full; i += kLanes)
    store_halves16(acc + i, _mm512_mul_ps(load_halves16(acc + i), _mm512_set1_ps(factor16)));
#elif defined(__AVX2__) && defined(__F16C__)
  for (; i < full; i += 8) store_halves8(acc + i, _mm256_mul_ps(load_halves8(acc + i), _mm256_set1_ps(factor16)));
#endif
  for (; i < dv; ++i) acc[i] = c10::Half(static_cast<float>(acc[i]) * (i < full ? factor16 : factor));
}

// acc += value * weight: on the first ``full`` values a native F16 fused multiply-add (``half_once`` of the exact
// sum, ``weight16`` the weight as an F16), on the rest the F32 path's float fused multiply-add rounded to F16
inline void mad_f16(c10::Half* acc, const c10::Half* value, int64_t full, int64_t dv, double weight16, float weight) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512VL__)
  const __m512d w = _mm512_set1_pd(weight16);
  for (; i < full; i += 8) {
    const __m512d a = _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(acc + i))));
    const __m512d v = _mm512_cvtps_pd(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(value + i))));
    const __m512d e = _mm512_add_pd(a, _mm512_mul_pd(v, w));  // the product is exact in double
    // half_once: rounded to odd in float32 (truncated, the last bit set where that was inexact), then to F16
    const __m256 truncated = _mm512_cvt_roundpd_ps(e, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __mmask8 inexact = _mm512_cmp_pd_mask(_mm512_cvtps_pd(truncated), e, _CMP_NEQ_UQ);
    const __m256i odd = _mm256_mask_or_epi32(_mm256_castps_si256(truncated), inexact, _mm256_castps_si256(truncated),
                                             _mm256_set1_epi32(1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(acc + i),
                     _mm256_cvtps_ph(_mm256_castsi256_ps(odd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i + kLanes <= dv; i += kLanes)
    store_halves16(acc + i, _mm512_fmadd_ps(load_halves16(value + i), _mm512_set1_ps(weight), load_halves16(acc + i)));
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
  const __m256d w = _mm256_set1_pd(weight16);
  const __m256d magnitude = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
  const __m256i low_words = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m128i one = _mm_set1_epi32(1);
  for (; i < full; i += 4) {
    const __m128i a16 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(acc + i));
    const __m128i v16 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(value + i));
    const __m256d e = _mm256_add_pd(_mm256_cvtps_pd(_mm_cvtph_ps(a16)),
                                    _mm256_mul_pd(_mm256_cvtps_pd(_mm_cvtph_ps(v16)), w));
    // half_once: rounded to nearest in float32, stepped toward zero where that went past e (truncation), the last
    // bit set where inexact; each 64-bit comparison's low word is the float32 lane's mask
    const __m128 nearest = _mm256_cvtpd_ps(e);
    const __m256d back = _mm256_cvtps_pd(nearest);
    const __m256d past = _mm256_cmp_pd(_mm256_and_pd(back, magnitude), _mm256_and_pd(e, magnitude), _CMP_GT_OQ);
    const __m256d inexact = _mm256_cmp_pd(back, e, _CMP_NEQ_UQ);
    const __m128i past32 = _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(past), low_words));
    const __m128i inexact32 =
        _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(_mm256_castpd_si256(inexact), low_words));
    __m128i bits = _mm_sub_epi32(_mm_castps_si128(nearest), _mm_and_si128(past32, one));
    bits = _mm_or_si128(bits, _mm_and_si128(inexact32, one));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(acc + i),
                     _mm_cvtps_ph(_mm_castsi128_ps(bits), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i + 8 <= dv; i += 8)
    store_halves8(acc + i, _mm256_fmadd_ps(load_halves8(value + i), _mm256_set1_ps(weight), load_halves8(acc + i)));
#endif
  for (; i < dv; ++i)
    acc[i] = i < full ? half_once(static_cast<double>(static_cast<float>(acc[i])) +
                                  static_cast<double>(static_cast<float>(value[i])) * weight16)
                      : c10::Half(std::fma(static_cast<float>(value[i]), weight, static_cast<float>(acc[i])));
}

// ggml_vec_dot_f16: products (exact in float32) summed in four registers of sixteen lanes over full steps of 64, the
// registers added pairwise (0+2, 1+3, then 0+1), the lanes as a tree, the products past the last step in double
__attribute__((optimize("fp-contract=off")))
inline float dot_f16(const c10::Half* q, const c10::Half* k, int64_t d) {
  const int64_t full = d - d % kDotStep;
  double total = 0.0;
  if (full) {
    float v[kLanes];
#if defined(__AVX512F__)
    __m512 reg[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t i = 0; i < full; i += kDotStep)
      for (int r = 0; r < 4; ++r)  // a product of two halves is exact in float32: with or without a fused add
        reg[r] = _mm512_add_ps(reg[r], _mm512_mul_ps(load_halves16(q + i + r * kLanes),
                                                     load_halves16(k + i + r * kLanes)));
    _mm512_storeu_ps(v, _mm512_add_ps(_mm512_add_ps(reg[0], reg[2]), _mm512_add_ps(reg[1], reg[3])));
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 reg[4][2] = {};  // each sixteen-lane register as two of eight lanes
    for (int64_t i = 0; i < full; i += kDotStep)
      for (int r = 0; r < 4; ++r)
        for (int half = 0; half < 2; ++half) {
          const int64_t at = i + r * kLanes + half * 8;
          reg[r][half] = _mm256_add_ps(reg[r][half], _mm256_mul_ps(load_halves8(q + at), load_halves8(k + at)));
        }
    for (int half = 0; half < 2; ++half)
      _mm256_storeu_ps(v + half * 8, _mm256_add_ps(_mm256_add_ps(reg[0][half], reg[2][half]),
                                                   _mm256_add_ps(reg[1][half], reg[3][half])));
#else
    float reg[4][kLanes] = {};
    for (int64_t i = 0; i < full; i += kDotStep)
      for (int r = 0; r < 4; ++r)
        for (int64_t lane = 0; lane < kLanes; ++lane) {
          const int64_t at = i + r * kLanes + lane;
          reg[r][lane] += static_cast<float>(q[at]) * static_cast<float>(k[at]);
        }
    for (int64_t lane = 0; lane < kLanes; ++lane)
      v[lane] = (reg[0][lane] + reg[2][lane]) + (reg[1][lane] + reg[3][lane]);
#endif
    for (int64_t width = kLanes / 2; width >= 2; width /= 2)
      for (int64_t lane = 0; lane < width; ++lane) v[lane] += v[lane + width];
    total = static_cast<double>(v[0] + v[1]);
  }
  for (int64_t i = full; i < d; ++i) total += static_cast<double>(static_cast<float>(q[i]) * static_cast<float>(k[i]));
  return static_cast<float>(total);
}

}  // namespace one_chunk

// out [N, T, Dv] float32 for q [N, T, D] float32, k [N, S, D] and v [N, S, Dv] float16, allowed [N, T, S] bool
__attribute__((optimize("fp-contract=off")))
torch::Tensor flash_attn_one_chunk(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& allowed, double scale) {
  using namespace one_chunk;
  TORCH_CHECK(q.is_cpu() && q.scalar_type() == torch::kFloat32 && q.is_contiguous() && q.dim() == 3 &&
                  k.scalar_type() == torch::kHalf && k.is_contiguous() && k.dim() == 3 &&
                  v.scalar_type() == torch::kHalf && v.is_contiguous() && v.dim() == 3 &&
                  allowed.scalar_type() == torch::kBool && allowed.is_contiguous() && allowed.dim() == 3 &&
                  k.size(0) > 0 && q.size(0) % k.size(0) == 0 && k.size(2) == q.size(2) && v.size(0) == k.size(0) &&
                  v.size(1) == k.size(1) && allowed.size(0) == q.size(0) && allowed.size(1) == q.size(1) &&
                  allowed.size(2) == k.size(1),
              "workbench cpu kernels: flash_attn_one_chunk needs q [N, T, D] float32, k [N / G, S, D] and v [N / G, "
              "S, Dv] float16 and allowed [N, T, S] bool, all contiguous; got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes(), ", ", allowed.sizes());
  // G query heads share each key-value head (grouped-query attention): q's row n reads k's and v's row n / G
  const int64_t n = q.size(0), tokens = q.size(1), d = q.size(2), slots = k.size(1), dv = v.size(2);
  const int64_t group = n / k.size(0);
  const float kq_scale = static_cast<float>(scale);
  torch::Tensor out = torch::empty({n, tokens, dv}, q.options());
  const float* qp = q.data_ptr<float>();
  const auto* kp = reinterpret_cast<const c10::Half*>(k.data_ptr<at::Half>());
  const auto* vp = reinterpret_cast<const c10::Half*>(v.data_ptr<at::Half>());
  const bool* ap = allowed.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const int64_t full = dv - dv % kF16Step;
  at::parallel_for(0, n * tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<c10::Half> q16(d), acc(dv);
    for (int64_t row = begin; row < end; ++row) {
      const int64_t kv_row = row / tokens / group;
      for (int64_t i = 0; i < d; ++i) q16[i] = c10::Half(qp[row * d + i]);
      std::fill(acc.begin(), acc.end(), c10::Half(0.0f));
      float best = -INFINITY, sum = 0.0f;
      for (int64_t key = 0; key < slots; ++key) {
        if (!ap[row * slots + key]) continue;
        const float s = dot_f16(q16.data(), kp + (kv_row * slots + key) * d, d) * kq_scale;
        float ms = 1.0f, vs = 1.0f;
        if (s > best) {  // a new maximum: what was accumulated scaled by exp(M_old - M), this key weighed by 1
          ms = expf_libm(best - s);
          best = s;
          scale_f16(acc.data(), full, dv, static_cast<float>(c10::Half(ms)), ms);
        } else {
          vs = expf_libm(s - best);
        }
        mad_f16(acc.data(), vp + (kv_row * slots + key) * dv, full, dv,
                static_cast<double>(static_cast<float>(c10::Half(vs))), vs);
        sum = static_cast<float>(static_cast<double>(sum) * ms + vs);
      }
      const float inverse = sum == 0.0f ? 0.0f : static_cast<float>(1.0 / static_cast<double>(sum));
      for (int64_t i = 0; i < dv; ++i) op[row * dv + i] = static_cast<float>(acc[i]) * inverse;
    }
  });
  return out;
}

// c + a @ b of batched float32 matrices, a [N, R, K], b [N, K, J], c [N, R, J], each output a chain of fused
// multiply-adds in k order, as ggml-cpu's simd_gemm computes them (llama.cpp's tiled flash attention: llama.cpp
// numerics reproduce it in kernels/llamacpp_ops.py).
torch::Tensor fma_chain(const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c) {
  check_floats(a, "a", 3);
  check_floats(b, "b", 3);
  check_floats(c, "c", 3);
  const int64_t n = a.size(0), rows = a.size(1), depth = a.size(2), cols = b.size(2);
  TORCH_CHECK(b.size(0) == n && b.size(1) == depth && c.size(0) == n && c.size(1) == rows && c.size(2) == cols,
              "workbench cpu kernels: fma_chain needs a [N, R, K], b [N, K, J], c [N, R, J], got ", a.sizes(), ", ",
              b.sizes(), ", ", c.sizes());
  torch::Tensor out = c.clone();
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n * rows, std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(depth * cols, 1)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* ar = ap + row * depth;
      const float* bm = bp + row / rows * depth * cols;
      float* o = op + row * cols;
      for (int64_t k = 0; k < depth; ++k) {
        const float av = ar[k];
        const float* br = bm + k * cols;
        for (int64_t j = 0; j < cols; ++j) {
          o[j] = std::fma(av, br[j], o[j]);
        }
      }
    }
  });
  return out;
}

// ggml-cpu's AVX-512 ggml_v_expf (ggml-cpu/vec.h) of one value: exp by range reduction and a degree-5 polynomial, each
// step one float32 operation or fused multiply-add, scaled by 2^n as _mm512_scalef_ps does.
__attribute__((optimize("fp-contract=off")))
inline float v_expf(float v) {
  const float r = 0x1.8p23f;
  const float z = std::fma(v, 0x1.715476p+0f, r);
  const float n = z - r;
  const float b = std::fma(-n, 0x1.7f7d1cp-20f, std::fma(-n, 0x1.62e4p-1f, v));
  const float u = b * b;
  const float j = std::fma(std::fma(std::fma(0x1.0e4020p-7f, b, 0x1.573e2ep-5f), u,
                                    std::fma(0x1.555e66p-3f, b, 0x1.fffdb6p-2f)),
                           u, std::fma(0x1.ffffecp-1f, b, 1.0f));
  if (std::isnan(n)) return n;
  if (std::fabs(n) > 192.0f) return n <= 0.0f ? 0.0f : INFINITY;
  return std::ldexp(j, static_cast<int>(n));
}

torch::Tensor ggml_expf(const torch::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "workbench cpu kernels: ggml_expf needs a contiguous float32 CPU tensor");
  torch::Tensor out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, x.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) op[i] = v_expf(xp[i]);
  });
  return out;
}

// llama.cpp numerics' glue between the matmuls, one call each where llamacpp_ops' torch formulas take 6 to 20 ops,
// with their bits: each step below is one of those formulas' operations, in their precision and order.

// ggml_compute_forward_rms_norm_f32 of x [T, d]: the squares (float32) summed in double, the mean rounded to
// float32, 1 / sqrt(mean + eps) (each correctly rounded), then (x * scale) * weight. Returns the scale [T, 1] and out.
__attribute__((optimize("fp-contract=off")))
std::tuple<torch::Tensor, torch::Tensor> llamacpp_rms_norm(const torch::Tensor& x, const torch::Tensor& weight,
                                                           double eps) {
  check_norm(x, weight);
  const int64_t rows = x.size(0), d = x.size(1);
  torch::Tensor scale = torch::empty({rows, 1}, x.options()), out = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *sp = scale.data_ptr<float>(), *op = out.data_ptr<float>();
  const float eps32 = static_cast<float>(eps);
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * d;
      double squares = 0.0;
      for (int64_t i = 0; i < d; ++i) squares += static_cast<double>(xr[i] * xr[i]);
      const float mean = static_cast<float>(squares / static_cast<double>(d));
      const float root = static_cast<float>(std::sqrt(static_cast<double>(mean + eps32)));
      const float s = static_cast<float>(1.0 / static_cast<double>(root));
      sp[t] = s;
      for (int64_t i = 0; i < d; ++i) op[t * d + i] = (xr[i] * s) * wp[i];
    }
  });
  return {scale, out};
}

// ggml_vec_swiglu_f32 of gate and up [T, d] (rows may be strided): x / (1 + ggml_v_expf(-x)) * g over the full groups
// of sixteen values, libm's expf (the float64 exp rounded to float32) past them; each quotient correctly rounded.
__attribute__((optimize("fp-contract=off")))
torch::Tensor llamacpp_swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  check_gate_up(gate, up, "llamacpp_swiglu");
  const int64_t rows = gate.size(0), d = gate.size(1), full = d - d % 16;
  torch::Tensor out = torch::empty({rows, d}, gate.options());
  const float *gp = gate.data_ptr<float>(), *up_p = up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(d, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = gp + t * gate.stride(0), *u = up_p + t * up.stride(0);
      for (int64_t i = 0; i < d; ++i) {
        const float e = i < full ? v_expf(0.0f - g[i]) : expf_libm(-g[i]);
        const float silu = static_cast<float>(static_cast<double>(g[i]) / static_cast<double>(1.0f + e));
        op[t * d + i] = silu * u[i];
      }
    }
  });
  return out;
}

// rotate_pairs of x [T, H, D] with cos and sin [T, 1, D] (each pair's cos at its first value, sin at its second):
// x0 cos - x1 sin and x0 sin + x1 cos, each output's second product rounded to float32 and its first fused into the
// sum (in double, then rounded), as the compiler's contraction of ggml's loop computes it.
__attribute__((optimize("fp-contract=off")))
torch::Tensor llamacpp_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                            bool interleaved) {
  check_rope(x, cos, sin);
  torch::Tensor out = torch::empty_like(x);
  const int64_t heads = x.size(1), d = x.size(2), half = d / 2, rows = x.size(0) * heads;
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 15) / d), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float *xr = xp + row * d, *c = cp + row / heads * d, *s = sp + row / heads * d;
      float* o = op + row * d;
      for (int64_t i = 0; i < half; ++i) {
        const int64_t first = interleaved ? 2 * i : i, second = interleaved ? 2 * i + 1 : i + half;
        const double x0 = xr[first];
        const float cf = c[first], sf = s[second];
        o[first] = static_cast<float>(x0 * cf + static_cast<double>(-(xr[second] * sf)));
        o[second] = static_cast<float>(x0 * sf + static_cast<double>(xr[second] * cf));
      }
    }
  });
  return out;
}

}  // namespace

// Registered as torch ops in a namespace named after the build (one per ISA, so several builds can be loaded at
// once): calls from Python and from torch.compile's graphs (C++ wrapper included) go through the dispatcher.
#define WORKBENCH_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define WORKBENCH_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

WORKBENCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // x @ dequantize(W).T from GGUF blocks for each W, side by side, fp32 accumulation
  m.def("linear_exact(Tensor x, Tensor[] packed, int[] ggml_types, int[] rows, int cols, int panel_min_batch) -> Tensor");
  // each W = packed[p] times its own rows of x, the results stacked (a token's experts in one call)
  m.def("linear_exact_segments(Tensor x, Tensor[] packed, int[] ggml_types, int rows, int cols, int[] x_first, "
        "int[] x_count, int panel_min_batch) -> Tensor");
  // x @ W.T with ggml-cpu's Q8 activation quantization and integer dots
  m.def("linear_llamacpp(Tensor x, Tensor[] packed, int ggml_type, int[] rows, int cols) -> Tensor");
  m.def("linear_llamacpp_segments(Tensor x, Tensor[] packed, int ggml_type, int rows, int cols, int[] x_first, "
        "int[] x_count) -> Tensor");
  // ggml-cpu's Q8_0 / Q8_1 / Q8_K blocks of x for a weight type
  m.def("quantize_activations(Tensor x, int ggml_type) -> Tensor");
  m.def("dequantize(Tensor packed, int ggml_type, int cols) -> Tensor");
  // {values, bytes, activation type} of a weight type as compiled in, from the format table's macros
  m.def("format_layout(int ggml_type) -> int[]", &format_layout);
  // RMSNorm's scale and output (after the residual sum), SwiGLU and the rope, for the runner's eager CPU forward
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("swiglu(Tensor gate, Tensor up) -> Tensor");
  // each row's index of its largest value, as torch.argmax(-1) picks it (greedy decoding)
  m.def("argmax_rows(Tensor x) -> Tensor");
  // each row's k largest values' softmax probabilities and ids (the logit lens)
  m.def("top_k_softmax(Tensor logits, int k) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  // the rope of q and k, the cache write and attention of a layer without hooks between them (eager forward)
  m.def("rope_attention(Tensor q, Tensor k, Tensor v, Tensor cos, Tensor sin, bool interleaved, Tensor? key_cache, "
        "Tensor? value_cache, int[] starts, float divisor, Tensor? blocked, Tensor? q_norm=None, Tensor? k_norm=None, "
        "float eps=0.0, int[] bounds=[]) -> Tensor");
  // a run of whole plain blocks with no hook inside or between them (eager forward): the last one's stream after
  // attention and its MLP's output
  m.def("blocks_exact(Tensor x, Tensor normalized, Tensor[] weights, int[] ggml_types, int[] rows, Tensor[] qkv_bias, "
        "Tensor[] qk_norm, Tensor[] attn_norms, Tensor[] mlp_norms, float eps, Tensor[] cos, Tensor[] sin, "
        "bool interleaved, Tensor[] key_caches, Tensor[] value_caches, int[] starts, float divisor, Tensor?[] blocked, "
        "int[] bounds, int panel_min_batch) -> (Tensor, Tensor)");
  // c + a @ b, each output a chain of float32 fused multiply-adds in order (llama.cpp numerics' attention)
  m.def("fma_chain(Tensor a, Tensor b, Tensor c) -> Tensor");
  // ggml-cpu's polynomial exp (ggml_v_expf) of each value
  m.def("ggml_expf(Tensor x) -> Tensor");
  // ggml-cpu's RMSNorm, SwiGLU and rope (llama.cpp numerics' glue)
  m.def("llamacpp_rms_norm(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("llamacpp_swiglu(Tensor gate, Tensor up) -> Tensor");
  m.def("llamacpp_rope(Tensor x, Tensor cos, Tensor sin, bool interleaved) -> Tensor");
  // ggml-cpu's flash attention for fewer than 64 query tokens, F16 keys, values and accumulator
  m.def("flash_attn_one_chunk(Tensor q, Tensor k, Tensor v, Tensor allowed, float scale) -> Tensor");
  // the outputs of a group of projections sharing x, each plus its LoRA term B (A x), side by side (few rows)
  m.def("lora_add(Tensor x, Tensor a, Tensor b_t, Tensor[] outs, int[] ranks, int parallel_work) -> Tensor");
}

WORKBENCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("linear_exact", &linear_exact);
  m.impl("linear_exact_segments", &linear_exact_segments);
  m.impl("linear_llamacpp", &linear_llamacpp);
  m.impl("linear_llamacpp_segments", &linear_llamacpp_segments);
  m.impl("quantize_activations", &quantize_activations);
  m.impl("dequantize", &dequantize);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("swiglu", &swiglu);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("top_k_softmax", &top_k_softmax);
  m.impl("rope", &rope);
  m.impl("rope_attention", &rope_attention);
  m.impl("blocks_exact", &blocks_exact);
  m.impl("fma_chain", &fma_chain);
  m.impl("ggml_expf", &ggml_expf);
  m.impl("llamacpp_rms_norm", &llamacpp_rms_norm);
  m.impl("llamacpp_swiglu", &llamacpp_swiglu);
  m.impl("llamacpp_rope", &llamacpp_rope);
  m.impl("flash_attn_one_chunk", &flash_attn_one_chunk);
  m.impl("lora_add", &lora_add);
}
