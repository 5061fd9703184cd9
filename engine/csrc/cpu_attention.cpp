// Fused CPU attention of a few new tokens per row over that row's KV cache (decode, verify, draft).
//
// One task per (row, KV head): the g query heads of the group times the T new tokens form R = g*T
// query rows that share one pass over the group's keys and values, read in place from the engine's
// cache [slots, kv_heads, capacity, D]. Entries are processed in blocks with an online softmax
// (running max and sum per query row), so each K and V row is read from memory once per step.
// New token t of a row whose newest position is end - 1 may see positions <= end - T + t.
// Two entry sets: every position [0, end) (the target), or a list of positions with a validity mask
// (a draft's compressed view). Not for prefill chunks (large T): torch's GEMMs are better there.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kBlock = 64;    // entries per online-softmax block (a K and a V block fit in L1)
constexpr float kNoMax = -1e30f;  // finite "minus infinity" (the build uses -ffast-math)

template <int64_t D>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t d_len) {
  float s = 0.0f;
  for (int64_t d = 0; d < (D > 0 ? D : d_len); ++d) s += a[d] * b[d];
  return s;
}

// Attention of R query rows over n_entries entries of one (slot, KV head) block.
// positions == nullptr: entry i is position i. Otherwise entry i is positions[i], used if valid[i].
template <int64_t D>
void attend_task(const float* __restrict q, int64_t R, int64_t T, int64_t end,
                 const float* __restrict k, const float* __restrict v,
                 const int64_t* positions, const bool* valid, int64_t n_entries,
                 float* __restrict out, int64_t dyn_d) {
  const int64_t d_len = D > 0 ? D : dyn_d;
  std::vector<float> scores(R * kBlock);
  std::vector<float> acc(R * d_len, 0.0f);
  std::vector<float> row_max(R, kNoMax);
  std::vector<float> row_sum(R, 0.0f);
  int64_t pos[kBlock];
  for (int64_t start = 0; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    for (int64_t i = 0; i < n; ++i) {
      if (positions == nullptr) pos[i] = start + i;
      else pos[i] = valid[start + i] ? positions[start + i] : end;  // `end` is never visible
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t last = end - T + r % T;  // rows are (head, token), token fastest
      float* s = scores.data() + r * kBlock;
      const float* qr = q + r * d_len;
      float m = row_max[r];
      bool any = false;
      for (int64_t i = 0; i < n; ++i) {
        if (pos[i] <= last) {
          s[i] = dot<D>(qr, k + pos[i] * d_len, d_len);
          m = std::max(m, s[i]);
          any = true;
        } else {
          s[i] = kNoMax;
        }
      }
      if (!any) continue;
      const float correction = std::exp(row_max[r] - m);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = pos[i] <= last ? std::exp(s[i] - m) : 0.0f;
        sum += s[i];
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = m;
      float a[D > 0 ? D : 256];
      float* ar = acc.data() + r * d_len;
      for (int64_t d = 0; d < d_len; ++d) a[d] = ar[d] * correction;
      for (int64_t i = 0; i < n; ++i) {
        const float p = s[i];
        if (p == 0.0f) continue;
        const float* vr = v + pos[i] * d_len;
        for (int64_t d = 0; d < d_len; ++d) a[d] += p * vr[d];
      }
      for (int64_t d = 0; d < d_len; ++d) ar[d] = a[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < d_len; ++d) out[r * d_len + d] = acc[r * d_len + d] * inv;
  }
}

torch::Tensor attend(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer, torch::Tensor slots,
                     torch::Tensor ends, int64_t T, const torch::Tensor* positions, const torch::Tensor* valid) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && k_layer.dtype() == torch::kFloat32, "float32 only");
  TORCH_CHECK(query.is_contiguous() && k_layer.is_contiguous() && v_layer.is_contiguous(), "contiguous only");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2), D = query.size(3);
  TORCH_CHECK(D <= 256, "head_dim up to 256");
  const int64_t capacity = k_layer.size(2);
  auto out = torch::empty_like(query);
  const float* qp = query.data_ptr<float>();
  const float* kp = k_layer.data_ptr<float>();
  const float* vp = v_layer.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ep = ends.data_ptr<int64_t>();
  const int64_t N = positions ? positions->size(2) : 0;
  const int64_t* pp = positions ? positions->data_ptr<int64_t>() : nullptr;
  const bool* vm = valid ? valid->data_ptr<bool>() : nullptr;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t base = (sp[b] * KVH + h) * capacity * D;
      const float* q = qp + task * R * D;
      float* o = op + task * R * D;
      const int64_t* p = pp ? pp + task * N : nullptr;
      const bool* m = vm ? vm + task * N : nullptr;
      const int64_t n = pp ? N : ep[b];
      if (D == 64) attend_task<64>(q, R, T, ep[b], kp + base, vp + base, p, m, n, o, D);
      else if (D == 128) attend_task<128>(q, R, T, ep[b], kp + base, vp + base, p, m, n, o, D);
      else attend_task<0>(q, R, T, ep[b], kp + base, vp + base, p, m, n, o, D);
    }
  });
  return out;
}

}  // namespace

// query: [B, kv_heads, R, D] float32 contiguous, pre-scaled, R = group * T (head-major, token fastest)
// k_layer, v_layer: [slots, kv_heads, capacity, D] float32 contiguous; slots, ends: [B] int64.
// Returns [B, kv_heads, R, D].
torch::Tensor attend_cached(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                            torch::Tensor slots, torch::Tensor ends, int64_t T) {
  return attend(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr);
}

// As attend_cached, over the listed positions only. positions: [B, kv_heads, N] int64 contiguous;
// valid: [B, kv_heads, N] bool contiguous.
torch::Tensor attend_positions(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                               torch::Tensor slots, torch::Tensor ends, int64_t T,
                               torch::Tensor positions, torch::Tensor valid) {
  TORCH_CHECK(positions.is_contiguous() && valid.is_contiguous(), "contiguous positions only");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && valid.dtype() == torch::kBool, "int64 positions, bool valid");
  return attend(query, k_layer, v_layer, slots, ends, T, &positions, &valid);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attend_cached", &attend_cached, "fused attention over each row's whole cache (CPU, fp32)");
  m.def("attend_positions", &attend_positions, "fused attention over listed cache positions (CPU, fp32)");
}
