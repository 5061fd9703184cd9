// A draft's linear map from the model's own GGUF panels (Q4_1 or Q8_0) with its input rounded to
// int8, by the CPU's VNNI dot products (VPDPBUSD: 4 u8 x s8 products summed into each 32-bit lane).
//
// The draft's GEMMs only have to be cheap and close (verification keeps the output exact). fbgemm's
// int8 draft rounds the whole input with one scale, and the weights to a second int8 copy. Here the
// weights are the panels the target already reads (engine/models/gguf_blocks.py `to_panels`: per 16
// outputs and 32-weight block, the outputs' fp16 scales side by side, Q4_1's d then m, Q8_0's d; then
// lines of 16 bytes, byte i of line j being output i's byte j: Q4_1 16 lines, weight j in the low
// nibble and j + 16 in the high one; Q8_0 32 lines of int8 weights). Each row's input is rounded per
// block of 32 with its own scale: s = max |x| / 127, q = round(x / s) in [-127, 127]. Output i of row r
// is then the sum over blocks of d_i s (w_q . q) (+ m_i s sum(q) for Q4_1): the model's weights times
// the rounded input, the dot products exact in integers.
//
// A 64-byte line of a panel block holds 4 of its lines; VPERMB turns it into 16 outputs x 4
// consecutive bytes, one VPDPBUSD's operand against the row's 4 inputs broadcast. Q4_1's nibbles are
// the unsigned operand as they are. Q8_0's weights are signed, so there the input is the unsigned one,
// shifted by 128, and 128 times the block's weight sums (one more dot product per line, shared by the
// rows) is taken off again.
//
// Each output's sums run in one order whatever the number of rows, the tiling or the threads, so a
// row's result does not depend on its batch. Not here: float32 weights and the target's own GEMMs
// (cpu_linear.cpp); CPUs without AVX512-VNNI and AVX512-VBMI (the caller keeps fbgemm's int8 there).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "panel_tasks.h"  // for_panel_tiles

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && \
    defined(__F16C__)
#include <immintrin.h>
#define MAGICDEC_INT8_PANELS 1
#endif

namespace {

#ifdef MAGICDEC_INT8_PANELS
constexpr int64_t kBlock = 32;                       // weights per Q4_1 block
constexpr int64_t kOutputs = 16;                     // outputs per panel
constexpr int64_t kQ4_1BlockBytes = 16 * 2 + 16 * 2 + 16 * 16;  // a Q4_1 panel block: d, m, 16 lines of nibbles
constexpr int64_t kQ8_0BlockBytes = 16 * 2 + 32 * 16;           // a Q8_0 panel block: d, 32 lines of int8
constexpr int kMaxRows = 16;  // R float32 sums, 8 weight vectors, d, m and a row's int32 sums: 28 registers

// VPERMB's index from 4 panel lines [4][16 outputs] to [16 outputs][4 lines]: byte 4 i + t <- 16 t + i.
constexpr std::array<uint8_t, 64> transpose_index() {
  std::array<uint8_t, 64> idx{};
  for (int i = 0; i < 16; ++i)
    for (int t = 0; t < 4; ++t) idx[i * 4 + t] = static_cast<uint8_t>(t * 16 + i);
  return idx;
}
alignas(64) constexpr std::array<uint8_t, 64> kTranspose = transpose_index();

// One row's input rounded per block: q [K] int8, scale [K / 32], and the rounded block's sum [K / 32]
// (s times the sum of its q: Q4_1's m term then meets the same rounded input as its d term, so the
// result is the weights times the rounded input, whose error is centred, as the weights are).
void quantise_row(const float* __restrict x, int64_t K, int8_t* __restrict q, float* __restrict scale,
                  float* __restrict sum) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    const float* xb = x + b * kBlock;
    float amax = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(xb[k]));
    const float s = amax / 127.0f;
    int32_t total = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      const int8_t code = s > 0.0f ? static_cast<int8_t>(std::nearbyint(xb[k] / s)) : 0;
      q[b * kBlock + k] = code;
      total += code;
    }
    scale[b] = s;
    sum[b] = s * static_cast<float>(total);
  }
}

// out[r][0..15] (+ bias) for R rows of the rounded input (q rows K apart, scale and sum rows K / 32
// apart) against one panel's K / 32 blocks, Q4_1 (Q8 false) or Q8_0 (Q8 true).
template <bool Q8, int R>
void panel_rows(const int8_t* __restrict q, const float* __restrict scale, const float* __restrict sum, int64_t K,
                const uint8_t* __restrict panel, const float* bias, float* __restrict out, int64_t ldo) {
  constexpr int64_t block_bytes = Q8 ? kQ8_0BlockBytes : kQ4_1BlockBytes;
  constexpr int kLines = 8;  // 64-byte lines of weights per block, 4 weights of 16 outputs each after VPERMB
  const int64_t blocks = K / kBlock;
  const __m512i transpose = _mm512_load_si512(kTranspose.data());
  const __m512i nibble = _mm512_set1_epi8(0x0F), shift = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, panel += block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)  // two blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(panel + 2 * block_bytes + line), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel)));
    // w[t]: [16 outputs][4 weights], the weights x[first[t] .. first[t] + 3] meets
    __m512i w[kLines];
    int first[kLines];
    __m512 m = _mm512_setzero_ps();
    __m512i offset = _mm512_setzero_si512();  // Q8_0: 128 x each output's weight sum
    if constexpr (Q8) {
      for (int t = 0; t < kLines; ++t) {
        w[t] = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(panel + 32 + 64 * t));
        first[t] = 4 * t;
        offset = _mm512_dpbusd_epi32(offset, shift, w[t]);
      }
    } else {
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32)));
      for (int t = 0; t < 4; ++t) {
        const __m512i lines = _mm512_permutexvar_epi8(transpose, _mm512_loadu_si512(panel + 64 + 64 * t));
        w[t] = _mm512_and_si512(lines, nibble), first[t] = 4 * t;
        w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(lines, 4), nibble), first[t + 4] = 16 + 4 * t;
      }
    }
    for (int r = 0; r < R; ++r) {
      const int8_t* qb = q + r * K + b * kBlock;
      __m512i dot = _mm512_setzero_si512();
      for (int t = 0; t < kLines; ++t) {
        int32_t four;
        std::memcpy(&four, qb + first[t], 4);
        if constexpr (Q8)  // the input unsigned (+128), the weights signed
          dot = _mm512_dpbusd_epi32(dot, _mm512_xor_si512(_mm512_set1_epi32(four), shift), w[t]);
        else  // the nibbles unsigned, the input signed
          dot = _mm512_dpbusd_epi32(dot, w[t], _mm512_set1_epi32(four));
      }
      if constexpr (Q8) dot = _mm512_sub_epi32(dot, offset);
      const int64_t sb = r * blocks + b;
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(scale[sb])), total[r]);
      if constexpr (!Q8) total[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum[sb]), total[r]);
    }
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, _mm512_add_ps(total[r], bv));
}

using PanelRows = void (*)(const int8_t*, const float*, const float*, int64_t, const uint8_t*, const float*,
                           float*, int64_t);
template <bool Q8, int... R>
constexpr std::array<PanelRows, sizeof...(R) + 1> panel_table(std::integer_sequence<int, R...>) {
  return {nullptr, &panel_rows<Q8, R + 1>...};
}
constexpr auto kQ4_1Rows = panel_table<false>(std::make_integer_sequence<int, kMaxRows>{});  // [R] -> R rows
constexpr auto kQ8_0Rows = panel_table<true>(std::make_integer_sequence<int, kMaxRows>{});
#endif

}  // namespace

// Whether panels_int8_linear_cat is compiled in here (AVX512-VNNI and AVX512-VBMI).
bool int8_panels_available() {
#ifdef MAGICDEC_INT8_PANELS
  return true;
#else
  return false;
#endif
}

// x [M, K] float32 contiguous (K a multiple of 32); panels[i]: GGUF panels (`to_panels`), Q4_1 uint8
// [N_i / 16, K / 32, 320] or Q8_0 [N_i / 16, K / 32, 544]; biases[i]: float32 [N_i] or None -> [M, sum
// of N_i] float32, every weight's outputs side by side, x rounded to int8 per row and block of 32.
torch::Tensor panels_int8_linear_cat(torch::Tensor x, std::vector<torch::Tensor> panels,
                                     std::vector<c10::optional<torch::Tensor>> biases) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] float32, contiguous");
  TORCH_CHECK(!panels.empty() && biases.size() == panels.size(), "one bias (or None) per panel set");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0, "K a multiple of 32");
  const int64_t parts = static_cast<int64_t>(panels.size());
  std::vector<int64_t> first_task(parts + 1, 0), columns(parts + 1, 0);
  std::vector<const uint8_t*> panel_ptr(parts);
  std::vector<const float*> bias_ptr(parts, nullptr);
  std::vector<bool> q8(parts);
  for (int64_t i = 0; i < parts; ++i) {
    const auto& p = panels[i];
    TORCH_CHECK(p.dim() == 3 && p.dtype() == torch::kUInt8 && p.is_contiguous() && p.size(1) == K / 32 &&
                    (p.size(2) == 320 || p.size(2) == 544),
                "panels: uint8 [N / 16, K / 32, 320] (Q4_1) or [N / 16, K / 32, 544] (Q8_0), contiguous");
    panel_ptr[i] = p.data_ptr<uint8_t>();
    q8[i] = p.size(2) == 544;
    const int64_t N = p.size(0) * 16;
    if (biases[i].has_value()) {
      const auto& b = *biases[i];
      TORCH_CHECK(b.dtype() == torch::kFloat32 && b.is_contiguous() && b.numel() == N, "bias: [N] float32");
      bias_ptr[i] = b.data_ptr<float>();
    }
    first_task[i + 1] = first_task[i] + p.size(0);
    columns[i + 1] = columns[i] + N;
  }
  const int64_t N = columns[parts];
  auto out = torch::empty({M, N}, x.options());
#ifdef MAGICDEC_INT8_PANELS
  const int64_t blocks = K / kBlock;
  std::vector<int8_t> q(M * K);
  std::vector<float> scale(M * blocks), sum(M * blocks);
  const float* xp = x.data_ptr<float>();
  for (int64_t r = 0; r < M; ++r) quantise_row(xp + r * K, K, q.data() + r * K, scale.data() + r * blocks,
                                               sum.data() + r * blocks);
  float* op = out.data_ptr<float>();
  magicdec_panels::for_panel_tiles(first_task, M, kMaxRows, [&](int64_t i, int64_t g, int64_t m, int64_t rows) {
    const int64_t n = g * kOutputs;
    const uint8_t* panel = panel_ptr[i] + g * blocks * (q8[i] ? kQ8_0BlockBytes : kQ4_1BlockBytes);
    const float* bn = bias_ptr[i] != nullptr ? bias_ptr[i] + n : nullptr;
    (q8[i] ? kQ8_0Rows : kQ4_1Rows)[rows](q.data() + m * K, scale.data() + m * blocks, sum.data() + m * blocks, K,
                                          panel, bn, op + m * N + columns[i] + n, N);
  });
#else
  TORCH_CHECK(false, "panels_int8_linear_cat needs a build for a CPU with AVX512-VNNI and AVX512-VBMI");
#endif
  return out;
}
