// Vector math shared by the compiled CPU ops: 16-float vectors through the compiler's generic vector
// extension (one AVX-512 register, two AVX2 ones on narrower machines), loads and stores that convert
// bf16 / fp16 exactly as c10's scalar conversions do, and a vectorised exp.
//
// Everything here has internal linkage (static): the files that include it are compiled with different
// floating-point contraction settings, and each must keep its own copy.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagedserve_cpu {

using vec16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));
using u32x16 = uint32_t __attribute__((vector_size(64)));
using u16x16 = uint16_t __attribute__((vector_size(32)));
using u16x8 = uint16_t __attribute__((vector_size(16)));
using f16x16 = _Float16 __attribute__((vector_size(32)));
using vec8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));
using u32x8 = uint32_t __attribute__((vector_size(32)));

// Where a 64-byte vector is not one register (AVX2), GCC lowers arithmetic on vec16 to two 8-float
// instructions but a comparison or a `?:` select on it to 16 scalar compares and branches (SiLU-and-mul,
// through exp16, took 6 ns a float: 7x its time on halves). Code that compares runs on native-width halves:
// `lanewise(f, v...)` applies a function written for any vector width to 16 floats at once on AVX-512 and
// to each 8-float half on narrower machines; the lanes compute the same either way.
#if defined(__AVX512F__)
template <typename F, typename... V>
static inline vec16 lanewise(F f, V... v) {
  return f(v...);
}
#else
template <typename F, typename... V>
static inline vec16 lanewise(F f, V... v) {
  const vec8 lo = f(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)...);
  const vec8 hi = f(__builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)...);
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// The integer vectors of the same width as a float vector (vec8 -> i32x8 / u32x8, vec16 -> i32x16 / u32x16).
template <typename V>
using int_vec_of = std::conditional_t<sizeof(V) == sizeof(vec8), i32x8, i32x16>;
template <typename V>
using uint_vec_of = std::conditional_t<sizeof(V) == sizeof(vec8), u32x8, u32x16>;

// Lane-wise max as `a > b ? a : b` (a NaN in `a` gives `b`).
static inline vec16 max16(vec16 a, vec16 b) {
  return lanewise([](auto x, auto y) { return x > y ? x : y; }, a, b);
}

// 16 elements widened to float (bf16: the 16 bits are the top half of the float).
static inline vec16 load16(const float* p) {
  vec16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// bf16 widened to float in generic vector code, at any width (V floats from U16 halves through U32): the
// 16 bits are the top half of the float.
template <typename V, typename U16, typename U32>
static inline V widen_bf16(const c10::BFloat16* p) {
  U16 h;
  std::memcpy(&h, p, sizeof(h));
  const U32 w = __builtin_convertvector(h, U32) << 16;
  V v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
}

// bf16 <-> float widths changed by one instruction on AVX-512 (vpmovzxwd / vpmovdw): GCC lowers the
// generic 16-lane conversions to two 8-lane halves and a merge (~6 instructions), which perf put at about
// a quarter of SiLU-and-mul's time at decode batch 64.
static inline vec16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  vec16 v;
  std::memcpy(&v, &w, sizeof(v));
  return v;
#else
  return widen_bf16<vec16, u16x16, u32x16>(p);
#endif
}

static inline vec16 load16(const c10::Half* p) {
  f16x16 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, vec16);
}

// The machine's float vector, one register wide (16 floats on AVX-512, 8 on narrower targets), and loads
// into it converting bf16 / fp16 as load16 does: for loops that keep several vectors live or compare and
// select on them, where 16-float vectors on AVX2 are register pairs that spill or scalarise.
#if defined(__AVX512F__)
using native_vec = vec16;
template <typename T>
static inline native_vec load_native(const T* p) {
  return load16(p);
}
#else
using native_vec = vec8;
static inline native_vec load_native(const float* p) {
  native_vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline native_vec load_native(const c10::BFloat16* p) {
  return widen_bf16<vec8, u16x8, u32x8>(p);
}
static inline native_vec load_native(const c10::Half* p) {
  using f16x8 = _Float16 __attribute__((vector_size(16)));
  f16x8 h;
  std::memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, native_vec);
}
#endif

// 16 floats rounded to the element type, as static_cast<T> rounds each: to nearest even, NaN to the
// quiet NaN c10 writes for bf16.
static inline void store16(float* p, vec16 v) { std::memcpy(p, &v, sizeof(v)); }

static inline void store16(c10::BFloat16* p, vec16 v) {
  // The rounded bits sit in the low half of each float lane (a NaN lane gets the quiet NaN).
  const vec16 rounded = lanewise([](auto x) {
    using U = uint_vec_of<decltype(x)>;
    U bits;
    std::memcpy(&bits, &x, sizeof(bits));
    const U r = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    const U out = x != x ? U{} + 0x7FC0u : r;
    decltype(x) as_float;
    std::memcpy(&as_float, &out, sizeof(out));
    return as_float;
  }, v);
#if defined(__AVX512F__)
  __m512i bits;
  std::memcpy(&bits, &rounded, sizeof(bits));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
#else
  u32x16 bits;
  std::memcpy(&bits, &rounded, sizeof(bits));
  const u16x16 h = __builtin_convertvector(bits, u16x16);
  std::memcpy(static_cast<void*>(p), &h, sizeof(h));
#endif
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
template <typename V>
static inline V exp_lanes(V x) {
  using I = int_vec_of<V>;
  const V lo = V{} - 87.3365447505531f, hi = V{} + 88.3762626647949f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const V clamped = x;
  V fx = x * 1.44269504088896341f + 0.5f;  // floor(x / ln 2 + 0.5)
  const V truncated = __builtin_convertvector(__builtin_convertvector(fx, I), V);
  fx = truncated > fx ? truncated - 1.f : truncated;
  x = x - fx * 0.693359375f - fx * -2.12194440e-4f;
  V y = x * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * (x * x) + x + 1.f;
  const I n = __builtin_convertvector(fx, I);
  // 2^n; n = -126 at the lower clamp, so the exponent stays >= 1.
  const I bits = (n + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const V result = y * scale;
  return clamped <= lo ? V{} : (clamped >= hi ? V{} + __builtin_inff() : result);
}

static inline vec16 exp16(vec16 x) {
  return lanewise([](auto v) { return exp_lanes(v); }, x);
}

}  // namespace pagedserve_cpu
