// The small per-layer ops of a decoder step as one compiled op each: RMSNorm (with the residual add
// fused), rotary embedding of q and k, and SiLU-and-mul.
//
// At batch 1 a decode step is a few hundred of these over vectors of a few hundred elements; their torch
// compositions cost 5 to 10 dispatched ops each (dtype casts, pow, mean, rsqrt, muls, a cat), so Python and
// the dispatcher, not the arithmetic, set the step's time. Each op here is one dispatch.
//
// The arithmetic is the torch twins' (kernels/torch_impl), operation for operation and rounding for rounding:
// statistics and rotations in float32, the results rounded to the activation dtype where the twins round.
// Only the order of the RMSNorm sum of squares differs (sixteen float32 lanes, then their sum), and SiLU's
// exp is vec_math.h's (within about an ulp of torch's), so results agree with the twins up to float32
// summation order and an ulp of exp. RMSNorm and SiLU-and-mul run 16 elements at a time (vec_math.h's loads
// and stores convert bf16 / fp16 exactly as the scalar casts do), a scalar loop taking the tail; rotary
// stays scalar (16-wide halves measured slower at one token). Contraction into fused multiply-adds is off in this
// file: `a * c - b * s` rounds its two products as torch does.

#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "vec_math.h"

#include "ops.h"

namespace {

using pagedserve_cpu::exp16;
using pagedserve_cpu::load16;
using pagedserve_cpu::round16;
using pagedserve_cpu::store16;
using pagedserve_cpu::vec16;

// Rows per parallel chunk: below ~16k elements of work a call runs on the calling thread.
inline int64_t grain_rows(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// A value rounded to T and back (the twins' `.to(x.dtype)`); the identity for float.
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void rms_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  vec16 acc = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const vec16 v = load16(x + i);
    acc += v * v;
  }
  float ss = 0.f;
  for (int j = 0; j < 16; ++j) ss += acc[j];
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) store16(out + k, load16(w + k) * round16<T>(load16(x + k) * r));
  for (; k < n; ++k) {
    const float normed = round_to<T>(to_f(x[k]) * r);
    out[k] = static_cast<T>(to_f(w[k]) * normed);
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& w, at::Tensor& out, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_row<T>(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
  });
}

template <typename T>
void add_rms_norm_impl(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, at::Tensor& out,
                       at::Tensor& summed, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / std::max<int64_t>(1, n);
  const T* xp = x.data_ptr<T>();
  const T* rp = residual.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* sp = summed.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* s = sp + r * n;
      const T* xr = xp + r * n;
      const T* rr = rp + r * n;
      int64_t k = 0;
      for (; k + 16 <= n; k += 16) store16(s + k, load16(xr + k) + load16(rr + k));
      for (; k < n; ++k) s[k] = static_cast<T>(to_f(xr[k]) + to_f(rr[k]));
      rms_row<T>(s, wp, op + r * n, n, static_cast<float>(eps));
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm (CPU op): CPU tensors expected");
  TORCH_CHECK(x.dim() >= 1 && w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm: weight [hidden] expected");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: weight dtype must match x");
}

#define PAGEDSERVE_FLOAT_TYPES(dtype, NAME, ...)                                        \
  switch (dtype) {                                                                      \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                    \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }         \
    case at::kHalf: { using scalar_t = c10::Half; __VA_ARGS__; break; }                 \
    default: TORCH_CHECK(false, NAME " (CPU op): unsupported dtype ", dtype);           \
  }

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  check_norm(x_in, w_in);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x);
  PAGEDSERVE_FLOAT_TYPES(x.scalar_type(), "rms_norm", rms_norm_impl<scalar_t>(x, w, out, eps));
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x_in, const at::Tensor& residual_in,
                                                       const at::Tensor& w_in, double eps) {
  check_norm(x_in, w_in);
  TORCH_CHECK(residual_in.sizes() == x_in.sizes() && residual_in.scalar_type() == x_in.scalar_type(),
              "fused_add_rms_norm: residual must match x in shape and dtype");
  const at::Tensor x = x_in.contiguous(), residual = residual_in.contiguous(), w = w_in.contiguous();
  at::Tensor out = at::empty_like(x), summed = at::empty_like(x);
  PAGEDSERVE_FLOAT_TYPES(x.scalar_type(), "fused_add_rms_norm",
                         add_rms_norm_impl<scalar_t>(x, residual, w, out, summed, eps));
  return {out, summed};
}

// Rotate every head of rows [T, H * head_size] (row stride `in_stride`) into out [T, H * head_size].
template <typename T, typename C>
void rotate(const int64_t* positions, const T* in, int64_t in_stride, T* out, int64_t tokens, int64_t heads,
            int64_t head_size, const C* cache, int64_t rot, bool is_neox) {
  const int64_t half = rot / 2, width = heads * head_size;
  at::parallel_for(0, tokens, grain_rows(width), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const C* cos = cache + positions[t] * rot;
      const C* sin = cos + half;
      const T* src = in + t * in_stride;
      T* dst = out + t * width;
      for (int64_t h = 0; h < heads; ++h) {
        const T* x = src + h * head_size;
        T* y = dst + h * head_size;
        for (int64_t i = 0; i < half; ++i) {
          const int64_t ia = is_neox ? i : 2 * i, ib = is_neox ? i + half : 2 * i + 1;
          const float a = to_f(x[ia]), b = to_f(x[ib]), c = to_f(cos[i]), s = to_f(sin[i]);
          const float ac = a * c, bs = b * s, bc = b * c, as = a * s;
          y[ia] = static_cast<T>(ac - bs);
          y[ib] = static_cast<T>(bc + as);
        }
        for (int64_t i = rot; i < head_size; ++i) y[i] = x[i];
      }
    }
  });
}

template <typename T>
void rotate_any_cache(const at::Tensor& positions, const at::Tensor& x, at::Tensor& out, int64_t head_size,
                      const at::Tensor& cache, bool is_neox) {
  const int64_t tokens = x.size(0), heads = x.size(1) / head_size, rot = cache.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  switch (cache.scalar_type()) {
    case at::kFloat:
      rotate<T, float>(pos, x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), tokens, heads, head_size,
                       cache.data_ptr<float>(), rot, is_neox);
      break;
    case at::kBFloat16:
      rotate<T, c10::BFloat16>(pos, x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), tokens, heads, head_size,
                               cache.data_ptr<c10::BFloat16>(), rot, is_neox);
      break;
    case at::kHalf:
      rotate<T, c10::Half>(pos, x.data_ptr<T>(), x.stride(0), out.data_ptr<T>(), tokens, heads, head_size,
                           cache.data_ptr<c10::Half>(), rot, is_neox);
      break;
    default: TORCH_CHECK(false, "rotary_embedding (CPU op): unsupported cos_sin_cache dtype ", cache.scalar_type());
  }
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions_in, const at::Tensor& query,
                                                     const at::Tensor& key, const at::Tensor& cache_in,
                                                     int64_t head_size, bool is_neox) {
  TORCH_CHECK(query.device().is_cpu() && key.device().is_cpu(), "rotary_embedding (CPU op): CPU tensors expected");
  TORCH_CHECK(query.dim() == 2 && key.dim() == 2 && query.size(0) == key.size(0), "rotary_embedding: q/k [T, width]");
  TORCH_CHECK(query.stride(1) == 1 && key.stride(1) == 1, "rotary_embedding: rows must be contiguous");
  TORCH_CHECK(query.scalar_type() == key.scalar_type(), "rotary_embedding: q and k dtypes differ");
  TORCH_CHECK(head_size > 0 && query.size(1) % head_size == 0 && key.size(1) % head_size == 0,
              "rotary_embedding: widths must be multiples of head_size");
  TORCH_CHECK(cache_in.dim() == 2 && cache_in.size(1) % 2 == 0 && cache_in.size(1) <= head_size,
              "rotary_embedding: cos_sin_cache [positions, rotary_dim <= head_size] expected");
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == query.size(0), "rotary_embedding: positions [T] expected");
  const at::Tensor cache = cache_in.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < positions.numel(); ++t)  // an index outside the cache would read past it
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cache.size(0), "rotary_embedding: position ", pos[t],
                " outside the cos/sin cache of ", cache.size(0), " positions");
  at::Tensor q_out = at::empty({query.size(0), query.size(1)}, query.options());
  at::Tensor k_out = at::empty({key.size(0), key.size(1)}, key.options());
  PAGEDSERVE_FLOAT_TYPES(query.scalar_type(), "rotary_embedding", {
    rotate_any_cache<scalar_t>(positions, query, q_out, head_size, cache, is_neox);
    rotate_any_cache<scalar_t>(positions, key, k_out, head_size, cache, is_neox);
  });
  return {q_out, k_out};
}

template <typename T>
void silu_mul_impl(const at::Tensor& x, at::Tensor& out) {
  const int64_t d = out.size(-1), rows = out.numel() / std::max<int64_t>(1, d);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, grain_rows(2 * d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gate = xp + r * 2 * d;
      const T* up = gate + d;
      T* y = op + r * d;
      int64_t i = 0;
      for (; i + 16 <= d; i += 16) {
        const vec16 g = load16(gate + i);
        const vec16 silu = round16<T>(g / (1.f + exp16(-g)));  // F.silu, rounded to the dtype
        store16(y + i, silu * load16(up + i));
      }
      for (; i < d; ++i) {
        const float g = to_f(gate[i]);
        const float silu = round_to<T>(g / (1.f + std::exp(-g)));  // F.silu, rounded to the dtype
        y[i] = static_cast<T>(silu * to_f(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x_in) {
  TORCH_CHECK(x_in.device().is_cpu(), "silu_and_mul (CPU op): CPU tensor expected");
  TORCH_CHECK(x_in.dim() >= 1 && x_in.size(-1) % 2 == 0, "silu_and_mul: last dim must be even");
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() /= 2;
  at::Tensor out = at::empty(shape, x.options());
  PAGEDSERVE_FLOAT_TYPES(x.scalar_type(), "silu_and_mul", silu_mul_impl<scalar_t>(x, out));
  return out;
}

#undef PAGEDSERVE_FLOAT_TYPES

}  // namespace

// The C++ entry points (ops.h): the functions registered below.
namespace pagedserve_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) { return ::rms_norm(x, weight, eps); }

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                      const at::Tensor& weight, double eps) {
  return ::fused_add_rms_norm(x, residual, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding(const at::Tensor& positions, const at::Tensor& query,
                                                    const at::Tensor& key, const at::Tensor& cos_sin_cache,
                                                    int64_t head_size, bool is_neox) {
  return ::rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox);
}

at::Tensor silu_and_mul(const at::Tensor& x) { return ::silu_and_mul(x); }
}  // namespace pagedserve_cpu

TORCH_LIBRARY_IMPL(pagedserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
