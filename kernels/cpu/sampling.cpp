// Greedy token choice: the index of each row's largest logit, as torch's argmax(dim=-1) / max(dim=-1)
// answer it (the first index among equal maxima; a NaN counts as the largest, the first NaN winning).
//
// torch's CPU reduction walks the row one element at a time: on a [64, 49152] bf16 batch of logits (the
// default model's vocabulary at decode batch 64) `max(dim=-1)` took ~3 ms of a ~100 ms step on two
// threads, and ~0.1 ms of a ~10 ms batch-1 step. Here each row is one pass at the machine's vector width
// (16 floats on AVX-512, 8 on AVX2: a comparison or select on a vector wider than a register is
// scalarised by GCC): per lane the largest value seen and the index of its first occurrence, then the
// lanes merged with ties going to the lower index. A NaN anywhere sends the row to a scalar scan for the
// first NaN (torch's answer), so ordinary rows pay one OR per vector for the check.
//
// torch.ops.pagedserve.greedy_argmax(logits) -> int64 [logits.shape[:-1]] (schema in registration.cpp).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

using fvec = pagedserve_cpu::native_vec;
using ivec = pagedserve_cpu::int_vec_of<fvec>;
using pagedserve_cpu::load_native;
constexpr int64_t kWidth = sizeof(fvec) / sizeof(float);

template <typename T>
int64_t first_nan(const T* row, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (v != v) return i;
  }
  return -1;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  float best = static_cast<float>(row[0]);
  int64_t best_index = 0;
  int64_t i = 0;
  if (n >= kWidth) {
    ivec lane_index;
    for (int64_t l = 0; l < kWidth; ++l) lane_index[l] = static_cast<int32_t>(l);
    fvec lane_best = load_native(row);
    ivec lane_best_index = lane_index;
    ivec nan = lane_best != lane_best;
    for (i = kWidth; i + kWidth <= n; i += kWidth) {
      const fvec v = load_native(row + i);
      const ivec greater = v > lane_best;  // strictly: a lane keeps the first index of its maximum
      lane_best = greater ? v : lane_best;
      lane_best_index = greater ? lane_index + static_cast<int32_t>(i) : lane_best_index;
      nan |= v != v;
    }
    bool any_nan = false;
    for (int64_t l = 0; l < kWidth; ++l) any_nan |= nan[l] != 0;
    if (any_nan) return first_nan(row, n);
    best = lane_best[0];
    best_index = lane_best_index[0];
    for (int64_t l = 1; l < kWidth; ++l) {
      if (lane_best[l] > best || (lane_best[l] == best && lane_best_index[l] < best_index)) {
        best = lane_best[l];
        best_index = lane_best_index[l];
      }
    }
  } else if (best != best) {
    return 0;
  } else {
    i = 1;
  }
  for (; i < n; ++i) {  // the tail (or a row shorter than a vector): indices above every lane's
    const float v = static_cast<float>(row[i]);
    if (v != v) return first_nan(row, n);
    if (v > best) {
      best = v;
      best_index = i;
    }
  }
  return best_index;
}

template <typename T>
void argmax_rows(const T* data, int64_t rows, int64_t n, int64_t* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = row_argmax(data + r * n, n);
  });
}

at::Tensor greedy_argmax(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu(), "greedy_argmax (CPU op): tensors must be on the CPU");
  TORCH_CHECK(logits.dim() >= 1, "greedy_argmax: logits must have at least one dimension");
  const int64_t n = logits.size(-1);
  TORCH_CHECK(n > 0, "greedy_argmax: the last dimension of logits is empty");
  const at::Tensor x = logits.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  at::Tensor out = at::empty(shape, x.options().dtype(at::kLong));
  const int64_t rows = out.numel();
  int64_t* op = out.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat: argmax_rows(x.data_ptr<float>(), rows, n, op); break;
    case at::kBFloat16: argmax_rows(x.data_ptr<c10::BFloat16>(), rows, n, op); break;
    case at::kHalf: argmax_rows(x.data_ptr<c10::Half>(), rows, n, op); break;
    default: TORCH_CHECK(false, "greedy_argmax (CPU op): unsupported dtype ", x.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) { m.impl("greedy_argmax", &greedy_argmax); }
