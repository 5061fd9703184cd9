// A bfloat16 linear map on the CPU's bfloat16 dot products: out = x W^T (+ bias), for a bfloat16 model's
// decode steps, verification forwards and draft steps (any row count works; engine/core/linear.py keeps
// torch's GEMM for prefill chunks).
//
// On a Zen 4 (AVX512-BF16, no AMX) a bfloat16 model decoded the docQA set more slowly than a float32 one,
// although it reads half the bytes: torch's bfloat16 GEMM at a decode step's 16 rows takes 1.7-2x the
// time this kernel takes for the default model's layers (BENCHMARKS.md section 42). Here W is
// read from panels made once per weight (`bf16_panels`): 16 outputs side by side, each 64-byte line
// holding their weights k and k + 1 as pairs, [N / 16][K / 2][16][2]. One VDPBF16PS multiplies such a
// line by a row's pair (x[k], x[k + 1]) broadcast and adds both products to 16 float32 sums, so an
// outer product runs in registers: one panel by up to 16 rows for a decode step's few rows (the panel
// line loaded once for all of them), two panels by up to 12 rows past that (each broadcast feeding two
// dot products). Products of bfloat16 values are exact in float32; each output is one float32 chain
// over k in pairs, in the same order whatever M, the tiling or the thread split, so a row's result
// does not depend on its batch (verification and plain decoding give a row the same logits); the bias
// is added in float32 and the sum rounded to bfloat16 once (nearest even), as torch's bfloat16 linear
// does; its bits differ from torch's (another summation order). Not here: float32 weights
// (cpu_linear.cpp), K odd or N not a multiple of 16 (the caller keeps torch's GEMM for those), AMX tiles.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <array>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MAGICDEC_BF16_LINEAR 1
#endif

namespace {

#ifdef MAGICDEC_BF16_LINEAR
constexpr int64_t kOutputs = 16;       // outputs per panel (one 16-lane float32 sum each)
constexpr int kMaxRowsOnePanel = 16;   // calls of up to 16 rows: one panel x up to 16 rows (16 sums)
constexpr int kMaxRowsTwoPanels = 12;  // more rows: two panels x up to 12 rows (24 sums), so that each
                                       // broadcast pair of x feeds two dot products (a 24-row tile of
                                       // one panel spilled its sums: 7x the time at 48 rows)

// out[r][16 j .. 16 j + 15] for R rows of x (bfloat16 pairs as 32-bit words, rows `ldx` words apart)
// against P adjacent panels (each K / 2 lines of 16 outputs x 2, `pairs` lines apart), plus bias
// (float32, or none), rounded to bfloat16. Each sum is one chain over the pairs in order, whatever P and R.
template <int P, int R>
void panel_rows(const uint32_t* __restrict x, int64_t ldx, int64_t pairs, const uint16_t* __restrict panel,
                const float* bias, uint16_t* __restrict out, int64_t ldo) {
  const int64_t stride = pairs * 2 * kOutputs;  // elements from one panel to the next
  __m512 acc[P][R];
  for (int j = 0; j < P; ++j)
    for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    if ((p & 1) == 0)
      for (int j = 0; j < P; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(panel + j * stride + (p + 8) * 2 * kOutputs), _MM_HINT_T0);
    __m512bh w[P];
    for (int j = 0; j < P; ++j) w[j] = (__m512bh)_mm512_loadu_si512(panel + j * stride + p * 2 * kOutputs);
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + p]));
      for (int j = 0; j < P; ++j) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], pair, w[j]);
    }
  }
  for (int j = 0; j < P; ++j) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + j * kOutputs) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[j][r], b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo + j * kOutputs), (__m256i)rounded);
    }
  }
}

using PanelRows = void (*)(const uint32_t*, int64_t, int64_t, const uint16_t*, const float*, uint16_t*, int64_t);
template <int P, int... R>
constexpr std::array<PanelRows, sizeof...(R) + 1> panel_table(std::integer_sequence<int, R...>) {
  return {nullptr, &panel_rows<P, R + 1>...};
}
constexpr auto kOnePanelRows = panel_table<1>(std::make_integer_sequence<int, kMaxRowsOnePanel>{});  // [R]
constexpr auto kTwoPanelRows = panel_table<2>(std::make_integer_sequence<int, kMaxRowsTwoPanels>{});  // [R]
#endif

}  // namespace

// Whether bf16_linear is compiled in (a build for a CPU with AVX512-BF16).
bool bf16_linear_available() {
#ifdef MAGICDEC_BF16_LINEAR
  return true;
#else
  return false;
#endif
}

// weight [N, K] bfloat16 (N % 16 == 0, K even) -> its panels [N / 16, K / 2, 16, 2] bfloat16.
torch::Tensor bf16_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.dtype() == torch::kBFloat16, "weight: [N, K] bfloat16");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % 16 == 0 && K % 2 == 0, "bf16_panels: N a multiple of 16 and K even");
  return weight.reshape({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] bfloat16 contiguous, panels from `bf16_panels` (one per weight, each [N_i / 16, K / 2, 16, 2]),
// biases float32 [N_i] or None -> [M, sum of N_i] bfloat16: every weight's output side by side.
torch::Tensor bf16_linear_cat(torch::Tensor x, std::vector<torch::Tensor> panels,
                              std::vector<c10::optional<torch::Tensor>> biases) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kBFloat16 && x.is_contiguous(), "x: [M, K] bfloat16, contiguous");
  TORCH_CHECK(!panels.empty() && biases.size() == panels.size(), "one bias (or None) per panel set");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % 2 == 0, "K even");
  const int64_t parts = static_cast<int64_t>(panels.size());
  std::vector<int64_t> first_task(parts + 1, 0), columns(parts + 1, 0);
  std::vector<const uint16_t*> panel_ptr(parts);
  std::vector<const float*> bias_ptr(parts, nullptr);
  for (int64_t i = 0; i < parts; ++i) {
    const auto& p = panels[i];
    TORCH_CHECK(p.dim() == 4 && p.dtype() == torch::kBFloat16 && p.is_contiguous() && p.size(1) == K / 2 &&
                p.size(2) == 16 && p.size(3) == 2, "panels: [N / 16, K / 2, 16, 2] bfloat16, contiguous");
    panel_ptr[i] = reinterpret_cast<const uint16_t*>(p.data_ptr<at::BFloat16>());
    first_task[i + 1] = first_task[i] + p.size(0);
    columns[i + 1] = columns[i] + p.size(0) * 16;
    if (biases[i].has_value()) {
      const auto& b = *biases[i];
      TORCH_CHECK(b.dtype() == torch::kFloat32 && b.is_contiguous() && b.numel() == p.size(0) * 16,
                  "bias: [N] float32, contiguous");
      bias_ptr[i] = b.data_ptr<float>();
    }
  }
  const int64_t N = columns[parts];
  auto out = torch::empty({M, N}, x.options());
#ifdef MAGICDEC_BF16_LINEAR
  const auto* xw = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // Up to 16 rows, a task is one panel (its weights streamed once for every row); past that, two
  // adjacent panels of one weight (the last alone where a weight has an odd count), in row tiles of <= 12.
  const int64_t pairs = K / 2, width = M <= kMaxRowsOnePanel ? 1 : 2;
  const int64_t max_rows = width == 1 ? kMaxRowsOnePanel : kMaxRowsTwoPanels;
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  std::vector<int64_t> first_group(parts + 1, 0);
  for (int64_t i = 0; i < parts; ++i)
    first_group[i + 1] = first_group[i] + (first_task[i + 1] - first_task[i] + width - 1) / width;
  at::parallel_for(0, first_group[parts], 1, [&](int64_t first, int64_t last) {
    int64_t i = 0;
    for (int64_t t = first; t < last; ++t) {
      while (t >= first_group[i + 1]) ++i;
      const int64_t g = (t - first_group[i]) * width, n = columns[i] + g * kOutputs;
      const int64_t P = std::min(width, first_task[i + 1] - first_task[i] - g);
      const uint16_t* panel = panel_ptr[i] + g * pairs * 2 * kOutputs;
      const float* bn = bias_ptr[i] != nullptr ? bias_ptr[i] + g * kOutputs : nullptr;
      for (int64_t tile = 0, m = 0; tile < tiles; ++tile) {  // near-equal row tiles of at most max_rows
        const int64_t rows = (M - m) / (tiles - tile);
        const PanelRows kernel = P == 1 ? kOnePanelRows[rows] : kTwoPanelRows[rows];
        kernel(xw + m * pairs, pairs, pairs, panel, bn, op + m * N + n, N);
        m += rows;
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear_cat needs a build for a CPU with AVX512-BF16 (bf16_linear_available())");
#endif
  return out;
}
