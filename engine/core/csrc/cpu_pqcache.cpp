// PQCache's nearest centroid: for each sub-vector, the index of the closest of its group's centroids.
//
// argmin_c ||x - c||^2 = argmax_c (x.c - ||c||^2 / 2). torch's version (`nearest` in
// engine/spec/compressors/pqcache.py) is a batched matmul of 4-wide sub-vectors against 256
// centroids, which writes and reads a score per (point, centroid) and runs at a small fraction of the
// core's rate: the k-means of one 3.3K-token prompt of the 135M model (30 layers x 3 KV heads x 16
// sub-spaces, 6 Lloyd steps on 1,024 keys, then every key) took seconds. Here the scores never leave
// registers: centroids are laid out [d, C] per group, each point takes 16 centroids at a time (d
// multiply-adds into 16 lanes) and keeps, per lane, the best score and its index; the lanes are
// reduced at the end. Ties go to the lowest index, as torch's argmax does; the scores' rounding may
// differ from the matmul's, so two centroids within a rounding error of each other may swap. With
// AVX-512 a block of 16 centroids is one register (a compare mask and two masked moves keep the
// best); otherwise, or after `pq_use_vector_path(false)` (the tests check both), the same steps in
// portable C++. One task per (group, block of points). This file only computes codes; fitting the
// centroids (the k-means updates) stays in torch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vector_math.h"  // MAGICDEC_AVX512

namespace {
constexpr int64_t kLanes = 16;  // centroids scored at once per point
constexpr int64_t kPointBlock = 256;  // points per task
bool g_vector_path = true;  // the AVX-512 steps where compiled in (tests switch them off)

// The nearest of Cp (a multiple of 16) centroids to x [d]: columns [d, Cp], halves [Cp] (||c||^2 / 2,
// +inf for padding). Ties: the lowest index.
int64_t nearest_portable(const float* x, int64_t d, const float* columns, const float* halves, int64_t Cp) {
  float best[kLanes];
  int64_t best_index[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) best[l] = -std::numeric_limits<float>::infinity(), best_index[l] = l;
  for (int64_t c0 = 0; c0 < Cp; c0 += kLanes) {
    float score[kLanes];
    for (int64_t l = 0; l < kLanes; ++l) score[l] = -halves[c0 + l];
    for (int64_t j = 0; j < d; ++j) {
      const float xj = x[j];
      const float* column = columns + j * Cp + c0;
      for (int64_t l = 0; l < kLanes; ++l) score[l] += xj * column[l];
    }
    for (int64_t l = 0; l < kLanes; ++l) {
      const bool better = score[l] > best[l];  // strict: a lane keeps its first best
      best[l] = better ? score[l] : best[l];
      best_index[l] = better ? c0 + l : best_index[l];
    }
  }
  int64_t arg = best_index[0];
  float top = best[0];
  for (int64_t l = 1; l < kLanes; ++l)
    if (best[l] > top || (best[l] == top && best_index[l] < arg)) top = best[l], arg = best_index[l];
  return arg;
}

#if defined(MAGICDEC_AVX512)
int64_t nearest_avx512(const float* x, int64_t d, const float* columns, const float* halves, int64_t Cp) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i index = best_index;
  const __m512i step = _mm512_set1_epi32(static_cast<int>(kLanes));
  for (int64_t c0 = 0; c0 < Cp; c0 += kLanes) {
    __m512 score = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_loadu_ps(halves + c0));
    for (int64_t j = 0; j < d; ++j)
      score = _mm512_fmadd_ps(_mm512_set1_ps(x[j]), _mm512_loadu_ps(columns + j * Cp + c0), score);
    const __mmask16 better = _mm512_cmp_ps_mask(score, best, _CMP_GT_OQ);  // strict, as above
    best = _mm512_mask_mov_ps(best, better, score);
    best_index = _mm512_mask_mov_epi32(best_index, better, index);
    index = _mm512_add_epi32(index, step);
  }
  alignas(64) float top_lanes[kLanes];
  alignas(64) int32_t index_lanes[kLanes];
  _mm512_store_ps(top_lanes, best);
  _mm512_store_si512(reinterpret_cast<__m512i*>(index_lanes), best_index);
  int64_t arg = index_lanes[0];
  float top = top_lanes[0];
  for (int64_t l = 1; l < kLanes; ++l)
    if (top_lanes[l] > top || (top_lanes[l] == top && index_lanes[l] < arg)) top = top_lanes[l], arg = index_lanes[l];
  return arg;
}
#endif
}  // namespace

// Whether pq_nearest may take its AVX-512 steps; returns whether they are compiled in.
bool pq_use_vector_path(bool enabled) {
  g_vector_path = enabled;
#if defined(MAGICDEC_AVX512)
  return true;
#else
  return false;
#endif
}

// points: [G, n, d] float32 contiguous; centroids: [G, C, d] float32 contiguous. Returns [G, n] int64,
// the index in [0, C) of each point's nearest centroid of its group.
torch::Tensor pq_nearest(torch::Tensor points, torch::Tensor centroids) {
  TORCH_CHECK(points.dtype() == torch::kFloat32 && points.is_contiguous() && points.dim() == 3,
              "points [G, n, d] float32 contiguous");
  TORCH_CHECK(centroids.dtype() == torch::kFloat32 && centroids.is_contiguous() && centroids.dim() == 3,
              "centroids [G, C, d] float32 contiguous");
  const int64_t G = points.size(0), n = points.size(1), d = points.size(2), C = centroids.size(1);
  TORCH_CHECK(centroids.size(0) == G && centroids.size(2) == d && C > 0, "centroids of every group, same d");
  auto out = torch::empty({G, n}, points.options().dtype(torch::kInt64));
  if (G == 0 || n == 0) return out;
  const float* pp = points.data_ptr<float>();
  const float* cp = centroids.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  // [G, d, Cp] transposed centroids and [G, Cp] half norms; padded centroids score -inf (never chosen).
  const int64_t Cp = (C + kLanes - 1) / kLanes * kLanes;
  std::vector<float> transposed(G * d * Cp, 0.0f);
  std::vector<float> half_norm(G * Cp, std::numeric_limits<float>::infinity());
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < C; ++c) {
        const float* centroid = cp + (g * C + c) * d;
        float norm = 0.0f;
        for (int64_t j = 0; j < d; ++j) {
          norm += centroid[j] * centroid[j];
          transposed[(g * d + j) * Cp + c] = centroid[j];
        }
        half_norm[g * Cp + c] = 0.5f * norm;
      }
  });
  const int64_t blocks = (n + kPointBlock - 1) / kPointBlock;
  at::parallel_for(0, G * blocks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t g = task / blocks, i0 = (task % blocks) * kPointBlock, i1 = std::min(n, i0 + kPointBlock);
      const float* columns = transposed.data() + g * d * Cp;  // [d, Cp]
      const float* halves = half_norm.data() + g * Cp;  // [Cp]
      for (int64_t i = i0; i < i1; ++i) {
        const float* x = pp + (g * n + i) * d;
#if defined(MAGICDEC_AVX512)
        const int64_t arg = g_vector_path ? nearest_avx512(x, d, columns, halves, Cp)
                                          : nearest_portable(x, d, columns, halves, Cp);
#else
        const int64_t arg = nearest_portable(x, d, columns, halves, Cp);
#endif
        op[g * n + i] = std::min(arg, C - 1);  // (only NaN scores leave a padding lane's index)
      }
    }
  });
  return out;
}
