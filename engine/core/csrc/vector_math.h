// The small numeric pieces the kernels share (cpu_attention.cpp for a few new tokens per row,
// cpu_prefill.cpp for prefill chunks, cpu_linear.cpp): the softmax constants, bfloat16 -> float32, an
// allocator for cache-line-aligned scratch, and, where the build has AVX2 + FMA, 8-lane loads (float32
// or bfloat16), horizontal max / sum and a vectorised base-2 exponential for non-positive arguments
// (with AVX-512: 16-lane loads and exponential).
// Each kernel keeps its own tiling and tasks; this header holds no kernel. It is compiled into each
// translation unit (everything is inline).

#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#if defined(__AVX512F__)
#define MAGICDEC_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define MAGICDEC_AVX2 1
#endif
#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
#include <immintrin.h>
#endif

namespace magicdec_vec {

constexpr float kNoMax = -1e30f;               // finite "minus infinity" (the build uses -ffast-math)
constexpr float kLog2e = 1.4426950408889634f;  // scores are kept in log2 units: exp(x) = 2^(x log2 e)
constexpr float kExpFloor = -125.0f;           // 2^x below this is ~0 for softmax; keeps 2^n a normal float
// exp2_nonpos: 2^x for x <= 0 (clamped below at kExpFloor): x = n + f with n = round(x), |f| <= 1/2;
// 2^f by a degree-5 polynomial (coefficients fitted for minimal relative error on [-1/2, 1/2]: max
// relative error 2.3e-7 in float32), 2^n added into the exponent bits.
constexpr float kExpC5 = 1.32764e-3f, kExpC4 = 9.67554e-3f, kExpC3 = 5.550713e-2f, kExpC2 = 0.2402212f,
                kExpC1 = 0.69314694f, kExpC0 = 1.0000001f;

// Scratch vectors whose data starts on a cache line (std::vector's own start on 16 bytes): a 64-byte
// vector load, or a row of an AMX tile load, that straddles two cache lines costs up to several times
// one that does not (BENCHMARKS.md section 32).
template <typename T>
struct CacheLineAllocator {
  using value_type = T;
  CacheLineAllocator() = default;
  template <typename U>
  CacheLineAllocator(const CacheLineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const CacheLineAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const CacheLineAllocator<U>&) const { return false; }
};
template <typename T>
using AlignedVector = std::vector<T, CacheLineAllocator<T>>;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bfloat16: the top half of a float32
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
// 256-bit helpers (every AVX-512 CPU has AVX2 + FMA as well).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 -> 8 float32
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline __m256 exp2_nonpos8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(kExpFloor));
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_set1_ps(kExpC5);
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC1));
  p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExpC0));
  const __m256i scale = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), scale));
}
#endif

#ifdef MAGICDEC_AVX512
// 16-lane loads: float32, or bfloat16 widened to float32 (cpu_attention.cpp's AVX-512 task, the AMX
// prefill task's splits).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __m512 exp2_nonpos16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(kExpFloor));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(kExpC5);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC1));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExpC0));
  const __m512i scale = _mm512_slli_epi32(_mm512_cvtps_epi32(n), 23);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p), scale));
}
#endif

}  // namespace magicdec_vec
