// Test-only build of cpu_prefill.cpp with a 16-lane vector policy emulated by pairs of AVX2 registers.
//
// The AVX-512 prefill path is the templated task of cpu_prefill.cpp instantiated with its V16 policy;
// this machine cannot run AVX-512, so test_kernels.py builds this file (as a separate extension) and
// checks the task with V16Emulated: everything that depends on the width (16-lane column tiles, key
// blocks and padding in multiples of 32, lane masks, one-vector tails of D) is exercised, and what
// remains untested of the real V16 is its one-line intrinsic wrappers. Not part of the engine.

#include <algorithm>
#include <cstdint>

#include "vector_math.h"  // the same 8-lane exponential and reductions cpu_prefill.cpp's policies use

namespace {

struct V16Emulated {
  struct reg {
    __m256 lo, hi;
  };
  using mask = reg;
  static constexpr int W = 16;
  static reg make(__m256 lo, __m256 hi) { return reg{lo, hi}; }
  static reg load(const float* p) { return make(_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)); }
  static void store(float* p, reg x) {
    _mm256_storeu_ps(p, x.lo);
    _mm256_storeu_ps(p + 8, x.hi);
  }
  static reg bcast(const float* p) { return make(_mm256_broadcast_ss(p), _mm256_broadcast_ss(p)); }
  static reg set1(float x) { return make(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
  static reg zero() { return make(_mm256_setzero_ps(), _mm256_setzero_ps()); }
  static reg fma(reg a, reg b, reg c) { return make(_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)); }
  static reg mul(reg a, reg b) { return make(_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)); }
  static reg add(reg a, reg b) { return make(_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)); }
  static reg sub(reg a, reg b) { return make(_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)); }
  static reg max(reg a, reg b) { return make(_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)); }
  static __m256 first8(int64_t count) {
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t c = static_cast<int32_t>(std::max<int64_t>(-1, std::min<int64_t>(count, 8)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), iota));
  }
  static mask first(int64_t count) { return make(first8(count), first8(count - 8)); }
  static reg select(mask m, reg x, reg fill) {
    return make(_mm256_blendv_ps(fill.lo, x.lo, m.lo), _mm256_blendv_ps(fill.hi, x.hi, m.hi));
  }
  static reg keep(mask m, reg x) { return make(_mm256_and_ps(x.lo, m.lo), _mm256_and_ps(x.hi, m.hi)); }
  static float hmax(reg x) { return magicdec_vec::hmax8(_mm256_max_ps(x.lo, x.hi)); }
  static float hsum(reg x) { return magicdec_vec::hsum8(x.lo) + magicdec_vec::hsum8(x.hi); }
  static reg exp2_nonpos(reg x) { return make(magicdec_vec::exp2_nonpos8(x.lo), magicdec_vec::exp2_nonpos8(x.hi)); }
};

}  // namespace

#define MAGICDEC_PREFILL_TEST_POLICY V16Emulated
#include "cpu_prefill.cpp"

bool use_vector_path(bool enabled) { return prefill_use_vector_path(enabled); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention, "cpu_prefill.cpp's entry point, 16-lane emulated policy");
  m.def("use_vector_path", &use_vector_path, "allow (true) or forbid (false) the vector path");
}
