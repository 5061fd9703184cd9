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
// Implementations: where the build and the CPU have AMX tiles, head sizes that are multiples of 32 take
// a task whose two products run on the tile unit at float32 accuracy (prefill_task_amx, below; tasks of
// 128 tokens); AVX-512 (multiples of 16) and AVX2 + FMA (multiples of 8) share one templated task over
// a small vector policy (V16 / V8); a portable task covers every head size up to kMaxHeadDim on any
// CPU. `prefill_use_vector_path(false)` (called by use_vector_path in cpu_attention.cpp) forces the
// portable one, `use_amx(false)` (cpu_linear.cpp: the one AMX switch) the vector one. A bfloat16 query
// over a bfloat16 cache (a bfloat16 model's prefill) takes, where the CPU has AVX512-BF16 and no AMX
// tiles, a task on bfloat16 dot products (prefill_task_bf16_dot: twice the multiply-adds per
// instruction, the probabilities rounded to bfloat16 as the model's own attention rounds them;
// `prefill_use_bf16_dot(false)` turns it off); elsewhere such a query is widened to float32.
// prefill_attention_mass (AMX tasks only) also returns the attention mass of each segment's last
// tokens (SnapKV's observation window), summed over them and each group's heads, from the same pass:
// such a tail is a task of its own per KV head, which keeps its blocks' probabilities and rescales them
// by the rows' final maxima and sums at the end; the outputs stay prefill_attention's bits.
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

#include "amx_tiles.h"    // MAGICDEC_AMX_TILES, TileConfig, amx_permitted, split_bf16
#include "vector_math.h"  // MAGICDEC_AVX2 / MAGICDEC_AVX512, to_float, load8/16, hmax8, hsum8, exp2_nonpos8/16

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
bool g_bf16_dot = true;  // a bfloat16 query over a bfloat16 cache may take the dot-product task

// Keys per block for head size D: kKeyBlockFloats / D, a multiple of kKeyAlign in [32, 128].
inline int64_t key_block(int64_t D) {
  const int64_t bk = (kKeyBlockFloats / D) / kKeyAlign * kKeyAlign;
  return std::min(kMaxKeyBlock, std::max(kMinKeyBlock, bk));
}

struct Problem {
  const float* query = nullptr;  // [N, H, D] (every task but the bfloat16 dot-product one)
  const uint16_t* query_bf16 = nullptr;  // [N, H, D] bfloat16 bits: the bfloat16 dot-product task's query
  const void* k;       // [slots, KVH, capacity, D], float or bf16 bits
  const void* v;
  float* out;          // [N, H, D]
  const int64_t* seg_slot;
  const int64_t* seg_start;
  const int64_t* seg_offset;
  int64_t H, KVH, group, D, capacity;
  float scale;
  int64_t tile_tokens;  // query tokens per task
  bool amx;             // tasks run on the AMX tile unit (prefill_task_amx)
  float* mass = nullptr;  // [S, KVH, mass_len]: the tail tasks' attention mass (prefill_attention_mass)
  int64_t mass_len = 0;
};

struct Task {
  int64_t seg, kv_head, t0, tokens;  // tokens t0 .. t0 + tokens - 1 of the segment
  double cost;                        // ~ query rows x keys seen
  bool mass = false;                  // a segment's tail: its rows' attention mass into Problem::mass
};

// Per-thread scratch, grown on demand and kept between calls (bfloat16 words for the AMX task's tiles).
struct Scratch {
  AlignedVector<float> buf[6];
  AlignedVector<uint16_t> words[5];
  float* get(int i, size_t n) {
    if (buf[i].size() < n) buf[i].resize(n);
    return buf[i].data();
  }
  uint16_t* get_words(int i, size_t n) {
    if (words[i].size() < n) words[i].resize(n);
    return words[i].data();
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

// A task's rows (r = t * group + j: token t, head j of the group), its first token's position, the
// keys its last token sees (positions < keys), and where its slot's K/V rows of its KV head start.
struct TaskSpan {
  int64_t rows, start, keys, base;
  TaskSpan(const Problem& pb, const Task& task)
      : rows(task.tokens * pb.group),
        start(pb.seg_start[task.seg] + task.t0),
        keys(start + task.tokens),
        base((pb.seg_slot[task.seg] * pb.KVH + task.kv_head) * pb.capacity * pb.D) {}
};

// Calls f(std::integral_constant<int, M>{}) for a register tile of M rows, 1 <= M <= Max.
template <int Max, class F>
inline void with_rows(int M, F&& f) {
  if constexpr (Max > 1) {
    if (M < Max) return with_rows<Max - 1>(M, f);
  }
  f(std::integral_constant<int, Max>{});
}

// For each register tile of up to Max of a task's R rows that sees any key of the block at kb (n keys):
// f(rows, r0, vis, ncols), rows a std::integral_constant<int, M> (the tile's rows r0 .. r0 + M - 1),
// vis[m] how many of the block's keys row r0 + m sees (its token's position start + (r0 + m) / group
// and every one before it; <= 0: none), ncols the most of them (the last row's: rows are token-major).
template <int Max, class F>
inline void for_each_tile(int64_t R, int64_t n, int64_t start, int64_t group, int64_t kb, F&& f) {
  for (int64_t r0 = 0; r0 < R; r0 += Max) {
    const int M = static_cast<int>(std::min<int64_t>(Max, R - r0));
    int64_t vis[Max];
    for (int m = 0; m < M; ++m) vis[m] = std::min(n, start + (r0 + m) / group + 1 - kb);
    const int64_t ncols = vis[M - 1];
    if (ncols <= 0) continue;  // the whole register tile is above the diagonal
    with_rows<Max>(M, [&](auto rows) { f(rows, r0, static_cast<const int64_t*>(vis), ncols); });
  }
}

// The task's rows divided by their softmax sums, into the output (a token's group heads contiguous).
inline void write_rows(const Problem& pb, const Task& task, const float* o, const float* row_sum) {
  const int64_t D = pb.D, group = pb.group;
  for (int64_t t = 0; t < task.tokens; ++t) {
    float* dst = pb.out + ((pb.seg_offset[task.seg] + task.t0 + t) * pb.H + task.kv_head * group) * D;
    for (int64_t j = 0; j < group; ++j) {
      const int64_t r = t * group + j;
      const float inv = 1.0f / row_sum[r];  // >= 1: every row sees position 0 and its own maximum
      for (int64_t d = 0; d < D; ++d) dst[j * D + d] = o[r * D + d] * inv;
    }
  }
}

template <class V, typename E>
void prefill_task_vector(const Problem& pb, const Task& task) {
  constexpr bool kWiden = !std::is_same<E, float>::value;
  const int64_t D = pb.D, group = pb.group, bk = key_block(D);
  const TaskSpan span(pb, task);
  const int64_t R = span.rows, start = span.start, keys = span.keys;
  const E* k = static_cast<const E*>(pb.k) + span.base;
  const E* v = static_cast<const E*>(pb.v) + span.base;
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
    for_each_tile<kRows>(R, n, start, group, kb, [&](auto rows, int64_t r0, const int64_t* vis, int64_t ncols) {
      row_tile<V, decltype(rows)::value>(q + r0 * D, o + r0 * D, row_max + r0, row_sum + r0, vis, ncols, D, kt, bk,
                                         vb, s);
    });
  }
  write_rows(pb, task, o, row_sum);
}
#endif  // any vector policy

#if defined(MAGICDEC_AVX512) && defined(__AVX512BF16__)
#define MAGICDEC_PREFILL_BF16_DOT 1
// The task for a bfloat16 query over a bfloat16 cache, on the CPU's bfloat16 dot products (AVX512-BF16:
// one instruction multiplies 16 pairs of bfloat16 and adds both products to 16 float32 sums, twice the
// multiply-adds of a float32 FMA). The tiles, causal cuts, key blocks and online softmax are the
// vector task's, with 12-row register tiles (AVX-512 has 32 registers). The operands go in pairs: K
// as its rows' 32-bit words (elements 2i, 2i+1) transposed, the query rows as words broadcast, so that
// S = Q K^T has exact products summed in float32 and is scaled afterwards (the query stays the model's
// bfloat16 values); then the probabilities are rounded to bfloat16 in pairs of keys, V is packed as
// pairs of key rows interleaved, and O += P V sums exact products of those in float32. So the only
// rounding beyond float32 sums is that of the probabilities to bfloat16, what a bfloat16 model's own
// attention does (transformers' eager path casts its float32 softmax to the query's dtype): each is
// off by at most 2^-8 of itself, so a row's output is off the float32 result by at most 2^-8 of the
// largest |V| entry it sees (the tests' bound; 1.6-1.7x the widened task's speed at 512 tokens over
// 2-3K cached on a Zen 4, BENCHMARKS.md section 41). A row's bits do not depend on the other rows of
// its tile or task (its sums run over the same key blocks, and keys it does not see add exact zeros),
// so chunking, packing and reuse change none.
constexpr int kRowsBf16 = 12;  // 12 x 2 accumulators + 2 loads + 1 broadcast = 27 of 32 registers

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

inline __m512bh broadcast_word(const uint32_t* p) {  // *p (two bfloat16) in all 16 lanes; read by memcpy,
  int32_t w;                                           // as the scratch holds it as bfloat16 elements
  std::memcpy(&w, p, sizeof(w));
  return as_bh(_mm512_set1_epi32(w));
}

// vw[cp * D + d] = the word (v_rows[2cp][d], v_rows[2cp + 1][d]) for cp < n_pad / 2 (rows >= n: 0).
inline void pack_value_pairs(const uint16_t* v_rows, int64_t D, int64_t n, int64_t n_pad, uint32_t* vw) {
  alignas(64) uint16_t idx[32];
  for (int j = 0; j < 16; ++j) {
    idx[2 * j] = static_cast<uint16_t>(j);            // element j of the first row
    idx[2 * j + 1] = static_cast<uint16_t>(32 + j);   // element j of the second
  }
  const __m512i pick = _mm512_load_si512(idx);
  for (int64_t c = 0; c < n_pad; c += 2) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      const __m512i low =
          c < n ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows + c * D + d0)))
                : _mm512_setzero_si512();
      const __m512i high =
          c + 1 < n
              ? _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v_rows + (c + 1) * D + d0)))
              : _mm512_setzero_si512();
      _mm512_storeu_si512(vw + (c / 2) * D + d0, _mm512_permutex2var_epi16(low, pick, high));
    }
  }
}

// s[m * bk + 0 .. 32) = q[m] . kt[:, 0 .. 32) for M rows: q rows of Dw words, ktw [Dw, bk] words.
template <int M>
inline void qk_tile_bf16(const uint32_t* __restrict q, int64_t Dw, const uint32_t* __restrict ktw, int64_t bk,
                         float* __restrict s) {
  __m512 acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t w = 0; w < Dw; ++w) {
    const __m512bh b0 = as_bh(_mm512_loadu_si512(ktw + w * bk)), b1 = as_bh(_mm512_loadu_si512(ktw + w * bk + 16));
    for (int m = 0; m < M; ++m) {
      const __m512bh a = broadcast_word(q + m * Dw + w);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm512_storeu_ps(s + m * bk, acc[m][0]);
    _mm512_storeu_ps(s + m * bk + 16, acc[m][1]);
  }
}

// o[m][0 .. 16 NV) = o[m][...] * corr[m] + sum over key pairs cp < pairs of the words p[m * bkw + cp]
// (two probabilities) dotted with vw[cp * D + ...] (two V rows' elements), for M rows.
template <int M, int NV>
inline void pv_tile_bf16(float* __restrict o, int64_t D, const uint32_t* __restrict p, int64_t bkw,
                         const float* __restrict corr, const uint32_t* __restrict vw, int64_t pairs) {
  __m512 acc[M][NV];
  for (int m = 0; m < M; ++m) {
    const __m512 c = _mm512_set1_ps(corr[m]);
    for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_mul_ps(c, _mm512_loadu_ps(o + m * D + j * 16));
  }
#pragma GCC unroll 4
  for (int64_t cp = 0; cp < pairs; ++cp) {
    __m512bh b[NV];
    for (int j = 0; j < NV; ++j) b[j] = as_bh(_mm512_loadu_si512(vw + cp * D + j * 16));
    for (int m = 0; m < M; ++m) {
      const __m512bh a = broadcast_word(p + m * bkw + cp);
      for (int j = 0; j < NV; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], a, b[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(o + m * D + j * 16, acc[m][j]);
}

// One register tile of M rows against one key block (row_tile's steps on bfloat16 pairs); qscale
// multiplies the raw scores (log2 units, as the vector task's pre-scaled queries give them).
template <int M>
void row_tile_bf16(const uint32_t* q, float* o, float* row_max, float* row_sum, const int64_t* vis, int64_t ncols,
                   int64_t D, const uint32_t* ktw, int64_t bk, const uint32_t* vw, float* s, uint32_t* pw,
                   float qscale) {
  using V = V16;
  const int64_t ncols_pad = (ncols + 31) / 32 * 32;
  for (int64_t c0 = 0; c0 < ncols_pad; c0 += 32) qk_tile_bf16<M>(q, D / 2, ktw + c0, bk, s + c0);
  const __m512 scale = _mm512_set1_ps(qscale);
  float corr[M];
  for (int m = 0; m < M; ++m) {
    float* sr = s + m * bk;
    uint32_t* pr = pw + m * (bk / 2);
    if (vis[m] <= 0) {  // sees nothing here: no change, zero probabilities
      for (int64_t c = 0; c < ncols_pad; c += 32) _mm512_storeu_si512(pr + c / 2, _mm512_setzero_si512());
      corr[m] = 1.0f;
      continue;
    }
    __m512 mx = V::set1(kNoMax);
    for (int64_t c = 0; c < ncols_pad; c += V::W) {
      const __m512 x = _mm512_mul_ps(V::load(sr + c), scale);
      V::store(sr + c, x);
      mx = V::max(mx, V::select(V::first(vis[m] - c), x, V::set1(kNoMax)));
    }
    const float mnew = std::max(row_max[m], V::hmax(mx));
    const __m512 mv = V::set1(mnew);
    __m512 sum = V::zero();
    for (int64_t c = 0; c < ncols_pad; c += 32) {
      const __m512 p0 = V::keep(V::first(vis[m] - c), V::exp2_nonpos(V::sub(V::load(sr + c), mv)));
      const __m512 p1 = V::keep(V::first(vis[m] - c - 16), V::exp2_nonpos(V::sub(V::load(sr + c + 16), mv)));
      sum = V::add(sum, V::add(p0, p1));
      const __m512bh words = _mm512_cvtne2ps_pbh(p1, p0);  // keys c .. c + 31 as 16 pairs, c first
      _mm512_storeu_si512(pr + c / 2, reinterpret_cast<const __m512i&>(words));
    }
    corr[m] = std::exp2(row_max[m] - mnew);
    row_sum[m] = row_sum[m] * corr[m] + V::hsum(sum);
    row_max[m] = mnew;
  }
  const int64_t pairs = (ncols + 1) / 2;
  int64_t d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) pv_tile_bf16<M, 2>(o + d0, D, pw, bk / 2, corr, vw + d0, pairs);
  if (d0 < D) pv_tile_bf16<M, 1>(o + d0, D, pw, bk / 2, corr, vw + d0, pairs);  // D % 32 == 16
}

void prefill_task_bf16_dot(const Problem& pb, const Task& task) {
  const int64_t D = pb.D, Dw = D / 2, group = pb.group, bk = key_block(D);
  const TaskSpan span(pb, task);
  const int64_t R = span.rows, start = span.start, keys = span.keys;
  const uint16_t* k = static_cast<const uint16_t*>(pb.k) + span.base;
  const uint16_t* v = static_cast<const uint16_t*>(pb.v) + span.base;
  // Word buffers (32-bit words of bfloat16 pairs) in the scratch's bfloat16 arrays, read and written
  // by vector loads and stores (and memcpy) only.
  uint32_t* q = reinterpret_cast<uint32_t*>(t_scratch.get_words(0, R * D));
  uint32_t* ktw = reinterpret_cast<uint32_t*>(t_scratch.get_words(1, D * bk));
  uint32_t* vw = reinterpret_cast<uint32_t*>(t_scratch.get_words(2, bk * D));
  uint32_t* pw = reinterpret_cast<uint32_t*>(t_scratch.get_words(3, kRowsBf16 * bk));
  float* o = t_scratch.get(1, R * D);
  float* stats = t_scratch.get(2, 2 * R);  // row max, then row sum
  float* s = t_scratch.get(4, kRowsBf16 * bk);
  float* row_max = stats;
  float* row_sum = stats + R;
  for (int64_t t = 0; t < task.tokens; ++t) {  // a token's group heads are contiguous in the query
    const uint16_t* src = pb.query_bf16 + ((pb.seg_offset[task.seg] + task.t0 + t) * pb.H + task.kv_head * group) * D;
    std::memcpy(q + t * group * Dw, src, group * D * sizeof(uint16_t));
  }
  std::fill(o, o + R * D, 0.0f);
  std::fill(row_max, row_max + R, kNoMax);
  std::fill(row_sum, row_sum + R, 0.0f);
  for (int64_t kb = 0; kb < keys; kb += bk) {
    const int64_t n = std::min(bk, keys - kb);
    const int64_t n_pad = (n + 31) / 32 * 32;
    // K's rows as Dw words each, transposed ([Dw, bk] words): the float32 packer moves 32-bit lanes.
    pack_keys(reinterpret_cast<const float*>(k + kb * D), Dw, n, n_pad, reinterpret_cast<float*>(ktw), bk);
    pack_value_pairs(v + kb * D, D, n, n_pad, vw);
    for_each_tile<kRowsBf16>(R, n, start, group, kb, [&](auto rows, int64_t r0, const int64_t* vis, int64_t ncols) {
      row_tile_bf16<decltype(rows)::value>(q + r0 * Dw, o + r0 * D, row_max + r0, row_sum + r0, vis, ncols, D, ktw,
                                           bk, vw, s, pw, pb.scale * kLog2e);
    });
  }
  write_rows(pb, task, o, row_sum);
}
#endif  // MAGICDEC_PREFILL_BF16_DOT

#if defined(MAGICDEC_AMX_TILES) && !defined(MAGICDEC_PREFILL_TEST_POLICY)  // (the test build checks the vector task)
#define MAGICDEC_PREFILL_AMX 1
// The task by the AMX tile unit (float32 or bfloat16 K/V, head sizes that are multiples of 32): the
// tiles of query rows, causal cuts and online softmax of the vector task, with both products on the
// tiles, S = Q K^T and O += P V, in bfloat16 parts of float32 accuracy. The queries (once per task),
// the probabilities (per block) and float32 K / V (per block, shared by the task's row tiles) are each
// split into three bfloat16 parts (amx_tiles.h: by truncation, the parts sum to the float32 value); a
// product of two split operands takes the six part products a + b <= 2 (the three dropped are below
// float32's rounding), a bfloat16 cache's K / V are one exact part, so three. The tile unit sums in
// float32 in a fixed order per element, so a row's output does not depend on the other rows of its
// tile or task: how a prompt is cut into chunks, packed or reused changes no bit, as with the vector
// task. Per pair of 16-row tiles and block of 64 keys: the scores 32 keys at a time in four C tiles
// (2 row tiles x 2 key tiles, B = K's rows as bfloat16 pairs transposed once per block), so that four
// independent sums alternate; the softmax by AVX-512 on the stored scores (the 32 rows' corrections
// in two vectors, exactly 1 where a row's maximum stays); then P's parts against V's (pairs of key
// rows interleaved), 32 outputs at a time, added to the float32 O rows with the rows' corrections.
// Tasks of 128 tokens (kAmxTaskRows) split each block for 12 pairs of row tiles. Measured against
// the vector task in BENCHMARKS.md section 33.
using magicdec_amx::split_bf16;
using magicdec_amx::TileConfig;

constexpr int kAmxRows = 16;                // query rows per tile
constexpr int64_t kAmxKeys = 64;            // keys per block: four 16-key score tiles, two P V depth tiles
constexpr int kScoreTiles = kAmxKeys / 16, kDepthTiles = kAmxKeys / 32;
constexpr int kWords = 32;                  // bfloat16 per tile row (64 bytes)
constexpr int64_t kTileWords = 16 * kWords; // one 1 KB tile
constexpr int kQParts = 3;                  // float32 queries and probabilities: three parts
constexpr int64_t kAmxTaskRows = 384;       // query rows per task (128 tokens x 3 heads): a key block is
                                            // split into tiles once per task, for 12 pairs of row tiles

// In place: r[i] (16 dwords each) becomes column i of the 16 x 16 matrix of dwords r.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // r[4g + j], 128-bit lane L: rows 4g .. 4g + 3 of column 4L + j
    r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // then a 4 x 4 transpose of 128-bit lanes
    const __m512i v0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    t[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    t[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    t[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A block's n <= kAmxKeys rows of K or V [n, D] -> their P bfloat16 parts [P][kAmxKeys][D], rows past n zero.
template <int P, typename E>
void split_block_rows(const E* x, int64_t D, int64_t n, uint16_t* parts) {
  for (int64_t c = 0; c < kAmxKeys; ++c)
    for (int64_t d = 0; d < D; d += kWords) {
      __m512i part[P];
      if (c < n) {
        split_bf16<P>(load16(x + c * D + d), load16(x + c * D + d + 16), part);
      } else {
        for (int p = 0; p < P; ++p) part[p] = _mm512_setzero_si512();
      }
      for (int p = 0; p < P; ++p) _mm512_store_si512(parts + (p * kAmxKeys + c) * D + d, part[p]);
    }
}

// Split K rows [P][kAmxKeys][D] -> B tiles [P][key tile][depth chunk][16 pairs i][16 keys][2]: pair i
// of key c is its elements 2i, 2i + 1 of the chunk (a 16 x 16 transpose of 32-bit pairs).
template <int P>
void key_tiles(const uint16_t* parts, int64_t D, uint16_t* tiles) {
  const int64_t chunks = D / kWords;
  for (int p = 0; p < P; ++p)
    for (int kt = 0; kt < kScoreTiles; ++kt)
      for (int64_t dc = 0; dc < chunks; ++dc) {
        __m512i r[16];
        for (int c = 0; c < 16; ++c) r[c] = _mm512_load_si512(parts + (p * kAmxKeys + kt * 16 + c) * D + dc * kWords);
        transpose16(r);
        uint16_t* tile = tiles + ((p * kScoreTiles + kt) * chunks + dc) * kTileWords;
        for (int i = 0; i < 16; ++i) _mm512_store_si512(tile + i * kWords, r[i]);
      }
}

// Split V rows [P][kAmxKeys][D] -> B tiles [P][depth tile][output tile][16 key pairs i][16 outputs][2]:
// pair i of output j is rows 2i, 2i + 1 (of the depth tile's 32) of column j, interleaved word by word.
template <int P>
void value_tiles(const uint16_t* parts, int64_t D, uint16_t* tiles) {
  alignas(64) static const uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  const int64_t dtiles = D / 16;
  for (int p = 0; p < P; ++p)
    for (int kd = 0; kd < kDepthTiles; ++kd)
      for (int i = 0; i < 16; ++i)
        for (int64_t g = 0; g < D / kWords; ++g) {
          const uint16_t* row = parts + (p * kAmxKeys + kd * 32 + 2 * i) * D + g * kWords;
          const __m512i a = _mm512_load_si512(row), b = _mm512_load_si512(row + D);
          uint16_t* tile = tiles + ((p * kDepthTiles + kd) * dtiles + 2 * g) * kTileWords + i * kWords;
          _mm512_store_si512(tile, _mm512_permutex2var_epi16(a, low, b));
          _mm512_store_si512(tile + kTileWords, _mm512_permutex2var_epi16(a, high, b));
        }
}

// C tiles 0..3 += the 2 x 2 products of A tiles 4, 5 (two 16-row tiles) and B tiles 6, 7 (two
// 16-column tiles): four independent sums in a row, so that none waits on its own last product.
inline void products_2x2() {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// C tiles 0..3 (+)= A . B over the split parts, those of a + b <= 2: A part a of the two row tiles at
// a0, a1 (kParts tiles each, part a at + a tiles), B part b of the two column tiles at b0, b1 (parts
// b_stride words apart). bparts: B's parts (1: exact bfloat16, 3: split float32).
inline void split_products(const uint16_t* a0, const uint16_t* a1, const uint16_t* b0, const uint16_t* b1,
                           int64_t b_stride, int bparts) {
  for (int bp = 0; bp < bparts; ++bp) {
    _tile_loadd(6, b0 + bp * b_stride, 64);
    _tile_loadd(7, b1 + bp * b_stride, 64);
    for (int ap = 0; ap + bp <= 2; ++ap) {
      _tile_loadd(4, a0 + ap * kTileWords, 64);
      _tile_loadd(5, a1 + ap * kTileWords, 64);
      products_2x2();
    }
  }
}

// Store C tiles 0..3 (rows 0-15 / 16-31 x columns 0-15 / 16-31 of a 32 x 32 block) at c, rows `stride` floats apart.
inline void store_2x2(float* c, int64_t stride) {
  _tile_stored(0, c, stride * 4);
  _tile_stored(1, c + 16, stride * 4);
  _tile_stored(2, c + 16 * stride, stride * 4);
  _tile_stored(3, c + 16 * stride + 16, stride * 4);
}

inline void zero_2x2() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

template <typename E>
void prefill_task_amx(const Problem& pb, const Task& task) {
  constexpr int KP = std::is_same<E, float>::value ? 3 : 1;  // parts of K and V
  const int64_t D = pb.D, group = pb.group, chunks = D / kWords, dtiles = D / 16;
  const int64_t R = task.tokens * group;                       // rows r = t * group + j
  const int64_t pairs = (R + 2 * kAmxRows - 1) / (2 * kAmxRows);  // 32-row pairs of tiles
  const int64_t mtiles = 2 * pairs, padded = mtiles * kAmxRows;
  const int64_t start = pb.seg_start[task.seg] + task.t0;  // position of the tile's first token
  const int64_t keys = start + task.tokens;                // the last token sees positions < keys
  const int64_t base = (pb.seg_slot[task.seg] * pb.KVH + task.kv_head) * pb.capacity * D;
  const E* k = static_cast<const E*>(pb.k) + base;
  const E* v = static_cast<const E*>(pb.v) + base;
  uint16_t* qa = t_scratch.get_words(0, mtiles * chunks * kQParts * kTileWords);  // [mtile][chunk][part] A tiles
  uint16_t* rows = t_scratch.get_words(1, KP * kAmxKeys * D);                     // a block's split rows
  uint16_t* kb = t_scratch.get_words(2, KP * kScoreTiles * chunks * kTileWords);
  uint16_t* vb = t_scratch.get_words(3, KP * kDepthTiles * dtiles * kTileWords);
  uint16_t* pa = t_scratch.get_words(4, 2 * kDepthTiles * kQParts * kTileWords);  // P's parts [mtile][depth tile][part]
  float* o = t_scratch.get(0, padded * D);
  float* stats = t_scratch.get(1, 2 * padded);
  float* s = t_scratch.get(2, 2 * kAmxRows * kAmxKeys);  // a pair's scores [32 rows][64 keys]
  float* c = t_scratch.get(3, 2 * kAmxRows * 32);        // a pair's P V for 32 outputs [32 rows][32]
  float* row_max = stats;
  float* row_sum = stats + padded;
  const __m512 qscale = _mm512_set1_ps(pb.scale * kLog2e);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t mt = r / kAmxRows, m = r % kAmxRows;
    const float* src = r < R ? pb.query + ((pb.seg_offset[task.seg] + task.t0 + r / group) * pb.H +
                                          task.kv_head * group + r % group) * D
                             : nullptr;
    for (int64_t d = 0; d < D; d += kWords) {
      __m512i part[kQParts];
      if (src != nullptr) {
        split_bf16<kQParts>(_mm512_mul_ps(_mm512_loadu_ps(src + d), qscale),
                            _mm512_mul_ps(_mm512_loadu_ps(src + d + 16), qscale), part);
      } else {
        for (int p = 0; p < kQParts; ++p) part[p] = _mm512_setzero_si512();
      }
      for (int p = 0; p < kQParts; ++p)
        _mm512_store_si512(qa + ((mt * chunks + d / kWords) * kQParts + p) * kTileWords + m * kWords, part[p]);
    }
  }
  std::fill(o, o + padded * D, 0.0f);
  std::fill(row_max, row_max + padded, kNoMax);
  std::fill(row_sum, row_sum + padded, 0.0f);
  // A tail task keeps every block's probabilities [block][row][key] and the maximum each row's were
  // taken against [block][row], to rescale them by the final maxima and sums at the end (the mass).
  const int64_t n_blocks = (keys + kAmxKeys - 1) / kAmxKeys;
  float* block_probs = nullptr;
  float* block_maxima = nullptr;
  if (task.mass) {
    block_probs = t_scratch.get(4, n_blocks * padded * kAmxKeys);
    block_maxima = t_scratch.get(5, n_blocks * padded);
    std::fill(block_probs, block_probs + n_blocks * padded * kAmxKeys, 0.0f);
    std::fill(block_maxima, block_maxima + n_blocks * padded, kNoMax);
  }
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.colsb[tile] = 64;
    config.rows[tile] = 16;
  }
  asm volatile("" : : "r"(&config) : "memory");  // keep the stores ldtilecfg reads (see cpu_linear.cpp)
  _tile_loadconfig(&config);
  constexpr int64_t kRows2 = 2 * kAmxRows;
  for (int64_t kb0 = 0; kb0 < keys; kb0 += kAmxKeys) {
    const int64_t n = std::min(kAmxKeys, keys - kb0);
    split_block_rows<KP>(k + kb0 * D, D, n, rows);
    key_tiles<KP>(rows, D, kb);
    split_block_rows<KP>(v + kb0 * D, D, n, rows);
    value_tiles<KP>(rows, D, vb);
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t r0 = pair * kRows2, here = std::min<int64_t>(kRows2, R - r0);
      if (kb0 > start + (r0 + here - 1) / group) continue;  // every row of the pair is above the diagonal
      // scores [32 rows][64 keys], 32 keys at a time: Q's parts (A) times K's (B)
      for (int kt = 0; kt < kScoreTiles; kt += 2) {
        zero_2x2();
        for (int64_t dc = 0; dc < chunks; ++dc) {
          const uint16_t* a0 = qa + ((2 * pair) * chunks + dc) * kQParts * kTileWords;
          const uint16_t* a1 = qa + ((2 * pair + 1) * chunks + dc) * kQParts * kTileWords;
          const uint16_t* b0 = kb + (kt * chunks + dc) * kTileWords;  // part p at + p * kScoreTiles * chunks tiles
          split_products(a0, a1, b0, b0 + chunks * kTileWords, kScoreTiles * chunks * kTileWords, KP);
        }
        store_2x2(s + 16 * kt, kAmxKeys);
      }
      // online softmax (log2 units): each row's block maximum, then the new maxima and the
      // corrections of 16 rows at once (exactly 1 where a maximum stays), then P's parts into pa
      alignas(64) float block_max[kRows2], corr[kRows2];
      int64_t vis[kRows2];
      for (int m = 0; m < kRows2; ++m) {
        vis[m] = m < here ? std::min(n, start + (r0 + m) / group + 1 - kb0) : 0;  // keys row m sees
        __m512 mx = _mm512_set1_ps(kNoMax);
        for (int j = 0; j < kScoreTiles && 16 * j < vis[m]; ++j)
          mx = _mm512_max_ps(mx, _mm512_mask_blend_ps(V16::first(vis[m] - 16 * j), _mm512_set1_ps(kNoMax),
                                                      _mm512_loadu_ps(s + m * kAmxKeys + 16 * j)));
        block_max[m] = _mm512_reduce_max_ps(mx);
      }
      for (int h = 0; h < kRows2; h += 16) {
        const __m512 old_max = _mm512_loadu_ps(row_max + r0 + h);
        const __m512 new_max = _mm512_max_ps(old_max, _mm512_load_ps(block_max + h));
        _mm512_store_ps(corr + h, _mm512_mask_blend_ps(_mm512_cmp_ps_mask(old_max, new_max, _CMP_EQ_OQ),
                                                       exp2_nonpos16(_mm512_sub_ps(old_max, new_max)),
                                                       _mm512_set1_ps(1.0f)));
        _mm512_storeu_ps(row_max + r0 + h, new_max);
      }
      for (int m = 0; m < kRows2; ++m) {
        const __m512 mv = _mm512_set1_ps(row_max[r0 + m]);
        __m512 sum = _mm512_setzero_ps();
        uint16_t* prow = pa + (m / kAmxRows) * kDepthTiles * kQParts * kTileWords + (m % kAmxRows) * kWords;
        for (int kd = 0; kd < kDepthTiles; ++kd) {  // keys 32 kd .. 32 kd + 31: one row of depth tile kd
          __m512i part[kQParts];
          if (32 * kd < vis[m]) {
            const float* sr = s + m * kAmxKeys + 32 * kd;
            const __m512 p0 = _mm512_maskz_mov_ps(V16::first(vis[m] - 32 * kd),
                                                  exp2_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sr), mv)));
            const __m512 p1 = _mm512_maskz_mov_ps(V16::first(vis[m] - 32 * kd - 16),
                                                  exp2_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sr + 16), mv)));
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            split_bf16<kQParts>(p0, p1, part);
            if (block_probs != nullptr) {
              float* kept = block_probs + ((kb0 / kAmxKeys) * padded + r0 + m) * kAmxKeys + 32 * kd;
              _mm512_storeu_ps(kept, p0);
              _mm512_storeu_ps(kept + 16, p1);
            }
          } else {
            for (int p = 0; p < kQParts; ++p) part[p] = _mm512_setzero_si512();
          }
          for (int p = 0; p < kQParts; ++p) _mm512_store_si512(prow + (kd * kQParts + p) * kTileWords, part[p]);
        }
        if (vis[m] > 0) row_sum[r0 + m] = row_sum[r0 + m] * corr[m] + _mm512_reduce_add_ps(sum);
        if (block_maxima != nullptr && vis[m] > 0) block_maxima[(kb0 / kAmxKeys) * padded + r0 + m] = row_max[r0 + m];
      }
      // values, 32 outputs at a time: P's parts (A) times V's (B) over both depth tiles, then O = O * corr + C
      for (int64_t dt = 0; dt < dtiles; dt += 2) {
        zero_2x2();
        for (int kd = 0; kd < kDepthTiles; ++kd) {
          const uint16_t* a0 = pa + kd * kQParts * kTileWords;
          const uint16_t* a1 = a0 + kDepthTiles * kQParts * kTileWords;
          const uint16_t* b0 = vb + (kd * dtiles + dt) * kTileWords;  // part p at + p * kDepthTiles * dtiles tiles
          split_products(a0, a1, b0, b0 + kTileWords, kDepthTiles * dtiles * kTileWords, KP);
        }
        store_2x2(c, 32);
        for (int m = 0; m < here; ++m) {
          const __m512 cm = _mm512_set1_ps(corr[m]);
          float* orow = o + (r0 + m) * D + dt * 16;
          for (int j = 0; j < 2; ++j)
            _mm512_storeu_ps(orow + 16 * j, _mm512_fmadd_ps(_mm512_loadu_ps(orow + 16 * j), cm,
                                                            _mm512_load_ps(c + 32 * m + 16 * j)));
        }
      }
    }
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t token = pb.seg_offset[task.seg] + task.t0 + r / group;  // in the packed token axis
    float* dst = pb.out + (token * pb.H + task.kv_head * group + r % group) * D;
    const float inv = 1.0f / row_sum[r];  // >= 1: every row sees position 0 and its own maximum
    for (int64_t d = 0; d < D; ++d) dst[d] = o[r * D + d] * inv;
  }
  if (task.mass) {  // mass[j] = sum over rows of p(j) * 2^(its block's max - final max) / final sum, rows in order
    float* mass = pb.mass + (task.seg * pb.KVH + task.kv_head) * pb.mass_len;
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      alignas(64) float acc[kAmxKeys] = {};
      for (int64_t r = 0; r < R; ++r) {
        const float f = std::exp2(block_maxima[blk * padded + r] - row_max[r]) / row_sum[r];
        const float* p = block_probs + (blk * padded + r) * kAmxKeys;
        for (int64_t i = 0; i < kAmxKeys; ++i) acc[i] += f * p[i];
      }
      const int64_t len = std::min(kAmxKeys, keys - blk * kAmxKeys);
      std::copy(acc, acc + len, mass + blk * kAmxKeys);
    }
  }
}
#endif  // MAGICDEC_AMX_TILES

template <typename E>
void run_task(const Problem& pb, const Task& task) {
#ifdef MAGICDEC_PREFILL_BF16_DOT
  if constexpr (std::is_same<E, uint16_t>::value) {
    if (pb.query_bf16 != nullptr) return prefill_task_bf16_dot(pb, task);
  }
#endif
  if (g_vector_path) {
#ifdef MAGICDEC_PREFILL_TEST_POLICY  // tests only: prefill_w16_emulation.cpp runs the task with a
    // 16-lane policy emulated on AVX2, to exercise the AVX-512 path's tiling on machines without it
    if (pb.D % MAGICDEC_PREFILL_TEST_POLICY::W == 0)
      return prefill_task_vector<MAGICDEC_PREFILL_TEST_POLICY, E>(pb, task);
#endif
#ifdef MAGICDEC_PREFILL_AMX
    if (pb.amx) return prefill_task_amx<E>(pb, task);
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

// Whether a bfloat16 query over a bfloat16 cache, head size D, takes the dot-product task here: the build
// and CPU have AVX512-BF16, the vector tasks and this one are allowed, D is a multiple of 16, and no AMX
// tile unit takes prefill tasks (there the AMX task keeps them: not measured against this one).
bool prefill_bf16_dot_in_use(int64_t D) {
#ifdef MAGICDEC_PREFILL_BF16_DOT
  bool amx = false;
#ifdef MAGICDEC_PREFILL_AMX
  amx = magicdec_amx::amx_usable();
#endif
  return g_bf16_dot && g_vector_path && !amx && D % 16 == 0;
#else
  (void)D;
  return false;
#endif
}

// Allow (true) or forbid (false) the bfloat16 dot-product task; returns whether it is compiled in.
bool prefill_use_bf16_dot(bool enabled) {
  g_bf16_dot = enabled;
#ifdef MAGICDEC_PREFILL_BF16_DOT
  return true;
#else
  return false;
#endif
}

namespace {

// prefill_attention, and with seg_tail / mass (prefill_attention_mass) the tails' attention mass.
torch::Tensor run_prefill(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer, torch::Tensor seg_slot,
                          torch::Tensor seg_start, torch::Tensor seg_offset, torch::Tensor seg_len, double scale,
                          const int64_t* seg_tail, torch::Tensor* mass) {
  TORCH_CHECK((query.dtype() == torch::kFloat32 || query.dtype() == torch::kBFloat16) && query.is_contiguous() &&
              query.dim() == 3, "query: [N, H, D] float32 or bfloat16 contiguous");
  TORCH_CHECK(k_layer.dtype() == v_layer.dtype() && k_layer.is_contiguous() && v_layer.is_contiguous() &&
              k_layer.dim() == 4 && k_layer.sizes() == v_layer.sizes(),
              "K, V: [slots, KVH, capacity, D] contiguous, one dtype");
  const bool bf16 = k_layer.dtype() == torch::kBFloat16;
  // A bfloat16 query takes the dot-product task where it runs (see prefill_bf16_dot_in_use), which reads
  // it as it is; elsewhere it is widened to float32 (exactly) for the other tasks.
  const bool bf16_dot = query.dtype() == torch::kBFloat16 && bf16 && seg_tail == nullptr &&
                        prefill_bf16_dot_in_use(query.size(2));
  if (query.dtype() == torch::kBFloat16 && !bf16_dot) query = query.to(torch::kFloat32);
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
    if (seg_tail != nullptr) {
      TORCH_CHECK(seg_tail[s] >= 0 && seg_tail[s] <= len[s], "a segment's tail is at most its length");
      TORCH_CHECK(start[s] + len[s] <= mass->size(2), "the mass must cover every segment with a tail");
    }
  }
  // Tokens no segment covers are zeroed here; the tasks write every other one (no separate fill).
  auto out = torch::empty(query.sizes(), query.options().dtype(torch::kFloat32));
  {
    std::vector<char> covered(N, 0);
    for (int64_t s = 0; s < S; ++s) std::fill(covered.begin() + offset[s], covered.begin() + offset[s] + len[s], 1);
    float* op = out.data_ptr<float>();
    for (int64_t i = 0; i < N; ++i)
      if (!covered[i]) std::fill(op + i * H * D, op + (i + 1) * H * D, 0.0f);
  }

  Problem pb;
  if (bf16_dot) pb.query_bf16 = reinterpret_cast<const uint16_t*>(query.data_ptr());
  else pb.query = query.data_ptr<float>();
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
  pb.amx = false;
#ifdef MAGICDEC_PREFILL_AMX
  pb.amx = g_vector_path && D % kWords == 0 && magicdec_amx::amx_usable();
  pb.tile_tokens = std::max<int64_t>(1, (pb.amx ? kAmxTaskRows : kTileRows) / pb.group);
#else
  pb.tile_tokens = std::max<int64_t>(1, kTileRows / pb.group);
#endif
  if (seg_tail != nullptr) {
    TORCH_CHECK(pb.amx, "prefill attention mass: only the AMX task computes it (prefill_mass_on_amx)");
    pb.mass = mass->data_ptr<float>();
    pb.mass_len = mass->size(2);
  }

  // Tasks of up to tile_tokens tokens; a segment's tail (its last seg_tail[s] tokens) is one task of
  // its own per KV head, whatever its length, so that one task writes each (segment, KV head)'s mass.
  std::vector<Task> tasks;
  auto add_tasks = [&](int64_t s, int64_t from, int64_t to, int64_t step, bool with_mass) {
    for (int64_t t0 = from; t0 < to; t0 += step) {
      const int64_t tokens = std::min(step, to - t0);
      const double cost = static_cast<double>(tokens) * (static_cast<double>(start[s] + t0) + 0.5 * tokens + 1.0);
      for (int64_t h = 0; h < KVH; ++h) tasks.push_back({s, h, t0, tokens, cost, with_mass});
    }
  };
  for (int64_t s = 0; s < S; ++s) {
    const int64_t tail = seg_tail != nullptr ? seg_tail[s] : 0;
    add_tasks(s, 0, len[s] - tail, pb.tile_tokens, false);
    if (tail > 0) add_tasks(s, len[s] - tail, len[s], tail, true);
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  if (bf16) run_all<uint16_t>(pb, tasks);
  else run_all<float>(pb, tasks);
  return out;
}

}  // namespace

// query: [N, H, D] float32 (or bfloat16: see prefill_bf16_dot_in_use) contiguous (token-major:
// transformers' [1, N, H, D]); k_layer, v_layer:
// [slots, KVH, capacity, D] float32 or bfloat16 contiguous, the segments' new K/V already written;
// seg_slot, seg_start, seg_offset, seg_len: [S] int64. Segments must not overlap in the token axis;
// tokens no segment covers come out as zeros. scale multiplies q.k (e.g. D^-0.5).
// Returns [N, H, D] float32: token i of segment s attends causally to positions
// 0 .. seg_start[s] + i of slot seg_slot[s].
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                torch::Tensor seg_slot, torch::Tensor seg_start, torch::Tensor seg_offset,
                                torch::Tensor seg_len, double scale) {
  return run_prefill(query, k_layer, v_layer, seg_slot, seg_start, seg_offset, seg_len, scale, nullptr, nullptr);
}

// prefill_attention, plus the attention mass of each segment's last seg_tail[s] tokens (SnapKV's
// observation window; [S] int64, 0: none): mass [S, KVH, mass_len] float32, mass[s, h, j] = the softmax
// probability those tokens' queries of KV head h's group put on position j, summed over them (zero past
// the segment's end and for segments without a tail). From the same pass, on the AMX tile unit only
// (prefill_mass_on_amx); the outputs are prefill_attention's, bit for bit.
std::vector<torch::Tensor> prefill_attention_mass(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                                  torch::Tensor seg_slot, torch::Tensor seg_start,
                                                  torch::Tensor seg_offset, torch::Tensor seg_len,
                                                  torch::Tensor seg_tail, int64_t mass_len, double scale) {
  TORCH_CHECK(seg_tail.dtype() == torch::kInt64 && seg_tail.is_contiguous() && seg_tail.dim() == 1 &&
              seg_tail.numel() == seg_slot.numel(), "seg_tail: [S] int64 contiguous");
  auto mass = torch::zeros({seg_slot.numel(), k_layer.size(1), mass_len}, query.options().dtype(torch::kFloat32));
  auto out = run_prefill(query, k_layer, v_layer, seg_slot, seg_start, seg_offset, seg_len, scale,
                         seg_tail.data_ptr<int64_t>(), &mass);
  return {out, mass};
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

// Whether prefill_attention_mass can take head size D here (its tasks on the AMX tile unit).
bool prefill_mass_on_amx(int64_t D) {
#ifdef MAGICDEC_PREFILL_AMX
  return g_vector_path && D % kWords == 0 && magicdec_amx::amx_usable();
#else
  (void)D;
  return false;
#endif
}

// Whether prefill tasks of head sizes that are multiples of 32 run on the AMX tile unit here.
bool prefill_amx_in_use() {
#ifdef MAGICDEC_PREFILL_AMX
  return magicdec_amx::amx_usable();
#else
  return false;
#endif
}
