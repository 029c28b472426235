// Vector math shared by the compiled CPU ops: 16-float vectors through the compiler's generic vector
// extension (one AVX-512 register, two AVX2 ones on narrower machines), loads and stores that convert
// bf16 / fp16 exactly as c10's scalar conversions do, and a vectorised exp.
//
// Everything here has internal linkage (static): the files that include it are compiled with different
// floating-point contraction settings, and each must keep its own copy.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve_cpu {

using vec16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using u16x16 = uint16_t __attribute__((vector_size(32)));
using f16x16 = _Float16 __attribute__((vector_size(32)));

// 16 elements widened to float (bf16: the 16 bits are the top half of the float).
static inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

static inline vec16 load16(const c10::BFloat16* p) {
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

static inline vec16 load16(const c10::Half* p) {
  f16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vec16);
}

// 16 floats rounded to the element type, as static_cast<T> rounds each: to nearest even, NaN to the
// quiet NaN c10 writes for bf16.
static inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

static inline void store16(c10::BFloat16* p, vec16 v) {
  u32x16 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  rounded = v != v ? u32x16{} + 0x7FC0u : rounded;
  const u16x16 h = __builtin_convertvector(rounded, u16x16);
  std::memcpy(static_cast<void*>(p), &h, sizeof(h));
}

static inline void store16(c10::Half* p, vec16 v) {
  const f16x16 h = __builtin_convertvector(v, f16x16);
  std::memcpy(static_cast<void*>(p), &h, sizeof(h));
}

// The values rounded to T and widened back (the torch twins' intermediate `.to(dtype)`).
template <typename T>
static inline vec16 round16(vec16 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    T tmp[16];
    store16(tmp, v);
    return load16(tmp);
  }
}

// exp of 16 floats: Cephes' expf (range reduction by ln 2, degree-5 polynomial), within about 1 ulp of the
// correctly rounded result over the whole range (measured against double exp). A scalar expf per element
// is most of the time of the ops that need one (attention scores, SiLU).
// Inputs at or below -87.3 give 0 (no denormals); inputs at or above 88.37 give +inf.
static inline vec16 exp16(vec16 x) {
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
  // 2^n; n = -126 at the lower clamp, so the exponent stays >= 1.
  const i32x16 bits = (n + 127) << 23;
  vec16 scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const vec16 result = y * scale;
  return clamped <= lo ? vec16{} : (clamped >= hi ? vec16{} + __builtin_inff() : result);
}

}  // namespace pagedserve_cpu
