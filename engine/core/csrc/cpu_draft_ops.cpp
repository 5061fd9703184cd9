// Small fused CPU ops for the lean draft forward (engine/draft_forward.py), float32.
//
// A batch-16 draft step is a few large GEMMs and many tiny element-wise ops; from Python each tiny op
// costs more in dispatch than in arithmetic. These three replace the tiny ones of a decoder layer:
//  - residual_rms_norm: optionally x += delta (in place), then RMSNorm(x) * weight into a new tensor.
//  - rope_write: RoPE (rotate-half form) on the queries and keys of a fused q|k|v projection, the
//    rotated keys and the values written into a KV store (the cache, or a draft's compact bfloat16
//    store) at each token's (slot, row); returns the rotated queries in the attention kernel's layout.
//  - silu_mul: silu(gate) * up for a fused gate|up projection.
// Bindings are in cpu_attention.cpp. Not here: attention itself, GEMMs.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

// x: [N, hidden] float32 contiguous (updated in place when delta is given); delta: same shape or
// undefined; weight: [hidden]. Returns RMSNorm(x) * weight, [N, hidden].
torch::Tensor residual_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight,
                                double eps) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && weight.is_contiguous(), "float32, contiguous");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  auto out = torch::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = nullptr;
  if (delta.has_value()) {
    TORCH_CHECK(delta->is_contiguous() && delta->numel() == x.numel() && delta->dtype() == torch::kFloat32,
                "delta: float32, contiguous, x's shape");
    dp = delta->data_ptr<float>();
  }
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* xr = xp + r * hidden;
    if (dp != nullptr) {
      const float* dr = dp + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) xr[i] += dr[i];
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < hidden; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(hidden) + static_cast<float>(eps));
    float* orow = op + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) orow[i] = wp[i] * (xr[i] * inv);
  }
  return out;
}

template <typename E>
void store_row(const float* x, int64_t n, E* out) {
  for (int64_t d = 0; d < n; ++d) out[d] = static_cast<E>(x[d]);  // bfloat16: round to nearest even
}

// qkv: [B, T, (H + 2 KV) * D] float32 contiguous (queries, keys, values, head-major); cos, sin:
// [B, T, D] contiguous; k_layer, v_layer: [slots, KV, rows, D] float32 or bfloat16; slots: [B];
// rows: [B, T], the store row of each token (its position, in the cache).
// Writes rotated keys and values at (slots[b], rows[b, t]); returns the rotated queries as
// [B, KV, group * T, D] (the heads of a group together, token fastest), unscaled.
template <typename E>
torch::Tensor rope_write_as(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_layer,
                            torch::Tensor v_layer, torch::Tensor slots, torch::Tensor positions,
                            int64_t heads, int64_t kv_heads) {
  const int64_t B = qkv.size(0), T = qkv.size(1), D = k_layer.size(3), capacity = k_layer.size(2);
  const int64_t half = D / 2, group = heads / kv_heads, width = (heads + 2 * kv_heads) * D;
  TORCH_CHECK(qkv.size(2) == width, "qkv width must be (heads + 2 kv_heads) * head_dim");
  auto query = torch::empty({B, kv_heads, group * T, D}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  E* kp = static_cast<E*>(k_layer.data_ptr());
  E* vp = static_cast<E*>(v_layer.data_ptr());
  float* qp = query.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  auto rotate = [&](const float* x, const float* c, const float* s, float* out) {
    for (int64_t d = 0; d < half; ++d) {
      out[d] = x[d] * c[d] - x[d + half] * s[d];
      out[d + half] = x[d + half] * c[d + half] + x[d] * s[d + half];
    }
  };
  float rotated[512];
  TORCH_CHECK(D <= 512, "head_dim up to 512");
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const float* row = in + (b * T + t) * width;
      const float* c = cp + (b * T + t) * D;
      const float* s = sp + (b * T + t) * D;
      for (int64_t h = 0; h < heads; ++h) {  // query head h is head h % group of KV group h / group
        float* out = qp + ((b * kv_heads + h / group) * group * T + (h % group) * T + t) * D;
        rotate(row + h * D, c, s, out);
      }
      for (int64_t h = 0; h < kv_heads; ++h) {
        const int64_t at = ((slot[b] * kv_heads + h) * capacity + pos[b * T + t]) * D;
        rotate(row + (heads + h) * D, c, s, rotated);
        store_row(rotated, D, kp + at);
        store_row(row + (heads + kv_heads + h) * D, D, vp + at);
      }
    }
  }
  return query;
}

torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_layer,
                         torch::Tensor v_layer, torch::Tensor slots, torch::Tensor rows,
                         int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() && k_layer.is_contiguous() &&
              v_layer.is_contiguous() && rows.is_contiguous(), "contiguous only");
  TORCH_CHECK(qkv.dtype() == torch::kFloat32 && cos.dtype() == torch::kFloat32 && sin.dtype() == torch::kFloat32,
              "float32 projections");
  TORCH_CHECK(k_layer.dtype() == v_layer.dtype(), "K and V of one dtype");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && rows.dtype() == torch::kInt64, "int64 slots and rows");
  if (k_layer.dtype() == torch::kBFloat16)
    return rope_write_as<c10::BFloat16>(qkv, cos, sin, k_layer, v_layer, slots, rows, heads, kv_heads);
  TORCH_CHECK(k_layer.dtype() == torch::kFloat32, "float32 or bfloat16 store");
  return rope_write_as<float>(qkv, cos, sin, k_layer, v_layer, slots, rows, heads, kv_heads);
}

// gate_up: [..., 2 I] float32 contiguous -> silu(gate) * up, [..., I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.dtype() == torch::kFloat32 && gate_up.is_contiguous(), "float32, contiguous");
  const int64_t width = gate_up.size(-1), inter = width / 2, rows = gate_up.numel() / width;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = in + r * width;
    const float* u = g + inter;
    float* o = op + r * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
  return out;
}
