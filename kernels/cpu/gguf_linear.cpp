// y = x W^T for a weight kept in llama.cpp's GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the
// K-quants Q4_K, Q5_K, Q6_K).
//
// Decode on a CPU is bound by the bytes of weight it streams per step; keeping W quantized (4.5 to 8.5
// bits a weight instead of 32) is the point. W is a uint8 tensor [N, K / block * block_bytes], rows of
// blocks exactly as the file stores them (see kernels/torch_impl/gguf_quant.py for the formats).
//
// Few rows of x (decode batches): each output row n dequantizes W's row n block by block into registers
// (two 16-float vectors per block) and multiplies it into up to four rows of x at once; more rows of x take
// the row from a dequantized float buffer in L1/L2 instead. Many rows of x (prefill): a tile of W's rows is
// dequantized into x's dtype and multiplied by at::mm (oneDNN: AMX/AVX-512 BF16 where the CPU has them).
// Either way W is never dequantized whole. Accumulation is in float32.
//
// torch.ops.pagedserve.gguf_linear(x, weight, qtype, in_features) (schema in registration.cpp); qtype is
// the GGMLQuantizationType value.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "work_sharing.h"

namespace {

using vec16 = float __attribute__((vector_size(64)));
using vec8 = float __attribute__((vector_size(32)));
using vec4 = float __attribute__((vector_size(16)));
using u8x16 = uint8_t __attribute__((vector_size(16)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));

constexpr int64_t kBlock = 32;
// x with at least this many rows goes through tile dequantization + at::mm.
constexpr int64_t kGemmRows = 16;
// The GEMV loops prefetch W this many row groups ahead (measured: 2 groups doubles the speed of a
// matrix streamed from L3 over none, at a 3% cost when it sits in L2).
constexpr int64_t kPrefetchRows = 2;
// Below this many multiply-adds a call runs on the calling thread (waking the pool costs more).
constexpr int64_t kInlineWork = 1 << 16;
// A prefill tile of W (dequantized to x's dtype) fills at most this much of L2 (2 MiB a core on the machines
// measured) while at::mm reads it. Fewer, larger tiles matter: each at::mm call repacks x, and 4x larger
// tiles than 512 KiB measured 1.25-1.4x faster at 64 and 512 rows (bf16, one thread, weights from DRAM).
constexpr int64_t kTileBytes = 2 << 20;

enum QType : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

inline float f16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

inline float hsum(vec16 v) {
  const vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

#if defined(__AVX512F__)
// Bytes to floats through 32-bit integers (vpmovzxbd/vpmovsxbd + vcvtdq2ps); a direct conversion from
// 8-bit lanes is scalarised by GCC.
inline vec16 to_float(u8x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), vec16); }
// Signed bytes: flip the sign bit in the byte lanes, widen as unsigned, subtract 128 (GCC scalarises a
// direct int8 -> int32 conversion).
inline vec16 to_float_signed(u8x16 q) {
  return __builtin_convertvector(__builtin_convertvector(q ^ 0x80, i32x16) - 128, vec16);
}
#elif defined(__AVX2__)
// Without AVX-512 GCC widens only the low 8 bytes with vpmovzxbd and extracts the high 8 one by one (a
// 16x slower GEMV on AVX2 machines, measured): each half widened explicitly.
template <bool Signed>
inline vec16 bytes_to_float(u8x16 q) {
  __m128i b;
  std::memcpy(&b, &q, sizeof(b));
  const __m128i high = _mm_srli_si128(b, 8);
  const __m256 lo = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  const __m256 hi = _mm256_cvtepi32_ps(Signed ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high));
  vec16 v;
  std::memcpy(&v, &lo, sizeof(lo));
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof(lo), &hi, sizeof(hi));
  return v;
}
inline vec16 to_float(u8x16 q) { return bytes_to_float<false>(q); }
inline vec16 to_float_signed(u8x16 q) { return bytes_to_float<true>(q); }
#else
inline vec16 to_float(u8x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), vec16); }
inline vec16 to_float_signed(u8x16 q) {
  return __builtin_convertvector(__builtin_convertvector(q ^ 0x80, i32x16) - 128, vec16);
}
#endif
inline vec16 to_float(u32x16 q) { return __builtin_convertvector(__builtin_convertvector(q, i32x16), vec16); }

inline u8x16 load_u8x16(const uint8_t* p) {
  u8x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Q5: the fifth bits of elements [first, first + 16) from the little-endian word at p, as 0 or 16.
inline u32x16 high_bits(const uint8_t* p, uint32_t first) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const u32x16 shifts = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (((u32x16{} + qh) >> (shifts + first)) & 1u) << 4;
}

// One 32-element block of type QT -> elements 0-15 in lo, 16-31 in hi.
template <int64_t QT>
struct Block;

template <>
struct Block<Q4_0> {
  static constexpr int64_t kBytes = 18, kElements = 32;
  static inline void dequant(const uint8_t* b, int64_t /*sub-block: one per block*/, vec16& lo, vec16& hi) {
    const float d = f16(b);
    const u8x16 q = load_u8x16(b + 2);
    lo = (to_float(q & 0x0F) - 8.f) * d;
    hi = (to_float(q >> 4) - 8.f) * d;
  }
};

template <>
struct Block<Q4_1> {
  static constexpr int64_t kBytes = 20, kElements = 32;
  static inline void dequant(const uint8_t* b, int64_t /*sub-block: one per block*/, vec16& lo, vec16& hi) {
    const float d = f16(b), m = f16(b + 2);
    const u8x16 q = load_u8x16(b + 4);
    lo = to_float(q & 0x0F) * d + m;
    hi = to_float(q >> 4) * d + m;
  }
};

template <>
struct Block<Q5_0> {
  static constexpr int64_t kBytes = 22, kElements = 32;
  static inline void dequant(const uint8_t* b, int64_t /*sub-block: one per block*/, vec16& lo, vec16& hi) {
    const float d = f16(b);
    const u8x16 q = load_u8x16(b + 6);
    const u32x16 l = __builtin_convertvector(q & 0x0F, u32x16) | high_bits(b + 2, 0);
    const u32x16 h = __builtin_convertvector(q >> 4, u32x16) | high_bits(b + 2, 16);
    lo = (to_float(l) - 16.f) * d;
    hi = (to_float(h) - 16.f) * d;
  }
};

template <>
struct Block<Q5_1> {
  static constexpr int64_t kBytes = 24, kElements = 32;
  static inline void dequant(const uint8_t* b, int64_t /*sub-block: one per block*/, vec16& lo, vec16& hi) {
    const float d = f16(b), m = f16(b + 2);
    const u8x16 q = load_u8x16(b + 8);
    const u32x16 l = __builtin_convertvector(q & 0x0F, u32x16) | high_bits(b + 4, 0);
    const u32x16 h = __builtin_convertvector(q >> 4, u32x16) | high_bits(b + 4, 16);
    lo = to_float(l) * d + m;
    hi = to_float(h) * d + m;
  }
};

template <>
struct Block<Q8_0> {
  static constexpr int64_t kBytes = 34, kElements = 32;
  static inline void dequant(const uint8_t* b, int64_t /*sub-block: one per block*/, vec16& lo, vec16& hi) {
    const float d = f16(b);
    lo = to_float_signed(load_u8x16(b + 2)) * d;
    hi = to_float_signed(load_u8x16(b + 18)) * d;
  }
};

// K-quants: a 256-element super-block of eight 32-element sub-blocks; `i` picks the sub-block.
// Q4_K / Q5_K: sub-block i's 6-bit scale and min from the 12 packed bytes (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, int64_t i, float& sc, float& mn) {
  if (i < 4) {
    sc = static_cast<float>(s[i] & 63);
    mn = static_cast<float>(s[i + 4] & 63);
  } else {
    sc = static_cast<float>((s[i + 4] & 0xF) | ((s[i - 4] >> 6) << 4));
    mn = static_cast<float>((s[i + 4] >> 4) | ((s[i] >> 6) << 4));
  }
}

template <>
struct Block<Q4_K> {
  static constexpr int64_t kBytes = 144, kElements = 256;
  static inline void dequant(const uint8_t* b, int64_t i, vec16& lo, vec16& hi) {
    float sc, mn;
    scale_min_k4(b + 4, i, sc, mn);
    const float d = f16(b) * sc, m = f16(b + 2) * mn;
    const uint8_t* q = b + 16 + 32 * (i / 2);
    const int shift = static_cast<int>(4 * (i % 2));
    lo = to_float((load_u8x16(q) >> shift) & 0x0F) * d - m;
    hi = to_float((load_u8x16(q + 16) >> shift) & 0x0F) * d - m;
  }
};

template <>
struct Block<Q5_K> {
  static constexpr int64_t kBytes = 176, kElements = 256;
  static inline void dequant(const uint8_t* b, int64_t i, vec16& lo, vec16& hi) {
    float sc, mn;
    scale_min_k4(b + 4, i, sc, mn);
    const float d = f16(b) * sc, m = f16(b + 2) * mn;
    const int bit = static_cast<int>(i), shift = static_cast<int>(4 * (i % 2));
    const u8x16 h0 = ((load_u8x16(b + 16) >> bit) & 1) << 4, h1 = ((load_u8x16(b + 32) >> bit) & 1) << 4;
    const uint8_t* q = b + 48 + 32 * (i / 2);
    lo = to_float(((load_u8x16(q) >> shift) & 0x0F) | h0) * d - m;
    hi = to_float(((load_u8x16(q + 16) >> shift) & 0x0F) | h1) * d - m;
  }
};

template <>
struct Block<Q6_K> {
  static constexpr int64_t kBytes = 210, kElements = 256;
  static inline void dequant(const uint8_t* b, int64_t i, vec16& lo, vec16& hi) {
    const int64_t half = i / 4, k = i % 4;
    const uint8_t* ql = b + 64 * half + 32 * (k % 2);
    const uint8_t* qh = b + 128 + 32 * half;
    const int lshift = static_cast<int>(4 * (k / 2)), hshift = static_cast<int>(2 * k);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192) + 8 * half + 2 * k;  // one scale per 16
    const float d = f16(b + 208);
    const u8x16 q0 = ((load_u8x16(ql) >> lshift) & 0x0F) | (((load_u8x16(qh) >> hshift) & 3) << 4);
    const u8x16 q1 = ((load_u8x16(ql + 16) >> lshift) & 0x0F) | (((load_u8x16(qh + 16) >> hshift) & 3) << 4);
    lo = (to_float(q0) - 32.f) * (d * sc[0]);
    hi = (to_float(q1) - 32.f) * (d * sc[1]);
  }
};

// 32-element sub-block sb of a row (a block of the simple types, a slice of a K-quant super-block).
template <int64_t QT>
inline void sub_block(const uint8_t* row, int64_t sb, vec16& lo, vec16& hi) {
  constexpr int64_t per = Block<QT>::kElements / kBlock;
  Block<QT>::dequant(row + (sb / per) * Block<QT>::kBytes, sb % per, lo, hi);
}

// out[m, n] for MT (1-4) rows of x and NR rows of W from n, each block dequantized once into registers and
// multiplied into every row of x; NR independent rows keep the FMA units busy and share the loads of x.
template <int64_t QT, int MT, int NR>
inline void rows_fused(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n, float* out,
                       int64_t N) {
  const int64_t nb = K / kBlock;
  vec16 acc_lo[NR][MT] = {}, acc_hi[NR][MT] = {};
  for (int64_t b = 0; b < nb; ++b) {
    vec16 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      __builtin_prefetch(w + (n + r + kPrefetchRows * NR) * row_bytes + b * row_bytes / nb);  // see rows_factored
      sub_block<QT>(w + (n + r) * row_bytes, b, lo[r], hi[r]);
    }
    for (int m = 0; m < MT; ++m) {
      const vec16 x0 = load16(x + m * K + b * kBlock), x1 = load16(x + m * K + b * kBlock + 16);
      for (int r = 0; r < NR; ++r) {
        acc_lo[r][m] += x0 * lo[r];
        acc_hi[r][m] += x1 * hi[r];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * N + n + r] = hsum(acc_lo[r][m] + acc_hi[r][m]);
}

// W rows [n0, n1) for MT rows of x: NR rows at a time, then one by one.
template <int64_t QT, int MT>
void rows_range(const float* x, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, float* out,
                int64_t N) {
  constexpr int NR = MT == 1 ? 4 : 2;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) rows_fused<QT, MT, NR>(x, K, w, row_bytes, n, out, N);
  for (; n < n1; ++n) rows_fused<QT, MT, 1>(x, K, w, row_bytes, n, out, N);
}

// out[m, n] for MT rows of x against one dequantized row (float, K elements).
template <int MT>
inline void dot_rows(const float* x, int64_t K, const float* wrow, float* out, int64_t N) {
  vec16 a0[MT] = {}, a1[MT] = {};
  for (int64_t k = 0; k < K; k += kBlock) {
    const vec16 w0 = load16(wrow + k), w1 = load16(wrow + k + 16);
    for (int m = 0; m < MT; ++m) {
      a0[m] += load16(x + m * K + k) * w0;
      a1[m] += load16(x + m * K + k + 16) * w1;
    }
  }
  for (int m = 0; m < MT; ++m) out[m * N] = hsum(a0[m] + a1[m]);
}

template <int64_t QT>
inline void dequant_row(const uint8_t* row, int64_t K, float* dst) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    vec16 lo, hi;
    sub_block<QT>(row, b, lo, hi);
    store16(dst + b * kBlock, lo);
    store16(dst + b * kBlock + 16, hi);
  }
}

// The 32-element types factored: w = d * i + m per block, with i an integer (q, q - 8, q - 16, or Q8_0's
// signed byte) and m nonzero only for Q4_1 / Q5_1. Then x . w over a block is d * (x . i) + m * sum(x), so
// a block costs one scale multiply instead of dequantizing every element (two multiply-adds per 16), and
// sum(x) per block is computed once per call. The scales go through memory so the multiply broadcasts
// them from there (no shuffle-port broadcast per block): this loop is bound by that port otherwise.
// AVX-512 here; AVX2 (avx2::, below) on targets without it; elsewhere every type takes rows_range.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2 machines (no AVX-512): the factored loop on 8-float registers, for the 32-element types and the
// K-quants alike. A row is walked in 32-element sub-blocks (one per block of the simple types, eight per
// K-quant super-block), each as four registers of integers (elements 0-7, 8-15, 16-23, 24-31) with a
// scale per 16 elements (the same two for all but Q6_K) and a min per 32 (w = scale * i + min; zero for
// the types without one). The generic 16-float code (rows_range) compiles to twice the instructions there
// and spills its accumulators; this runs the decode GEMVs at the weights' streaming speed.
// AVX-512 builds take its K-quant loop too (their own paths cover the 32-element types only).
namespace avx2 {

template <int64_t QT>
struct Ints;

inline __m256i bytes8_u32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 nibbles_lo(__m256i q) { return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))); }
inline __m256 nibbles_hi(__m256i q) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)); }
// Q5: the fifth bits of elements [first, first + 8) from the little-endian word at p, as 0 or 16.
inline __m256i high_bits8(const uint8_t* p, int first) {
  uint32_t qh;
  std::memcpy(&qh, p, 4);
  const __m256i shifts = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(first));
  const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh)), shifts),
                                       _mm256_set1_epi32(1));
  return _mm256_slli_epi32(bit, 4);
}
// Q5's integers: (nibble | fifth bit) - offset for the eight elements from `first`.
inline __m256 five_bits(__m256i nibbles, const uint8_t* qh, int first, int offset) {
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(nibbles, high_bits8(qh, first)), _mm256_set1_epi32(offset)));
}
// The bits [shift, shift + width) of eight bytes, as 32-bit integers.
inline __m256i bit_field8(const uint8_t* p, int shift, int mask) {
  return _mm256_and_si256(_mm256_srl_epi32(bytes8_u32(p), _mm_cvtsi32_si128(shift)), _mm256_set1_epi32(mask));
}

// The simple types: one sub-block per block, d and m as float16 at its start.
template <bool Min>
inline void header_scales(const uint8_t* b, float* scale, float* min) {
  int32_t scales;  // d (and m) as float16
  std::memcpy(&scales, b, 4);
  alignas(16) float dm[4];
  _mm_store_ps(dm, _mm_cvtph_ps(_mm_cvtsi32_si128(scales)));
  scale[0] = scale[1] = dm[0];
  min[0] = Min ? dm[1] : 0.f;
}

// Q4_0 / Q4_1: 16 bytes of nibbles from byte Qs (low nibbles elements 0-15, high ones 16-31), minus Offset.
template <int64_t Qs, int Offset>
inline void q4_ints(const uint8_t* b, __m256 v[4]) {
  const __m256i q0 = bytes8_u32(b + Qs), q1 = bytes8_u32(b + Qs + 8);
  v[0] = nibbles_lo(q0);
  v[1] = nibbles_lo(q1);
  v[2] = nibbles_hi(q0);
  v[3] = nibbles_hi(q1);
  if constexpr (Offset != 0)
    for (int i = 0; i < 4; ++i) v[i] = _mm256_sub_ps(v[i], _mm256_set1_ps(static_cast<float>(Offset)));
}

// Q5_0 / Q5_1: the same nibbles from byte Qs with their fifth bits from the word at byte Qh, minus Offset.
template <int64_t Qs, int64_t Qh, int Offset>
inline void q5_ints(const uint8_t* b, __m256 v[4]) {
  const __m256i q0 = bytes8_u32(b + Qs), q1 = bytes8_u32(b + Qs + 8), mask = _mm256_set1_epi32(0x0F);
  v[0] = five_bits(_mm256_and_si256(q0, mask), b + Qh, 0, Offset);
  v[1] = five_bits(_mm256_and_si256(q1, mask), b + Qh, 8, Offset);
  v[2] = five_bits(_mm256_srli_epi32(q0, 4), b + Qh, 16, Offset);
  v[3] = five_bits(_mm256_srli_epi32(q1, 4), b + Qh, 24, Offset);
}

// The simple types: one sub-block per block (the sub-block index is unused).
template <>
struct Ints<Q4_0> {
  static constexpr bool kMin = false;
  static inline void scales(const uint8_t* b, float* scale, float* min) { header_scales<false>(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t, __m256 v[4]) { q4_ints<2, 8>(b, v); }
};

template <>
struct Ints<Q4_1> {
  static constexpr bool kMin = true;
  static inline void scales(const uint8_t* b, float* scale, float* min) { header_scales<true>(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t, __m256 v[4]) { q4_ints<4, 0>(b, v); }
};

template <>
struct Ints<Q5_0> {
  static constexpr bool kMin = false;
  static inline void scales(const uint8_t* b, float* scale, float* min) { header_scales<false>(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t, __m256 v[4]) { q5_ints<6, 2, 16>(b, v); }
};

template <>
struct Ints<Q5_1> {
  static constexpr bool kMin = true;
  static inline void scales(const uint8_t* b, float* scale, float* min) { header_scales<true>(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t, __m256 v[4]) { q5_ints<8, 4, 0>(b, v); }
};

template <>
struct Ints<Q8_0> {
  static constexpr bool kMin = false;
  static inline void scales(const uint8_t* b, float* scale, float* min) { header_scales<false>(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t, __m256 v[4]) {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * i))));
  }
};

// Q4_K / Q5_K: sub-block i's scale d * sc_i and min -dmin * mn_i (Block<Q4_K>: w = d * sc * q - dmin * mn).
inline void k4_scales(const uint8_t* b, float* scale, float* min) {
  const float d = f16(b), dmin = f16(b + 2);
  for (int64_t i = 0; i < 8; ++i) {
    float sc, mn;
    scale_min_k4(b + 4, i, sc, mn);
    scale[2 * i] = scale[2 * i + 1] = d * sc;
    min[i] = -(dmin * mn);
  }
}

template <>
struct Ints<Q4_K> {
  static constexpr bool kMin = true;
  static inline void scales(const uint8_t* b, float* scale, float* min) { k4_scales(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t i, __m256 v[4]) {
    const uint8_t* q = b + 16 + 32 * (i / 2);
    const int shift = static_cast<int>(4 * (i % 2));
    for (int j = 0; j < 4; ++j) v[j] = _mm256_cvtepi32_ps(bit_field8(q + 8 * j, shift, 0x0F));
  }
};

template <>
struct Ints<Q5_K> {
  static constexpr bool kMin = true;
  static inline void scales(const uint8_t* b, float* scale, float* min) { k4_scales(b, scale, min); }
  static inline void get(const uint8_t* b, int64_t i, __m256 v[4]) {
    const uint8_t* q = b + 48 + 32 * (i / 2);
    const int shift = static_cast<int>(4 * (i % 2)), bit = static_cast<int>(i);
    for (int j = 0; j < 4; ++j) {
      const __m256i high = _mm256_slli_epi32(bit_field8(b + 16 + 8 * j, bit, 1), 4);
      v[j] = _mm256_cvtepi32_ps(_mm256_or_si256(bit_field8(q + 8 * j, shift, 0x0F), high));
    }
  }
};

template <>
struct Ints<Q6_K> {
  static constexpr bool kMin = false;
  static inline void scales(const uint8_t* b, float* scale, float* min) {  // one scale per 16 elements
    const float d = f16(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int64_t i = 0; i < 16; ++i) scale[i] = d * sc[i];
    for (int64_t i = 0; i < 8; ++i) min[i] = 0.f;
  }
  static inline void get(const uint8_t* b, int64_t i, __m256 v[4]) {
    const int64_t half = i / 4, k = i % 4;
    const uint8_t* ql = b + 64 * half + 32 * (k % 2);
    const uint8_t* qh = b + 128 + 32 * half;
    const int lshift = static_cast<int>(4 * (k / 2)), hshift = static_cast<int>(2 * k);
    for (int j = 0; j < 4; ++j) {
      const __m256i q = _mm256_or_si256(bit_field8(ql + 8 * j, lshift, 0x0F),
                                        _mm256_slli_epi32(bit_field8(qh + 8 * j, hshift, 3), 4));
      v[j] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32)));
    }
  }
};

template <int64_t QT>
constexpr bool kFactored = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0 || QT == Q4_K ||
                           QT == Q5_K || QT == Q6_K;

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Q8_0 on AVX2: each block's integers scaled to weights (d * q, exact in float32) before the multiply-adds,
// rather than the block's products summed and then scaled: three more multiplies a block, but no chain of
// five dependent operations per block before the accumulator (the likely reason it is faster). On an AMD
// Zen 3 VM (noisy: interleaved runs) the default model's 49152 x 576 LM head (Q8_0) took 1.9-2.4 ms instead
// of 2.6-2.8 on two threads, and `bench latency` batch-1 decode 11.8-12.8 ms a token instead of 13.1-15.3.
// The 4-bit types gained nothing from it (Q4_0) or lost a third (Q4_1, whose min adds a multiply-add per
// eight weights): they stay factored.
// One row of x is the exception: there a Q8_0 block's scale costs one multiply-add either way, and the
// factored loop over one W row at a time (`kRowsInFlight`) with W prefetched eight rows ahead streams
// faster from memory: the default model's LM head on two threads (a standalone copy of both loops, the
// 30 MB weight from DRAM, interleaved): 1.50-1.74 ms factored against 1.91-2.39 scaled over four rows;
// scaled over one row, or factored over four, gained nothing. The op itself, three interleaved pairs on a
// noisy Zen 3 guest: 1.74-1.87 ms against 1.77-2.59 (one thread 3.0-3.3 against 3.4-4.9). The 4-bit types
// measured no better over one row (Q4_1: 1.74 against 1.56 ms on a 49152 x 576 matrix).
template <int64_t QT, int MT>
constexpr bool kScaledBlocks = QT == Q8_0 && MT > 1;

// W rows multiplied together by the AVX2 loops (each block's integers reused across MT rows of x), and
// how many W rows ahead they prefetch.
template <int64_t QT, int MT>
constexpr int kRowsInFlight = MT > 1 ? 2 : (QT == Q8_0 ? 1 : 4);
template <int64_t QT, int MT>
constexpr int64_t kAheadRows = QT == Q8_0 && MT == 1 ? 8 : kPrefetchRows * kRowsInFlight<QT, MT>;

// As the AVX-512 rows_factored: out[m, n .. n + NR) for MT rows of x, the block's integers taken once per
// W row and multiplied into every row of x (x read from memory by the multiply-adds: 16 registers);
// sums[m * nb + b] = sum of x row m over block b (types with a min). The 32-element types.
template <int64_t QT, int MT, int NR>
inline void rows_factored_blocks(const float* x, const float* sums, int64_t K, const uint8_t* w, int64_t row_bytes,
                                 int64_t n, float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kBytes = Block<QT>::kBytes;
  __m256 acc[NR][MT];
  float macc[NR][MT] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  alignas(16) float dm[NR][4];
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + (n + r) * row_bytes + b * kBytes;
      if ((b * kBytes) / 64 != ((b + 1) * kBytes) / 64)  // kAheadRows on (see the AVX-512 loop)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kAheadRows<QT, MT> * row_bytes), _MM_HINT_T0);
      int32_t scales;  // d (and m) as float16
      std::memcpy(&scales, blk, 4);
      const __m128 scales_f32 = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));
      __m256 v[4];
      Ints<QT>::get(blk, 0, v);
      __m256 d;
      if constexpr (kScaledBlocks<QT, MT>) {  // (d from the register: the form measured above)
        d = _mm256_broadcastss_ps(scales_f32);
        for (int i = 0; i < 4; ++i) v[i] = _mm256_mul_ps(v[i], d);
      } else {
        _mm_store_ps(dm[r], scales_f32);
        d = _mm256_broadcast_ss(&dm[r][0]);
      }
      for (int m = 0; m < MT; ++m) {
        const float* xb = x + m * K + b * kBlock;
        if constexpr (kScaledBlocks<QT, MT>) {
          acc[r][m] = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xb), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), acc[r][m]);
          acc[r][m] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), acc[r][m]);
        } else {
          __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
          t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
          t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
          t = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
          acc[r][m] = _mm256_fmadd_ps(t, d, acc[r][m]);
          if constexpr (Ints<QT>::kMin) macc[r][m] += dm[r][1] * sums[m * nb + b];
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * N + n + r] = hsum8(acc[r][m]) + macc[r][m];
}

// The K-quants: a super-block's scales and mins decoded once per W row, then its eight sub-blocks as above
// (Q6_K: a scale per 16 elements, so two partial sums per sub-block).
template <int64_t QT, int MT, int NR>
inline void rows_factored_superblocks(const float* x, const float* sums, int64_t K, const uint8_t* w,
                                      int64_t row_bytes, int64_t n, float* out, int64_t N) {
  constexpr int64_t kBytes = Block<QT>::kBytes, kSub = Block<QT>::kElements / kBlock;
  const int64_t nblocks = K / Block<QT>::kElements, nb = K / kBlock;
  __m256 acc[NR][MT];
  float macc[NR][MT] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  alignas(32) float scale[2 * kSub], min[kSub];
  for (int64_t b = 0; b < nblocks; ++b) {
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + (n + r) * row_bytes + b * kBytes;
      for (int64_t line = 0; line < kBytes; line += 64)  // the row group after next, a super-block at a time
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * NR * row_bytes + line), _MM_HINT_T0);
      Ints<QT>::scales(blk, scale, min);
      for (int64_t i = 0; i < kSub; ++i) {
        __m256 v[4];
        Ints<QT>::get(blk, i, v);
        const __m256 d0 = _mm256_broadcast_ss(&scale[2 * i]), d1 = _mm256_broadcast_ss(&scale[2 * i + 1]);
        for (int m = 0; m < MT; ++m) {
          const float* xb = x + m * K + (b * kSub + i) * kBlock;
          __m256 t0 = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
          t0 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t0);
          if constexpr (QT == Q6_K) {
            __m256 t1 = _mm256_mul_ps(v[2], _mm256_loadu_ps(xb + 16));
            t1 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t1);
            acc[r][m] = _mm256_fmadd_ps(t1, d1, _mm256_fmadd_ps(t0, d0, acc[r][m]));
          } else {
            t0 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t0);
            t0 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t0);
            acc[r][m] = _mm256_fmadd_ps(t0, d0, acc[r][m]);
          }
          if constexpr (Ints<QT>::kMin) macc[r][m] += min[i] * sums[m * nb + b * kSub + i];
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * N + n + r] = hsum8(acc[r][m]) + macc[r][m];
}

// Two loops, not one: the super-block loop run on the 32-element types (one sub-block per block) measured
// ~10% slower at 4 rows of x (its scales go through arrays shared by the row group; three paired runs).
template <int64_t QT, int MT, int NR>
inline void rows_factored(const float* x, const float* sums, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n,
                          float* out, int64_t N) {
  if constexpr (Block<QT>::kElements == kBlock) rows_factored_blocks<QT, MT, NR>(x, sums, K, w, row_bytes, n, out, N);
  else rows_factored_superblocks<QT, MT, NR>(x, sums, K, w, row_bytes, n, out, N);
}

template <int64_t QT, int MT>
void rows_range_factored(const float* x, const float* sums, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                         int64_t n1, float* out, int64_t N) {
  constexpr int NR = kRowsInFlight<QT, MT>;
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) rows_factored<QT, MT, NR>(x, sums, K, w, row_bytes, n, out, N);
  for (; n < n1; ++n) rows_factored<QT, MT, 1>(x, sums, K, w, row_bytes, n, out, N);
}
}  // namespace avx2
#define PAGEDSERVE_AVX2 1
#else
#define PAGEDSERVE_AVX2 0
#endif

#if defined(__AVX512F__)
template <int64_t QT>
struct Ints;

inline __m512 ints_lo(__m512i q) { return _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))); }
inline __m512 ints_hi(__m512i q) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)); }
inline __m512i bytes_u32(const uint8_t* p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m512i as_m512i(u32x16 v) {
  __m512i r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}

template <>
struct Ints<Q4_0> {
  static constexpr bool kMin = false;
  static inline void get(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m512i q = bytes_u32(b + 2);
    lo = _mm512_sub_ps(ints_lo(q), _mm512_set1_ps(8.f));
    hi = _mm512_sub_ps(ints_hi(q), _mm512_set1_ps(8.f));
  }
};

template <>
struct Ints<Q4_1> {
  static constexpr bool kMin = true;
  static inline void get(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m512i q = bytes_u32(b + 4);
    lo = ints_lo(q);
    hi = ints_hi(q);
  }
};

template <>
struct Ints<Q5_0> {
  static constexpr bool kMin = false;
  static inline void get(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m512i q = bytes_u32(b + 6), mask = _mm512_set1_epi32(0x0F), sixteen = _mm512_set1_epi32(16);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(_mm512_and_si512(q, mask), as_m512i(high_bits(b + 2, 0))), sixteen));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_or_si512(_mm512_srli_epi32(q, 4), as_m512i(high_bits(b + 2, 16))), sixteen));
  }
};

template <>
struct Ints<Q5_1> {
  static constexpr bool kMin = true;
  static inline void get(const uint8_t* b, __m512& lo, __m512& hi) {
    const __m512i q = bytes_u32(b + 8), mask = _mm512_set1_epi32(0x0F);
    lo = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_and_si512(q, mask), as_m512i(high_bits(b + 4, 0))));
    hi = _mm512_cvtepi32_ps(_mm512_or_si512(_mm512_srli_epi32(q, 4), as_m512i(high_bits(b + 4, 16))));
  }
};

template <>
struct Ints<Q8_0> {
  static constexpr bool kMin = false;
  static inline void get(const uint8_t* b, __m512& lo, __m512& hi) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18))));
  }
};

template <int64_t QT>
constexpr bool kFactored = QT == Q4_0 || QT == Q4_1 || QT == Q5_0 || QT == Q5_1 || QT == Q8_0;

// out[m, n .. n + NR) for MT rows of x; sums[m * nb + b] = sum of x row m over block b (types with a min).
template <int64_t QT, int MT, int NR>
inline void rows_factored(const float* x, const float* sums, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n,
                          float* out, int64_t N) {
  const int64_t nb = K / kBlock;
  constexpr int64_t kBytes = Block<QT>::kBytes;
  __m512 acc[NR][MT];
  float macc[NR][MT] = {};
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm512_setzero_ps();
  alignas(16) float dm[NR][4];
  for (int64_t b = 0; b < nb; ++b) {
    __m512 lo[NR], hi[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* blk = w + (n + r) * row_bytes + b * kBytes;
      // Each cache line of the row group after next is requested as this group reaches it: W streams
      // from L3/DRAM at decode, and these interleaved row streams outrun the hardware prefetcher.
      if ((b * kBytes) / 64 != ((b + 1) * kBytes) / 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchRows * NR * row_bytes), _MM_HINT_T0);
      int32_t scales;  // d (and m) as float16
      std::memcpy(&scales, blk, 4);
      _mm_store_ps(dm[r], _mm_cvtph_ps(_mm_cvtsi32_si128(scales)));
      Ints<QT>::get(blk, lo[r], hi[r]);
    }
    for (int m = 0; m < MT; ++m) {
      const __m512 x0 = _mm512_loadu_ps(x + m * K + b * kBlock), x1 = _mm512_loadu_ps(x + m * K + b * kBlock + 16);
      for (int r = 0; r < NR; ++r) {
        const __m512 t = _mm512_fmadd_ps(hi[r], x1, _mm512_mul_ps(lo[r], x0));
        acc[r][m] = _mm512_fmadd_ps(t, _mm512_set1_ps(dm[r][0]), acc[r][m]);
        if constexpr (Ints<QT>::kMin) macc[r][m] += dm[r][1] * sums[m * nb + b];
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MT; ++m) out[m * N + n + r] = _mm512_reduce_add_ps(acc[r][m]) + macc[r][m];
}

template <int64_t QT, int MT>
void rows_range_factored(const float* x, const float* sums, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                         int64_t n1, float* out, int64_t N) {
  constexpr int NR = MT == 1 ? 4 : 2;  // (the AVX2 Q8_0 one-row form is not measured here)
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) rows_factored<QT, MT, NR>(x, sums, K, w, row_bytes, n, out, N);
  for (; n < n1; ++n) rows_factored<QT, MT, 1>(x, sums, K, w, row_bytes, n, out, N);
}
#define PAGEDSERVE_FACTORED 1
#else
#define PAGEDSERVE_FACTORED 0
#endif

#if PAGEDSERVE_AVX2
// Whether avx2:: takes a decode batch of M rows of this type. AVX2 builds: every batch of every type, four
// rows of x at a time (W's range re-read from L1/L2 per group; the buffered path, dot_rows on 16-float
// vectors, spills there and measured 11x slower at 8 rows). AVX-512 builds: the K-quants up to four rows
// (their generic loop ran at half the speed; the 32-element types have the AVX-512 loop).
template <int64_t QT>
constexpr bool avx2_gemv(int64_t M) {
#if defined(__AVX512F__)
  return avx2::kFactored<QT> && Block<QT>::kElements > kBlock && M <= 4;
#else
  return avx2::kFactored<QT> && M < kGemmRows;
#endif
}
#endif

// Decode-sized batches: x float [M, K] (M < kGemmRows) -> out float [M, N].
template <int64_t QT>
void gemv(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t N, float* out) {
  const int64_t work = M * N * K;
  const int64_t grain = work < kInlineWork ? N : std::max<int64_t>(4, N / (8 * at::get_num_threads()));
  const int64_t nb = K / kBlock;
  std::vector<float> sums;  // per row of x and 32-element block, for the factored loops of types with a min
  auto block_sums = [&] {
    sums.resize(M * nb);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t b = 0; b < nb; ++b) {
        vec16 v = load16(x + m * K + b * kBlock) + load16(x + m * K + b * kBlock + 16);
        sums[m * nb + b] = hsum(v);
      }
  };
#if PAGEDSERVE_AVX2
  if constexpr (avx2::kFactored<QT>) {
    if (avx2_gemv<QT>(M) && avx2::Ints<QT>::kMin) block_sums();
  }
#endif
#if PAGEDSERVE_FACTORED && defined(__AVX512F__)
  if constexpr (kFactored<QT>) {
    if (M <= 4 && Ints<QT>::kMin) block_sums();
  }
#endif
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
#if PAGEDSERVE_AVX2
    if constexpr (avx2::kFactored<QT>) {
      if (avx2_gemv<QT>(M)) {  // up to four rows of x per pass over this range of W
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
          const float* xm = x + m0 * K;
          const float* sm = sums.empty() ? nullptr : sums.data() + m0 * nb;
          float* om = out + m0 * N;
          switch (std::min<int64_t>(4, M - m0)) {
            case 1: avx2::rows_range_factored<QT, 1>(xm, sm, K, w, row_bytes, n0, n1, om, N); break;
            case 2: avx2::rows_range_factored<QT, 2>(xm, sm, K, w, row_bytes, n0, n1, om, N); break;
            case 3: avx2::rows_range_factored<QT, 3>(xm, sm, K, w, row_bytes, n0, n1, om, N); break;
            default: avx2::rows_range_factored<QT, 4>(xm, sm, K, w, row_bytes, n0, n1, om, N); break;
          }
        }
        return;
      }
    }
#endif
#if PAGEDSERVE_FACTORED && defined(__AVX512F__)
    if constexpr (kFactored<QT>) {
      switch (M) {
        case 1: rows_range_factored<QT, 1>(x, sums.data(), K, w, row_bytes, n0, n1, out, N); return;
        case 2: rows_range_factored<QT, 2>(x, sums.data(), K, w, row_bytes, n0, n1, out, N); return;
        case 3: rows_range_factored<QT, 3>(x, sums.data(), K, w, row_bytes, n0, n1, out, N); return;
        case 4: rows_range_factored<QT, 4>(x, sums.data(), K, w, row_bytes, n0, n1, out, N); return;
        default: break;
      }
    }
#endif
    switch (M) {
      case 1: rows_range<QT, 1>(x, K, w, row_bytes, n0, n1, out, N); return;
      case 2: rows_range<QT, 2>(x, K, w, row_bytes, n0, n1, out, N); return;
      case 3: rows_range<QT, 3>(x, K, w, row_bytes, n0, n1, out, N); return;
      case 4: rows_range<QT, 4>(x, K, w, row_bytes, n0, n1, out, N); return;
      default: break;
    }
    std::vector<float> wrow(K);
    for (int64_t n = n0; n < n1; ++n) {
      dequant_row<QT>(w + n * row_bytes, K, wrow.data());
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) dot_rows<4>(x + m * K, K, wrow.data(), out + m * N + n, N);
      switch (M - m) {
        case 3: dot_rows<3>(x + m * K, K, wrow.data(), out + m * N + n, N); break;
        case 2: dot_rows<2>(x + m * K, K, wrow.data(), out + m * N + n, N); break;
        case 1: dot_rows<1>(x + m * K, K, wrow.data(), out + m * N + n, N); break;
        default: break;
      }
    }
  });
}

// Round-to-nearest-even float -> bfloat16 bits (weights are finite).
inline void store_bf16(c10::BFloat16* dst, vec16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof(v));
  bits = (bits + (0x7FFFu + ((bits >> 16) & 1u))) >> 16;
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  const u16x16 h = __builtin_convertvector(bits, u16x16);
  std::memcpy(dst, &h, sizeof(h));
}

inline void store_out(float* dst, vec16 v) { store16(dst, v); }
inline void store_out(c10::BFloat16* dst, vec16 v) { store_bf16(dst, v); }
inline void store_out(c10::Half* dst, vec16 v) {
  using f16x16 = _Float16 __attribute__((vector_size(32)));
  const f16x16 h = __builtin_convertvector(v, f16x16);
  std::memcpy(dst, &h, sizeof(h));
}

template <typename T>
void widen(const T* src, int64_t n, float* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Round each float to T (round to nearest even, as Tensor.to does).
template <typename T>
void narrow_to(const float* src, int64_t n, T* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

// One row of W (nb 32-element sub-blocks) dequantized into dst of type T.
template <int64_t QT, typename T>
inline void dequant_row_to(const uint8_t* row, int64_t nb, T* dst) {
#if PAGEDSERVE_FACTORED && defined(__AVX512BF16__)
  // The 32-element types into bf16 (the prefill tiles of a bf16 model): the block's integers from
  // Ints<QT>, its scales by one half-to-float conversion, and the 32 results rounded to bf16 by one
  // instruction (round to nearest even, as store_bf16; a dequantized weight is never a float32 subnormal,
  // which it would flush). The whole tile GEMM measured 1.1-1.2x faster at 64 and 512 rows.
  if constexpr (kFactored<QT> && std::is_same_v<T, c10::BFloat16>) {
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * Block<QT>::kBytes;
      int32_t scales;  // d (and m) as float16
      std::memcpy(&scales, blk, 4);
      const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128(scales));
      const __m512 d = _mm512_broadcastss_ps(dm);
      __m512 lo, hi;
      Ints<QT>::get(blk, lo, hi);
      if constexpr (Ints<QT>::kMin) {
        const __m512 m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
        lo = _mm512_fmadd_ps(lo, d, m);
        hi = _mm512_fmadd_ps(hi, d, m);
      } else {
        lo = _mm512_mul_ps(lo, d);
        hi = _mm512_mul_ps(hi, d);
      }
      const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
      std::memcpy(dst + b * kBlock, &packed, sizeof(packed));
    }
    return;
  }
#if PAGEDSERVE_AVX2
  // The K-quants into bf16 alike: a sub-block's integers and scales from avx2::Ints, 32 results rounded
  // by one instruction.
  if constexpr (avx2::kFactored<QT> && Block<QT>::kElements > kBlock && std::is_same_v<T, c10::BFloat16>) {
    constexpr int64_t kSub = Block<QT>::kElements / kBlock;
    alignas(32) float scale[2 * kSub], min[kSub];
    for (int64_t b = 0; b < nb / kSub; ++b) {
      const uint8_t* blk = row + b * Block<QT>::kBytes;
      avx2::Ints<QT>::scales(blk, scale, min);
      for (int64_t i = 0; i < kSub; ++i) {
        __m256 v[4];
        avx2::Ints<QT>::get(blk, i, v);
        const __m256 m = _mm256_broadcast_ss(&min[i]);
        for (int j = 0; j < 4; ++j) {
          const __m256 d = _mm256_broadcast_ss(&scale[2 * i + j / 2]);
          v[j] = avx2::Ints<QT>::kMin ? _mm256_fmadd_ps(v[j], d, m) : _mm256_mul_ps(v[j], d);
        }
        auto join = [](__m256 a, __m256 b) {  // AVX-512F only (no DQ): through the 64-bit lane insert
          return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(a)), _mm256_castps_pd(b), 1));
        };
        const __m512 lo = join(v[0], v[1]), hi = join(v[2], v[3]);
        const __m512bh packed = _mm512_cvtne2ps_pbh(hi, lo);
        std::memcpy(dst + (b * kSub + i) * kBlock, &packed, sizeof(packed));
      }
    }
    return;
  }
#endif
#endif
#if PAGEDSERVE_AVX2
  // Into float32 (the dtype AVX2 machines run) from avx2::Ints<QT> and the scales, the same multiply-add as
  // Block<QT>::dequant, eight floats a register: every type on AVX2 builds, the K-quants on AVX-512 ones.
#if defined(__AVX512F__)
  constexpr bool kAvx2Dequant = avx2::kFactored<QT> && Block<QT>::kElements > kBlock;
#else
  constexpr bool kAvx2Dequant = avx2::kFactored<QT>;
#endif
  if constexpr (kAvx2Dequant && std::is_same_v<T, float>) {
    using avx2::Ints;
    constexpr int64_t kSub = Block<QT>::kElements / kBlock;
    alignas(32) float scale[2 * kSub], min[kSub];
    for (int64_t b = 0; b < nb / kSub; ++b) {
      const uint8_t* blk = row + b * Block<QT>::kBytes;
      Ints<QT>::scales(blk, scale, min);
      for (int64_t i = 0; i < kSub; ++i) {
        __m256 v[4];
        Ints<QT>::get(blk, i, v);
        const __m256 m = _mm256_broadcast_ss(&min[i]);
        float* out = dst + (b * kSub + i) * kBlock;
        for (int j = 0; j < 4; ++j) {
          const __m256 d = _mm256_broadcast_ss(&scale[2 * i + j / 2]);
          _mm256_storeu_ps(out + 8 * j, Ints<QT>::kMin ? _mm256_fmadd_ps(v[j], d, m) : _mm256_mul_ps(v[j], d));
        }
      }
    }
    return;
  }
#endif
  for (int64_t b = 0; b < nb; ++b) {
    vec16 lo, hi;
    sub_block<QT>(row, b, lo, hi);
    store_out(dst + b * kBlock, lo);
    store_out(dst + b * kBlock + 16, hi);
  }
}

// Rows [n0, n1) of W dequantized into dst [n1 - n0, K] of type T.
template <int64_t QT, typename T>
void dequant_tile(const uint8_t* w, int64_t row_bytes, int64_t K, int64_t n0, int64_t n1, T* dst) {
  const int64_t nb = K / kBlock;
  at::parallel_for(n0, n1, std::max<int64_t>(1, 4096 / nb), [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      T* out = dst + (n - n0) * K;
      dequant_row_to<QT>(row, nb, out);
    }
  });
}

// This thread's tile buffer of at least `bytes` (64-byte aligned), kept for the thread's later calls: a
// fresh tile each call was a fresh allocation of up to kTileBytes, which the allocator may map anew (page
// faults) and whose first writes miss the caches (5-10% of the tile GEMM's time at 64 rows). One buffer
// per pool thread, so the threads of a call never share one.
inline void* thread_tile_buffer(size_t bytes) {
  struct Buffer {
    void* data = nullptr;
    size_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    std::free(buffer.data);
    buffer.size = (bytes + 63) / 64 * 64;
    buffer.data = std::aligned_alloc(64, buffer.size);
    TORCH_CHECK(buffer.data != nullptr, "gguf_linear (CPU op): out of memory for a ", bytes, "-byte weight tile");
  }
  return buffer.data;
}

// Prefill-sized batches: x [M, K] (its own dtype) -> out [M, N]. One parallel region: each thread takes
// its share of tiles of W's rows, dequantizes a tile into its own buffer and multiplies it alone (ATen ops
// run single-threaded inside at::parallel_for), so a call waits on its threads once, not once per tile:
// on a busy machine every wait can cost a descheduled thread's time slice. The pool's threads take the
// caller's thread-local state (inference mode: `out` is an inference tensor under torch.inference_mode).
template <int64_t QT, typename T>
void gemm(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t N, at::Tensor& out) {
  const int64_t K = x.size(1);
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t max_tile = std::max<int64_t>(16, kTileBytes / static_cast<int64_t>(sizeof(T)) / K);
  int64_t num_tiles = (N + max_tile - 1) / max_tile;
  num_tiles = std::min(N, (num_tiles + threads - 1) / threads * threads);  // an equal share per thread
  const int64_t tile = (N + num_tiles - 1) / num_tiles;
  num_tiles = (N + tile - 1) / tile;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, num_tiles, 1, [&](int64_t t0, int64_t t1) {
    const at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor buffer = at::from_blob(thread_tile_buffer(tile * K * sizeof(T)), {tile, K}, x.options());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * tile, n1 = std::min(N, n0 + tile);
      at::Tensor wt = buffer.narrow(0, 0, n1 - n0);
      dequant_tile<QT, T>(w, row_bytes, K, n0, n1, wt.data_ptr<T>());  // runs inline: already in parallel
      at::Tensor out_tile = out.narrow(1, n0, n1 - n0);
      at::mm_out(out_tile, x, wt.t());  // straight into out's columns (BLAS takes its row stride)
    }
  });
}

#if PAGEDSERVE_FACTORED && defined(__AVX512BF16__) && defined(__AMX_BF16__) && defined(__AMX_TILE__)
#define PAGEDSERVE_AMX 1
// bf16 activations on a CPU with AMX (Sapphire Rapids and later): the tile path above writes each
// dequantized tile of W to memory and at::mm packs it again into its own layout, so at decode batch
// sizes the GEMM cost 1.6-1.9x a matmul on weights already in bf16. Here W is dequantized once per
// strip of kAmxStripRows rows into a small thread-local buffer, which the AMX tiles read as it is:
// out^T = W . x^T, with W's rows as the A tiles (row-major, K contiguous, as dequantized) and x
// packed once per call into the B tiles' pair-interleaved layout (16 rows of x per tile). Each
// tile product accumulates in float32 over the whole K and is rounded to bf16 once, as at::mm does.
constexpr int64_t kAmxStripRows = 32;  // two 16-row A tiles of W
// Rows of x that take this path (bf16, one thread and two, the default model's shapes): from 5, where
// it beats the GEMV loops' generic case 1.8-2.2x (up to 4 rows those read W once for all rows and win),
// to 256, where the tile path's at::mm (better blocked for many rows) is as fast; 2-2.5x slower at 2048.
// At most 256 rows, the packed x (K * 512 bytes) stays in L2 across the strips.
constexpr int64_t kAmxMinRows = 5, kAmxMaxRows = 256;

// Linux lends the AMX tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); without it the first tile instruction raises SIGILL. Asked once per process.
bool amx_usable() {
  static const bool usable = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return usable;
}

// PAGEDSERVE_CPU_AMX=0 keeps bf16 GEMMs on the tile path (for A/B measurements, or a hypervisor whose
// AMX misbehaves); read once per process.
bool amx_enabled() {
  static const bool enabled = [] {
    const char* value = std::getenv("PAGEDSERVE_CPU_AMX");
    return value == nullptr || std::strcmp(value, "0") != 0;
  }();
  return enabled;
}

// Tiles 0-3: the four 16 x 16 float32 accumulators (2 strip halves x 2 blocks of x rows); 4-5: A (W);
// 6-7: B (x). Every tile is 16 rows of 64 bytes.
struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void amx_configure() {
  AmxConfig config;
  for (int t = 0; t < 8; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

// A 16 x 16 block of 32-bit elements transposed in registers: on return v[c] holds column c of the block
// given as rows v[0..15] (64 shuffles).
inline void transpose16x16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i + 1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // v[4i + j], lane L: element 4L + j of rows 4i .. 4i + 3
    v[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    v[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    v[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    v[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int j = 0; j < 4; ++j) {  // lanes regrouped: rows 0-7 (t[j], t[4 + j]) and 8-15 (t[8 + j], t[12 + j])
    t[j] = _mm512_shuffle_f32x4(v[j], v[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(v[j], v[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(v[8 + j], v[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(v[8 + j], v[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {  // whole columns j, 4 + j, 8 + j, 12 + j
    v[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    v[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    v[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    v[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// x [M, K] bf16 -> packed [blocks of 16 rows (zero rows past M; an even count)][K / 32][16 pairs][16 rows]
// of 32-bit (two bf16) elements: one B tile per (row block, 32 columns of K). Each B tile is the 16 x 16
// block of pairs transposed in registers (a pair at a time, stored 64 bytes apart, had the pack at ~3% of
// a batch-64 decode step, on the caller's thread: at decode batch sizes it runs inline).
void amx_pack_x(const c10::BFloat16* x, int64_t M, int64_t K, int64_t row_blocks, uint32_t* packed) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, row_blocks, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K)), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      for (int64_t kb = 0; kb < nb; ++kb) {
        __m512 v[16];
        for (int64_t r = 0; r < 16; ++r) {
          const int64_t m = b * 16 + r;
          v[r] = m < M ? _mm512_loadu_ps(x + m * K + kb * kBlock) : _mm512_setzero_ps();
        }
        transpose16x16(v);
        float* dst = reinterpret_cast<float*>(packed + (b * nb + kb) * 256);
        for (int64_t p = 0; p < 16; ++p) _mm512_storeu_ps(dst + p * 16, v[p]);
      }
    }
  });
}

// One 16 x 16 float32 accumulator (rows: 16 rows of W from n0, columns: 16 rows of x from m0), written
// transposed into out [M, N] bf16, rounded to nearest even; rows of W past N and of x past M left out.
inline void amx_store(const float* acc, int64_t m0, int64_t M, int64_t n0, int64_t N, c10::BFloat16* out) {
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  const int64_t n_valid = std::min<int64_t>(16, N - n0);
  if (n_valid <= 0) return;
  const __mmask16 keep = static_cast<__mmask16>((1u << n_valid) - 1u);
  for (int64_t r = 0; r < 16 && m0 + r < M; ++r) {
    const __m512 v = _mm512_i32gather_ps(column, acc + r, 4);  // acc[n][r] for n = 0..15
    _mm256_mask_storeu_epi16(out + (m0 + r) * N + n0, keep, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

template <int64_t QT>
void amx_gemm(const at::Tensor& x, const uint8_t* w, int64_t row_bytes, int64_t N, at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / kBlock;
  const int64_t row_blocks = (M + 31) / 32 * 2;  // blocks of 16 rows, an even count (tiles 6 and 7)
  std::vector<uint32_t> packed(static_cast<size_t>(row_blocks) * nb * 256);
  amx_pack_x(x.data_ptr<c10::BFloat16>(), M, K, row_blocks, packed.data());
  c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
  const int64_t strips = (N + kAmxStripRows - 1) / kAmxStripRows;
  // Strips are claimed one at a time (work_sharing.h): fixed halves left one thread waiting for the other.
  const int64_t threads = M * N * K < kInlineWork ? 1 : at::get_num_threads();
  pagedserve_cpu::run_claiming(strips, threads, [&](pagedserve_cpu::Claims& claims) {
    auto* strip = static_cast<c10::BFloat16*>(thread_tile_buffer(kAmxStripRows * K * sizeof(c10::BFloat16)));
    alignas(64) float acc[4][256];
    amx_configure();
    for (int64_t s = claims.next(); s >= 0; s = claims.next()) {
      const int64_t n0 = s * kAmxStripRows;
      for (int64_t r = 0; r < kAmxStripRows; ++r) {  // rows past N are zeros (their outputs are dropped)
        c10::BFloat16* dst = strip + r * K;
        if (n0 + r < N) dequant_row_to<QT>(w + (n0 + r) * row_bytes, nb, dst);
        else std::memset(dst, 0, K * sizeof(c10::BFloat16));
      }
      for (int64_t b = 0; b < row_blocks; b += 2) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const uint32_t* x_lo = packed.data() + b * nb * 256;
        const uint32_t* x_hi = x_lo + nb * 256;
        for (int64_t kb = 0; kb < nb; ++kb) {
          _tile_loadd(4, strip + kb * kBlock, K * sizeof(c10::BFloat16));
          _tile_loadd(5, strip + 16 * K + kb * kBlock, K * sizeof(c10::BFloat16));
          _tile_loadd(6, x_lo + kb * 256, 64);
          _tile_loadd(7, x_hi + kb * 256, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, acc[0], 64);
        _tile_stored(1, acc[1], 64);
        _tile_stored(2, acc[2], 64);
        _tile_stored(3, acc[3], 64);
        amx_store(acc[0], b * 16, M, n0, N, y);
        amx_store(acc[1], (b + 1) * 16, M, n0, N, y);
        amx_store(acc[2], b * 16, M, n0 + 16, N, y);
        amx_store(acc[3], (b + 1) * 16, M, n0 + 16, N, y);
      }
    }
    _tile_release();
  });
}
#else
#define PAGEDSERVE_AMX 0
#endif

template <int64_t QT>
at::Tensor run(const at::Tensor& x, const at::Tensor& weight, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  const uint8_t* w = weight.data_ptr<uint8_t>();
  const int64_t row_bytes = weight.size(1);
#if PAGEDSERVE_AMX
  if (M >= kAmxMinRows && M <= kAmxMaxRows && x.scalar_type() == at::kBFloat16 && amx_enabled() && amx_usable()) {
    at::Tensor out = at::empty({M, N}, x.options());
    amx_gemm<QT>(x, w, row_bytes, N, out);
    return out;
  }
#endif
  if (M >= kGemmRows) {
    at::Tensor out = at::empty({M, N}, x.options());
    switch (x.scalar_type()) {
      case at::kFloat: gemm<QT, float>(x, w, row_bytes, N, out); break;
      case at::kBFloat16: gemm<QT, c10::BFloat16>(x, w, row_bytes, N, out); break;
      case at::kHalf: gemm<QT, c10::Half>(x, w, row_bytes, N, out); break;
      default: TORCH_CHECK(false, "gguf_linear (CPU op): unsupported dtype ", x.scalar_type());
    }
    return out;
  }
  at::Tensor out = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    gemv<QT>(x.data_ptr<float>(), M, K, w, row_bytes, N, out.data_ptr<float>());
    return out;
  }
  // bf16 / fp16 activations: widened here and the result narrowed here, with no tensor ops around the
  // kernel (at batch 1 each would cost more than the conversion itself).
  std::vector<float> xf(M * K), yf(M * N);
  switch (x.scalar_type()) {
    case at::kBFloat16: widen(x.data_ptr<c10::BFloat16>(), M * K, xf.data()); break;
    case at::kHalf: widen(x.data_ptr<c10::Half>(), M * K, xf.data()); break;
    default: TORCH_CHECK(false, "gguf_linear (CPU op): unsupported dtype ", x.scalar_type());
  }
  gemv<QT>(xf.data(), M, K, w, row_bytes, N, yf.data());
  switch (x.scalar_type()) {
    case at::kBFloat16: narrow_to(yf.data(), M * N, out.data_ptr<c10::BFloat16>()); break;
    default: narrow_to(yf.data(), M * N, out.data_ptr<c10::Half>()); break;
  }
  return out;
}

// (bytes, elements) of one block of qtype; `op` names the caller in the error for any other type.
std::pair<int64_t, int64_t> block_shape(const char* op, int64_t qtype) {
  switch (qtype) {
#define PAGEDSERVE_SHAPE(T) \
  case T:                   \
    return {Block<T>::kBytes, Block<T>::kElements};
    PAGEDSERVE_SHAPE(Q4_0) PAGEDSERVE_SHAPE(Q4_1) PAGEDSERVE_SHAPE(Q5_0) PAGEDSERVE_SHAPE(Q5_1)
    PAGEDSERVE_SHAPE(Q8_0) PAGEDSERVE_SHAPE(Q4_K) PAGEDSERVE_SHAPE(Q5_K) PAGEDSERVE_SHAPE(Q6_K)
#undef PAGEDSERVE_SHAPE
    default: TORCH_CHECK(false, op, " (CPU op): unsupported GGML quant type ", qtype);
  }
  return {0, 0};
}

// An op's weight: uint8 rows [N, K / elements * bytes] of qtype's blocks, K (named `what`) whole blocks.
void check_weight(const char* op, const at::Tensor& weight, int64_t qtype, const char* what, int64_t K) {
  TORCH_CHECK(weight.device().is_cpu(), op, " (CPU op): tensors must be on the CPU");
  TORCH_CHECK(weight.scalar_type() == at::kByte && weight.dim() == 2, op, ": weight must be uint8 [N, bytes]");
  const auto [bytes, elements] = block_shape(op, qtype);
  TORCH_CHECK(K > 0 && K % elements == 0, op, ": ", what, " must be a multiple of ", elements);
  TORCH_CHECK(weight.size(1) == K / elements * bytes,
              op, ": weight rows of ", weight.size(1), " bytes do not hold ", K, " elements");
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  TORCH_CHECK(x.device().is_cpu(), "gguf_linear (CPU op): tensors must be on the CPU");
  check_weight("gguf_linear", weight, qtype, "in_features", in_features);
  TORCH_CHECK(x.size(-1) == in_features, "gguf_linear: x has ", x.size(-1), " features, the weight ", in_features);
  const at::Tensor w = weight.contiguous();
  const bool flat = x.dim() == 2 && x.is_contiguous();  // the usual case: no reshape or view around the call
  const at::Tensor x2 = flat ? x : x.reshape({-1, in_features}).contiguous();
  const int64_t N = w.size(0);
  at::Tensor out;
  switch (qtype) {
    case Q4_0: out = run<Q4_0>(x2, w, N); break;
    case Q4_1: out = run<Q4_1>(x2, w, N); break;
    case Q5_0: out = run<Q5_0>(x2, w, N); break;
    case Q5_1: out = run<Q5_1>(x2, w, N); break;
    case Q8_0: out = run<Q8_0>(x2, w, N); break;
    case Q4_K: out = run<Q4_K>(x2, w, N); break;
    case Q5_K: out = run<Q5_K>(x2, w, N); break;
    default: out = run<Q6_K>(x2, w, N); break;
  }
  if (flat) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return out.view(shape);
}

// Rows `ids` of W dequantized into out's dtype (an embedding lookup: a GGUF token_embd kept quantized):
// each row the values dequantize_gguf gives (dequant_tile's row code). The torch twin ran ~10 tensor ops
// a call (~50 us, ~1.5% of the default model's batch-1 decode step under py-spy).
template <int64_t QT, typename T>
void gather_rows(const int64_t* ids, int64_t n, const uint8_t* w, int64_t row_bytes, int64_t K, T* out) {
  const int64_t nb = K / kBlock;
  at::parallel_for(0, n, std::max<int64_t>(1, 16384 / K), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequant_row_to<QT>(w + ids[i] * row_bytes, nb, out + i * K);
  });
}

template <int64_t QT>
void gather(const at::Tensor& ids, const at::Tensor& w, at::Tensor& out) {
  const int64_t* rows = ids.data_ptr<int64_t>();
  const int64_t n = ids.numel(), K = out.size(-1), row_bytes = w.size(1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  switch (out.scalar_type()) {
    case at::kFloat: gather_rows<QT>(rows, n, wp, row_bytes, K, out.data_ptr<float>()); break;
    case at::kBFloat16: gather_rows<QT>(rows, n, wp, row_bytes, K, out.data_ptr<c10::BFloat16>()); break;
    case at::kHalf: gather_rows<QT>(rows, n, wp, row_bytes, K, out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "gguf_embedding (CPU op): unsupported dtype ", out.scalar_type());
  }
}

at::Tensor gguf_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t qtype, int64_t dim,
                          at::ScalarType dtype) {
  TORCH_CHECK(ids.device().is_cpu(), "gguf_embedding (CPU op): tensors must be on the CPU");
  TORCH_CHECK(!at::isFloatingType(ids.scalar_type()) && ids.scalar_type() != at::kBool,
              "gguf_embedding: ids must be integers, got ", ids.scalar_type());
  check_weight("gguf_embedding", weight, qtype, "dim", dim);
  const at::Tensor w = weight.contiguous();
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();
  const int64_t* rows = flat.data_ptr<int64_t>();
  for (int64_t i = 0, vocab = w.size(0); i < flat.numel(); ++i)
    TORCH_CHECK_INDEX(rows[i] >= 0 && rows[i] < vocab, "gguf_embedding: id ", rows[i], " is out of range for ", vocab,
                      " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(dim);
  at::Tensor out = at::empty(shape, weight.options().dtype(dtype));
  switch (qtype) {  // block_shape (in check_weight) has refused any other type
    case Q4_0: gather<Q4_0>(flat, w, out); break;
    case Q4_1: gather<Q4_1>(flat, w, out); break;
    case Q5_0: gather<Q5_0>(flat, w, out); break;
    case Q5_1: gather<Q5_1>(flat, w, out); break;
    case Q8_0: gather<Q8_0>(flat, w, out); break;
    case Q4_K: gather<Q4_K>(flat, w, out); break;
    case Q5_K: gather<Q5_K>(flat, w, out); break;
    default: gather<Q6_K>(flat, w, out); break;
  }
  return out;
}

}  // namespace

// The C++ entry points (ops.h): the functions registered below.
namespace pagedserve_cpu {

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, int64_t qtype, int64_t in_features) {
  return ::gguf_linear(x, weight, qtype, in_features);
}
}  // namespace pagedserve_cpu

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_embedding", &gguf_embedding);
}
