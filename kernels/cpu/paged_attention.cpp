// Paged decode attention for the CPU, reading K/V rows in place from the block-table cache.
//
// The pure-torch path gathers each sequence's blocks into a contiguous buffer before SDPA: a second pass over
// memory that the op's cost is made of. Here one work item is (sequence, context partition, range of KV
// heads). It walks its tokens in order (one token's K for all its KV heads is one contiguous row), scores
// each key against the G query heads grouped on its KV head (the key is read once for all G), then walks
// the values the same way, weighted by the softmax numerators. A sequence split into several partitions
// (split-K, for long contexts or too few sequences to occupy every thread) is merged by log-sum-exp.
// With AVX-512 (head sizes a multiple of 16) the item is walked block by block instead, keys scored 16 at a
// time and the outputs kept in registers (see "The AVX-512 path" below); elsewhere the generic vectors do it.
//
// torch.ops.pagedserve.paged_decode_attention (schema in registration.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "work_sharing.h"

namespace {

using pagedserve_cpu::exp16;
using pagedserve_cpu::load16;
using pagedserve_cpu::vec16;
using pagedserve_cpu::vec8;

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kAvx512Path = true;  // the AVX-512 path below is compiled in
#else
constexpr bool kAvx512Path = false;
#endif
constexpr int64_t kMinPartitionTokens = 256;
constexpr int64_t kMaxPartitionTokens = 2048;
constexpr int64_t kSplitBelowSeqs = 16;  // batches this small split contexts into several partitions
constexpr int64_t kPrefetchBytes = 2048;
// Below this many query-head x key x head-dim products a call runs on the calling thread: waking the
// pool costs more than the work (and on a busy machine a descheduled worker stalls the whole call).
constexpr int64_t kInlineWork = 1 << 17;
// The AVX-512 path does the same work in about half the time: twice the products for the same ~25 us of
// single-thread work (one sequence of ~450 tokens on the default model's shapes).
constexpr int64_t kInlineWorkAvx512 = 1 << 18;

using vec4 = float __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// Pairwise halving: a lane-by-lane loop would be a chain of 16 dependent scalar adds.
inline float hsum(vec16 v) {
  const vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// The generic path's vectors: one register wide. On AVX2 16-float vectors are register pairs, and the four
// accumulators of dot_heads with their operands spill (the generic path measured 4x slower).
using dot_vec = pagedserve_cpu::native_vec;
using pagedserve_cpu::load_native;
#if defined(__AVX512F__)
inline float hsum_dot(dot_vec v) { return hsum(v); }
#else
inline float hsum_dot(dot_vec v) {
  const vec4 h4 = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}
#endif
constexpr int64_t kDotLanes = sizeof(dot_vec) / sizeof(float);

// out[g] = q[g] . k for `count` (<= 4) query heads q[g] = q + g * head_size sharing one key row, the key
// widened to float as it is loaded; the independent accumulators hide the FMA latency.
template <typename T>
inline void dot_heads(const float* q, const T* k, int64_t head_size, int64_t count, float* out) {
  dot_vec a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t d = 0; d < head_size; d += kDotLanes) {
    const dot_vec kv = load_native(k + d);
    a0 += load_native(q + d) * kv;
    if (count > 1) a1 += load_native(q + head_size + d) * kv;
    if (count > 2) a2 += load_native(q + 2 * head_size + d) * kv;
    if (count > 3) a3 += load_native(q + 3 * head_size + d) * kv;
  }
  out[0] = hsum_dot(a0);
  if (count > 1) out[1] = hsum_dot(a1);
  if (count > 2) out[2] = hsum_dot(a2);
  if (count > 3) out[3] = hsum_dot(a3);
}

// acc[g] += p[g] * v for `group` query heads sharing one value row.
template <typename T>
inline void axpy_heads(const float* p, const T* v, int64_t head_size, int64_t group, float* acc) {
  for (int64_t d = 0; d < head_size; d += kDotLanes) {
    const dot_vec vv = load_native(v + d);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * head_size + d;
      const dot_vec updated = load_native(a) + p[g] * vv;
      std::memcpy(a, &updated, sizeof(dot_vec));
    }
  }
}

// Head sizes that are not a multiple of 16: widen the row to float, then plain loops.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Rows are requested line by line (see "The next block's rows" below).
constexpr int64_t kPrefetchStride = 64;

// Ask for a future token's K or V row (the item's KV heads) ahead of use: consecutive blocks of a
// sequence may sit far apart, which the hardware prefetcher cannot guess.
template <typename T>
inline void prefetch_row(const T* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  const int64_t bytes = elems * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < bytes; off += kPrefetchStride) __builtin_prefetch(p + off);
}

// Whether the AVX-512 path reads T's rows as [16 even, 16 odd] per 32 elements (bf16) rather than in order.
template <typename T>
constexpr bool kEvenOdd = std::is_same_v<T, c10::BFloat16>;

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
constexpr bool kDpbf16 = true;
#else
constexpr bool kDpbf16 = false;
#endif
// Whether the scores multiply bf16 keys by the bf16 query with vdpbf16ps (the query kept as bf16, in order).
template <typename T>
inline bool dpbf16_scores(int64_t head_size) { return kDpbf16 && kEvenOdd<T> && head_size % 32 == 0; }

// Each whole 32 elements of a row of n floats reordered as [16 even, 16 odd] (a tail of 16 stays).
inline void to_even_odd(float* x, int64_t n) {
  float tmp[32];
  for (int64_t d = 0; d + 32 <= n; d += 32) {
    for (int i = 0; i < 16; ++i) tmp[i] = x[d + 2 * i], tmp[16 + i] = x[d + 2 * i + 1];
    std::memcpy(x + d, tmp, sizeof(tmp));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// The AVX-512 path (head sizes a multiple of 16), per work item, block by block and within a block KV head
// by KV head: (1) the scores, 16 keys at a time: one query head's 16 dot products accumulate in 16 registers
// (the key row widened as it is loaded), then one transposing reduction tree turns them into a vector of 16
// scores (45 shuffles and adds instead of 16 horizontal sums); (2) the exponentials, 16 at a time; (3) the
// values: up to 6 query heads x 64 dimensions of output stay in registers over a block while each value row,
// widened once, is multiplied by the heads' broadcast probabilities. bf16 rows are widened 32 elements per
// load (widen32_even_odd). With AVX-512 BF16 and no AMX (AMD Zen 4 and the like) bf16 keys are scored
// with vdpbf16ps against the query kept as bf16 (exact: the query arrives in bf16; the products are exact in
// float32, only their summation order differs): 30 layers of a 64-sequence decode step with the cache in L3
// 15.0 / 18.8 -> 11.5 / 11.6 ms on a 2-core EPYC guest, 64 requests offline 262.6 / 306.4 -> 293.1 / 311.1
// out tok/s (interleaved). On the Sapphire Rapids VM measured (AMX machines) it issued at a quarter of the
// FMA rate and scored no faster, so builds with AMX keep the widening path.
// The next block's rows are requested line by line (not every other line, leaving the pair to the L2's
// adjacent-line prefetcher, which a host may have turned off): in paired runs on a loaded 2-core machine
// the two were within noise of each other. The scores pass also requests each block's values (and the first
// block of keys before it starts): the values pass that follows then reads them from cache instead of
// waiting on memory block by block (64 sequences x 225 tokens x 30 layers of the default model's shapes,
// bf16, random blocks: 39.3 against 44.1 ms, means of four interleaved runs on a 2-core EPYC guest).
// Those requests go out a KV head's rows at a time, between the dot products and the value products that
// use the rows before them, not as one burst of the whole next block at its start: a burst of ~200 lines
// holds every line-fill buffer, and the rows about to be used waited behind it (2026-11-29, Sapphire Rapids
// VM, the same 30 layers, 64 sequences of 64-383 tokens: 33.5 -> 23.5 ms on two threads, 58.7 -> 39.7 on
// one; means of interleaved runs).

// Lane t of the result is the sum of the 16 lanes of acc[t].
inline __m512 sum_each16(const __m512 (&acc)[16]) {
  // The tree leaves input j's sum at lane 4 * (j % 4) + j / 4, so it is fed acc in that transposed order.
  __m512 s[8], r[4];
  for (int i = 0; i < 8; ++i) {  // pairs of rows: each 128-bit lane keeps a half of one row's partials
    const __m512 x = acc[4 * ((2 * i) % 4) + (2 * i) / 4], y = acc[4 * ((2 * i + 1) % 4) + (2 * i + 1) / 4];
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  for (int i = 0; i < 4; ++i)  // one row per 128-bit lane, four partials each
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(r[0], r[1]), _mm512_unpackhi_ps(r[0], r[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(r[2], r[3]), _mm512_unpackhi_ps(r[2], r[3]));
  return _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x44), _mm512_shuffle_ps(t0, t1, 0xEE));
}

inline __m512 widen16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 widen16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// bf16 as floats, 32 at a time from one load: the even elements shifted up, the odd ones masked (two cheap
// integer operations instead of a widening shuffle per 16). Whatever multiplies them (the query in the
// scores, the accumulators of the values) is kept in the same [16 even, 16 odd] order per 32 elements.
inline void widen32_even_odd(const c10::BFloat16* p, __m512& even, __m512& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// q . row for one query head (float, in the row's element order) and one key row of head_size elements.
// D > 0: the head size as a constant (fully unrolled); 0: head_size.
template <int D, typename T>
inline __m512 dot_row(const T* k, const float* q, int64_t head_size) {
  const int64_t hs = D > 0 ? D : head_size;
  __m512 a = _mm512_setzero_ps();
  int64_t d = 0;
#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
  if constexpr (kEvenOdd<T>) {
    if (hs % 32 == 0) {  // q holds the query as bf16 (dpbf16_scores)
      const auto* qb = reinterpret_cast<const c10::BFloat16*>(q);
      for (; d < hs; d += 32)
        a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(k + d), (__m512bh)_mm512_loadu_si512(qb + d));
      return a;
    }
  }
#endif
  if constexpr (kEvenOdd<T>) {
    for (; d + 32 <= hs; d += 32) {
      __m512 even, odd;
      widen32_even_odd(k + d, even, odd);
      a = _mm512_fmadd_ps(even, _mm512_loadu_ps(q + d), a);
      a = _mm512_fmadd_ps(odd, _mm512_loadu_ps(q + d + 16), a);
    }
  }
  for (; d < hs; d += 16) a = _mm512_fmadd_ps(widen16(k + d), _mm512_loadu_ps(q + d), a);
  return a;
}

// Dot products of one query head with 16 key rows (row i at k + i * stride); lane i of the result is
// row i's. Row by row, one pointer advanced by the stride: 16 row addresses live at once would spill.
template <int D, typename T>
inline __m512 dots16(const T* k, int64_t stride, const float* q, int64_t head_size) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i, k += stride) acc[i] = dot_row<D>(k, q, head_size);
  return sum_each16(acc);
}

// Where the work item's rows are: token t's row (all KV heads) is row(t); the block holding t ends at
// block_end(t); prefetch_block_of(t) requests the whole block holding t (an item's first, before it starts).
template <typename T>
struct PagedRows {
  const T* cache;
  const int32_t* table;
  int64_t block_size, block_stride, token_stride;
  int64_t head_begin, row_elems;  // the item's KV heads within a token row: offset and extent in elements

  const T* row(int64_t t) const {
    return cache + table[t / block_size] * block_stride + (t % block_size) * token_stride + head_begin;
  }
  int64_t block_end(int64_t t, int64_t t1) const { return std::min(t1, t - t % block_size + block_size); }
  void prefetch_block_of(int64_t t) const {
    const T* first = cache + table[t / block_size] * block_stride + head_begin;
    for (int64_t i = 0; i < block_size; ++i) prefetch_row(first + i * token_stride, row_elems);
  }
};

// Scores of the item's query heads for its tokens [t0, t1): scores[h * stride + j] for token t0 + j and the
// item's h-th query head (KV head h / group at kv_stride elements into a row). Keys are taken 16 at a time
// within a block, every KV head of a block before the next block; a shorter run (a partial block, or blocks
// under 16 tokens) is first copied into a zero-padded tile. `values`: the same tokens' V rows, only prefetched.
template <int D, typename T>
void key_scores(const PagedRows<T>& rows, const PagedRows<T>& values, int64_t kv_heads, int64_t kv_stride,
                int64_t t0, int64_t t1, const float* q, int64_t group, int64_t head_size, float scale,
                float* scores, int64_t stride, T* tile) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  const int64_t row_bytes = head_size * static_cast<int64_t>(sizeof(T));
  if (t0 < t1) rows.prefetch_block_of(t0);
  for (int64_t t = t0; t < t1;) {
    const int64_t block_end = rows.block_end(t, t1);
    const T* next_keys = block_end < t1 ? rows.row(block_end) : nullptr;  // the next block's first row
    for (; t < block_end;) {
      const int64_t m = std::min<int64_t>(16, block_end - t);
      const __mmask16 mask = static_cast<__mmask16>((1u << m) - 1);
      const T* base = rows.row(t);
      const T* vals = values.row(t);
      const int64_t first = t % rows.block_size;  // these keys' first row within their block
      for (int64_t kh = 0; kh < kv_heads; ++kh) {
        // This KV head's rows of the next block's keys and of these tokens' values, requested before its
        // dot products (see "The next block's rows" above).
        for (int64_t i = 0; i < m; ++i) {
          if (next_keys != nullptr) prefetch_row(next_keys + (first + i) * rows.token_stride + kh * kv_stride, head_size);
          prefetch_row(vals + i * rows.token_stride + kh * kv_stride, head_size);
        }
        const T* keys = base + kh * kv_stride;
        int64_t key_stride = rows.token_stride;
        if (m < 16) {
          for (int64_t i = 0; i < m; ++i) std::memcpy(tile + i * head_size, keys + i * key_stride, row_bytes);
          std::memset(static_cast<void*>(tile + m * head_size), 0, (16 - m) * row_bytes);
          keys = tile;
          key_stride = head_size;
        }
        for (int64_t g = kh * group; g < (kh + 1) * group; ++g) {
          const __m512 dots = dots16<D>(keys, key_stride, q + g * head_size, head_size);
          _mm512_mask_storeu_ps(scores + g * stride + (t - t0), mask, _mm512_mul_ps(dots, scale_v));
        }
      }
      t += m;
    }
  }
}

// acc[g * head_size + v * 16 ...] += sum over n tokens (rows `token_stride` apart) of p[g * stride + j] *
// row_j[v * 16 ...], for NH query heads and NV 16-wide slices of the head dimension: the NH x NV
// accumulators stay in registers over the run. `ahead` (or null): the same slices of the next block's rows,
// requested one row per row used.
template <typename T, int NH, int NV>
void value_tile(const T* row, int64_t token_stride, int64_t n, const float* p, int64_t stride, float* acc,
                int64_t head_size, const T* ahead) {
  __m512 a[NH][NV];
  for (int g = 0; g < NH; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = _mm512_loadu_ps(acc + g * head_size + v * 16);
  for (int64_t j = 0; j < n; ++j, row += token_stride) {
    if (ahead != nullptr) prefetch_row(ahead + j * token_stride, NV * 16);
    __m512 x[NV];
    if constexpr (kEvenOdd<T> && NV % 2 == 0) {  // the accumulators hold each 32 dimensions as [even, odd]
      for (int v = 0; v < NV; v += 2) widen32_even_odd(row + v * 16, x[v], x[v + 1]);
    } else {
      for (int v = 0; v < NV; ++v) x[v] = widen16(row + v * 16);
    }
    for (int g = 0; g < NH; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * stride + j]);
      for (int v = 0; v < NV; ++v) a[g][v] = _mm512_fmadd_ps(pg, x[v], a[g][v]);
    }
  }
  for (int g = 0; g < NH; ++g)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + g * head_size + v * 16, a[g][v]);
}

template <typename T, int NV>
void value_tile_heads(int64_t nh, const T* row, int64_t token_stride, int64_t n, const float* p, int64_t stride,
                      float* acc, int64_t head_size, const T* ahead) {
  switch (nh) {
    case 1: value_tile<T, 1, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
    case 2: value_tile<T, 2, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
    case 3: value_tile<T, 3, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
    case 4: value_tile<T, 4, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
    case 5: value_tile<T, 5, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
    default: value_tile<T, 6, NV>(row, token_stride, n, p, stride, acc, head_size, ahead); break;
  }
}

// The probability-weighted values of the item's query heads, added into acc [heads, head_size]: block by
// block, every KV head of a block before the next block, in tiles of up to 6 query heads x 64 dimensions
// (24 accumulator registers) that stay in registers over the block. The first tile of a KV head's query
// heads requests the next block's rows of that head as it goes.
template <typename T>
void weighted_values(const PagedRows<T>& rows, int64_t kv_heads, int64_t kv_stride, int64_t t0, int64_t t1,
                     const float* probs, int64_t stride, int64_t group, int64_t head_size, float* acc) {
  for (int64_t t = t0; t < t1;) {
    const int64_t block_end = rows.block_end(t, t1), n = block_end - t;
    const T* next = block_end < t1 ? rows.row(block_end) : nullptr;
    const T* base = rows.row(t);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      for (int64_t g = kh * group; g < (kh + 1) * group; g += 6) {
        const int64_t nh = std::min<int64_t>(6, (kh + 1) * group - g);
        const float* p = probs + g * stride + (t - t0);
        for (int64_t d = 0; d < head_size;) {
          const T* row = base + kh * kv_stride + d;
          const T* ahead = next != nullptr && g == kh * group ? next + kh * kv_stride + d : nullptr;
          float* a = acc + g * head_size + d;
          const int64_t left = (head_size - d) / 16;
          if (left >= 4) {
            value_tile_heads<T, 4>(nh, row, rows.token_stride, n, p, stride, a, head_size, ahead);
            d += 64;
          } else if (left >= 2) {
            value_tile_heads<T, 2>(nh, row, rows.token_stride, n, p, stride, a, head_size, ahead);
            d += 32;
          } else {
            value_tile_heads<T, 1>(nh, row, rows.token_stride, n, p, stride, a, head_size, ahead);
            d += 16;
          }
        }
      }
    }
    t = block_end;
  }
}
// bf16 values are accumulated with each 32 dimensions as [16 even, 16 odd] (value_tile); back into order.
inline void interleave_even_odd(float* acc, int64_t heads, int64_t head_size) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t d = h * head_size; d + 32 <= (h + 1) * head_size; d += 32) {
      const __m512 even = _mm512_loadu_ps(acc + d), odd = _mm512_loadu_ps(acc + d + 16);
      const __m512 lo = _mm512_unpacklo_ps(even, odd), hi = _mm512_unpackhi_ps(even, odd);
      _mm512_storeu_ps(acc + d, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(acc + d + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
}
#endif

// This thread's scratch buffer of at least n floats (contents undefined), kept for later calls.
inline float* thread_scratch(int64_t n) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

// One unit of parallel work: a context partition of one sequence, for a contiguous range of KV heads.
// A sequence in one partition writes its output directly (`partial` < 0); the partitions of a split
// sequence leave unnormalised partials in slot `partial`, merged afterwards.
struct WorkItem {
  int64_t seq, token_begin, token_end, kv_head_begin, kv_head_end, partial;
};

struct WorkPlan {
  std::vector<WorkItem> items;
  int64_t num_partials = 0;
  int64_t max_tokens = 0;  // longest partition: the per-thread score buffer size
};

// Splitting a context costs a partial buffer and a merge, so it is done only when needed: to bound the
// score buffer (kMaxPartitionTokens) or, in a batch of few sequences, to have enough pieces for the
// threads (at least kMinPartitionTokens each). Too few items even then: the KV heads are split as well.
//
// The partitioning (which alone changes the arithmetic) depends on the batch, never on the thread count,
// so a batch gives bitwise the same result however many threads run it.
WorkPlan plan_work(const int32_t* lens, int64_t num_seqs, int64_t num_kv_heads, int64_t sliding_window) {
  int64_t partition = kMaxPartitionTokens;
  if (num_seqs < kSplitBelowSeqs) {
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total += lens[s];
    partition = std::clamp<int64_t>((total + kSplitBelowSeqs - 1) / kSplitBelowSeqs, kMinPartitionTokens,
                                    kMaxPartitionTokens);
  }
  const int64_t wanted = 4 * static_cast<int64_t>(at::get_num_threads());
  WorkPlan plan;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = lens[s];
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    const int64_t parts = std::max<int64_t>(1, (len - start + partition - 1) / partition);
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t t0 = start + p * partition, t1 = std::min<int64_t>(len, t0 + partition);
      plan.items.push_back({s, t0, t1, 0, num_kv_heads, parts == 1 ? -1 : plan.num_partials++});
      plan.max_tokens = std::max(plan.max_tokens, t1 - t0);
    }
  }
  int64_t head_chunks = 1;
  while (static_cast<int64_t>(plan.items.size()) * head_chunks < wanted && num_kv_heads % (2 * head_chunks) == 0)
    head_chunks *= 2;
  if (head_chunks > 1) {
    std::vector<WorkItem> split;
    split.reserve(plan.items.size() * head_chunks);
    const int64_t per_chunk = num_kv_heads / head_chunks;
    for (const WorkItem& it : plan.items)
      for (int64_t c = 0; c < head_chunks; ++c)
        split.push_back({it.seq, it.token_begin, it.token_end, c * per_chunk, (c + 1) * per_chunk, it.partial});
    plan.items = std::move(split);
  }
  return plan;
}

// An item's cost: the keys and values it reads (a fixed cost per item is small beside a context's).
inline int64_t item_work(const WorkItem& it) {
  return (it.token_end - it.token_begin) * (it.kv_head_end - it.kv_head_begin);
}

// The items in the order they are claimed: the most work first, so that the last claims, which decide how
// long a thread waits for the other at the end, are the smallest.
std::vector<int64_t> claim_order(const std::vector<WorkItem>& items) {
  std::vector<int64_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return item_work(items[a]) > item_work(items[b]); });
  return order;
}

template <typename T>
void decode_kernel(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                   int64_t sliding_window, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_size = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t table_stride = block_tables.stride(0);
  const int64_t cache_block_stride = key_cache.stride(0), cache_token_stride = key_cache.stride(1);
  const int64_t cache_head_stride = key_cache.stride(2);
  const int64_t q_seq_stride = query.stride(0), q_head_stride = query.stride(1);

  const T* q_data = query.data_ptr<T>();
  const T* k_data = key_cache.data_ptr<T>();
  const T* v_data = value_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  T* out_data = out.data_ptr<T>();
  const float scale_f = static_cast<float>(scale);

  const WorkPlan plan = plan_work(lens, num_seqs, num_kv_heads, sliding_window);
  const std::vector<WorkItem>& items = plan.items;
  const int64_t num_items = static_cast<int64_t>(items.size());
  // Per partial slot and query head: the unnormalised output, its score maximum and its exp-sum.
  std::vector<float> partial_acc(plan.num_partials * num_heads * head_size);
  std::vector<float> partial_max(plan.num_partials * num_heads), partial_sum(plan.num_partials * num_heads);

  const bool vectorised = head_size % kLanes == 0;
  const bool fast = kAvx512Path && vectorised;  // the AVX-512 path (else the generic vectors below)
  int64_t work = 0;
  for (const WorkItem& it : items) work += item_work(it);
  const bool run_inline = work * group * head_size < (fast ? kInlineWorkAvx512 : kInlineWork);
  const std::vector<int64_t> order = claim_order(items);
  pagedserve_cpu::run_claiming(num_items, run_inline ? 1 : at::get_num_threads(), [&](pagedserve_cpu::Claims& claims) {
    // Per-thread scratch, reused across calls (a call allocating seven buffers costs more than a short
    // context's arithmetic): the query widened to float, a row widened to float (generic path), the
    // scores, the accumulator of items that write their output directly (partials have their own slots),
    // the exp-sum per head, one token's probabilities, and (fast path) a zero-padded tile of 16 keys.
    const int64_t score_elems = num_heads * round_up(plan.max_tokens, kLanes);
    const int64_t tile_floats = fast ? (16 * head_size * static_cast<int64_t>(sizeof(T)) + 3) / 4 : 0;
    float* q_f = thread_scratch(2 * num_heads * head_size + head_size + score_elems + num_heads + group + tile_floats);
    float* direct_acc = q_f + num_heads * head_size;
    float* row = direct_acc + num_heads * head_size;
    float* scores = row + head_size;
    float* sum_of = scores + score_elems;
    float* probs = sum_of + num_heads;
    T* tile = reinterpret_cast<T*>(probs + group);
    for (int64_t claim = claims.next(); claim >= 0; claim = claims.next()) {
      const WorkItem& it = items[order[claim]];
      const int64_t t0 = it.token_begin, t1 = it.token_end, n = t1 - t0;
      const int64_t kv_begin = it.kv_head_begin, kv_end = it.kv_head_end;
      const int64_t h_begin = kv_begin * group, h_end = kv_end * group;
      const int64_t row_offset = kv_begin * cache_head_stride;
      const int64_t row_elems = (kv_end - kv_begin) * cache_head_stride;
      const int64_t stride = round_up(plan.max_tokens, kLanes);  // scores row of one head
      // Rows are requested about kPrefetchBytes ahead of use (at least one token).
      const int64_t prefetch_tokens = std::max<int64_t>(1, kPrefetchBytes / (row_elems * static_cast<int64_t>(sizeof(T))));
      const int32_t* table = tables + it.seq * table_stride;
      for (int64_t h = h_begin; h < h_end; ++h) {
        const T* src = q_data + it.seq * q_seq_stride + h * q_head_stride;
        float* qh = q_f + h * head_size;
        if (fast && dpbf16_scores<T>(head_size)) {  // the query as it came, bf16 (exact), for vdpbf16ps
          std::memcpy(static_cast<void*>(qh), src, head_size * sizeof(T));
          continue;
        }
        to_float(src, qh, head_size);
        if (fast) {  // the scores are scaled after the dot products, the query read in the keys' order
          if (kEvenOdd<T>) to_even_odd(qh, head_size);
        } else {
          for (int64_t d = 0; d < head_size; ++d) qh[d] *= scale_f;
        }
      }
      // Visit the item's tokens block by block: fn(j, row) with j the token's index in the partition and
      // row its K or V for the item's KV heads (contiguous per head, heads cache_head_stride apart).
      auto for_each_token = [&](const T* cache, auto&& fn) {
        auto row_of = [&](int64_t t) {
          return cache + table[t / block_size] * cache_block_stride + (t % block_size) * cache_token_stride + row_offset;
        };
        for (int64_t t = t0; t < std::min(t1, t0 + prefetch_tokens); ++t) prefetch_row(row_of(t), row_elems);
        for (int64_t t = t0; t < t1;) {
          const int64_t off = t % block_size, stop = std::min(t1, t - off + block_size);
          const T* row = row_of(t);
          for (; t < stop; ++t, row += cache_token_stride) {
            if (t + prefetch_tokens < t1) prefetch_row(row_of(t + prefetch_tokens), row_elems);
            fn(t - t0, row);
          }
        }
      };
#if defined(__AVX512F__) && defined(__AVX512BW__)
      auto fast_rows = [&](const T* cache) {
        return PagedRows<T>{cache, table, block_size, cache_block_stride, cache_token_stride, row_offset, row_elems};
      };
#endif
      // Scores: each key row read once for the G query heads grouped on its KV head.
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (fast) {
        auto scores_with = [&](auto head_size_constant) {
          key_scores<decltype(head_size_constant)::value>(
              fast_rows(k_data), fast_rows(v_data), kv_end - kv_begin, cache_head_stride, t0, t1,
              q_f + h_begin * head_size, group, head_size, scale_f, scores + h_begin * stride, stride, tile);
        };
        if (head_size == 64) scores_with(std::integral_constant<int, 64>{});
        else if (head_size == 128) scores_with(std::integral_constant<int, 128>{});
        else scores_with(std::integral_constant<int, 0>{});
      }
#endif
      if (!fast) for_each_token(k_data, [&](int64_t j, const T* krow) {
        for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
          const T* k = krow + (kh - kv_begin) * cache_head_stride;
          for (int64_t g = 0; g < group; g += 4) {
            const int64_t h = kh * group + g, count = std::min<int64_t>(4, group - g);
            float dots[4];
            if (vectorised) {
              dot_heads(q_f + h * head_size, k, head_size, count, dots);
            } else {
              to_float(k, row, head_size);
              for (int64_t c = 0; c < count; ++c) dots[c] = dot(q_f + (h + c) * head_size, row, head_size);
            }
            for (int64_t c = 0; c < count; ++c) scores[(h + c) * stride + j] = dots[c];
          }
        }
      });
      float* acc = it.partial >= 0 ? partial_acc.data() + it.partial * num_heads * head_size : direct_acc;
      for (int64_t h = h_begin; h < h_end; ++h) {
        float* sc = scores + h * stride;
        // The row is padded to whole vectors with -inf, whose exp is 0: every score takes the same path.
        std::fill(sc + n, sc + round_up(n, kLanes), -std::numeric_limits<float>::infinity());
        vec16 maxes = vec16{} - std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; j += kLanes) {  // lane-wise: a scalar max is one long dependency chain
          const vec16 x = load16(sc + j);
          maxes = pagedserve_cpu::max16(x, maxes);
        }
        float m = maxes[0];
        for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, maxes[l]);
        vec16 sums = {};
        for (int64_t j = 0; j < n; j += kLanes) {
          const vec16 e = exp16(load16(sc + j) - m);
          std::memcpy(sc + j, &e, sizeof(e));
          sums += e;
        }
        const float l = hsum(sums);
        if (it.partial >= 0) {
          partial_max[it.partial * num_heads + h] = m;
          partial_sum[it.partial * num_heads + h] = l;
        }
        sum_of[h] = l;
        std::fill(acc + h * head_size, acc + (h + 1) * head_size, 0.f);
      }
      // Values, weighted by the softmax numerators, each row read once for its G query heads.
#if defined(__AVX512F__) && defined(__AVX512BW__)
      if (fast) {
        weighted_values(fast_rows(v_data), kv_end - kv_begin, cache_head_stride, t0, t1, scores + h_begin * stride,
                        stride, group, head_size, acc + h_begin * head_size);
        if constexpr (kEvenOdd<T>) interleave_even_odd(acc + h_begin * head_size, h_end - h_begin, head_size);
      }
#endif
      if (!fast) for_each_token(v_data, [&](int64_t j, const T* vrow) {
        for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
          const T* v = vrow + (kh - kv_begin) * cache_head_stride;
          for (int64_t g = 0; g < group; ++g) probs[g] = scores[(kh * group + g) * stride + j];
          if (vectorised) {
            axpy_heads(probs, v, head_size, group, acc + kh * group * head_size);
          } else {
            to_float(v, row, head_size);
            for (int64_t g = 0; g < group; ++g) axpy(probs[g], row, acc + (kh * group + g) * head_size, head_size);
          }
        }
      });
      if (it.partial < 0) {  // the whole context: normalise into the output
        for (int64_t h = h_begin; h < h_end; ++h) {
          const float inv = sum_of[h] > 0.f ? 1.f / sum_of[h] : 0.f;
          T* orow = out_data + (it.seq * num_heads + h) * head_size;
          for (int64_t d = 0; d < head_size; ++d) orow[d] = static_cast<T>(acc[h * head_size + d] * inv);
        }
      }
    }
  });
  if (plan.num_partials == 0) return;

  // Merge each split sequence's partitions by their log-sum-exp and normalise.
  std::vector<std::pair<int64_t, int64_t>> split_seqs;  // (seq, first partial slot)
  std::vector<int64_t> parts_of;
  for (const WorkItem& it : items) {
    if (it.partial < 0 || it.kv_head_begin != 0) continue;
    if (split_seqs.empty() || split_seqs.back().first != it.seq) {
      split_seqs.emplace_back(it.seq, it.partial);
      parts_of.push_back(0);
    }
    ++parts_of.back();
  }
  const int64_t num_split = static_cast<int64_t>(split_seqs.size());
  const int64_t num_merges = num_split * num_heads;
  at::parallel_for(0, num_merges, run_inline ? std::max<int64_t>(num_merges, 1) : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_size);
    for (int64_t idx = begin; idx < end; ++idx) {
      const auto [s, first] = split_seqs[idx / num_heads];
      const int64_t h = idx % num_heads, last = first + parts_of[idx / num_heads];
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t p = first; p < last; ++p) m = std::max(m, partial_max[p * num_heads + h]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float l = 0.f;
      for (int64_t p = first; p < last; ++p) {
        const float sum = partial_sum[p * num_heads + h];
        if (sum == 0.f) continue;
        const float w = std::exp(partial_max[p * num_heads + h] - m);
        l += w * sum;
        axpy(w, partial_acc.data() + (p * num_heads + h) * head_size, merged.data(), head_size);
      }
      const float inv = l > 0.f ? 1.f / l : 0.f;
      T* orow = out_data + (s * num_heads + h) * head_size;
      for (int64_t d = 0; d < head_size; ++d) orow[d] = static_cast<T>(merged[d] * inv);
    }
  });
}

// The kernel reads cache rows through the tables unchecked: refuse a table that is too short for its
// sequence or names a block outside the cache, as the gathering torch path would, instead of reading stray
// memory.
void check_block_references(const at::Tensor& tables, const at::Tensor& lens, int64_t num_blocks, int64_t block_size) {
  const int32_t* table_data = tables.data_ptr<int32_t>();
  const int32_t* len_data = lens.data_ptr<int32_t>();
  const int64_t width = tables.size(1), row_stride = tables.stride(0);
  for (int64_t s = 0; s < lens.size(0); ++s) {
    TORCH_CHECK(len_data[s] >= 0, "seq_lens[", s, "] is negative");
    const int64_t used = (static_cast<int64_t>(len_data[s]) + block_size - 1) / block_size;
    TORCH_CHECK(used <= width, "seq_lens[", s, "] = ", len_data[s], " needs ", used, " blocks but block_tables has ",
                width, " columns");
    for (int64_t b = 0; b < used; ++b) {
      const int32_t block = table_data[s * row_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block_tables[", s, ", ", b, "] = ", block,
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(query.device().is_cpu(), "paged_decode_attention (CPU op): query must be on the CPU");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [S, H, D] and key_cache [N, bs, Hkv, D] expected");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes() && key_cache.strides() == value_cache.strides(),
              "key_cache and value_cache must have the same shape and layout");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(key_cache.stride(3) == 1 && query.stride(2) == 1, "head dimension must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt,
              "block_tables and seq_lens must be int32");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == query.size(0),
              "block_tables [S, max_blocks] and seq_lens [S] expected for S = query.size(0)");
  const at::Tensor tables = block_tables.stride(1) == 1 ? block_tables : block_tables.contiguous();
  const at::Tensor lens = seq_lens.contiguous();
  check_block_references(tables, lens, key_cache.size(0), key_cache.size(1));
  at::Tensor out = at::empty(query.sizes(), query.options());
  switch (query.scalar_type()) {
    case at::kFloat: decode_kernel<float>(query, key_cache, value_cache, tables, lens, scale, sliding_window, out); break;
    case at::kBFloat16: decode_kernel<c10::BFloat16>(query, key_cache, value_cache, tables, lens, scale, sliding_window, out); break;
    case at::kHalf: decode_kernel<c10::Half>(query, key_cache, value_cache, tables, lens, scale, sliding_window, out); break;
    default: TORCH_CHECK(false, "paged_decode_attention (CPU op): unsupported dtype ", query.scalar_type());
  }
  return out;
}

}  // namespace

// The C++ entry points (ops.h): the functions registered below.
namespace pagedserve_cpu {

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window) {
  return ::paged_decode_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, sliding_window);
}
}  // namespace pagedserve_cpu

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
