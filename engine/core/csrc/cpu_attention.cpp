// Fused CPU attention of a few new tokens per row over that row's KV cache (decode, verify, draft).
//
// One task per (row, KV head): the g query heads of the group times the T new tokens form R = g*T
// query rows that share one pass over the group's keys and values, read in place from the engine's
// cache [slots, kv_heads, capacity, D]. Entries are processed in blocks with an online softmax
// (running max and sum per query row), so each K and V row is read from memory once per step.
// New token t of a row whose newest position is end - 1 may see positions <= end - T + t.
// Three entry sets: every position [0, end) (the target), a list of positions with a validity mask
// (a draft's compressed view of the cache), or every row of a small store whose entries hold the
// positions listed per row (a draft's own compact KV, `engine/kv/compact.py`; -1 = empty). K and V
// are float32 or bfloat16 (read as float32). Not for prefill chunks (large T): torch's GEMMs are
// better there.
//
// Two implementations of one task: a portable one (any head size, any CPU), and an AVX-512 one for
// head sizes 32, 64, 96 and 128 that scores 16 entries per query row at once (one horizontal
// reduction for 16 dot products instead of one each) and updates up to 4 query rows' outputs per V
// row loaded. `use_vector_path(false)` forces the portable one (the tests check both).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define MAGICDEC_AVX512 1
#endif

namespace {

constexpr int64_t kBlock = 64;    // entries per online-softmax block (a K and a V block fit in L1)
constexpr float kNoMax = -1e30f;  // finite "minus infinity" (the build uses -ffast-math)
bool g_vector_path = true;        // the AVX-512 task where it applies (tests switch it off)

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bfloat16: the top half of a float32
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &wide, sizeof(x));
  return x;
}

template <int64_t D, typename E>
inline float dot(const float* __restrict a, const E* __restrict b, int64_t d_len) {
  float s = 0.0f;
  for (int64_t d = 0; d < (D > 0 ? D : d_len); ++d) s += a[d] * to_float(b[d]);
  return s;
}

// Which entries a task reads. All null: entry i is position i. positions/valid: entry i is cache
// row positions[i], used if valid[i]. entry_pos: entry i is row i, holding position entry_pos[i]
// (unused if negative).
struct Entries {
  const int64_t* positions = nullptr;
  const bool* valid = nullptr;
  const int64_t* entry_pos = nullptr;

  // The position entry e holds (`end`, never visible, when unused) and the K/V row it is stored in.
  inline void at(int64_t e, int64_t end, int64_t* pos, int64_t* row) const {
    if (entry_pos != nullptr) {
      *pos = entry_pos[e] >= 0 ? entry_pos[e] : end;
      *row = e;
    } else if (positions != nullptr) {
      *pos = valid[e] ? positions[e] : end;
      *row = valid[e] ? positions[e] : 0;
    } else {
      *pos = e;
      *row = e;
    }
  }
};

// Attention of R query rows over n_entries entries of one (slot, KV head) block.
template <int64_t D, typename E>
void attend_task(const float* __restrict q, int64_t R, int64_t T, int64_t end,
                 const E* __restrict k, const E* __restrict v, const Entries& entries, int64_t n_entries,
                 float* __restrict out, int64_t dyn_d) {
  const int64_t d_len = D > 0 ? D : dyn_d;
  std::vector<float> scores(R * kBlock);
  std::vector<float> acc(R * d_len, 0.0f);
  std::vector<float> row_max(R, kNoMax);
  std::vector<float> row_sum(R, 0.0f);
  int64_t pos[kBlock], rows[kBlock];
  for (int64_t start = 0; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    for (int64_t i = 0; i < n; ++i) entries.at(start + i, end, pos + i, rows + i);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t last = end - T + r % T;  // rows are (head, token), token fastest
      float* s = scores.data() + r * kBlock;
      const float* qr = q + r * d_len;
      float m = row_max[r];
      bool any = false;
      for (int64_t i = 0; i < n; ++i) {
        if (pos[i] <= last) {
          s[i] = dot<D>(qr, k + rows[i] * d_len, d_len);
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
        const E* vr = v + rows[i] * d_len;
        for (int64_t d = 0; d < d_len; ++d) a[d] += p * to_float(vr[d]);
      }
      for (int64_t d = 0; d < d_len; ++d) ar[d] = a[d];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < d_len; ++d) out[r * d_len + d] = acc[r * d_len + d] * inv;
  }
}


#ifdef MAGICDEC_AVX512
// Lane i of the result = the sum of the 16 lanes of v[i].
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int j = 0; j < 8; ++j)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    w[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // per 128-bit lane L: [A, B, C, D] summed over lane L of v[4j..4j+3]
    const __m512d c = _mm512_castps_pd(w[2 * j]), d = _mm512_castps_pd(w[2 * j + 1]);
    x[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)), _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  const __m512 y01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y01, y23, _MM_SHUFFLE(3, 1, 3, 1)));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> 16 float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// out[g] += sum_i p[g][i] * v_rows[i] for G query rows, n entries; the G x D accumulators stay in
// registers while each V row is loaded once.
template <int64_t D, int G, typename E>
inline void accumulate_values(float* const* out, const float* const* p, const E* const* v_rows, int64_t n) {
  constexpr int C = D / 16;
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) acc[g][c] = _mm512_loadu_ps(out[g] + 16 * c);
  for (int64_t i = 0; i < n; ++i) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(v_rows[i] + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(p[g][i]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out[g] + 16 * c, acc[g][c]);
}

// The same task as attend_task, for D = 32, 64, 96 or 128. Entries come in blocks of kBlock (4 groups
// of 16); with dense entries, the block's V rows are prefetched while its scores are computed, and
// the next block's K rows into L2 (worth ~10% at batch 16 x 4K on a 2-core EPYC). Per
// block: the scores of every query row (16 entries at a time), an online-softmax update, then the
// values, up to kGroup query rows per pass over the block's V rows (from L1 after the first pass).
template <int64_t D, typename E>
void attend_task_avx512(const float* __restrict q, int64_t R, int64_t T, int64_t end,
                        const E* __restrict k, const E* __restrict v, const Entries& entries,
                        int64_t n_entries, float* __restrict out) {
  constexpr int C = D / 16;
  constexpr int kGroup = D <= 64 ? 4 : 2;  // query rows per pass over V (accumulators in registers)
  std::vector<float> scores(R * kBlock);   // then the probabilities, [R, kBlock]
  std::vector<float> acc(R * D, 0.0f);
  std::vector<float> row_max(R, kNoMax), row_sum(R, 0.0f);
  int64_t pos[kBlock];
  const E* k_rows[kBlock];
  const E* v_rows[kBlock];
  std::vector<int> live;  // query rows that see at least one entry of the current block
  live.reserve(R);
  for (int64_t start = 0; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    for (int64_t i = 0; i < kBlock; ++i) {
      int64_t row;
      entries.at(std::min(start + i, n_entries - 1), end, pos + i, &row);  // lanes past n read a valid row...
      if (i >= n) pos[i] = end;  // ...masked here
      k_rows[i] = k + row * D;
      v_rows[i] = v + row * D;
    }
    if (entries.positions == nullptr) {  // dense rows: this block's V (needed after the scores), the next block's K
      const char* vb = reinterpret_cast<const char*>(v + start * D);
      for (int64_t x = 0; x < n * D * int64_t(sizeof(E)); x += 64) _mm_prefetch(vb + x, _MM_HINT_T0);
      if (start + kBlock < n_entries) {
        const int64_t next = std::min(kBlock, n_entries - start - kBlock) * D * int64_t(sizeof(E));
        const char* kn = reinterpret_cast<const char*>(k + (start + kBlock) * D);
        for (int64_t x = 0; x < next; x += 64) _mm_prefetch(kn + x, _MM_HINT_T1);
      }
    }
    live.clear();
    for (int64_t r = 0; r < R; ++r) {
      const int64_t last = end - T + r % T;  // rows are (head, token), token fastest
      float* s = scores.data() + r * kBlock;
      __m512 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(q + r * D + 16 * c);
      bool any = false;
      float m = row_max[r];
      for (int64_t group = 0; group < kBlock; group += 16) {
        __mmask16 visible = 0;
        for (int i = 0; i < 16; ++i) visible |= static_cast<__mmask16>(pos[group + i] <= last) << i;
        if (visible == 0) {
          _mm512_storeu_ps(s + group, _mm512_set1_ps(kNoMax));
          continue;
        }
        __m512 dots[16];
        for (int i = 0; i < 16; ++i) {
          const E* kr = k_rows[group + i];
          __m512 d = _mm512_mul_ps(qr[0], load16(kr));
          for (int c = 1; c < C; ++c) d = _mm512_fmadd_ps(qr[c], load16(kr + 16 * c), d);
          dots[i] = d;
        }
        const __m512 block = _mm512_mask_blend_ps(visible, _mm512_set1_ps(kNoMax), reduce16(dots));
        _mm512_storeu_ps(s + group, block);
        m = std::max(m, _mm512_reduce_max_ps(block));
        any = true;
      }
      if (!any) continue;
      live.push_back(static_cast<int>(r));
      const float correction = std::exp(row_max[r] - m);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < kBlock; ++i) {
        const float x = s[i];
        const float p = x > 0.5f * kNoMax ? std::exp(x - m) : 0.0f;
        s[i] = p;
        sum += p;
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = m;
      if (correction != 1.0f) {
        float* ar = acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
      }
    }
    for (size_t first = 0; first < live.size(); first += kGroup) {
      const int g = static_cast<int>(std::min<size_t>(kGroup, live.size() - first));
      float* outs[kGroup];
      const float* probs[kGroup];
      for (int j = 0; j < g; ++j) {
        outs[j] = acc.data() + live[first + j] * D;
        probs[j] = scores.data() + live[first + j] * kBlock;
      }
      switch (g) {
        case 1: accumulate_values<D, 1, E>(outs, probs, v_rows, n); break;
        case 2: accumulate_values<D, 2, E>(outs, probs, v_rows, n); break;
        case 3: if constexpr (kGroup >= 3) accumulate_values<D, 3, E>(outs, probs, v_rows, n); break;
        default: if constexpr (kGroup >= 4) accumulate_values<D, 4, E>(outs, probs, v_rows, n); break;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / row_sum[r];
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
  }
}
#endif

template <int64_t D, typename E>
void run_task(const float* q, int64_t R, int64_t T, int64_t end, const E* k, const E* v,
              const Entries& entries, int64_t n, float* out) {
#ifdef MAGICDEC_AVX512
  if constexpr (D > 0 && D % 16 == 0 && D <= 128) {
    if (g_vector_path) return attend_task_avx512<D, E>(q, R, T, end, k, v, entries, n, out);
  }
#endif
  attend_task<D, E>(q, R, T, end, k, v, entries, n, out, D);
}

template <typename E>
torch::Tensor attend(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer, torch::Tensor slots,
                     torch::Tensor ends, int64_t T, const torch::Tensor* positions, const torch::Tensor* valid,
                     const torch::Tensor* entry_pos) {
  TORCH_CHECK(query.dtype() == torch::kFloat32, "float32 queries");
  TORCH_CHECK(k_layer.dtype() == v_layer.dtype(), "K and V of one dtype");
  TORCH_CHECK(query.is_contiguous() && k_layer.is_contiguous() && v_layer.is_contiguous(), "contiguous only");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2), D = query.size(3);
  TORCH_CHECK(D <= 256, "head_dim up to 256");
  const int64_t capacity = k_layer.size(2);
  auto out = torch::empty_like(query);
  const float* qp = query.data_ptr<float>();
  const E* kp = static_cast<const E*>(k_layer.data_ptr());
  const E* vp = static_cast<const E*>(v_layer.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ep = ends.data_ptr<int64_t>();
  const int64_t N = positions ? positions->size(2) : 0;
  const int64_t* pp = positions ? positions->data_ptr<int64_t>() : nullptr;
  const bool* vm = valid ? valid->data_ptr<bool>() : nullptr;
  const int64_t S = entry_pos ? entry_pos->size(1) : 0;
  const int64_t* xp = entry_pos ? entry_pos->data_ptr<int64_t>() : nullptr;
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t stop) {
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t b = task / KVH, h = task % KVH;
      const int64_t base = (sp[b] * KVH + h) * capacity * D;
      const float* q = qp + task * R * D;
      float* o = op + task * R * D;
      Entries entries;
      if (pp != nullptr) {
        entries.positions = pp + task * N;
        entries.valid = vm + task * N;
      }
      if (xp != nullptr) entries.entry_pos = xp + b * S;  // shared by the row's KV heads
      const int64_t n = pp ? N : (xp ? S : ep[b]);
      switch (D) {
        case 32: run_task<32, E>(q, R, T, ep[b], kp + base, vp + base, entries, n, o); break;
        case 64: run_task<64, E>(q, R, T, ep[b], kp + base, vp + base, entries, n, o); break;
        case 96: run_task<96, E>(q, R, T, ep[b], kp + base, vp + base, entries, n, o); break;
        case 128: run_task<128, E>(q, R, T, ep[b], kp + base, vp + base, entries, n, o); break;
        default: attend_task<0, E>(q, R, T, ep[b], kp + base, vp + base, entries, n, o, D);
      }
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
  TORCH_CHECK(k_layer.dtype() == torch::kFloat32, "float32 cache");
  return attend<float>(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr, nullptr);
}

// As attend_cached, over the listed positions only. positions: [B, kv_heads, N] int64 contiguous;
// valid: [B, kv_heads, N] bool contiguous.
torch::Tensor attend_positions(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                               torch::Tensor slots, torch::Tensor ends, int64_t T,
                               torch::Tensor positions, torch::Tensor valid) {
  TORCH_CHECK(positions.is_contiguous() && valid.is_contiguous(), "contiguous positions only");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && valid.dtype() == torch::kBool, "int64 positions, bool valid");
  TORCH_CHECK(k_layer.dtype() == torch::kFloat32, "float32 cache");
  return attend<float>(query, k_layer, v_layer, slots, ends, T, &positions, &valid, nullptr);
}

// Over every entry of a compact store: k_store, v_store [slots, kv_heads, S, D] float32 or
// bfloat16; entry_pos: [B, S] int64, the position each entry of row b holds (-1: empty).
torch::Tensor attend_entries(torch::Tensor query, torch::Tensor k_store, torch::Tensor v_store,
                             torch::Tensor slots, torch::Tensor ends, int64_t T, torch::Tensor entry_pos) {
  TORCH_CHECK(entry_pos.is_contiguous() && entry_pos.dtype() == torch::kInt64, "int64 entry positions");
  TORCH_CHECK(entry_pos.size(0) == query.size(0) && entry_pos.size(1) == k_store.size(2), "entry_pos: [B, S]");
  if (k_store.dtype() == torch::kBFloat16)
    return attend<uint16_t>(query, k_store, v_store, slots, ends, T, nullptr, nullptr, &entry_pos);
  TORCH_CHECK(k_store.dtype() == torch::kFloat32, "float32 or bfloat16 store");
  return attend<float>(query, k_store, v_store, slots, ends, T, nullptr, nullptr, &entry_pos);
}

// Whether tasks may take the AVX-512 implementation (when compiled in); returns whether it is compiled in.
bool use_vector_path(bool enabled) {
  g_vector_path = enabled;
#ifdef MAGICDEC_AVX512
  return true;
#else
  return false;
#endif
}

// The lean draft's element-wise ops (cpu_draft_ops.cpp).
torch::Tensor residual_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_layer,
                         torch::Tensor v_layer, torch::Tensor slots, torch::Tensor positions,
                         int64_t heads, int64_t kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_vector_path", &use_vector_path, "allow (true) or forbid (false) the AVX-512 path; says if it exists");
  m.def("attend_cached", &attend_cached, "fused attention over each row's whole cache (CPU, fp32)");
  m.def("attend_positions", &attend_positions, "fused attention over listed cache positions (CPU, fp32)");
  m.def("attend_entries", &attend_entries, "fused attention over a compact store's entries (CPU, fp32/bf16 K/V)");
  m.def("residual_rms_norm", &residual_rms_norm, "x += delta (if given), then RMSNorm(x) * weight (CPU, fp32)");
  m.def("rope_write", &rope_write, "RoPE on fused q|k|v, keys and values into the cache; returns the queries");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate|up projection (CPU, fp32)");
}
