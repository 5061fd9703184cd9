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
// are float32 or bfloat16 (bf16 read as float32; all arithmetic in float32).
// `attend_cached_scores` also returns each position's attention mass (the final softmax probability
// summed over a group's query heads and new tokens), for attention-guided drafts, from the same pass.
// `attend_cached_shared` takes rows in groups whose slots hold the same K/V for a prefix (prefix
// reuse): one task per (group, KV head) folds each shared block into every member's online softmax
// (read once), then each member's own blocks; each vector task's block loop is shared by its group
// task, so per query row the arithmetic, and the output, is that of one task per row.
// Not here: prefill chunks (many new tokens per row; cpu_prefill.cpp), the draft's small element-wise
// ops (cpu_draft_ops.cpp), the few-row GEMM (cpu_linear.cpp); all bound below.
//
// Three implementations of one task, chosen at run time among those compiled in:
//  - portable (any head size, any CPU);
//  - AVX2 + FMA, head sizes 16..128 that are multiples of 8: scores 2 query rows x 4 entries per
//    register tile (each K chunk loaded once for 2 rows, one horizontal reduction per 4 dot products),
//    a vectorised base-2 exponential, values 2 query rows x 32 dims per register tile; bfloat16
//    blocks are widened once into a float32 scratch and shared by every query row; a block no query
//    row may see (a compact store's ring entries outside the view) is skipped unread;
//  - AVX-512, head sizes 32, 64, 96, 128: scores 16 entries per query row at once, the same base-2
//    exponential 16 lanes wide, up to 4 query rows' outputs per V row loaded; a block no query row
//    may see is skipped, and not prefetched by the block before it.
// The AVX2 and AVX-512 tasks each have a group task (attend_cached_shared) over the same block loop.
// Where both vector paths are compiled in, AVX-512 takes what it covers and AVX2 the rest.
// `use_vector_path(false)` forces the portable one (the tests check both).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "vector_math.h"  // MAGICDEC_AVX2 / MAGICDEC_AVX512, to_float, load8/16, hmax8, hsum8, exp2_nonpos8/16

namespace {

using namespace magicdec_vec;

constexpr int64_t kBlock = 64;    // entries per online-softmax block (a K and a V block fit in L1)
constexpr int64_t kMaxHeadDim = 256;  // the portable task's stack row; the vector ones stop at 128
bool g_vector_path = true;        // a vector task where one applies (tests switch it off)
// Code shared by a one-row and a group task, compiled once instead of inlined into each: under
// -ffast-math each inlined copy may be vectorised differently, and the outputs must be the same bits.
#if defined(__GNUC__)
#define MAGICDEC_ONE_COPY __attribute__((noinline))
#else
#define MAGICDEC_ONE_COPY
#endif

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

  // Whether any of entries [first, first + n) holds a position before `end` (dense rows always do).
  inline bool any_before(int64_t first, int64_t n, int64_t end) const {
    if (entry_pos == nullptr) return true;
    bool any = false;
    for (int64_t e = first; e < first + n; ++e) any |= entry_pos[e] >= 0 && entry_pos[e] < end;
    return any;
  }

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

// Where a task's attention mass goes (dense entries only: entry e is position e), and the scratch
// that makes it a by-product of the one pass over K/V: every block's probabilities, relative to the
// running max they were computed with, stay in `probs` [n_blocks, R, kBlock] (the task's score
// buffer, one [R, kBlock] slice per block instead of one reused slice) and that max in `block_max`
// [R, n_blocks]; at the end p_final = p_block * exp(block_max - final_max) / final_sum, summed over
// the R rows into `mass`.
struct MassOut {
  float* mass = nullptr;  // [n_entries] of this (row, KV head), zeroed by the caller
};

// Per-thread scratch, grown on demand and kept between tasks (a fresh large allocation per task
// would be an mmap and page faults every time).
struct Scratch {
  AlignedVector<float> buf[8];
  float* get(int i, size_t n) {
    if (buf[i].size() < n) buf[i].resize(n);
    return buf[i].data();
  }
};
thread_local Scratch t_scratch;

inline int64_t blocks_of(int64_t n) { return (n + kBlock - 1) / kBlock; }

// mass[e] = sum_r probs[block of e][r][e % kBlock] * f(r, block), f = base^(block_max - row_max) / row_sum
// (probs [n_blocks, R, kBlock]), the rows added in order. base2: scores and maxima in log2 units (the
// AVX2 task), else natural. A row's block maxima are its running maximum, which changes at a few
// blocks only: f is computed again only where the block's maximum differs from the block before
// (the same formula for a fraction of the exponentials: one per row and block cost ~2% of the
// kernel's time at 7 tokens a row, BENCHMARKS.md section 45).
void finish_mass(float* __restrict mass, int64_t R, int64_t n, const float* probs, const float* block_max,
                 const float* row_max, const float* row_sum, bool base2) {
  const int64_t n_blocks = blocks_of(n);
  for (int64_t r = 0; r < R; ++r) {
    if (!(row_sum[r] > 0.0f)) continue;
    const float* maxima = block_max + r * n_blocks;
    float f = 0.0f;
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      if (blk == 0 || maxima[blk] != maxima[blk - 1]) {
        const float delta = maxima[blk] - row_max[r];
        f = (base2 ? std::exp2(delta) : std::exp(delta)) / row_sum[r];
      }
      float* m = mass + blk * kBlock;
      const int64_t len = std::min(kBlock, n - blk * kBlock);
      const float* p = probs + (blk * R + r) * kBlock;
      for (int64_t i = 0; i < len; ++i) m[i] += f * p[i];
    }
  }
}

// An online-softmax state of R query rows before any entry: outputs [R, D] zero, maxima "none", sums 0.
inline void clear_rows(float* acc, float* row_max, float* row_sum, int64_t R, int64_t D) {
  std::fill(acc, acc + R * D, 0.0f);
  std::fill(row_max, row_max + R, kNoMax);
  std::fill(row_sum, row_sum + R, 0.0f);
}

// out [R, D] = acc [R, D] / row_sum [R] per row (zeros for a row that saw no entry): the end of a task.
// Never inlined (MAGICDEC_ONE_COPY): its copies inlined into the AVX2 one-row and group tasks were
// vectorised differently and gave different bits at head size 16 on a Zen 3 (test_kernels.py).
MAGICDEC_ONE_COPY void normalise_rows(const float* acc, const float* row_sum, int64_t R, int64_t D,
                                     float* __restrict out) {
  for (int64_t r = 0; r < R; ++r) {
    const float inv = row_sum[r] > 0.0f ? 1.0f / row_sum[r] : 0.0f;
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = acc[r * D + d] * inv;
  }
}

// The online-softmax state of R query rows of a vector task (pointers into a task's scratch): queries
// [R, D] (in log2 units for the AVX2 task), unnormalised outputs [R, D], running max and sum [R], the
// current block's scores, then probabilities [R, kBlock] (with mass: every block's, [n_blocks, R,
// kBlock], and each block's max [R, n_blocks], as MassOut describes). AVX2 also keeps each block's
// rescale per row (corr), AVX-512 room for R row indices (live: the rows that see the block).
struct RowState {
  const float* q;
  float* acc;
  float* row_max;
  float* row_sum;
  float* scores;
  float* corr = nullptr;
  int* live = nullptr;
  float* block_max = nullptr;  // non-null: keep every block's probabilities for the mass
  int64_t n_blocks = 1;
};

// out [R, D] = the state's normalised outputs (zeros for a row that saw no entry).
inline void finish_rows(const RowState& st, int64_t R, int64_t D, float* __restrict out) {
  normalise_rows(st.acc, st.row_sum, R, D, out);
}

// Member m's R query rows of a group's state whose members' rows are stacked (no mass kept).
inline RowState member_rows(RowState st, int64_t m, int64_t R, int64_t D) {
  st.q += m * R * D;
  st.acc += m * R * D;
  st.row_max += m * R;
  st.row_sum += m * R;
  st.scores += m * R * kBlock;
  if (st.corr != nullptr) st.corr += m * R;
  return st;
}

// Attention of R query rows over n_entries entries of one (slot, KV head) block.
template <int64_t D, typename E>
void attend_task(const float* __restrict q, int64_t R, int64_t T, int64_t end,
                 const E* __restrict k, const E* __restrict v, const Entries& entries, int64_t n_entries,
                 float* __restrict out, int64_t dyn_d, const MassOut& mass) {
  const int64_t d_len = D > 0 ? D : dyn_d;
  const int64_t n_blocks = blocks_of(n_entries);
  float* all_scores = t_scratch.get(0, (mass.mass ? n_blocks : 1) * R * kBlock);  // [blocks, R, kBlock]
  float* acc = t_scratch.get(1, R * d_len);
  float* row_max = t_scratch.get(2, R);
  float* row_sum = t_scratch.get(3, R);
  float* block_max = mass.mass ? t_scratch.get(4, R * n_blocks) : nullptr;
  clear_rows(acc, row_max, row_sum, R, d_len);
  int64_t pos[kBlock], rows[kBlock];
  for (int64_t start = 0; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    const int64_t blk = start / kBlock;
    float* scores = all_scores + (mass.mass ? blk * R * kBlock : 0);  // this block's [R, kBlock]
    for (int64_t i = 0; i < n; ++i) entries.at(start + i, end, pos + i, rows + i);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t last = end - T + r % T;  // rows are (head, token), token fastest
      float* s = scores + r * kBlock;
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
      if (block_max != nullptr) block_max[r * n_blocks + blk] = m;
      if (!any) {
        if (mass.mass) std::fill(s, s + n, 0.0f);
        continue;
      }
      const float correction = std::exp(row_max[r] - m);
      float sum = 0.0f;
      for (int64_t i = 0; i < n; ++i) {
        s[i] = pos[i] <= last ? std::exp(s[i] - m) : 0.0f;
        sum += s[i];
      }
      row_sum[r] = row_sum[r] * correction + sum;
      row_max[r] = m;
      float a[D > 0 ? D : kMaxHeadDim];
      float* ar = acc + r * d_len;
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
  normalise_rows(acc, row_sum, R, d_len, out);
  if (mass.mass)
    finish_mass(mass.mass, R, n_entries, all_scores, block_max, row_max, row_sum, /*base2=*/false);
}


#ifdef MAGICDEC_AVX2
namespace avx2 {

constexpr int kLanes = 8;        // floats per __m256
constexpr int kScoreRows = 2;    // query rows per score register tile: 2 x 4 accumulators + 2 q + 1 k
                                 // (3 rows would need all 16 registers, and GCC spills)
constexpr int kScoreEntries = 4; // entries per score register tile (one 4-way horizontal reduction)
constexpr int kValueRows = 2;    // query rows per value register tile: 2 x 4 accumulators + 2 p + 1 v
constexpr int kValueChunks = 4;  // 8-float chunks of D per value register tile (32 dims)
constexpr int64_t kCacheLine = 64;    // bytes per prefetch

// Keeps x in a register: stops GCC from folding one load into several FMAs' memory operands (each
// a separate load; with them the loads outnumbered the FMAs and the task ran ~25% slower here).
inline void pin(__m256& x) {
#if defined(__GNUC__)
  asm("" : "+x"(x));
#else
  (void)x;
#endif
}

// Lane i of the result = the sum of the 8 lanes of a[i], i < 4.
inline __m128 reduce4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Prefetches a byte range a few cache lines per call, so that the memory traffic overlaps compute
// (a burst of prefetches stalls the core until the memory system has taken them all).
struct Prefetch {
  const char* p = nullptr;
  int64_t left = 0;  // bytes not yet prefetched
  void reset(const void* base, int64_t bytes) {
    p = static_cast<const char*>(base);
    left = bytes;
  }
  int64_t lines() const { return (left + kCacheLine - 1) / kCacheLine; }
  void step(int64_t n) {
    for (; n > 0 && left > 0; --n, p += kCacheLine, left -= kCacheLine) _mm_prefetch(p, _MM_HINT_T0);
  }
};

// s[g * s_stride + e] = q[g] . k_rows[e] for G query rows (q: [G, 8C] contiguous) and 4 entries.
template <int C, int G>
inline void score_tile(const float* __restrict q, const float* const* k_rows, float* s, int64_t s_stride) {
  constexpr int D = C * kLanes;
  __m256 acc[G][kScoreEntries];
  for (int g = 0; g < G; ++g)
    for (int e = 0; e < kScoreEntries; ++e) acc[g][e] = _mm256_setzero_ps();
  for (int c = 0; c < C; ++c) {
    __m256 qv[G];
    for (int g = 0; g < G; ++g) {
      qv[g] = _mm256_loadu_ps(q + g * D + kLanes * c);
      pin(qv[g]);
    }
    for (int e = 0; e < kScoreEntries; ++e) {
      __m256 kv = _mm256_loadu_ps(k_rows[e] + kLanes * c);
      pin(kv);
      for (int g = 0; g < G; ++g) acc[g][e] = _mm256_fmadd_ps(qv[g], kv, acc[g][e]);
    }
  }
  for (int g = 0; g < G; ++g) _mm_storeu_ps(s + g * s_stride, reduce4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
}

// acc[g][offset + 0..8W) = acc[g][...] * corr[g] + sum_{i<n} p[g * p_stride + i] * v_rows[i][offset + ...]
// for G query rows (acc rows D floats apart): the G x W accumulators stay in registers over the block.
template <int W, int G>
inline void value_tile(float* acc, int64_t D, const float* p, int64_t p_stride, const float* corr,
                       const float* const* v_rows, int64_t offset, int64_t n) {
  __m256 a[G][W];
  for (int g = 0; g < G; ++g) {
    const __m256 c = _mm256_set1_ps(corr[g]);
    for (int w = 0; w < W; ++w) a[g][w] = _mm256_mul_ps(c, _mm256_loadu_ps(acc + g * D + kLanes * w));
  }
  for (int64_t i = 0; i < n; ++i) {
    __m256 b[G];
    for (int g = 0; g < G; ++g) b[g] = _mm256_broadcast_ss(p + g * p_stride + i);
    const float* vr = v_rows[i] + offset;
    for (int w = 0; w < W; ++w) {
      __m256 vv = _mm256_loadu_ps(vr + kLanes * w);
      pin(vv);
      for (int g = 0; g < G; ++g) a[g][w] = _mm256_fmadd_ps(b[g], vv, a[g][w]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + g * D + kLanes * w, a[g][w]);
}

// Every value tile of G rows: D in slices of kValueChunks chunks (the last one narrower).
template <int C, int G>
inline void value_rows(float* acc, const float* p, int64_t p_stride, const float* corr,
                       const float* const* v_rows, int64_t n) {
  constexpr int64_t D = C * kLanes;
  constexpr int full = C / kValueChunks, rest = C % kValueChunks;
  for (int s = 0; s < full; ++s)
    value_tile<kValueChunks, G>(acc + s * kValueChunks * kLanes, D, p, p_stride, corr, v_rows,
                                s * kValueChunks * kLanes, n);
  if constexpr (rest > 0)
    value_tile<rest, G>(acc + full * kValueChunks * kLanes, D, p, p_stride, corr, v_rows,
                        full * kValueChunks * kLanes, n);
}

// Entries [first, n_entries) (first a multiple of kBlock) folded into the state of R query rows,
// block by block: same arithmetic per query row whatever R is and whichever rows share the call.
// Never inlined (MAGICDEC_ONE_COPY), for the reason normalise_rows gives.
template <int C, typename E>
MAGICDEC_ONE_COPY void attend_blocks(const RowState& st, int64_t R, int64_t T, int64_t end,
                                     const E* __restrict k, const E* __restrict v, const Entries& entries,
                                     int64_t first, int64_t n_entries, float* widened) {
  constexpr int64_t D = C * kLanes;
  constexpr bool kWiden = !std::is_same<E, float>::value;
  const float* q = st.q;
  float* acc = st.acc;
  float* row_max = st.row_max;
  float* row_sum = st.row_sum;
  float* corr = st.corr;
  float* block_max = st.block_max;
  const int64_t n_blocks = st.n_blocks;
  alignas(32) int32_t pos[kBlock];
  const float* k_rows[kBlock];
  const float* v_rows[kBlock];
  for (int64_t start = first; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    const int64_t blk = start / kBlock;
    float* scores = st.scores + (block_max ? blk * R * kBlock : 0);  // this block's [R, kBlock]
    int64_t rows[kBlock];
    bool seen = false;  // whether any query row sees an entry of this block
    for (int64_t i = 0; i < kBlock; ++i) {
      int64_t p;
      entries.at(std::min(start + i, n_entries - 1), end, &p, rows + i);  // lanes past n read a valid row...
      pos[i] = i < n ? static_cast<int32_t>(std::min(p, end)) : static_cast<int32_t>(end);  // ...masked here
      seen |= pos[i] < end;
    }
    if (!seen) {  // e.g. a compact store's ring entries outside the view: nothing to read or fold in
      if (block_max != nullptr) {  // as the online softmax below leaves such a block
        std::fill(scores, scores + R * kBlock, 0.0f);
        for (int64_t r = 0; r < R; ++r) block_max[r * n_blocks + blk] = row_max[r];
      }
      continue;
    }
    for (int64_t i = 0; i < kBlock; ++i) {
      const int64_t row = rows[i];
      if constexpr (kWiden) {
        float* kw = widened + i * D;
        float* vw = widened + (kBlock + i) * D;
        if (i < n) {
          const E* kr = k + row * D;
          const E* vr = v + row * D;
          for (int c = 0; c < C; ++c) {
            _mm256_storeu_ps(kw + kLanes * c, load8(kr + kLanes * c));
            _mm256_storeu_ps(vw + kLanes * c, load8(vr + kLanes * c));
          }
        }
        k_rows[i] = i < n ? kw : widened;
        v_rows[i] = i < n ? vw : widened + kBlock * D;
      } else {
        k_rows[i] = reinterpret_cast<const float*>(k) + row * D;
        v_rows[i] = reinterpret_cast<const float*>(v) + row * D;
      }
    }
    // Scores [R, kBlock], 4 entries at a time for every query row;
    // meanwhile the next block's K and V rows are prefetched a few lines per entry group (a burst of
    // prefetches at the block's start would stall the core instead of overlapping compute; measured
    // at batch 16 x 3300 positions: -25% time fp32 T = 1, -30% T = 4 against no prefetch).
    const int64_t next = std::min(kBlock, n_entries - start - kBlock);  // entries of the next block
    const bool dense = entries.positions == nullptr;
    Prefetch next_k, next_v;
    if (dense && next > 0) {
      next_k.reset(k + (start + kBlock) * D, next * D * static_cast<int64_t>(sizeof(E)));
      next_v.reset(v + (start + kBlock) * D, next * D * static_cast<int64_t>(sizeof(E)));
    }
    const int64_t k_step = (next_k.lines() * kScoreEntries + kBlock - 1) / kBlock;  // lines per entry group
    for (int64_t e = 0; e < kBlock; e += kScoreEntries) {
      if (dense) {
        next_k.step(k_step);
        next_v.step(k_step);
      } else {  // gathered rows: this group's rows of the next block, K and V
        for (int64_t i = e; i < std::min(e + kScoreEntries, next); ++i) {
          int64_t p, row;
          entries.at(start + kBlock + i, end, &p, &row);
          Prefetch rk, rv;
          rk.reset(k + row * D, D * static_cast<int64_t>(sizeof(E)));
          rv.reset(v + row * D, D * static_cast<int64_t>(sizeof(E)));
          rk.step(rk.lines());
          rv.step(rv.lines());
        }
      }
      for (int64_t r0 = 0; r0 < R; r0 += kScoreRows) {
        const int64_t g = std::min<int64_t>(kScoreRows, R - r0);
        float* s = scores + r0 * kBlock + e;
        const float* qr = q + r0 * D;
        if (g == kScoreRows) score_tile<C, kScoreRows>(qr, k_rows + e, s, kBlock);
        else score_tile<C, 1>(qr, k_rows + e, s, kBlock);
      }
    }
    // Online softmax per query row: probabilities in place (0 where not visible).
    for (int64_t r = 0; r < R; ++r) {
      const int32_t last = static_cast<int32_t>(end - T + r % T);  // rows are (head, token), token fastest
      const __m256i limit = _mm256_set1_epi32(last + 1);
      float* s = scores + r * kBlock;
      __m256 mx = _mm256_set1_ps(kNoMax);
      int any = 0;
      __m256 visible[kBlock / kLanes];
      for (int j = 0; j < kBlock / kLanes; ++j) {
        visible[j] = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(limit, _mm256_load_si256(reinterpret_cast<const __m256i*>(pos + kLanes * j))));
        any |= _mm256_movemask_ps(visible[j]);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(kNoMax), _mm256_loadu_ps(s + kLanes * j), visible[j]));
      }
      if (!any) {  // nothing visible in this block: no change, zero probabilities
        for (int j = 0; j < kBlock / kLanes; ++j) _mm256_storeu_ps(s + kLanes * j, _mm256_setzero_ps());
        corr[r] = 1.0f;
        if (block_max != nullptr) block_max[r * n_blocks + blk] = row_max[r];
        continue;
      }
      const float m = std::max(row_max[r], hmax8(mx));
      const __m256 mv = _mm256_set1_ps(m);
      __m256 sum = _mm256_setzero_ps();
      for (int j = 0; j < kBlock / kLanes; ++j) {
        const __m256 p = _mm256_and_ps(exp2_nonpos8(_mm256_sub_ps(_mm256_loadu_ps(s + kLanes * j), mv)), visible[j]);
        _mm256_storeu_ps(s + kLanes * j, p);
        sum = _mm256_add_ps(sum, p);
      }
      corr[r] = std::exp2(row_max[r] - m);
      row_sum[r] = row_sum[r] * corr[r] + hsum8(sum);
      row_max[r] = m;
      if (block_max != nullptr) block_max[r * n_blocks + blk] = m;
    }
    // Values.
    for (int64_t r0 = 0; r0 < R; r0 += kValueRows) {
      const float* p = scores + r0 * kBlock;
      if (R - r0 >= 2) value_rows<C, 2>(acc + r0 * D, p, kBlock, corr + r0, v_rows, n);
      else value_rows<C, 1>(acc + r0 * D, p, kBlock, corr + r0, v_rows, n);
    }
  }
}

// A state for R query rows in this thread's scratch, queries q_in [R, D] scaled into log2 units;
// mass_blocks > 0: the state keeps that many blocks' probabilities (the mass output).
template <int C>
RowState start_rows(const float* const* q_in, int64_t rows_per_input, int64_t inputs, int64_t mass_blocks) {
  constexpr int64_t D = C * kLanes;
  const int64_t R = rows_per_input * inputs;
  RowState st;
  st.n_blocks = std::max<int64_t>(mass_blocks, 1);
  st.scores = t_scratch.get(0, st.n_blocks * R * kBlock);
  st.acc = t_scratch.get(1, R * D);
  st.row_max = t_scratch.get(2, R);
  st.row_sum = t_scratch.get(3, R);
  st.block_max = mass_blocks > 0 ? t_scratch.get(4, R * mass_blocks) : nullptr;
  float* q = t_scratch.get(5, R * D);
  st.q = q;
  st.corr = t_scratch.get(7, R);
  for (int64_t j = 0; j < inputs; ++j) {
    float* qj = q + j * rows_per_input * D;
    for (int64_t i = 0; i < rows_per_input * D; ++i) qj[i] = q_in[j][i] * kLog2e;
  }
  clear_rows(st.acc, st.row_max, st.row_sum, R, D);
  return st;
}


template <typename E>
float* widen_scratch(int64_t D) {  // a K block, then a V block, widened to float32 (bfloat16 K/V only)
  return std::is_same<E, float>::value ? nullptr : t_scratch.get(6, 2 * kBlock * D);
}

// The task of attend_task for D = 8C. Per block of kBlock entries: its K/V row pointers (bfloat16
// rows widened into scratch first), the scores of every query row (register tiles of 2 rows x 4
// entries; lanes past the block's end read a valid row and are masked), the online-softmax update
// per query row in log2 units, then the values (register tiles of 2 rows x 32 dims).
template <int C, typename E>
void attend_task(const float* __restrict q_in, int64_t R, int64_t T, int64_t end, const E* __restrict k,
                 const E* __restrict v, const Entries& entries, int64_t n_entries, float* __restrict out,
                 const MassOut& mass) {
  const int64_t n_blocks = blocks_of(n_entries);
  const float* inputs[1] = {q_in};
  const RowState st = start_rows<C>(inputs, R, 1, mass.mass ? n_blocks : 0);
  attend_blocks<C, E>(st, R, T, end, k, v, entries, 0, n_entries, widen_scratch<E>(C * kLanes));
  finish_rows(st, R, C * kLanes, out);
  if (mass.mass) finish_mass(mass.mass, R, n_entries, st.scores, st.block_max, st.row_max, st.row_sum, /*base2=*/true);
}

// One KV head of a group of rows whose slots hold the same K/V at positions [0, shared) (shared a
// multiple of kBlock, below every member's new tokens): those blocks are read once, from the first
// member's slot, for every member's query rows stacked; then each member goes on over its own
// [shared, end). Per query row the arithmetic is attend_task's, block for block, so the outputs are
// bit for bit the ones of one task per member. q[m], k[m], v[m], out[m]: member m's (R rows).
template <int C, typename E>
void attend_group_task(const float* const* q, int64_t members, int64_t R, int64_t T, const int64_t* ends,
                       const E* const* k, const E* const* v, int64_t shared, float* const* out) {
  constexpr int64_t D = C * kLanes;
  const RowState all = start_rows<C>(q, R, members, 0);
  float* widened = widen_scratch<E>(D);
  attend_blocks<C, E>(all, R * members, T, shared + T, k[0], v[0], Entries{}, 0, shared, widened);
  for (int64_t m = 0; m < members; ++m) {
    const RowState own = member_rows(all, m, R, D);
    attend_blocks<C, E>(own, R, T, ends[m], k[m], v[m], Entries{}, shared, ends[m], widened);
    finish_rows(own, R, D, out[m]);
  }
}

}  // namespace avx2
#endif  // MAGICDEC_AVX2


#ifdef MAGICDEC_AVX512
namespace avx512 {

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

thread_local std::vector<int> t_live;  // RowState::live (per thread, kept between tasks)
constexpr int64_t kMaskTokens = 16;  // up to this many new tokens a row, visibility is worked out once per block

// Bit i: whether entry i of these 16 (positions pos[0..15]) is at or before position `last`.
inline __mmask16 visible_of(const int64_t* pos, int64_t last) {
  const __m512i limit = _mm512_set1_epi64(last);
  const __mmask8 low = _mm512_cmple_epi64_mask(_mm512_loadu_si512(pos), limit);
  const __mmask8 high = _mm512_cmple_epi64_mask(_mm512_loadu_si512(pos + 8), limit);
  return static_cast<__mmask16>(low | (static_cast<unsigned>(high) << 8));
}

// Entries [first, n_entries) (first a multiple of kBlock) folded into the state of R query rows,
// block by block (4 groups of 16 entries). With dense entries, the next block's K and V rows are
// prefetched into L2 a few lines per score tile (the attention of a batch-13 decode step over a
// shared 2.7K-token prefix 1.3x faster than one burst per block on a 2-vCPU Xeon VM, BENCHMARKS.md
// section 19). Per block: the scores of every query row (16 entries at a time), an online-softmax
// update, then the values, up to kGroup query rows per pass over the block's V rows (from L1 after the
// first pass). Per query row the arithmetic does not depend on R or on which rows share the call.
template <int64_t D, typename E>
MAGICDEC_ONE_COPY void attend_blocks(const RowState& st, int64_t R, int64_t T, int64_t end,
                                     const E* __restrict k, const E* __restrict v, const Entries& entries,
                                     int64_t first, int64_t n_entries) {
  constexpr int C = D / 16;
  constexpr int kGroup = D <= 64 ? 4 : 2;  // query rows per pass over V (accumulators in registers)
  int64_t pos[kBlock];
  const E* k_rows[kBlock];
  const E* v_rows[kBlock];
  for (int64_t start = first; start < n_entries; start += kBlock) {
    const int64_t n = std::min(kBlock, n_entries - start);
    const int64_t blk = start / kBlock;
    float* scores = st.scores + (st.block_max ? blk * R * kBlock : 0);  // this block's [R, kBlock]
    bool block_seen = false;  // whether any query row sees an entry of this block
    for (int64_t i = 0; i < kBlock; ++i) {
      int64_t row;
      entries.at(std::min(start + i, n_entries - 1), end, pos + i, &row);  // lanes past n read a valid row...
      if (i >= n) pos[i] = end;  // ...masked here
      block_seen |= pos[i] < end;
      k_rows[i] = k + row * D;
      v_rows[i] = v + row * D;
    }
    if (!block_seen) {  // e.g. a compact store's ring entries outside the view: nothing to read or fold in
      if (st.block_max != nullptr) {  // as the online softmax below leaves such a block
        std::fill(scores, scores + R * kBlock, 0.0f);
        for (int64_t r = 0; r < R; ++r) st.block_max[r * st.n_blocks + blk] = st.row_max[r];
      }
      continue;
    }
    // Dense rows: the next block's K and V are asked for (into L2) a few lines at a time between this
    // block's score tiles, so that they arrive while it computes. Issued in one burst, the requests
    // fill the core's miss buffers and stall it until the lines arrive (a third of the kernel's time
    // on a 2-vCPU Xeon VM, even from L3).
    const char* next_k = nullptr;
    const char* next_v = nullptr;
    int64_t next_bytes = 0, next_sent = 0, lines_per_tile = 0;
    if (entries.positions == nullptr && start + kBlock < n_entries &&
        entries.any_before(start + kBlock, std::min(kBlock, n_entries - start - kBlock), end)) {
      next_bytes = std::min(kBlock, n_entries - start - kBlock) * D * int64_t(sizeof(E));
      next_k = reinterpret_cast<const char*>(k + (start + kBlock) * D);
      next_v = reinterpret_cast<const char*>(v + (start + kBlock) * D);
      lines_per_tile = (2 * next_bytes / 64 + R * (kBlock / 16) - 1) / (R * (kBlock / 16));
    }
    auto prefetch_next = [&](int64_t lines) {  // the next `lines` lines of the next block's K, then its V
      for (; lines > 0 && next_sent < 2 * next_bytes; --lines, next_sent += 64)
        _mm_prefetch(next_sent < next_bytes ? next_k + next_sent : next_v + (next_sent - next_bytes), _MM_HINT_T1);
    };
    // Which of the block's entries each new token may see, per 16 entries: the same for every query
    // row of that token (rows are (head, token), token fastest), so worked out once per block.
    __mmask16 token_visible[kMaskTokens][kBlock / 16];
    const bool masks_once = T <= kMaskTokens;
    for (int64_t t = 0; masks_once && t < T; ++t)
      for (int64_t group = 0; group < kBlock; group += 16)
        token_visible[t][group / 16] = visible_of(pos + group, end - T + t);
    int64_t n_live = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t last = end - T + r % T;
      float* s = scores + r * kBlock;
      __m512 qr[C];
      for (int c = 0; c < C; ++c) qr[c] = _mm512_loadu_ps(st.q + r * D + 16 * c);
      bool any = false;
      __m512 running_max = _mm512_set1_ps(st.row_max[r]);  // max is exact: one reduction per block
      for (int64_t group = 0; group < kBlock; group += 16) {
        prefetch_next(lines_per_tile);
        const __mmask16 visible = masks_once ? token_visible[r % T][group / 16] : visible_of(pos + group, last);
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
        running_max = _mm512_max_ps(running_max, block);
        any = true;
      }
      const float m = _mm512_reduce_max_ps(running_max);
      if (st.block_max != nullptr) st.block_max[r * st.n_blocks + blk] = m;
      if (!any) {
        if (st.block_max != nullptr) std::fill(s, s + kBlock, 0.0f);  // probabilities of a block it cannot see
        continue;
      }
      st.live[n_live++] = static_cast<int>(r);
      const float correction =
          st.row_max[r] == m ? 1.0f : _mm512_cvtss_f32(exp2_nonpos16(_mm512_set1_ps((st.row_max[r] - m) * kLog2e)));
      const __m512 mv = _mm512_set1_ps(m), log2e = _mm512_set1_ps(kLog2e);
      __m512 sums = _mm512_setzero_ps();
      for (int64_t group = 0; group < kBlock; group += 16) {
        const __m512 x = _mm512_loadu_ps(s + group);
        const __mmask16 seen = _mm512_cmp_ps_mask(x, _mm512_set1_ps(0.5f * kNoMax), _CMP_GT_OQ);
        const __m512 p = _mm512_maskz_mov_ps(seen, exp2_nonpos16(_mm512_mul_ps(_mm512_sub_ps(x, mv), log2e)));
        _mm512_storeu_ps(s + group, p);
        sums = _mm512_add_ps(sums, p);
      }
      const float sum = _mm512_reduce_add_ps(sums);
      st.row_sum[r] = st.row_sum[r] * correction + sum;
      st.row_max[r] = m;
      if (correction != 1.0f) {
        float* ar = st.acc + r * D;
        for (int64_t d = 0; d < D; ++d) ar[d] *= correction;
      }
    }
    prefetch_next(2 * next_bytes);  // whatever the score tiles left
    for (int64_t first_live = 0; first_live < n_live; first_live += kGroup) {
      const int g = static_cast<int>(std::min<int64_t>(kGroup, n_live - first_live));
      float* outs[kGroup];
      const float* probs[kGroup];
      for (int j = 0; j < g; ++j) {
        outs[j] = st.acc + st.live[first_live + j] * D;
        probs[j] = scores + st.live[first_live + j] * kBlock;
      }
      switch (g) {
        case 1: accumulate_values<D, 1, E>(outs, probs, v_rows, n); break;
        case 2: accumulate_values<D, 2, E>(outs, probs, v_rows, n); break;
        case 3: if constexpr (kGroup >= 3) accumulate_values<D, 3, E>(outs, probs, v_rows, n); break;
        default: if constexpr (kGroup >= 4) accumulate_values<D, 4, E>(outs, probs, v_rows, n); break;
      }
    }
  }
}

// A state for rows_per_input query rows of each of `inputs` inputs q_in[j] [rows_per_input, D],
// stacked, in this thread's scratch (one input is read in place); mass_blocks > 0: the state keeps
// that many blocks' probabilities (the mass output).
template <int64_t D>
RowState start_rows(const float* const* q_in, int64_t rows_per_input, int64_t inputs, int64_t mass_blocks) {
  const int64_t R = rows_per_input * inputs;
  RowState st;
  st.n_blocks = std::max<int64_t>(mass_blocks, 1);
  st.scores = t_scratch.get(0, st.n_blocks * R * kBlock);
  st.block_max = mass_blocks > 0 ? t_scratch.get(4, R * mass_blocks) : nullptr;
  st.acc = t_scratch.get(1, R * D);
  st.row_max = t_scratch.get(2, R);
  st.row_sum = t_scratch.get(3, R);
  if (t_live.size() < static_cast<size_t>(R)) t_live.resize(R);
  st.live = t_live.data();
  if (inputs == 1) {
    st.q = q_in[0];
  } else {
    float* q = t_scratch.get(5, R * D);
    for (int64_t j = 0; j < inputs; ++j) std::copy(q_in[j], q_in[j] + rows_per_input * D, q + j * rows_per_input * D);
    st.q = q;
  }
  clear_rows(st.acc, st.row_max, st.row_sum, R, D);
  return st;
}


// The same task as attend_task, for D = 32, 64, 96 or 128.
template <int64_t D, typename E>
void attend_task(const float* __restrict q, int64_t R, int64_t T, int64_t end, const E* __restrict k,
                 const E* __restrict v, const Entries& entries, int64_t n_entries, float* __restrict out,
                 const MassOut& mass) {
  const float* inputs[1] = {q};
  const RowState st = start_rows<D>(inputs, R, 1, mass.mass ? blocks_of(n_entries) : 0);
  attend_blocks<D, E>(st, R, T, end, k, v, entries, 0, n_entries);
  finish_rows(st, R, D, out);
  if (mass.mass)
    finish_mass(mass.mass, R, n_entries, st.scores, st.block_max, st.row_max, st.row_sum, /*base2=*/false);
}

// avx2::attend_group_task's twin: a group's shared blocks [0, shared) read once, from the first
// member's slot, for every member's query rows stacked, then each member's own [shared, end); per
// query row the arithmetic is attend_task's, block for block, so the outputs are bit for bit its own.
template <int64_t D, typename E>
void attend_group_task(const float* const* q, int64_t members, int64_t R, int64_t T, const int64_t* ends,
                       const E* const* k, const E* const* v, int64_t shared, float* const* out) {
  const RowState all = start_rows<D>(q, R, members, 0);
  attend_blocks<D, E>(all, R * members, T, shared + T, k[0], v[0], Entries{}, 0, shared);
  for (int64_t m = 0; m < members; ++m) {
    const RowState own = member_rows(all, m, R, D);
    attend_blocks<D, E>(own, R, T, ends[m], k[m], v[m], Entries{}, shared, ends[m]);
    finish_rows(own, R, D, out[m]);
  }
}

}  // namespace avx512
#endif

// Head sizes each implementation takes (where compiled in).
constexpr bool avx512_covers(int64_t D) { return D == 32 || D == 64 || D == 96 || D == 128; }
constexpr bool avx2_covers(int64_t D) { return D >= 16 && D <= 128 && D % 8 == 0; }
#ifdef MAGICDEC_AVX2
static_assert(avx2::kLanes == 8, "avx2_covers counts head sizes in 8-float chunks");
#endif

// One task, by the fastest implementation compiled in that covers (D, mass).
template <int64_t D, typename E>
void run_task(const float* q, int64_t R, int64_t T, int64_t end, const E* k, const E* v,
              const Entries& entries, int64_t n, float* out, const MassOut& mass) {
  if (g_vector_path) {
#ifdef MAGICDEC_AVX512
    if constexpr (avx512_covers(D)) {
      return avx512::attend_task<D, E>(q, R, T, end, k, v, entries, n, out, mass);
    }
#endif
#ifdef MAGICDEC_AVX2
    if constexpr (avx2_covers(D))
      return avx2::attend_task<static_cast<int>(D / avx2::kLanes), E>(q, R, T, end, k, v, entries, n, out, mass);
#endif
  }
  if constexpr (D == 32 || D == 64 || D == 96 || D == 128)  // the portable task with D known
    attend_task<D, E>(q, R, T, end, k, v, entries, n, out, D, mass);
  else
    attend_task<0, E>(q, R, T, end, k, v, entries, n, out, D, mass);
}

// run_task for a head size known only at run time.
template <typename E>
void run_task_any(int64_t D, const float* q, int64_t R, int64_t T, int64_t end, const E* k, const E* v,
                  const Entries& entries, int64_t n, float* out, const MassOut& mass) {
  switch (D) {
#define MAGICDEC_CASE(d) \
  case d: return run_task<d, E>(q, R, T, end, k, v, entries, n, out, mass);
    MAGICDEC_CASE(16) MAGICDEC_CASE(24) MAGICDEC_CASE(32) MAGICDEC_CASE(40) MAGICDEC_CASE(48)
    MAGICDEC_CASE(56) MAGICDEC_CASE(64) MAGICDEC_CASE(72) MAGICDEC_CASE(80) MAGICDEC_CASE(88)
    MAGICDEC_CASE(96) MAGICDEC_CASE(104) MAGICDEC_CASE(112) MAGICDEC_CASE(120) MAGICDEC_CASE(128)
#undef MAGICDEC_CASE
    default: attend_task<0, E>(q, R, T, end, k, v, entries, n, out, D, mass);
  }
}

// mass: [B, kv_heads, n_mass] float32 (written in full), or null (no mass output).
template <typename E>
torch::Tensor attend(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer, torch::Tensor slots,
                     torch::Tensor ends, int64_t T, const torch::Tensor* positions, const torch::Tensor* valid,
                     const torch::Tensor* entry_pos, float* mass = nullptr, int64_t n_mass = 0) {
  TORCH_CHECK(query.dtype() == torch::kFloat32, "float32 queries");
  TORCH_CHECK(k_layer.dtype() == v_layer.dtype(), "K and V of one dtype");
  TORCH_CHECK(query.is_contiguous() && k_layer.is_contiguous() && v_layer.is_contiguous(), "contiguous only");
  TORCH_CHECK(query.dim() == 4 && k_layer.dim() == 4 && k_layer.sizes() == v_layer.sizes(),
              "query [B, kv_heads, R, D]; K, V [slots, kv_heads, capacity, D]");
  TORCH_CHECK(slots.dtype() == torch::kInt64 && ends.dtype() == torch::kInt64 && slots.is_contiguous() &&
              ends.is_contiguous(), "int64 contiguous slots and ends");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2), D = query.size(3);
  TORCH_CHECK(D <= kMaxHeadDim, "head_dim up to 256");
  TORCH_CHECK(k_layer.size(1) == KVH && k_layer.size(3) == D, "query and cache disagree on kv_heads or head_dim");
  TORCH_CHECK(T >= 1 && R % T == 0, "R = group * T");
  TORCH_CHECK(slots.numel() == B && ends.numel() == B, "slots, ends: [B]");
  const int64_t capacity = k_layer.size(2);
  auto out = torch::empty_like(query);
  const float* qp = query.data_ptr<float>();
  const E* kp = static_cast<const E*>(k_layer.data_ptr());
  const E* vp = static_cast<const E*>(v_layer.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ep = ends.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < k_layer.size(0), "slot out of range");
    TORCH_CHECK(ep[b] >= 0 && (positions != nullptr || entry_pos != nullptr || ep[b] <= capacity),
                "ends must be in [0, capacity]");
    TORCH_CHECK(mass == nullptr || ep[b] <= n_mass, "n_positions below a row's end");
  }
  const int64_t N = positions ? positions->size(2) : 0;
  const int64_t* pp = positions ? positions->data_ptr<int64_t>() : nullptr;
  const bool* vm = valid ? valid->data_ptr<bool>() : nullptr;
  const int64_t S = entry_pos ? entry_pos->size(1) : 0;
  const int64_t* xp = entry_pos ? entry_pos->data_ptr<int64_t>() : nullptr;
  // Tasks (row, KV head) longest first, pulled from a shared counter by one invocation per thread:
  // rows of different lengths, or a thread slowed by other work on its core, do not leave the other
  // threads idle at the end (a static split of the range would). Run inline (nested parallelism),
  // the one invocation does every task.
  const int64_t n_tasks = B * KVH;
  std::vector<int64_t> order(n_tasks);
  for (int64_t t = 0; t < n_tasks; ++t) order[t] = t;
  if (pp == nullptr && xp == nullptr)  // entries = the row's end (else the same count for every task)
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return ep[a / KVH] > ep[c / KVH]; });
  std::atomic<int64_t> next_task{0};
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks)), 1,
                   [&](int64_t, int64_t) {
    for (int64_t i = next_task.fetch_add(1); i < n_tasks; i = next_task.fetch_add(1)) {
      const int64_t task = order[i];
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
      MassOut m;
      if (mass != nullptr) {  // zeroed here, in the task, rather than by a separate (parallel) fill
        m.mass = mass + task * n_mass;
        std::fill(m.mass, m.mass + n_mass, 0.0f);
      }
      const E* kb = kp + base;
      const E* vb = vp + base;
      run_task_any<E>(D, q, R, T, ep[b], kb, vb, entries, n, o, m);
    }
  });
  return out;
}

// Whether run_task's implementation for head size D (without mass) has a group task: then a group's
// shared blocks can be read once without changing a single output bit.
bool group_task_applies(int64_t D) {
  if (!g_vector_path) return false;
#ifdef MAGICDEC_AVX512
  if (avx512_covers(D)) return true;
#endif
#ifdef MAGICDEC_AVX2
  if (avx2_covers(D)) return true;
#endif
  return false;
}

// The group task of the implementation run_task takes for head size D (see group_task_applies).
template <typename E>
void run_group_task(int64_t D, const float* const* q, int64_t members, int64_t R, int64_t T, const int64_t* ends,
                    const E* const* k, const E* const* v, int64_t shared, float* const* out) {
#ifdef MAGICDEC_AVX512
  switch (D) {
#define MAGICDEC_GROUP(d) \
  case d: return avx512::attend_group_task<d, E>(q, members, R, T, ends, k, v, shared, out);
    MAGICDEC_GROUP(32) MAGICDEC_GROUP(64) MAGICDEC_GROUP(96) MAGICDEC_GROUP(128)
#undef MAGICDEC_GROUP
    default: break;
  }
#endif
#ifdef MAGICDEC_AVX2
  switch (D / avx2::kLanes) {
#define MAGICDEC_GROUP(c) \
  case c: return avx2::attend_group_task<c, E>(q, members, R, T, ends, k, v, shared, out);
    MAGICDEC_GROUP(2) MAGICDEC_GROUP(3) MAGICDEC_GROUP(4) MAGICDEC_GROUP(5) MAGICDEC_GROUP(6)
    MAGICDEC_GROUP(7) MAGICDEC_GROUP(8) MAGICDEC_GROUP(9) MAGICDEC_GROUP(10) MAGICDEC_GROUP(11)
    MAGICDEC_GROUP(12) MAGICDEC_GROUP(13) MAGICDEC_GROUP(14) MAGICDEC_GROUP(15) MAGICDEC_GROUP(16)
#undef MAGICDEC_GROUP
    default: break;
  }
#endif
  TORCH_CHECK(false, "no group task for head size ", D);
}

// Groups of rows (members[offsets[g] .. offsets[g + 1]), batch row indices) whose slots hold the
// same K/V at positions [0, shared[g]); one task per (group, KV head). A group of one, shared 0,
// or a head size without the group task: each member as attend_cached does it.
template <typename E>
torch::Tensor attend_groups(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer, torch::Tensor slots,
                            torch::Tensor ends, int64_t T, torch::Tensor members, torch::Tensor offsets,
                            torch::Tensor shared) {
  TORCH_CHECK(query.dtype() == torch::kFloat32 && query.dim() == 4 && query.is_contiguous(),
              "float32 contiguous query [B, kv_heads, R, D]");
  TORCH_CHECK(k_layer.is_contiguous() && v_layer.is_contiguous() && k_layer.sizes() == v_layer.sizes() &&
              k_layer.dim() == 4, "K, V [slots, kv_heads, capacity, D] contiguous");
  for (const auto* t : {&slots, &ends, &members, &offsets, &shared})
    TORCH_CHECK(t->dtype() == torch::kInt64 && t->is_contiguous(), "int64 contiguous slots, ends, groups");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2), D = query.size(3);
  const int64_t G = shared.numel(), capacity = k_layer.size(2);
  TORCH_CHECK(k_layer.size(1) == KVH && k_layer.size(3) == D && T >= 1 && R % T == 0, "shapes disagree");
  TORCH_CHECK(slots.numel() == B && ends.numel() == B && members.numel() == B && offsets.numel() == G + 1,
              "slots, ends, members: [B]; offsets: [groups + 1]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* ep = ends.data_ptr<int64_t>();
  const int64_t* mp = members.data_ptr<int64_t>();
  const int64_t* op = offsets.data_ptr<int64_t>();
  const int64_t* shp = shared.data_ptr<int64_t>();
  std::vector<int> seen(B, 0);
  TORCH_CHECK(op[0] == 0 && op[G] == B, "offsets must run from 0 to B");
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(op[g] < op[g + 1], "empty group");
    TORCH_CHECK(shp[g] >= 0 && shp[g] % kBlock == 0, "shared lengths are multiples of 64");
    for (int64_t i = op[g]; i < op[g + 1]; ++i) {
      const int64_t b = mp[i];
      TORCH_CHECK(b >= 0 && b < B && !seen[b]++, "members: each batch row once");
      TORCH_CHECK(sp[b] >= 0 && sp[b] < k_layer.size(0) && ep[b] >= 0 && ep[b] <= capacity, "slot or end out of range");
      TORCH_CHECK(shp[g] <= ep[b] - T, "a group's shared positions precede its rows' new tokens");
    }
  }
  auto out = torch::empty_like(query);
  const float* qp = query.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const E* kp = static_cast<const E*>(k_layer.data_ptr());
  const E* vp = static_cast<const E*>(v_layer.data_ptr());
  const bool grouped = group_task_applies(D);
  // Tasks (group, KV head), the most entries to read first (see attend).
  std::vector<int64_t> cost(G, 0), order(G * KVH);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = op[g]; i < op[g + 1]; ++i) cost[g] += ep[mp[i]] - (grouped && i > op[g] ? shp[g] : 0);
  for (int64_t t = 0; t < G * KVH; ++t) order[t] = t;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t c) { return cost[a / KVH] > cost[c / KVH]; });
  std::atomic<int64_t> next_task{0};
  const int64_t n_tasks = G * KVH;
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n_tasks)), 1,
                   [&](int64_t, int64_t) {
    std::vector<const float*> q;
    std::vector<float*> o;
    std::vector<const E*> k, v;
    std::vector<int64_t> member_ends;
    for (int64_t i = next_task.fetch_add(1); i < n_tasks; i = next_task.fetch_add(1)) {
      const int64_t g = order[i] / KVH, h = order[i] % KVH;
      q.clear(); o.clear(); k.clear(); v.clear(); member_ends.clear();
      for (int64_t j = op[g]; j < op[g + 1]; ++j) {
        const int64_t b = mp[j], task = b * KVH + h, base = (sp[b] * KVH + h) * capacity * D;
        q.push_back(qp + task * R * D);
        o.push_back(outp + task * R * D);
        k.push_back(kp + base);
        v.push_back(vp + base);
        member_ends.push_back(ep[b]);
      }
      const int64_t m = static_cast<int64_t>(q.size());
      const bool done = grouped && m > 1 && shp[g] > 0;
      if (done) run_group_task<E>(D, q.data(), m, R, T, member_ends.data(), k.data(), v.data(), shp[g], o.data());
      for (int64_t j = 0; j < m && !done; ++j)  // one member at a time, as attend_cached
        run_task_any<E>(D, q[j], R, T, member_ends[j], k[j], v[j], Entries{}, member_ends[j], o[j], MassOut{});
    }
  });
  return out;
}

bool is_bf16(const torch::Tensor& t) {
  if (t.dtype() == torch::kBFloat16) return true;
  TORCH_CHECK(t.dtype() == torch::kFloat32, "float32 or bfloat16 K/V");
  return false;
}

}  // namespace

// query: [B, kv_heads, R, D] float32 contiguous, pre-scaled, R = group * T (head-major, token fastest)
// k_layer, v_layer: [slots, kv_heads, capacity, D] float32 or bfloat16 contiguous; slots, ends: [B]
// int64 (ends[b] = the row's newest position + 1). Returns [B, kv_heads, R, D] float32.
torch::Tensor attend_cached(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                            torch::Tensor slots, torch::Tensor ends, int64_t T) {
  if (is_bf16(k_layer)) return attend<uint16_t>(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr, nullptr);
  return attend<float>(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr, nullptr);
}

// As attend_cached, plus mass: [B, kv_heads, n_positions] float32, mass[b, h, p] = the softmax
// probability position p receives, summed over KV head h's g query heads and the T new tokens (so
// each (b, h) sums to g * T); 0 for positions a token may not see and for p >= ends[b].
// n_positions <= 0: max(ends). Returns (out, mass).
std::vector<torch::Tensor> attend_cached_scores(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                                torch::Tensor slots, torch::Tensor ends, int64_t T,
                                                int64_t n_positions) {
  TORCH_CHECK(ends.dtype() == torch::kInt64 && ends.is_contiguous(), "int64 contiguous ends");
  TORCH_CHECK(query.dim() == 4, "query [B, kv_heads, R, D]");
  if (n_positions <= 0) {
    const int64_t* ep = ends.data_ptr<int64_t>();
    n_positions = 0;
    for (int64_t b = 0; b < ends.numel(); ++b) n_positions = std::max(n_positions, ep[b]);
  }
  auto mass = torch::empty({query.size(0), query.size(1), n_positions}, query.options());
  float* mp = mass.data_ptr<float>();
  torch::Tensor out = is_bf16(k_layer)
      ? attend<uint16_t>(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr, nullptr, mp, n_positions)
      : attend<float>(query, k_layer, v_layer, slots, ends, T, nullptr, nullptr, nullptr, mp, n_positions);
  return {out, mass};
}

// As attend_cached, for rows grouped by a shared prefix: members [B] (batch rows, group by group),
// offsets [groups + 1], shared [groups] (positions [0, shared[g]) hold the same K/V, bit for bit, in
// every slot of group g; multiples of 64). Each group's shared blocks are read from memory once per
// KV head instead of once per row; the result equals attend_cached's exactly. Returns [B, kv_heads, R, D].
torch::Tensor attend_cached_shared(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                   torch::Tensor slots, torch::Tensor ends, int64_t T, torch::Tensor members,
                                   torch::Tensor offsets, torch::Tensor shared) {
  if (is_bf16(k_layer))
    return attend_groups<uint16_t>(query, k_layer, v_layer, slots, ends, T, members, offsets, shared);
  return attend_groups<float>(query, k_layer, v_layer, slots, ends, T, members, offsets, shared);
}

// Whether attend_cached_shared reads a group's shared blocks once for head size D here (else it
// runs each row as attend_cached does: no vector path, or a head size no vector task covers).
bool shares_prefix_reads(int64_t head_dim) { return group_task_applies(head_dim); }

// As attend_cached, over the listed positions only. positions: [B, kv_heads, N] int64 contiguous;
// valid: [B, kv_heads, N] bool contiguous.
torch::Tensor attend_positions(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                               torch::Tensor slots, torch::Tensor ends, int64_t T,
                               torch::Tensor positions, torch::Tensor valid) {
  TORCH_CHECK(positions.is_contiguous() && valid.is_contiguous(), "contiguous positions only");
  TORCH_CHECK(positions.dtype() == torch::kInt64 && valid.dtype() == torch::kBool, "int64 positions, bool valid");
  TORCH_CHECK(positions.dim() == 3 && positions.size(0) == query.size(0) && positions.size(1) == query.size(1) &&
              valid.sizes() == positions.sizes(), "positions, valid: [B, kv_heads, N]");
  if (is_bf16(k_layer))
    return attend<uint16_t>(query, k_layer, v_layer, slots, ends, T, &positions, &valid, nullptr);
  return attend<float>(query, k_layer, v_layer, slots, ends, T, &positions, &valid, nullptr);
}

// Over every entry of a compact store: k_store, v_store [slots, kv_heads, S, D] float32 or
// bfloat16; entry_pos: [B, S] int64, the position each entry of row b holds (-1: empty).
torch::Tensor attend_entries(torch::Tensor query, torch::Tensor k_store, torch::Tensor v_store,
                             torch::Tensor slots, torch::Tensor ends, int64_t T, torch::Tensor entry_pos) {
  TORCH_CHECK(entry_pos.is_contiguous() && entry_pos.dtype() == torch::kInt64, "int64 entry positions");
  TORCH_CHECK(entry_pos.size(0) == query.size(0) && entry_pos.size(1) == k_store.size(2), "entry_pos: [B, S]");
  if (is_bf16(k_store))
    return attend<uint16_t>(query, k_store, v_store, slots, ends, T, nullptr, nullptr, &entry_pos);
  return attend<float>(query, k_store, v_store, slots, ends, T, nullptr, nullptr, &entry_pos);
}

// The chunked-prefill kernel (cpu_prefill.cpp).
torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                torch::Tensor seg_slot, torch::Tensor seg_start, torch::Tensor seg_offset,
                                torch::Tensor seg_len, double scale);
std::vector<torch::Tensor> prefill_attention_mass(torch::Tensor query, torch::Tensor k_layer, torch::Tensor v_layer,
                                                  torch::Tensor seg_slot, torch::Tensor seg_start,
                                                  torch::Tensor seg_offset, torch::Tensor seg_len,
                                                  torch::Tensor seg_tail, int64_t mass_len, double scale);
bool prefill_use_vector_path(bool enabled);
bool pq_use_vector_path(bool enabled);  // cpu_pqcache.cpp
bool prefill_amx_in_use();
bool prefill_mass_on_amx(int64_t D);
bool prefill_use_bf16_dot(bool enabled);
bool prefill_bf16_dot_in_use(int64_t D);

// Whether tasks (here, in cpu_prefill.cpp and cpu_pqcache.cpp) may take a vector implementation; returns whether one
// is compiled in (AVX2 + FMA or AVX-512).
bool use_vector_path(bool enabled) {
  g_vector_path = enabled;
  const bool prefill_vector = prefill_use_vector_path(enabled);
  pq_use_vector_path(enabled);
#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
  const bool here = true;
#else
  const bool here = false;
#endif
  return here || prefill_vector;
}

// Which vector implementations are compiled in, for reports: "avx512+avx2", "avx2" or "none".
std::string vector_isa() {
#if defined(MAGICDEC_AVX512) && defined(MAGICDEC_AVX2)
  return "avx512+avx2";
#elif defined(MAGICDEC_AVX512)
  return "avx512";
#elif defined(MAGICDEC_AVX2)
  return "avx2";
#else
  return "none";
#endif
}

// The lean draft's element-wise ops (cpu_draft_ops.cpp).
torch::Tensor residual_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta, torch::Tensor weight, double eps);
torch::Tensor rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_layer,
                         torch::Tensor v_layer, torch::Tensor slots, torch::Tensor positions,
                         int64_t heads, int64_t kv_heads);
torch::Tensor silu_mul(torch::Tensor gate_up);
// PQCache's nearest centroids (cpu_pqcache.cpp).
torch::Tensor pq_nearest(torch::Tensor points, torch::Tensor centroids);
// The guided draft view's selection (cpu_guided.cpp).
int64_t guided_select(torch::Tensor scores, torch::Tensor slots, torch::Tensor kept_end, torch::Tensor old_count,
                      torch::Tensor kept, torch::Tensor hint, double hint_scale, double floor, int64_t sink,
                      int64_t top, int64_t successors, c10::optional<torch::Tensor> k_store,
                      c10::optional<torch::Tensor> v_store, c10::optional<torch::Tensor> k_cache,
                      c10::optional<torch::Tensor> v_cache);

// The few-row float32 linear map (cpu_linear.cpp).
bool small_linear_available();
torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor small_linear_cat(torch::Tensor x, std::vector<torch::Tensor> weights,
                               std::vector<c10::optional<torch::Tensor>> biases,
                               std::vector<c10::optional<torch::Tensor>> blocks, std::vector<int64_t> formats);
std::vector<int64_t> small_linear_formats();
bool amx_in_use();
bool use_amx(bool enabled);

// The bfloat16 linear map on bfloat16 dot products (cpu_bf16_linear.cpp).
bool bf16_linear_available();
torch::Tensor bf16_panels(torch::Tensor weight);
torch::Tensor bf16_linear_cat(torch::Tensor x, std::vector<torch::Tensor> panels,
                              std::vector<c10::optional<torch::Tensor>> biases);

// The draft's int8 linear map from GGUF panels on VNNI dot products (cpu_int8_panels.cpp).
bool int8_panels_available();
torch::Tensor panels_int8_linear_cat(torch::Tensor x, std::vector<torch::Tensor> panels,
                                     std::vector<c10::optional<torch::Tensor>> biases);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("small_linear_available", &small_linear_available, "whether small_linear is compiled in (AVX2 + FMA)");
  m.def("small_linear", &small_linear, py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        "x [M, K] @ weight [N, K]^T (+ bias) for a few rows, float32; each row's result independent of M");
  m.def("small_linear_cat", &small_linear_cat, py::arg("x"), py::arg("weights"), py::arg("biases"),
        py::arg("blocks") = std::vector<c10::optional<torch::Tensor>>{},
        py::arg("formats") = std::vector<int64_t>{},
        "small_linear of several weights at once, their outputs side by side [M, sum N] (no weight copy); "
        "a weight with a format (1: Q4_1, 2: Q8_0) is read from its GGUF blocks, same bits");
  m.def("bf16_linear_available", &bf16_linear_available,
        "whether bf16_linear_cat is compiled in (a CPU with AVX512-BF16)");
  m.def("bf16_panels", &bf16_panels, py::arg("weight"), "a bfloat16 weight [N, K] as bf16_linear_cat's panels");
  m.def("bf16_linear_cat", &bf16_linear_cat, py::arg("x"), py::arg("panels"), py::arg("biases"),
        "bfloat16 x [M, K] by every panel set's weight, side by side, on bfloat16 dot products");
  m.def("int8_panels_available", &int8_panels_available,
        "whether panels_int8_linear_cat is compiled in (AVX512-VNNI and AVX512-VBMI)");
  m.def("panels_int8_linear_cat", &panels_int8_linear_cat, py::arg("x"), py::arg("panels"), py::arg("biases"),
        "x [M, K] rounded to int8 per row and 32-block, times Q4_1 or Q8_0 panels by VNNI dot products, side by side");
  m.def("small_linear_formats", &small_linear_formats, "the weight formats small_linear_cat reads here");
  m.def("amx_in_use", &amx_in_use, "whether GGUF panels are multiplied by the AMX tile unit here");
  m.def("use_amx", &use_amx, "allow (true) or forbid (false) the AMX tile unit (GEMM panels and prefill "
        "attention); returns the previous setting");
  m.def("prefill_amx_in_use", &prefill_amx_in_use, "whether prefill attention runs on the AMX tile unit here");

  m.def("use_vector_path", &use_vector_path,
        "allow (true) or forbid (false) the vector (AVX2/AVX-512) paths; says if one is compiled in");
  m.def("vector_isa", &vector_isa, "the vector instruction sets compiled in");
  m.def("attend_cached", &attend_cached, "fused attention over each row's whole cache (CPU, fp32/bf16 K/V)");
  m.def("attend_cached_scores", &attend_cached_scores, py::arg("query"), py::arg("k_layer"), py::arg("v_layer"),
        py::arg("slots"), py::arg("ends"), py::arg("T"), py::arg("n_positions") = 0,
        "attend_cached plus each position's attention mass per KV head; returns (out, mass)");
  m.def("attend_cached_shared", &attend_cached_shared,
        "attend_cached for rows grouped by a shared prefix, each group's shared K/V read once per KV head");
  m.def("shares_prefix_reads", &shares_prefix_reads,
        "whether attend_cached_shared reads a group's shared blocks once for this head size here");
  m.def("attend_positions", &attend_positions, "fused attention over listed cache positions (CPU, fp32/bf16 K/V)");
  m.def("attend_entries", &attend_entries, "fused attention over a compact store's entries (CPU, fp32/bf16 K/V)");
  m.def("prefill_attention", &prefill_attention, py::arg("query"), py::arg("k_layer"), py::arg("v_layer"),
        py::arg("seg_slot"), py::arg("seg_start"), py::arg("seg_offset"), py::arg("seg_len"), py::arg("scale"),
        "causal chunked-prefill attention of packed segments over the cache (CPU, fp32/bf16 K/V; a bf16 "
        "query over bf16 K/V on bfloat16 dot products where prefill_bf16_dot_in_use)");
  m.def("prefill_attention_mass", &prefill_attention_mass, py::arg("query"), py::arg("k_layer"),
        py::arg("v_layer"), py::arg("seg_slot"), py::arg("seg_start"), py::arg("seg_offset"), py::arg("seg_len"),
        py::arg("seg_tail"), py::arg("mass_len"), py::arg("scale"),
        "prefill_attention plus the attention mass of each segment's last seg_tail tokens (AMX tiles only)");
  m.def("prefill_mass_on_amx", &prefill_mass_on_amx, "whether prefill_attention_mass takes this head size here");
  m.def("prefill_use_bf16_dot", &prefill_use_bf16_dot,
        "allow (true) or forbid (false) bfloat16 dot products for a bf16 query's prefill; says if compiled in");
  m.def("prefill_bf16_dot_in_use", &prefill_bf16_dot_in_use,
        "whether prefill_attention takes a bf16 query of this head size over bf16 K/V on bfloat16 dot products");
  m.def("residual_rms_norm", &residual_rms_norm, "x += delta (if given), then RMSNorm(x) * weight (CPU, fp32)");
  m.def("rope_write", &rope_write, "RoPE on fused q|k|v, keys and values into the cache; returns the queries");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused gate|up projection (CPU, fp32)");
  m.def("pq_nearest", &pq_nearest, py::arg("points"), py::arg("centroids"),
        "PQCache's codes: each point's nearest centroid of its group, points [G, n, d], centroids [G, C, d]");
  m.def("guided_select", &guided_select, "the guided view's top positions per (layer, row, KV head), kept "
        "lists and compact-store entries updated in place; returns the entries rewritten");
}
