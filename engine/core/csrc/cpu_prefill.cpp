// Causal chunked-prefill attention on the CPU, streaming the engine's KV cache (float32 or bfloat16).
//
// Packed ("varlen") input: the new tokens of S segments are concatenated along one token axis of the
// query [N, H, D]; segment s has seg_len[s] tokens starting at row seg_offset[s], lives in cache slot
// seg_slot[s], and its first token sits at cache position seg_start[s]. The new tokens' K/V must
// already be in the cache. Token i of segment s (at position seg_start[s] + i) attends to positions
// 0..seg_start[s] + i of its slot. Output [N, H, D] float32, the query's layout.
//
// Flash-attention style: tasks over (segment, KV head, tile of query tokens). A tile's query rows are
// (token, group head) pairs, token-major, so every K/V block is read once for the whole GQA group and
// the rows of one token are contiguous in the query and the output. Per key block (kKeyBlockFloats
// / D keys): K is packed transposed ([D, Bk], float32), then per register tile of kRows query rows:
// scores S = Q K^T by a register-blocked micro-kernel, an online-softmax update in log2 units (the
// queries are pre-scaled by scale * log2 e, so exp is a base-2 polynomial), and O = O * corr + P V by
// a second micro-kernel reading V rows in place (bfloat16 rows widened into scratch once per block).
// Key blocks above the causal diagonal of a register tile are skipped, and the diagonal ones are cut
// to the columns the tile's last row can see. No [heads, T, context] score matrix is ever formed.
// Tasks are scheduled heaviest first from a shared counter (tasks late in a long segment see more keys).
//
// Implementations: AVX-512 (head sizes that are multiples of 16) and AVX2 + FMA (multiples of 8)
// share one templated task over a small vector policy (V16 / V8); a portable task covers every head
// size up to kMaxHeadDim on any CPU. `prefill_use_vector_path(false)` (called by use_vector_path in
// cpu_attention.cpp) forces the portable one.
// Not here: decode/verify attention of a few tokens per row (cpu_attention.cpp), writing K/V into the
// cache, sliding windows, ALiBi, soft-capping, dropout.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vector_math.h"  // MAGICDEC_AVX2 / MAGICDEC_AVX512, to_float, load8, hmax8, hsum8, exp2_nonpos8/16

namespace {

using namespace magicdec_vec;

constexpr int64_t kMaxHeadDim = 256;          // larger head sizes are rejected (no supported model has
                                              // one; it bounds the per-thread scratch)
constexpr int64_t kTileRows = 96;             // target query rows per task (96 = 3 heads x 32 tokens:
                                              // Q, O tiles ~24 KB each at D = 64, in L2)
constexpr int64_t kKeyBlockFloats = 4096;     // one packed K^T block (or V block) is 16 KB: it stays in
                                              // L1 (32 KB) while every register tile of the task uses it
constexpr int64_t kKeyAlign = 32;             // key blocks are a multiple of the widest column tile
constexpr int64_t kMinKeyBlock = 32, kMaxKeyBlock = 128;  // 2048..8192 floats per block and 48..192
                                              // tile rows measured within noise of these at D = 64, 128
bool g_vector_path = true;

// Keys per block for head size D: kKeyBlockFloats / D, a multiple of kKeyAlign in [32, 128].
inline int64_t key_block(int64_t D) {
  const int64_t bk = (kKeyBlockFloats / D) / kKeyAlign * kKeyAlign;
  return std::min(kMaxKeyBlock, std::max(kMinKeyBlock, bk));
}

struct Problem {
  const float* query;  // [N, H, D]
  const void* k;       // [slots, KVH, capacity, D], float or bf16 bits
  const void* v;
  float* out;          // [N, H, D]
  const int64_t* seg_slot;
  const int64_t* seg_start;
  const int64_t* seg_offset;
  int64_t H, KVH, group, D, capacity;
  float scale;
  int64_t tile_tokens;  // query tokens per task
};

struct Task {
  int64_t seg, kv_head, t0, tokens;  // tokens t0 .. t0 + tokens - 1 of the segment
  double cost;                        // ~ query rows x keys seen
};

// Per-thread scratch, grown on demand and kept between calls.
struct Scratch {
  AlignedVector<float> buf[6];
  float* get(int i, size_t n) {
    if (buf[i].size() < n) buf[i].resize(n);
    return buf[i].data();
  }
};
thread_local Scratch t_scratch;

// The portable task: each query row in turn, keys in blocks with an online softmax (natural exp).
template <typename E>
void prefill_task_portable(const Problem& pb, const Task& task) {
  const int64_t D = pb.D, group = pb.group, bk = key_block(D);
  const int64_t start = pb.seg_start[task.seg] + task.t0;  // position of the tile's first token
  const E* k = static_cast<const E*>(pb.k) + (pb.seg_slot[task.seg] * pb.KVH + task.kv_head) * pb.capacity * D;
  const E* v = static_cast<const E*>(pb.v) + (pb.seg_slot[task.seg] * pb.KVH + task.kv_head) * pb.capacity * D;
  float* s = t_scratch.get(0, bk);
  float* q = t_scratch.get(1, D);
  float* o = t_scratch.get(2, D);
  for (int64_t t = 0; t < task.tokens; ++t) {
    const int64_t token = pb.seg_offset[task.seg] + task.t0 + t;  // row in the packed token axis
    const int64_t keys = start + t + 1;                          // positions 0 .. start + t
    for (int64_t j = 0; j < group; ++j) {
      const int64_t head = task.kv_head * group + j;
      const float* qin = pb.query + (token * pb.H + head) * D;
      for (int64_t d = 0; d < D; ++d) q[d] = qin[d] * pb.scale;
      std::fill(o, o + D, 0.0f);
      float m = kNoMax, l = 0.0f;
      for (int64_t kb = 0; kb < keys; kb += bk) {
        const int64_t n = std::min(bk, keys - kb);
        float mb = m;
        for (int64_t c = 0; c < n; ++c) {
          const E* kr = k + (kb + c) * D;
          float dot = 0.0f;
          for (int64_t d = 0; d < D; ++d) dot += q[d] * to_float(kr[d]);
          s[c] = dot;
          mb = std::max(mb, dot);
        }
        const float corr = std::exp(m - mb);
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) o[d] *= corr;
        for (int64_t c = 0; c < n; ++c) {
          const float p = std::exp(s[c] - mb);
          sum += p;
          const E* vr = v + (kb + c) * D;
          for (int64_t d = 0; d < D; ++d) o[d] += p * to_float(vr[d]);
        }
        l = l * corr + sum;
        m = mb;
      }
      float* orow = pb.out + (token * pb.H + head) * D;
      const float inv = 1.0f / l;  // l >= 1: every row sees position 0 and its own maximum
      for (int64_t d = 0; d < D; ++d) orow[d] = o[d] * inv;
    }
  }
}

#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
// K blocks are packed with the 256-bit helpers by both vector policies (every AVX-512 CPU has AVX2).

// In place: r[j][i] becomes the old r[i][j] (8 x 8 floats).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {  // t[2i]: rows 2i, 2i+1 interleaved, lanes {0,1 | 4,5}; t[2i+1]: {2,3 | 6,7}
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + c]: column c (and c + 4 in the upper half) of rows 4h..4h+3
    u[4 * h + 0] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h + 0], t[4 * h + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);      // column c: lower halves
    r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);  // column c + 4: upper halves
  }
}

// kt[d * bk + c] = k_rows[c][d] for c < n (0 for n <= c < n_pad); D, n_pad multiples of 8.
template <typename E>
void pack_keys(const E* k_rows, int64_t D, int64_t n, int64_t n_pad, float* kt, int64_t bk) {
  for (int64_t c0 = 0; c0 < n_pad; c0 += 8) {
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = c0 + i < n ? load8(k_rows + (c0 + i) * D + d0) : _mm256_setzero_ps();
      transpose8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kt + (d0 + j) * bk + c0, r[j]);
    }
  }
}

inline void widen_rows(const uint16_t* src, int64_t count, float* dst) {  // count a multiple of 8
  for (int64_t i = 0; i < count; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
}

// The vector policies: one register type, its width, and the handful of operations the task uses.
// exp2_nonpos: 2^x for x <= 0 (vector_math.h).
#endif

#ifdef MAGICDEC_AVX2
struct V8 {
  using reg = __m256;
  using mask = __m256;
  static constexpr int W = 8;
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg x) { _mm256_storeu_ps(p, x); }
  static reg bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static reg set1(float x) { return _mm256_set1_ps(x); }
  static reg zero() { return _mm256_setzero_ps(); }
  static reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static mask first(int64_t count) {  // lanes i < count
    const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int32_t c = static_cast<int32_t>(std::max<int64_t>(-1, std::min<int64_t>(count, W)));
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(c), iota));
  }
  static reg select(mask m, reg x, reg fill) { return _mm256_blendv_ps(fill, x, m); }
  static reg keep(mask m, reg x) { return _mm256_and_ps(x, m); }
  static float hmax(reg x) { return hmax8(x); }
  static float hsum(reg x) { return hsum8(x); }
  static reg exp2_nonpos(reg x) { return exp2_nonpos8(x); }
};
#endif

#ifdef MAGICDEC_AVX512
struct V16 {
  using reg = __m512;
  using mask = __mmask16;
  static constexpr int W = 16;
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg x) { _mm512_storeu_ps(p, x); }
  static reg bcast(const float* p) { return _mm512_set1_ps(*p); }
  static reg set1(float x) { return _mm512_set1_ps(x); }
  static reg zero() { return _mm512_setzero_ps(); }
  static reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static mask first(int64_t count) {  // lanes i < count
    if (count <= 0) return 0;
    if (count >= W) return 0xFFFF;
    return static_cast<mask>((1u << count) - 1u);
  }
  static reg select(mask m, reg x, reg fill) { return _mm512_mask_blend_ps(m, fill, x); }
  static reg keep(mask m, reg x) { return _mm512_maskz_mov_ps(m, x); }
  static float hmax(reg x) { return _mm512_reduce_max_ps(x); }
  static float hsum(reg x) { return _mm512_reduce_add_ps(x); }
  static reg exp2_nonpos(reg x) { return exp2_nonpos16(x); }
};
#endif

#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
constexpr int kRows = 6;  // query rows per register tile: 6 x 2 accumulators + 2 loads + 1 broadcast
                          // = 15 of AVX2's 16 registers

// s[m * bk + 0 .. 2W) = q[m] . kt[:, 0 .. 2W) for M query rows (q rows D apart, kt [D, bk]).
template <class V, int M>
inline void qk_tile(const float* __restrict q, int64_t D, const float* __restrict kt, int64_t bk,
                    float* __restrict s) {
  using reg = typename V::reg;
  reg acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = V::zero();
#pragma GCC unroll 4
  for (int64_t d = 0; d < D; ++d) {
    const reg b0 = V::load(kt + d * bk), b1 = V::load(kt + d * bk + V::W);
    for (int m = 0; m < M; ++m) {
      const reg a = V::bcast(q + m * D + d);
      acc[m][0] = V::fma(a, b0, acc[m][0]);
      acc[m][1] = V::fma(a, b1, acc[m][1]);
    }
  }
  for (int m = 0; m < M; ++m) {
    V::store(s + m * bk, acc[m][0]);
    V::store(s + m * bk + V::W, acc[m][1]);
  }
}

// o[m][0 .. NV W) = o[m][...] * corr[m] + sum_{c < n} p[m * bk + c] * v[c * D + 0 .. NV W) for M rows.
template <class V, int M, int NV>
inline void pv_tile(float* __restrict o, int64_t D, const float* __restrict p, int64_t bk,
                    const float* __restrict corr, const float* __restrict v, int64_t n) {
  using reg = typename V::reg;
  reg acc[M][NV];
  for (int m = 0; m < M; ++m) {
    const reg c = V::set1(corr[m]);
    for (int j = 0; j < NV; ++j) acc[m][j] = V::mul(c, V::load(o + m * D + j * V::W));
  }
#pragma GCC unroll 4
  for (int64_t c = 0; c < n; ++c) {
    reg b[NV];
    for (int j = 0; j < NV; ++j) b[j] = V::load(v + c * D + j * V::W);
    for (int m = 0; m < M; ++m) {
      const reg a = V::bcast(p + m * bk + c);
      for (int j = 0; j < NV; ++j) acc[m][j] = V::fma(a, b[j], acc[m][j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) V::store(o + m * D + j * V::W, acc[m][j]);
}

// One register tile of M query rows against one key block: scores, online softmax, values.
// vis[m]: how many of the block's keys row m sees (<= 0: none); ncols = max vis (> 0).
template <class V, int M>
void row_tile(const float* q, float* o, float* row_max, float* row_sum, const int64_t* vis, int64_t ncols,
              int64_t D, const float* kt, int64_t bk, const float* v, float* s) {
  using reg = typename V::reg;
  constexpr int64_t kCols = 2 * V::W;  // columns per score register tile
  const int64_t ncols_pad = (ncols + kCols - 1) / kCols * kCols;
  for (int64_t c0 = 0; c0 < ncols_pad; c0 += kCols) qk_tile<V, M>(q, D, kt + c0, bk, s + c0);
  float corr[M];
  for (int m = 0; m < M; ++m) {
    float* sr = s + m * bk;
    if (vis[m] <= 0) {  // sees nothing here: no change, zero probabilities
      for (int64_t c = 0; c < ncols_pad; c += V::W) V::store(sr + c, V::zero());
      corr[m] = 1.0f;
      continue;
    }
    reg mx = V::set1(kNoMax);
    for (int64_t c = 0; c < ncols_pad; c += V::W)
      mx = V::max(mx, V::select(V::first(vis[m] - c), V::load(sr + c), V::set1(kNoMax)));
    const float mnew = std::max(row_max[m], V::hmax(mx));
    const reg mv = V::set1(mnew);
    reg sum = V::zero();
    for (int64_t c = 0; c < ncols_pad; c += V::W) {
      const reg p = V::keep(V::first(vis[m] - c), V::exp2_nonpos(V::sub(V::load(sr + c), mv)));
      V::store(sr + c, p);
      sum = V::add(sum, p);
    }
    corr[m] = std::exp2(row_max[m] - mnew);
    row_sum[m] = row_sum[m] * corr[m] + V::hsum(sum);
    row_max[m] = mnew;
  }
  int64_t d0 = 0;
  for (; d0 + 2 * V::W <= D; d0 += 2 * V::W) pv_tile<V, M, 2>(o + d0, D, s, bk, corr, v + d0, ncols);
  if (d0 < D) pv_tile<V, M, 1>(o + d0, D, s, bk, corr, v + d0, ncols);  // D % (2W) == W
}

template <class V, typename E>
void prefill_task_vector(const Problem& pb, const Task& task) {
  constexpr bool kWiden = !std::is_same<E, float>::value;
  const int64_t D = pb.D, group = pb.group, bk = key_block(D);
  const int64_t R = task.tokens * group;                   // rows r = t * group + j
  const int64_t start = pb.seg_start[task.seg] + task.t0;  // position of the tile's first token
  const int64_t keys = start + task.tokens;                // the last token sees positions < keys
  const int64_t base = (pb.seg_slot[task.seg] * pb.KVH + task.kv_head) * pb.capacity * D;
  const E* k = static_cast<const E*>(pb.k) + base;
  const E* v = static_cast<const E*>(pb.v) + base;
  float* q = t_scratch.get(0, R * D);
  float* o = t_scratch.get(1, R * D);
  float* stats = t_scratch.get(2, 2 * R);  // row max, then row sum
  float* kt = t_scratch.get(3, D * bk);
  float* s = t_scratch.get(4, kRows * bk);
  float* vw = kWiden ? t_scratch.get(5, bk * D) : nullptr;
  float* row_max = stats;
  float* row_sum = stats + R;
  const float qscale = pb.scale * kLog2e;
  for (int64_t t = 0; t < task.tokens; ++t) {  // a token's group heads are contiguous in the query
    const float* src = pb.query + ((pb.seg_offset[task.seg] + task.t0 + t) * pb.H + task.kv_head * group) * D;
    float* dst = q + t * group * D;
    for (int64_t i = 0; i < group * D; ++i) dst[i] = src[i] * qscale;
  }
  std::fill(o, o + R * D, 0.0f);
  std::fill(row_max, row_max + R, kNoMax);
  std::fill(row_sum, row_sum + R, 0.0f);
  for (int64_t kb = 0; kb < keys; kb += bk) {
    const int64_t n = std::min(bk, keys - kb);
    const int64_t n_pad = (n + 2 * V::W - 1) / (2 * V::W) * (2 * V::W);
    pack_keys(k + kb * D, D, n, n_pad, kt, bk);
    const float* vb;
    if constexpr (kWiden) {
      widen_rows(v + kb * D, n * D, vw);
      vb = vw;
    } else {
      vb = v + kb * D;
    }
    for (int64_t r0 = 0; r0 < R; r0 += kRows) {
      const int M = static_cast<int>(std::min<int64_t>(kRows, R - r0));
      int64_t vis[kRows];
      for (int m = 0; m < M; ++m) vis[m] = std::min(n, start + (r0 + m) / group + 1 - kb);
      const int64_t ncols = vis[M - 1];  // rows are token-major: the last row sees the most
      if (ncols <= 0) continue;          // the whole register tile is above the diagonal
      float* orow = o + r0 * D;
      const float* qrow = q + r0 * D;
      switch (M) {
        case 6: row_tile<V, 6>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
        case 5: row_tile<V, 5>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
        case 4: row_tile<V, 4>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
        case 3: row_tile<V, 3>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
        case 2: row_tile<V, 2>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
        default: row_tile<V, 1>(qrow, orow, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk, vb, s); break;
      }
    }
  }
  for (int64_t t = 0; t < task.tokens; ++t) {
    float* dst = pb.out + ((pb.seg_offset[task.seg] + task.t0 + t) * pb.H + task.kv_head * group) * D;
    for (int64_t j = 0; j < group; ++j) {
      const int64_t r = t * group + j;
      const float inv = 1.0f / row_sum[r];  // >= 1: every row sees position 0 and its own maximum
      for (int64_t d = 0; d < D; ++d) dst[j * D + d] = o[r * D + d] * inv;
    }
  }
}
#endif  // any vector policy

template <typename E>
void run_task(const Problem& pb, const Task& task) {
  if (g_vector_path) {
#ifdef MAGICDEC_PREFILL_TEST_POLICY  // tests only: prefill_w16_emulation.cpp runs the task with a
    // 16-lane policy emulated on AVX2, to exercise the AVX-512 path's tiling on machines without it
    if (pb.D % MAGICDEC_PREFILL_TEST_POLICY::W == 0)
      return prefill_task_vector<MAGICDEC_PREFILL_TEST_POLICY, E>(pb, task);
#endif
#ifdef MAGICDEC_AVX512
    if (pb.D % V16::W == 0) return prefill_task_vector<V16, E>(pb, task);
#endif
#ifdef MAGICDEC_AVX2
    if (pb.D % V8::W == 0) return prefill_task_vector<V8, E>(pb, task);
#endif
  }
  prefill_task_portable<E>(pb, task);
}

template <typename E>
void run_all(const Problem& pb, const std::vector<Task>& tasks) {
  std::atomic<int64_t> next{0};
  const int64_t n_tasks = static_cast<int64_t>(tasks.size());
  // One invocation per thread; each pulls the heaviest task left (dynamic balance). If the range is
  // run inline (nested parallelism), the one invocation does every task.
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks)), 1,
                   [&](int64_t, int64_t) {
                     for (int64_t i = next.fetch_add(1); i < n_tasks; i = next.fetch_add(1))
                       run_task<E>(pb, tasks[i]);
                   });
}

}  // namespace

// query: [N, H, D] float32 contiguous (token-major: transformers' [1, N, H, D]); k_layer, v_layer:
// [slots, KVH, capacity, D] float32 or bfloat16 contiguous, the segments' new K/V already written;
// seg_slot, seg_start, seg_offset, seg_len: [S] int64. Segments must not overlap in the token axis;
// tokens no segment covers come out as zeros. scale multiplies q.k (e.g. D^-0.5).
// Returns [N, H, D] float32: token i of segment s attends causally to positions
// 0 .. seg_start[s] + i of slot seg_slot[s].
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                torch::Tensor seg_slot, torch::Tensor seg_start, torch::Tensor seg_offset,
                                torch::Tensor seg_len, double scale) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.is_contiguous() && query.dim() == 3,
              "query: [N, H, D] float32 contiguous");
  TORCH_CHECK(k_layer.dtype() == v_layer.dtype() && k_layer.is_contiguous() && v_layer.is_contiguous() &&
              k_layer.dim() == 4 && k_layer.sizes() == v_layer.sizes(),
              "K, V: [slots, KVH, capacity, D] contiguous, one dtype");
  const bool bf16 = k_layer.dtype() == torch::kBFloat16;
  TORCH_CHECK(bf16 || k_layer.dtype() == torch::kFloat32, "float32 or bfloat16 K/V");
  for (const auto* t : {&seg_slot, &seg_start, &seg_offset, &seg_len})
    TORCH_CHECK(t->dtype() == torch::kInt64 && t->is_contiguous() && t->dim() == 1 &&
                t->numel() == seg_slot.numel(), "segment tensors: [S] int64 contiguous");
  const int64_t N = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t KVH = k_layer.size(1), capacity = k_layer.size(2);
  TORCH_CHECK(k_layer.size(3) == D, "query and cache disagree on head_dim");
  TORCH_CHECK(D >= 1 && D <= kMaxHeadDim, "head_dim up to 256");
  TORCH_CHECK(KVH >= 1 && H % KVH == 0, "heads must be a multiple of kv_heads");
  const int64_t S = seg_slot.numel();
  const int64_t* slot = seg_slot.data_ptr<int64_t>();
  const int64_t* start = seg_start.data_ptr<int64_t>();
  const int64_t* offset = seg_offset.data_ptr<int64_t>();
  const int64_t* len = seg_len.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(slot[s] >= 0 && slot[s] < k_layer.size(0), "segment slot out of range");
    TORCH_CHECK(len[s] >= 0 && start[s] >= 0 && start[s] + len[s] <= capacity, "segment beyond the cache");
    TORCH_CHECK(offset[s] >= 0 && offset[s] + len[s] <= N, "segment beyond the query's token axis");
  }
  // Tokens no segment covers are zeroed here; the tasks write every other one (no separate fill).
  auto out = torch::empty_like(query);
  {
    std::vector<char> covered(N, 0);
    for (int64_t s = 0; s < S; ++s) std::fill(covered.begin() + offset[s], covered.begin() + offset[s] + len[s], 1);
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < N; ++i)
      if (!covered[i]) std::fill(op + i * H * D, op + (i + 1) * H * D, 0.0f);
  }

  Problem pb;
  pb.query = query.data_ptr<float>();
  pb.k = k_layer.data_ptr();
  pb.v = v_layer.data_ptr();
  pb.out = out.data_ptr<float>();
  pb.seg_slot = slot;
  pb.seg_start = start;
  pb.seg_offset = offset;
  pb.H = H;
  pb.KVH = KVH;
  pb.group = H / KVH;
  pb.D = D;
  pb.capacity = capacity;
  pb.scale = static_cast<float>(scale);
  pb.tile_tokens = std::max<int64_t>(1, kTileRows / pb.group);

  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t0 = 0; t0 < len[s]; t0 += pb.tile_tokens) {
      const int64_t tokens = std::min(pb.tile_tokens, len[s] - t0);
      const double cost = static_cast<double>(tokens) * (static_cast<double>(start[s] + t0) + 0.5 * tokens + 1.0);
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({s, h, t0, tokens, cost});
    }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  if (bf16) run_all<uint16_t>(pb, tasks);
  else run_all<float>(pb, tasks);
  return out;
}

// Whether prefill tasks may take a vector implementation; returns whether one is compiled in.
bool prefill_use_vector_path(bool enabled) {
  g_vector_path = enabled;
#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
  return true;
#else
  return false;
#endif
}
