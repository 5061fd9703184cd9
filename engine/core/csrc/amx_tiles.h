// What the kernels that use the AMX tile unit share (cpu_linear.cpp's GGUF panels, cpu_prefill.cpp's
// attention): the tile configuration (palette 1), Linux's once-per-process permission to use the tile
// registers, one switch every AMX path follows, and splitting float32 into bfloat16 parts whose sum
// is the float32 value. Compiled only where the build has AMX-TILE, AMX-BF16 and AVX512-BF16
// (MAGICDEC_AMX_TILES); holds no kernel.
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define MAGICDEC_AMX_TILES 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace magicdec_amx {

// Linux lends the tile registers' state to a process that asks (once per process).
inline bool amx_permitted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
}

// The one switch (use_amx in cpu_linear.cpp sets it; tests compare both ways, MAGICDEC_AMX=0 turns it
// off): the GEMM panels and the prefill attention take the tile unit while it is on and Linux lends it.
inline bool amx_switched_on = true;
inline bool amx_usable() { return amx_switched_on && amx_permitted(); }

struct alignas(64) TileConfig {  // palette 1: per tile register its rows and bytes per row
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 32 float32 (a: the first 16, b: the last 16) -> P bfloat16 parts of 32 words each (one 64-byte
// tile row), by truncation: part p holds the next 8 significant bits of what the parts before it left
// (each subtraction exact), so three parts sum to the float32 values exactly (but for values near the
// smallest normals), and with P = 1 a bfloat16 value is its own part.
template <int P>
inline void split_bf16(__m512 a, __m512 b, __m512i* parts) {
  alignas(64) static const uint16_t kHighWords[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21,
                                                      23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 43,
                                                      45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
  const __m512i high_words = _mm512_load_si512(kHighWords);
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int p = 0; p < P; ++p) {
    parts[p] = _mm512_permutex2var_epi16(_mm512_castps_si512(a), high_words, _mm512_castps_si512(b));
    if (p + 1 < P) {
      a = _mm512_sub_ps(a, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(a), top)));
      b = _mm512_sub_ps(b, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(b), top)));
    }
  }
}

}  // namespace magicdec_amx
#endif
