// Paged decode attention for the CPU, reading K/V rows in place from the block-table cache.
//
// The pure-torch path gathers each sequence's blocks into a contiguous buffer before SDPA: a second pass over
// memory that the op's cost is made of. Here one work item is (sequence, context partition, range of KV
// heads). It walks its tokens in order (one token's K for all its KV heads is one contiguous row), scores
// each key against the G query heads grouped on its KV head (the key is read once for all G), then walks
// the values the same way, weighted by the softmax numerators. A sequence split into several partitions
// (split-K, for long contexts or too few sequences to occupy every thread) is merged by log-sum-exp.
//
// torch.ops.pagedserve.paged_decode_attention (schema in registration.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kMinPartitionTokens = 256;
constexpr int64_t kMaxPartitionTokens = 2048;
constexpr int64_t kSplitBelowSeqs = 16;  // batches this small split contexts into several partitions
constexpr int64_t kPrefetchBytes = 2048;
// Below this many query-head x key x head-dim products a call runs on the calling thread: waking the
// pool costs more than the work (and on a busy machine a descheduled worker stalls the whole call).
constexpr int64_t kInlineWork = 1 << 17;

// 16-float vectors through the compiler's generic vector extension (AVX-512 here, split on narrower ISAs).
using vec16 = float __attribute__((vector_size(64)));
using vec8 = float __attribute__((vector_size(32)));
using vec4 = float __attribute__((vector_size(16)));
using u16x16 = uint16_t __attribute__((vector_size(32)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using f16x16 = _Float16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

// Load 16 elements widened to float (bf16: the 16 bits are the top half of the float).
inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vec16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

inline vec16 load16(const c10::Half* p) {
  f16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vec16);
}

inline int64_t round_up(int64_t x, int64_t multiple) { return (x + multiple - 1) / multiple * multiple; }

// exp of 16 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial, ~2 ulp), vectorised
// because a scalar expf per score and head is a quarter of the op's time at small head sizes.
// Inputs at or below -87.3 give 0 (no denormals); the op only exponentiates score - max <= 0.
inline vec16 exp16(vec16 x) {
  using i32x16 = int32_t __attribute__((vector_size(64)));
  const vec16 lo = vec16{} - 87.3365447505531f, hi = vec16{} + 88.3762626647949f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vec16 clamped = x;
  vec16 fx = x * 1.44269504088896341f + 0.5f;  // floor(x / ln 2 + 0.5)
  const vec16 truncated = __builtin_convertvector(__builtin_convertvector(fx, i32x16), vec16);
  fx = truncated > fx ? truncated - 1.f : truncated;
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  vec16 y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  const i32x16 n = __builtin_convertvector(fx, i32x16);
  const i32x16 bits = (n + 127) << 23;  // 2^n; n = -126 at the lower clamp, so the exponent stays >= 1
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vec16 result = y * scale;
  return clamped <= lo ? vec16{} : result;
}

// Pairwise halving: a lane-by-lane loop would be a chain of 16 dependent scalar adds.
inline float hsum(vec16 v) {
  const vec8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const vec4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

// out[g] = q[g] . k for `count` (<= 4) query heads q[g] = q + g * head_size sharing one key row, the key
// widened to float as it is loaded; the independent accumulators hide the FMA latency.
template <typename T>
inline void dot_heads(const float* q, const T* k, int64_t head_size, int64_t count, float* out) {
  vec16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
  for (int64_t d = 0; d < head_size; d += kLanes) {
    const vec16 kv = load16(k + d);
    a0 += load16(q + d) * kv;
    if (count > 1) a1 += load16(q + head_size + d) * kv;
    if (count > 2) a2 += load16(q + 2 * head_size + d) * kv;
    if (count > 3) a3 += load16(q + 3 * head_size + d) * kv;
  }
  out[0] = hsum(a0);
  if (count > 1) out[1] = hsum(a1);
  if (count > 2) out[2] = hsum(a2);
  if (count > 3) out[3] = hsum(a3);
}

// acc[g] += p[g] * v for `group` query heads sharing one value row.
template <typename T>
inline void axpy_heads(const float* p, const T* v, int64_t head_size, int64_t group, float* acc) {
  for (int64_t d = 0; d < head_size; d += kLanes) {
    const vec16 vv = load16(v + d);
    for (int64_t g = 0; g < group; ++g) {
      float* a = acc + g * head_size + d;
      const vec16 updated = load16(a) + p[g] * vv;
      std::memcpy(a, &updated, sizeof(vec16));
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

// Ask for a future token's K or V row (the item's KV heads) ahead of use: consecutive blocks of a
// sequence may sit far apart, which the hardware prefetcher cannot guess.
template <typename T>
inline void prefetch_row(const T* row, int64_t elems) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < elems * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off);
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
  int64_t work = 0;
  for (const WorkItem& it : items) work += (it.token_end - it.token_begin) * (it.kv_head_end - it.kv_head_begin);
  const bool run_inline = work * group * head_size < kInlineWork;
  at::parallel_for(0, num_items, run_inline ? std::max<int64_t>(num_items, 1) : 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_f(num_heads * head_size), row(head_size), scores(num_heads * round_up(plan.max_tokens, kLanes));
    // Output accumulator of items that write directly (partials have their own slots), exp-sum per head.
    std::vector<float> direct_acc(num_heads * head_size), sum_of(num_heads), probs(group);
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& it = items[i];
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
        float* qh = q_f.data() + h * head_size;
        to_float(q_data + it.seq * q_seq_stride + h * q_head_stride, qh, head_size);
        for (int64_t d = 0; d < head_size; ++d) qh[d] *= scale_f;
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
      // Scores: each key row read once for the G query heads grouped on its KV head.
      for_each_token(k_data, [&](int64_t j, const T* krow) {
        for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
          const T* k = krow + (kh - kv_begin) * cache_head_stride;
          for (int64_t g = 0; g < group; g += 4) {
            const int64_t h = kh * group + g, count = std::min<int64_t>(4, group - g);
            float dots[4];
            if (vectorised) {
              dot_heads(q_f.data() + h * head_size, k, head_size, count, dots);
            } else {
              to_float(k, row.data(), head_size);
              for (int64_t c = 0; c < count; ++c) dots[c] = dot(q_f.data() + (h + c) * head_size, row.data(), head_size);
            }
            for (int64_t c = 0; c < count; ++c) scores[(h + c) * stride + j] = dots[c];
          }
        }
      });
      float* acc = it.partial >= 0 ? partial_acc.data() + it.partial * num_heads * head_size : direct_acc.data();
      for (int64_t h = h_begin; h < h_end; ++h) {
        float* sc = scores.data() + h * stride;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) m = std::max(m, sc[j]);
        // The row is padded to whole vectors with -inf, whose exp is 0: every score takes the same path.
        std::fill(sc + n, sc + round_up(n, kLanes), -std::numeric_limits<float>::infinity());
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
      for_each_token(v_data, [&](int64_t j, const T* vrow) {
        for (int64_t kh = kv_begin; kh < kv_end; ++kh) {
          const T* v = vrow + (kh - kv_begin) * cache_head_stride;
          for (int64_t g = 0; g < group; ++g) probs[g] = scores[(kh * group + g) * stride + j];
          if (vectorised) {
            axpy_heads(probs.data(), v, head_size, group, acc + kh * group * head_size);
          } else {
            to_float(v, row.data(), head_size);
            for (int64_t g = 0; g < group; ++g) axpy(probs[g], row.data(), acc + (kh * group + g) * head_size, head_size);
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

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
