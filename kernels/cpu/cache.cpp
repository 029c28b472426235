// Write new K/V rows into the paged cache at their slots (slot -1: padding, skipped).
//
// One token's K (all KV heads) is one contiguous row of the cache, so a write is a memcpy per token
// (per head when the source is a strided view, e.g. a slice of the fused QKV projection). The torch
// path needs a mask, a compaction, a dtype cast and index_copy_ for the same work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

template <typename Slot>
void copy_rows(const at::Tensor& src, at::Tensor& cache, const Slot* slots) {
  const int64_t num_tokens = src.size(0), num_heads = src.size(1), head_size = src.size(2);
  const int64_t block_size = cache.size(1);
  const int64_t elem = src.element_size();
  const char* src_data = static_cast<const char*>(src.data_ptr());
  char* cache_data = static_cast<char*>(cache.data_ptr());
  const int64_t src_token = src.stride(0) * elem, src_head = src.stride(1) * elem;
  const int64_t cache_block = cache.stride(0) * elem, cache_token = cache.stride(1) * elem;
  const int64_t cache_head = cache.stride(2) * elem;
  const int64_t row_bytes = head_size * elem;
  const bool whole_rows = src_head == row_bytes && cache_head == row_bytes;
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = static_cast<int64_t>(slots[t]);
      if (slot < 0) continue;
      char* dst = cache_data + (slot / block_size) * cache_block + (slot % block_size) * cache_token;
      const char* row = src_data + t * src_token;
      if (whole_rows) {
        std::memcpy(dst, row, num_heads * row_bytes);
      } else {
        for (int64_t h = 0; h < num_heads; ++h) std::memcpy(dst + h * cache_head, row + h * src_head, row_bytes);
      }
    }
  });
}

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.device().is_cpu() && key_cache.device().is_cpu(), "reshape_and_cache (CPU op): CPU tensors expected");
  TORCH_CHECK(key.dim() == 3 && value.sizes() == key.sizes(), "key/value [T, Hkv, D] of one shape expected");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(), "caches [N, bs, Hkv, D] expected");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == value_cache.scalar_type(),
              "key/value dtype must match the cache dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
              "head dimension must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == key.size(0), "slot_mapping [T] expected");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const at::Tensor slots = slot_mapping.contiguous();
  // An out-of-range slot would write outside the cache: refuse it up front (a plain scan: at a decode
  // step's few tokens a tensor reduction costs more than the copies).
  TORCH_CHECK(slots.scalar_type() == at::kLong || slots.scalar_type() == at::kInt, "slot_mapping must be int32 or int64");
  int64_t max_slot = -1;
  if (slots.scalar_type() == at::kLong) {
    const int64_t* p = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < slots.numel(); ++t) max_slot = std::max(max_slot, p[t]);
  } else {
    const int32_t* p = slots.data_ptr<int32_t>();
    for (int64_t t = 0; t < slots.numel(); ++t) max_slot = std::max(max_slot, static_cast<int64_t>(p[t]));
  }
  TORCH_CHECK(max_slot < num_slots, "slot_mapping has a slot beyond the cache (", num_slots, " slots)");
  if (slots.scalar_type() == at::kLong) {
    copy_rows(key, key_cache, slots.data_ptr<int64_t>());
    copy_rows(value, value_cache, slots.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(slots.scalar_type() == at::kInt, "slot_mapping must be int32 or int64");
    copy_rows(key, key_cache, slots.data_ptr<int32_t>());
    copy_rows(value, value_cache, slots.data_ptr<int32_t>());
  }
}

}  // namespace

// The C++ entry points (ops.h): the functions registered below.
namespace pagedserve_cpu {

void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping) {
  ::reshape_and_cache(key, value, std::move(key_cache), std::move(value_cache), slot_mapping);
}
}  // namespace pagedserve_cpu

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }
