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
// differ from the matmul's, so two centroids within a rounding error of each other may swap. Plain C++
// that the compiler vectorises (-march=native); one task per (group, block of points). This file only
// computes codes; fitting the centroids (the k-means updates) stays in torch.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {
constexpr int64_t kLanes = 16;  // centroids scored at once per point
constexpr int64_t kPointBlock = 256;  // points per task
}  // namespace

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
        op[g * n + i] = std::min(arg, C - 1);
      }
    }
  });
  return out;
}
