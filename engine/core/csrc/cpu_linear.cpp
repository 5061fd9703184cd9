// A float32 linear map for a few rows: out = x W^T (+ bias), for decode, verification and draft steps.
//
// A decode step multiplies a handful of rows (one per sequence, or gamma + 1 per sequence when
// verifying) by every weight matrix of the model. With so few rows the GEMM library's kernels
// neither stream the weights at memory speed nor keep the FMA units busy: on a 2-core Zen 3, 13 rows
// through SmolLM2-135M's layers and lm_head took 1.6x, and through the 49152-row lm_head alone 2.6x,
// the time this kernel takes (BENCHMARKS.md section 12).
// Here each weight tile (3 rows of W with AVX2, 4 with AVX-512; a few KB) is read from memory once
// and multiplied, from L1, by every row of x (4 or 3 rows at a time: up to 12 accumulators of 8 lanes
// along K, or 16 of 16 lanes), while the next tile is prefetched; threads split W's rows. The
// build's widest vectors are used (AVX-512 where compiled in, else AVX2 + FMA).
//
// Every output element is computed by the same sequence of operations (FMAs along K, one fixed
// horizontal sum, the K tail, the bias) whatever M is and whichever rows share the call, so a
// row's result does not depend on its batch. Bindings are in cpu_attention.cpp.
//
// A weight may also be read from GGUF blocks instead of its float32 copy (`formats`: Q4_1, 0.625 bytes
// a weight; Q8_0, 1.0625): each thread de-quantises a W tile into a few KB of scratch, in float32 and
// in the order gguf-py does it (Q4_1: d * q, then + m, two roundings; Q8_0: d * q), and the same
// register tiles multiply it. The de-quantised tile is bit for bit the float32 weight the model was
// converted to (the loader checks that before it hands blocks over), and the summation is the same,
// so the outputs are the float32 kernel's, bit for bit, from 6.4x (Q4_1) fewer bytes of weights.
//
// With AVX-512, Q4_1 and Q8_0 weights whose N is a multiple of 16 are read from panels instead
// (`kQ4_1Panels`, `kQ8_0Panels`, made once by engine/models/gguf_blocks.py `q4_1_panels` /
// `q8_0_panels`): the same blocks regrouped so that one 16-byte load holds 16 outputs' weight k side
// by side (Q4_1: weights j and j + 16 in the two nibbles). The product is then an outer one: per k,
// 16 outputs' weights are de-quantised once into a register and multiplied by a broadcast x[r][k] of
// each of up to 13 rows, into one accumulator per row. No horizontal sums and no scratch: at 13 rows
// the 210 layer GEMMs of the default model ran 1.48x (Xeon) and 1.49x (Zen 4) faster than the
// dot-product tiles (BENCHMARKS.md section 21), and the Q8_0 lm_head ~1.5x (section 29). A de-quantised
// weight is exactly gguf-py's: d (fp16) times q (4 or 8 bits) is exact in float32, so Q4_1's d * q + m
// rounds once whether fused or not. Each output is one FMA chain over k in a fixed order (per block:
// Q4_1 j, j + 16 for j = 0..15, Q8_0 k = 0..31, into the block's sum; then the blocks' sums in turn),
// whatever M and the row tiling, so a row's result still does not depend on its batch; its bits
// differ from the float32 kernel's (another summation order). Where the build and the CPU have AMX
// tiles, the panels are multiplied by them instead (`amx_panel_linear`: x in three bfloat16 parts,
// float32 accuracy, a row's bits again independent of its batch; `use_amx(false)` switches back), for
// any number of rows, prefill chunks included. Not here: any other dtype (bfloat16/int8 draft GEMMs
// live in engine/spec/draft/gemms.py), many-row GEMMs without AMX (prefill chunks keep torch's
// there), weights that are not contiguous.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "amx_tiles.h"   // MAGICDEC_AMX_TILES, TileConfig, amx_permitted
#include "panel_tasks.h"  // for_panel_tiles
#include "vector_math.h"

namespace {

#if defined(MAGICDEC_AVX512) || defined(MAGICDEC_AVX2)
inline float sum8(__m256 v) {  // one fixed order of 8 lanes: the two halves, then pairs
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

#if defined(MAGICDEC_AVX512)
// AVX-512: 16-lane vectors, 32 registers (4 x 4 accumulators + 4 W vectors + 1 x vector).
constexpr int kTileOutputs = 4;  // rows of W per register tile
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(Vec v) {  // one fixed order of the 16 lanes: the two halves added, then sum8's
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX-512F only
  return sum8(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}
#define MAGICDEC_SMALL_LINEAR 1
#elif defined(MAGICDEC_AVX2)
// AVX2: 8-lane vectors, 16 registers (4 x 3 accumulators + 3 W vectors + 1 x vector).
constexpr int kTileOutputs = 3;  // rows of W per register tile
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(Vec v) { return sum8(v); }
#define MAGICDEC_SMALL_LINEAR 1
#endif

#ifdef MAGICDEC_SMALL_LINEAR
// out[i * ldo + j] = x[i] . w[j] (+ bias[j]) for MR rows x [MR, K] and NR rows w [NR, K]. With
// `prefetch`, the next W tile's lines are asked for (into L1) while this one is multiplied.
template <int MR, int NR>
inline void tile(const float* __restrict x, const float* __restrict w, const float* bias, float* __restrict out,
                 int64_t K, int64_t ldo, const float* prefetch) {
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = vzero();
  const int64_t KV = K & ~(kLanes - 1);
  for (int64_t k = 0; k < KV; k += kLanes) {
    if (prefetch != nullptr && (k & 15) == 0) {  // one 64-byte line per W row every 16 floats
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * K + k), _MM_HINT_T0);
    }
    // The empty asm statements keep each W and x vector in a register: without them the compiler
    // folds the W loads into the FMAs and reads every W vector once per row (16 loads per 12 FMAs,
    // more than the two load ports keep up with).
    Vec wv[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = vload(w + j * K + k);
      asm("" : "+v"(wv[j]));
    }
    for (int i = 0; i < MR; ++i) {
      Vec xv = vload(x + i * K + k);
      asm("" : "+v"(xv));
      for (int j = 0; j < NR; ++j) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = vsum(acc[i][j]);
      for (int64_t k = KV; k < K; ++k) s += x[i * K + k] * w[j * K + k];
      out[i * ldo + j] = bias != nullptr ? s + bias[j] : s;
    }
}

// Every row of x against NR rows of W starting at output n: register tiles of 4 rows, and of 3 where
// M is not a multiple of 4 (13 = 4 + 3 + 3 + 3), so that no tile of a single row (one FMA per load)
// remains unless M < 3. The first tile prefetches the next W tile (`prefetch`, or none).
// wn: the tile's first W row [NR, K]; bn: its biases or none; out_n: its first output (rows N apart).
template <int NR>
inline void rows_against(const float* x, const float* wn, const float* bn, float* out_n, int64_t M, int64_t K,
                         int64_t N, const float* prefetch) {
  int64_t fours = M / 4, threes = 0;
  const int64_t rest = M % 4;
  if (rest == 3) threes = 1;
  if (rest == 2 && fours >= 1) fours -= 1, threes = 2;
  if (rest == 1 && fours >= 2) fours -= 2, threes = 3;
  int64_t m = 0;
  for (int64_t t = 0; t < fours; ++t, m += 4, prefetch = nullptr)
    tile<4, NR>(x + m * K, wn, bn, out_n + m * N, K, N, prefetch);
  for (int64_t t = 0; t < threes; ++t, m += 3, prefetch = nullptr)
    tile<3, NR>(x + m * K, wn, bn, out_n + m * N, K, N, prefetch);
  for (; m + 2 <= M; m += 2, prefetch = nullptr) tile<2, NR>(x + m * K, wn, bn, out_n + m * N, K, N, prefetch);
  for (; m < M; ++m, prefetch = nullptr) tile<1, NR>(x + m * K, wn, bn, out_n + m * N, K, N, prefetch);
}
#endif  // MAGICDEC_SMALL_LINEAR

// How a weight is read: its float32 copy, or GGUF blocks of 32 weights along K (ids shared with
// engine/core/linear.py).
// kQ4_1Panels, kQ8_0Panels: Q4_1 and Q8_0 regrouped by 16 outputs (see the header).
enum WeightFormat : int64_t { kFloat32 = 0, kQ4_1 = 1, kQ8_0 = 2, kQ4_1Panels = 3, kQ8_0Panels = 4 };
constexpr int64_t kBlock = 32;  // weights per GGUF block
// A Q4_1 panel block: 16 outputs x 32 weights along K as 16 fp16 d, 16 fp16 m, then 16 rows j of 16
// bytes: byte i of row j holds output i's weight j (low nibble) and weight j + 16 (high nibble).
// A Q8_0 panel block: 16 fp16 d, then 32 rows k of 16 int8: byte i of row k is output i's weight k.
constexpr int64_t kPanelOutputs = 16, kPanelBlockBytes = 16 * 2 + 16 * 2 + 16 * 16;
constexpr int64_t kQ8PanelBlockBytes = 16 * 2 + 32 * 16;

inline bool is_panels(int64_t format) { return format == kQ4_1Panels || format == kQ8_0Panels; }

inline int64_t block_bytes(int64_t format) {  // Q4_1: fp16 d, fp16 m, 16 bytes of nibbles; Q8_0: fp16 d, 32 int8
  return format == kQ4_1 ? 20 : format == kQ8_0 ? 34 : format == kQ4_1Panels ? kPanelBlockBytes / kPanelOutputs
       : format == kQ8_0Panels ? kQ8PanelBlockBytes / kPanelOutputs : 0;
}

#if defined(MAGICDEC_SMALL_LINEAR) && defined(__F16C__)
#define MAGICDEC_GGUF_BLOCKS 1
inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// rows x K weights from their blocks [rows, K / 32, bytes] into float32 [rows, K]. The product is held
// in a register (the empty asm) so that -ffast-math cannot fuse it with the add: two roundings, as
// gguf-py's d * q + m. Q4_1: weight j < 16 is byte j's low nibble, weight j >= 16 byte j - 16's high one.
inline void dequantise(const uint8_t* blocks, int64_t format, int64_t rows, int64_t K, float* out) {
  const int64_t count = rows * (K / kBlock), bytes = block_bytes(format);
  for (int64_t b = 0; b < count; ++b, blocks += bytes, out += kBlock) {
    const float d = half_at(blocks);
#if defined(MAGICDEC_AVX512)
    const __m512 dv = _mm512_set1_ps(d);
    if (format == kQ4_1) {
      const __m512 mv = _mm512_set1_ps(half_at(blocks + 2));
      const __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 4));
      const __m128i low = _mm_and_si128(nibbles, _mm_set1_epi8(0x0F));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(nibbles, 4), _mm_set1_epi8(0x0F));
      __m512 p0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)));
      __m512 p1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)));
      asm("" : "+v"(p0), "+v"(p1));
      _mm512_storeu_ps(out, _mm512_add_ps(p0, mv));
      _mm512_storeu_ps(out + 16, _mm512_add_ps(p1, mv));
    } else {
      const __m128i* q = reinterpret_cast<const __m128i*>(blocks + 2);
      _mm512_storeu_ps(out, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)))));
      _mm512_storeu_ps(out + 16,
                       _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)))));
    }
#else
    const __m256 dv = _mm256_set1_ps(d);
    if (format == kQ4_1) {
      const __m256 mv = _mm256_set1_ps(half_at(blocks + 2));
      const __m128i nibbles = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 4));
      const __m128i low = _mm_and_si128(nibbles, _mm_set1_epi8(0x0F));
      const __m128i high = _mm_and_si128(_mm_srli_epi16(nibbles, 4), _mm_set1_epi8(0x0F));
      const __m128i halves[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
      for (int h = 0; h < 4; ++h) {
        __m256 p = _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(halves[h])));
        asm("" : "+v"(p));
        _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(p, mv));
      }
    } else {
      for (int h = 0; h < 4; ++h) {
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blocks + 2 + 8 * h));
        _mm256_storeu_ps(out + 8 * h, _mm256_mul_ps(dv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
      }
    }
#endif
  }
}
#endif  // MAGICDEC_SMALL_LINEAR && __F16C__

#if defined(MAGICDEC_GGUF_BLOCKS) && defined(MAGICDEC_AVX512)
#define MAGICDEC_PANELS 1
constexpr int kMaxPanelRows = 13;  // 2 R accumulators + d, m, two weight vectors, the nibbles: 32 registers

// out[r][0..15] = x[r] . the panel's 16 weight rows (+ bias) for R rows of x [R, K] (rows K apart),
// the panel in `Format` (kQ4_1Panels or kQ8_0Panels). panel: the 16 outputs' K / 32 panel blocks, one
// after the other. Each block's 32 products are summed on their own (one FMA chain: Q4_1 weights j,
// j + 16 for j = 0..15, Q8_0 weights k = 0..31) and then added to the row's total: a chain of 32 and
// one of K / 32 rather than one of K, about as accurate as the dot-product tiles' 16 lanes.
template <int64_t Format, int R>
void panel_rows(const float* __restrict x, int64_t K, const uint8_t* __restrict panel, const float* bias,
                float* __restrict out, int64_t ldo) {
  constexpr bool q8 = Format == kQ8_0Panels;
  constexpr int64_t block_bytes = q8 ? kQ8PanelBlockBytes : kPanelBlockBytes;
  __m512 total[R], part[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < K / kBlock; ++b, panel += block_bytes) {
    for (int64_t line = 0; line < block_bytes; line += 64)  // two blocks ahead
      _mm_prefetch(reinterpret_cast<const char*>(panel + 2 * block_bytes + line), _MM_HINT_T0);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel)));  // [16]
    const float* xb = x + b * kBlock;
    // part[r] += x[r][k] * w (w: weight k of the 16 outputs), the block's first product a plain one
    auto fold = [&](int64_t k, __m512 w) {
      for (int r = 0; r < R; ++r)
        part[r] = k == 0 ? _mm512_mul_ps(_mm512_set1_ps(xb[r * K]), w)
                         : _mm512_fmadd_ps(_mm512_set1_ps(xb[r * K + k]), w, part[r]);
    };
    if constexpr (q8) {
      for (int k = 0; k < kBlock; ++k) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 32 + 16 * k));
        fold(k, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));  // d * q: exact
      }
    } else {
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + 32)));
      for (int j = 0; j < 16; ++j) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(panel + 64 + 16 * j));
        const __m128i q_low = _mm_and_si128(bytes, low_nibbles);
        const __m128i q_high = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_nibbles);
        // d * q is exact (11 x 4 significant bits), so the fused d * q + m rounds as gguf-py's two steps
        fold(j, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_low)), m));
        fold(j + 16, _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q_high)), m));
      }
    }
    for (int r = 0; r < R; ++r) total[r] = _mm512_add_ps(total[r], part[r]);
  }
  const __m512 bv = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * ldo, bias != nullptr ? _mm512_add_ps(total[r], bv) : total[r]);
}

using PanelRows = void (*)(const float*, int64_t, const uint8_t*, const float*, float*, int64_t);
template <int64_t Format, int... R>
constexpr std::array<PanelRows, sizeof...(R) + 1> panel_table(std::integer_sequence<int, R...>) {
  return {nullptr, &panel_rows<Format, R + 1>...};
}
constexpr auto kRows = std::make_integer_sequence<int, kMaxPanelRows>{};
constexpr auto kQ4_1PanelRows = panel_table<kQ4_1Panels>(kRows);  // [R] -> R rows
constexpr auto kQ8_0PanelRows = panel_table<kQ8_0Panels>(kRows);

// The parts read from panels: tasks of 16 outputs, each over all M rows in near-equal tiles of at
// most kMaxPanelRows (13 rows: one tile; 16: 8 + 8; 26: 13 + 13).
void panel_linear(const float* x, int64_t M, int64_t K, const std::vector<const uint8_t*>& panels,
                  const std::vector<int64_t>& formats, const std::vector<const float*>& biases,
                  const std::vector<int64_t>& widths, const std::vector<int64_t>& columns, int64_t N, float* out) {
  const int64_t parts = static_cast<int64_t>(panels.size());
  std::vector<int64_t> first_task(parts + 1, 0);
  for (int64_t i = 0; i < parts; ++i) first_task[i + 1] = first_task[i] + widths[i] / kPanelOutputs;
  magicdec_panels::for_panel_tiles(first_task, M, kMaxPanelRows, [&](int64_t i, int64_t g, int64_t m, int64_t rows) {
    const int64_t n = g * kPanelOutputs;
    const bool q8 = formats[i] == kQ8_0Panels;
    const uint8_t* panel = panels[i] + g * (K / kBlock) * (q8 ? kQ8PanelBlockBytes : kPanelBlockBytes);
    const float* bn = biases[i] != nullptr ? biases[i] + n : nullptr;
    (q8 ? kQ8_0PanelRows : kQ4_1PanelRows)[rows](x + m * K, K, panel, bn, out + m * N + columns[i] + n, N);
  });
}
#endif  // MAGICDEC_GGUF_BLOCKS && MAGICDEC_AVX512

#if defined(MAGICDEC_PANELS) && defined(MAGICDEC_AMX_TILES)
#define MAGICDEC_AMX 1
// AMX: the same panels multiplied by the tile unit's bfloat16 dot products, exactly enough for float32.
// Each row of x is split into three bfloat16 parts, x = hi + mid + lo (each the rounding of what the
// parts before it left; 3 x 8 significant bits hold float32's 24, so the sum is x, bit for bit, but for
// values near float32's smallest normals); a weight's q (Q4_1 0..15, Q8_0 -128..127) is exact in
// bfloat16, so every product x_part * q is exact and the tile unit's float32 sums (round to nearest,
// in a fixed order per row) are the only roundings, as in the float32 kernels. Per block of 32 along K
// and 16 outputs: C [rows, 16 outputs] = sum over the parts of A_part [rows, 32] . B [32, 16], then
// out += d * C (+ m * the block's sum of x, Q4_1). A row's bits do not depend on the other rows of its
// tile (each row's products and sums are its own). B is built from the panel block's bytes in
// registers (q as bfloat16 pairs, the tile unit's layout) once per call and kept for further row
// tiles; two panels go side by side, their C tiles' sums interleaved so that neither waits on the
// other's. One decode step's GEMMs of the default model as the lean stack calls them, against the
// AVX-512 panels (layers / lm_head): 1.07x / 1.44x at 16 rows, 1.55x / 1.72x at 64 (1.83x torch's GEMM,
// which took those rows before), but 0.76x / 0.73x at 1 row: building B costs what the AVX-512
// kernel's one row of FMAs does (BENCHMARKS.md section 30); with the scratch on cache lines, 1.40x /
// 1.71x at 16 rows (section 32).
using magicdec_amx::TileConfig;

constexpr int kTileRows = 16, kParts = 3;
constexpr int64_t kAmxPassRows = 128;  // rows of x per amx_panel_pass (see amx_panel_linear)

// x rows [rows, K] of one row tile -> for each block b its A parts [kParts][16 rows][32 bf16] (rows past
// `rows` untouched: the tiles are configured to `rows` rows) and each row's sum of the block's 32 x
// [16] (Q4_1's m term). q4: the Q4_1 panels' order (bf16 pair j holds x[j], x[j + 16], as a panel byte
// holds weights j and j + 16), else Q8_0's (x[2j], x[2j + 1], the natural order).
void split_rows(const float* x, int64_t rows, int64_t K, bool q4, uint16_t* parts, float* sums) {
  const int64_t blocks = K / kBlock;
  const __m512i low_word = _mm512_set1_epi32(0xFFFF);
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r = 0; r < rows; ++r) {
      __m512 first = _mm512_loadu_ps(x + r * K + b * kBlock);  // x[0..15] of the block
      __m512 second = _mm512_loadu_ps(x + r * K + b * kBlock + 16);  // x[16..31]
      sums[b * kTileRows + r] = _mm512_reduce_add_ps(_mm512_add_ps(first, second));
      for (int p = 0; p < kParts; ++p) {
        // each half rounded to bfloat16, then widened back to subtract it (bf16 bits << 16 = float32)
        const __m512i a = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(first));
        const __m512i c = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(second));
        uint16_t* dst = parts + ((b * kParts + p) * kTileRows + r) * kBlock;
        if (q4) {  // dword j = (bf16 of x[j]) | (bf16 of x[j + 16]) << 16
          _mm512_storeu_si512(dst, _mm512_or_si512(_mm512_and_si512(a, low_word), _mm512_slli_epi32(c, 16)));
        } else {  // words 0..15 then 16..31
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(a));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm512_cvtepi32_epi16(c));
        }
        first = _mm512_sub_ps(first, _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)));
        second = _mm512_sub_ps(second, _mm512_castsi512_ps(_mm512_slli_epi32(c, 16)));
      }
    }
}

// bfloat16 bits of 0..15, twice: _mm512_permutexvar_epi16 reads bits 4:0 of each index word, so bit 4
// (whatever the byte above the nibble holds) picks the same value
alignas(64) constexpr uint16_t kNibbleBf16[32] = {
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0, 0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};

// B of a panel block [16 pairs j][16 outputs][2 bf16] into `tile` (1 KB, 64-byte aligned): Q4_1 pair j
// of output i = the two nibbles of byte i of the block's row j, looked up as bfloat16 (each byte b as
// the dword b | b << 12: its low word's bits 3:0 hold the low nibble, its high word's the high one);
// Q8_0 = its weights 2j, 2j + 1, through float32.
inline void build_b(const uint8_t* block, bool q4, uint16_t* tile) {
  if (q4) {
    const __m512i table = _mm512_load_si512(kNibbleBf16);
    for (int j = 0; j < 16; ++j) {
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 64 + 16 * j)));
      const __m512i index = _mm512_or_si512(bytes, _mm512_slli_epi32(bytes, 12));
      _mm512_store_si512(tile + 32 * j, _mm512_permutexvar_epi16(index, table));
    }
    return;
  }
  const __m512i high_word = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int j = 0; j < 16; ++j) {
    const uint8_t* row = block + 32 + 32 * j;
    const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row))));
    const __m512 second =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16))));
    // small integers are exact in bfloat16: the high half of their float32 bits
    const __m512i pair = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(first), 16),
                                         _mm512_and_si512(_mm512_castps_si512(second), high_word));
    _mm512_store_si512(tile + 32 * j, pair);
  }
}

// One task of amx_panel_linear: P (1 or 2) adjacent panels of one weight over every row of x.
struct AmxTask {
  const uint8_t* panel0;
  const uint8_t* panel1;  // the next panel (P = 2)
  bool q8;
  int64_t blocks, block_bytes;
  const uint16_t* split;  // x's A parts in this format's order, [row tile][block][part][16][32]
  int64_t part_words;     // per row tile
  const float* sums;      // [row tile][block][16]
  int64_t M;
  const float* bias;      // [16 P] or null
  float* out;             // the first panel's first output column (rows N apart)
  int64_t N;
  uint16_t* b_tiles;      // scratch [2][blocks][512]
};

// Per block: both panels' B tiles (built on the first row tile, then kept), the block's three A
// parts loaded once for both, the six products into two C tiles interleaved, then out += d * C (+ m *
// the block's sums of x) per panel, in registers until the row tile ends.
template <int P>
void amx_panels(const AmxTask& task, int64_t& configured_rows) {
  const int64_t row_tiles = (task.M + kTileRows - 1) / kTileRows;
  alignas(64) float c[P][kTileRows * 16];
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    const int64_t rows = std::min<int64_t>(kTileRows, task.M - rt * kTileRows);
    if (rows != configured_rows) {  // the A and C tiles hold this tile's rows; 0, 1: C; 2..4: A; 5, 6: B
      TileConfig config;
      for (int tile = 0; tile <= 6; ++tile) {
        config.colsb[tile] = 64;
        config.rows[tile] = static_cast<uint8_t>(tile >= 5 ? 16 : rows);
      }
      asm volatile("" : : "r"(&config) : "memory");  // GCC 12 drops the stores ldtilecfg reads without it
      _tile_loadconfig(&config);
      configured_rows = rows;
    }
    __m512 total[P][kTileRows];
    for (int p = 0; p < P; ++p) {
      const __m512 bias = task.bias != nullptr ? _mm512_loadu_ps(task.bias + 16 * p) : _mm512_setzero_ps();
      for (int r = 0; r < kTileRows; ++r) total[p][r] = bias;
    }
    const uint8_t* panel[2] = {task.panel0, task.panel1};
    for (int64_t b = 0; b < task.blocks; ++b) {
      uint16_t* b_tile[2] = {task.b_tiles + b * 512, task.b_tiles + (task.blocks + b) * 512};
      if (rt == 0)
        for (int p = 0; p < P; ++p) {
          const uint8_t* block = panel[p] + b * task.block_bytes;
          for (int64_t line = 0; line < task.block_bytes; line += 64)  // two blocks ahead
            _mm_prefetch(reinterpret_cast<const char*>(block + 2 * task.block_bytes + line), _MM_HINT_T0);
          build_b(block, !task.q8, b_tile[p]);
        }
      const uint16_t* a = task.split + rt * task.part_words + b * kParts * kTileRows * kBlock;
      _tile_loadd(2, a, 64);
      _tile_loadd(3, a + kTileRows * kBlock, 64);
      _tile_loadd(4, a + 2 * kTileRows * kBlock, 64);
      _tile_loadd(5, b_tile[0], 64);
      _tile_zero(0);
      if constexpr (P == 2) {
        _tile_loadd(6, b_tile[1], 64);
        _tile_zero(1);
      }
      _tile_dpbf16ps(0, 2, 5);
      if constexpr (P == 2) _tile_dpbf16ps(1, 2, 6);
      _tile_dpbf16ps(0, 3, 5);
      if constexpr (P == 2) _tile_dpbf16ps(1, 3, 6);
      _tile_dpbf16ps(0, 4, 5);
      if constexpr (P == 2) _tile_dpbf16ps(1, 4, 6);
      _tile_stored(0, c[0], 64);
      if constexpr (P == 2) _tile_stored(1, c[P - 1], 64);
      const float* s = task.sums + (rt * task.blocks + b) * kTileRows;
      for (int p = 0; p < P; ++p) {
        const uint8_t* block = panel[p] + b * task.block_bytes;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
        if (task.q8) {
          for (int r = 0; r < rows; ++r) total[p][r] = _mm512_fmadd_ps(d, _mm512_load_ps(c[p] + 16 * r), total[p][r]);
        } else {
          const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32)));
          for (int r = 0; r < rows; ++r)
            total[p][r] = _mm512_fmadd_ps(m, _mm512_set1_ps(s[r]),
                                          _mm512_fmadd_ps(d, _mm512_load_ps(c[p] + 16 * r), total[p][r]));
        }
      }
    }
    for (int p = 0; p < P; ++p)
      for (int r = 0; r < rows; ++r) _mm512_storeu_ps(task.out + (rt * kTileRows + r) * task.N + 16 * p, total[p][r]);
  }
}

// One pass of amx_panel_linear over M <= kAmxPassRows rows.
void amx_panel_pass(const float* x, int64_t M, int64_t K, const std::vector<const uint8_t*>& panels,
                      const std::vector<int64_t>& formats, const std::vector<const float*>& biases,
                      const std::vector<int64_t>& widths, const std::vector<int64_t>& columns, int64_t N, float* out) {
  const int64_t parts = static_cast<int64_t>(panels.size()), blocks = K / kBlock;
  const int64_t row_tiles = (M + kTileRows - 1) / kTileRows;
  const bool any_q8 = std::find(formats.begin(), formats.end(), kQ8_0Panels) != formats.end();
  const bool any_q4 = std::find(formats.begin(), formats.end(), kQ4_1Panels) != formats.end();
  // x split once per call for the orders present: [row tile][block][part][16][32] and sums [row tile][block][16]
  const int64_t part_words = blocks * kParts * kTileRows * kBlock;
  // the calling thread's scratch, grown on demand (every word read is written first); the tasks below
  // run on other threads too, so they are handed pointers, not the thread-local names
  // (cache-line aligned: a tile row straddling two lines loads several times slower, BENCHMARKS.md
  // section 32)
  static thread_local magicdec_vec::AlignedVector<uint16_t> split_q4_scratch, split_q8_scratch;
  static thread_local std::vector<float> sums_scratch;
  for (auto [split, needed] : {std::pair{&split_q4_scratch, any_q4}, std::pair{&split_q8_scratch, any_q8}})
    if (needed && split->size() < static_cast<size_t>(row_tiles * part_words)) split->resize(row_tiles * part_words);
  if (sums_scratch.size() < static_cast<size_t>(row_tiles * blocks * kTileRows))
    sums_scratch.resize(row_tiles * blocks * kTileRows);
  uint16_t* const split_q4 = split_q4_scratch.data();
  uint16_t* const split_q8 = split_q8_scratch.data();
  float* const sums = sums_scratch.data();
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    const int64_t rows = std::min<int64_t>(kTileRows, M - rt * kTileRows);
    float* tile_sums = sums + rt * blocks * kTileRows;
    if (any_q4) split_rows(x + rt * kTileRows * K, rows, K, true, split_q4 + rt * part_words, tile_sums);
    if (any_q8) split_rows(x + rt * kTileRows * K, rows, K, false, split_q8 + rt * part_words, tile_sums);
  }
  // tasks: two panels of one part at a time (their C tiles' sums interleaved, so that neither waits
  // on the other's), the last panel of a part with an odd count alone
  std::vector<int64_t> first_pair(parts + 1, 0);
  for (int64_t i = 0; i < parts; ++i) first_pair[i + 1] = first_pair[i] + (widths[i] / kPanelOutputs + 1) / 2;
  at::parallel_for(0, first_pair[parts], 1, [&](int64_t first, int64_t last) {
    // a task's panels' B tiles [2][blocks][512], for row tiles (cache-line aligned, as the split parts)
    static thread_local magicdec_vec::AlignedVector<uint16_t> b_tiles;
    if (b_tiles.size() < static_cast<size_t>(2 * blocks * 512)) b_tiles.resize(2 * blocks * 512);
    int64_t configured_rows = -1;
    int64_t i = 0;
    for (int64_t t = first; t < last; ++t) {
      while (t >= first_pair[i + 1]) ++i;
      const int64_t g = 2 * (t - first_pair[i]), n = g * kPanelOutputs;
      const int count = g + 1 < widths[i] / kPanelOutputs ? 2 : 1;
      const bool q8 = formats[i] == kQ8_0Panels;
      const int64_t block_bytes = q8 ? kQ8PanelBlockBytes : kPanelBlockBytes;
      const uint8_t* panel = panels[i] + g * blocks * block_bytes;
      const AmxTask task{panel, count == 2 ? panel + blocks * block_bytes : nullptr, q8, blocks, block_bytes,
                         q8 ? split_q8 : split_q4, part_words, sums, M,
                         biases[i] != nullptr ? biases[i] + n : nullptr, out + columns[i] + n, N, b_tiles.data()};
      if (count == 2)
        amx_panels<2>(task, configured_rows);
      else
        amx_panels<1>(task, configured_rows);
    }
    _tile_release();
  });
}

// panel_linear by the tile unit (same arguments and outputs layout), at most kAmxPassRows rows a pass:
// every panel pair re-reads the pass's split x, which then stays in the core's caches (a 512-row
// prefill chunk in one pass: 1.04x torch's GEMM; in four: 1.4x, BENCHMARKS.md section 31).
void amx_panel_linear(const float* x, int64_t M, int64_t K, const std::vector<const uint8_t*>& panels,
                      const std::vector<int64_t>& formats, const std::vector<const float*>& biases,
                      const std::vector<int64_t>& widths, const std::vector<int64_t>& columns, int64_t N, float* out) {
  for (int64_t m = 0; m < M; m += kAmxPassRows)
    amx_panel_pass(x + m * K, std::min(kAmxPassRows, M - m), K, panels, formats, biases, widths, columns, N,
                   out + m * N);
}
#endif  // MAGICDEC_AMX

}  // namespace

// Whether panels are multiplied by the tile unit (AMX) here: compiled in, permitted, not switched off.
bool amx_in_use() {
#ifdef MAGICDEC_AMX
  return magicdec_amx::amx_usable();
#else
  return false;
#endif
}

// Switch the AMX tile unit on or off for every kernel that uses it, the GEMM panels and the prefill
// attention (tests compare both; a no-op where not compiled in); returns the previous setting.
bool use_amx(bool enabled) {
#ifdef MAGICDEC_AMX_TILES
  const bool previous = magicdec_amx::amx_switched_on;
  magicdec_amx::amx_switched_on = enabled;
  return previous;
#else
  (void)enabled;
  return false;
#endif
}

// Whether small_linear has its vector implementation here (else callers keep torch's GEMM).
bool small_linear_available() {
#ifdef MAGICDEC_SMALL_LINEAR
  return true;
#else
  return false;
#endif
}

// Whether small_linear_cat reads weights in this format here: float32 wherever the kernel is
// compiled in, GGUF blocks where F16C is too.
bool reads_format(int64_t format) {
#ifdef MAGICDEC_SMALL_LINEAR
  if (format == kFloat32) return true;
#endif
#ifdef MAGICDEC_GGUF_BLOCKS
  if (format == kQ4_1 || format == kQ8_0) return true;
#endif
#ifdef MAGICDEC_PANELS
  if (is_panels(format)) return true;
#endif
  return false;
}

// The weight formats small_linear_cat reads here (ids of WeightFormat).
std::vector<int64_t> small_linear_formats() {
  std::vector<int64_t> formats;
  for (int64_t format : {kFloat32, kQ4_1, kQ8_0, kQ4_1Panels, kQ8_0Panels})
    if (reads_format(format)) formats.push_back(format);
  return formats;
}

// x: [M, K] float32 contiguous; weights[i]: [N_i, K] float32 contiguous; biases[i]: [N_i] or none;
// formats[i] (optional, default float32) and blocks[i]: weight i read from its GGUF blocks instead,
// uint8 [N_i, K / 32, block bytes] that de-quantise to exactly weights[i] (K a multiple of 32); for
// kQ4_1Panels uint8 [N_i / 16, K / 32, 320], kQ8_0Panels [N_i / 16, K / 32, 544] (N_i a multiple of 16).
// Returns [M, sum N_i]: every weight's outputs side by side (a fused q|k|v or gate|up projection from
// the model's own separate weights, with no concatenated copy), in one pass of the threads.
torch::Tensor small_linear_cat(torch::Tensor x, std::vector<torch::Tensor> weights,
                               std::vector<c10::optional<torch::Tensor>> biases,
                               std::vector<c10::optional<torch::Tensor>> blocks, std::vector<int64_t> formats) {
  TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.is_contiguous(), "x: [M, K] float32, contiguous");
  TORCH_CHECK(!weights.empty() && biases.size() == weights.size(), "one bias (or None) per weight");
  TORCH_CHECK(formats.size() == blocks.size() && (formats.empty() || formats.size() == weights.size()),
              "one format and one blocks tensor (or None) per weight, or none at all");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t parts = static_cast<int64_t>(weights.size());
  std::vector<const float*> wps(parts), bps(parts, nullptr);
  std::vector<const uint8_t*> blockps(parts, nullptr);
  std::vector<int64_t> widths(parts), columns(parts + 1, 0), first_tile(parts + 1, 0), fmts(parts, kFloat32);
  for (int64_t i = 0; i < parts; ++i) {
    const auto& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.dtype() == torch::kFloat32 && w.is_contiguous(),
                "weights: [N, K] float32, contiguous, x's K");
    wps[i] = w.data_ptr<float>();
    widths[i] = w.size(0);
    if (biases[i].has_value()) {
      const auto& b = *biases[i];
      TORCH_CHECK(b.dtype() == torch::kFloat32 && b.is_contiguous() && b.numel() == w.size(0), "bias: [N] float32");
      bps[i] = b.data_ptr<float>();
    }
    if (!formats.empty() && formats[i] != kFloat32) {
      fmts[i] = formats[i];
      TORCH_CHECK(reads_format(fmts[i]), "weight format ", fmts[i], " is not compiled in here (see small_linear_formats)");
      TORCH_CHECK(blocks[i].has_value(), "a GGUF-format weight needs its blocks");
      const auto& q = *blocks[i];
      TORCH_CHECK(K % kBlock == 0 && q.dtype() == torch::kUInt8 && q.is_contiguous() &&
                      q.numel() == w.size(0) * (K / kBlock) * block_bytes(fmts[i]),
                  "blocks: uint8 [N, K / 32, block bytes], contiguous");
      TORCH_CHECK(!is_panels(fmts[i]) || w.size(0) % kPanelOutputs == 0, "panels: N a multiple of 16");
      blockps[i] = q.data_ptr<uint8_t>();
    }
    columns[i + 1] = columns[i] + widths[i];
#ifdef MAGICDEC_SMALL_LINEAR
    const int64_t tiled = is_panels(fmts[i]) ? 0 : widths[i];  // panels are multiplied apart
    first_tile[i + 1] = first_tile[i] + (tiled + kTileOutputs - 1) / kTileOutputs;
#endif
  }
#ifdef MAGICDEC_SMALL_LINEAR
  const int64_t N = columns[parts];
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef MAGICDEC_PANELS
  {  // the parts in panels first (each output is computed the same way whatever shares the call)
    std::vector<const uint8_t*> panels;
    std::vector<const float*> panel_biases;
    std::vector<int64_t> panel_formats, panel_widths, panel_columns;
    for (int64_t i = 0; i < parts; ++i)
      if (is_panels(fmts[i])) {
        panels.push_back(blockps[i]), panel_formats.push_back(fmts[i]), panel_biases.push_back(bps[i]);
        panel_widths.push_back(widths[i]), panel_columns.push_back(columns[i]);
      }
    if (!panels.empty()) {
#ifdef MAGICDEC_AMX
      if (amx_in_use())
        amx_panel_linear(xp, M, K, panels, panel_formats, panel_biases, panel_widths, panel_columns, N, op);
      else
#endif
        panel_linear(xp, M, K, panels, panel_formats, panel_biases, panel_widths, panel_columns, N, op);
    }
    if (first_tile[parts] == 0) return out;
  }
#endif
  at::parallel_for(0, first_tile[parts], 16, [&](int64_t first, int64_t last) {
    std::vector<float> scratch;  // one de-quantised W tile [kTileOutputs, K], reused by this task's tiles
    int64_t i = 0;
    for (int64_t t = first; t < last; ++t) {
      while (t >= first_tile[i + 1]) ++i;  // the weight this tile belongs to
      const int64_t n = (t - first_tile[i]) * kTileOutputs, Ni = widths[i];
      const int64_t tile_rows = std::min<int64_t>(kTileOutputs, Ni - n);
      const float* bn = bps[i] != nullptr ? bps[i] + n : nullptr;
      float* on = op + columns[i] + n;  // the tile's first output column; rows of out are N apart
      const float* wn = wps[i] + n * K;
      const float* next = t + 1 < last && n + 2 * kTileOutputs <= Ni ? wn + kTileOutputs * K : nullptr;
#ifdef MAGICDEC_GGUF_BLOCKS
      if (fmts[i] != kFloat32) {
        const int64_t row_bytes = (K / kBlock) * block_bytes(fmts[i]);
        const uint8_t* qn = blockps[i] + n * row_bytes;
        if (next != nullptr)  // the next tile's blocks, one 64-byte line at a time
          for (int64_t b = 0; b < kTileOutputs * row_bytes; b += 64)
            _mm_prefetch(reinterpret_cast<const char*>(qn + kTileOutputs * row_bytes + b), _MM_HINT_T0);
        scratch.resize(kTileOutputs * K);
        dequantise(qn, fmts[i], tile_rows, K, scratch.data());
        wn = scratch.data();
        next = nullptr;
      }
#endif
      if (tile_rows == kTileOutputs) {
        rows_against<kTileOutputs>(xp, wn, bn, on, M, K, N, next);
      } else {
        for (int64_t j = 0; j < tile_rows; ++j)
          rows_against<1>(xp, wn + j * K, bn != nullptr ? bn + j : nullptr, on + j, M, K, N, nullptr);
      }
    }
  });
  return out;
#else
  TORCH_CHECK(false, "small_linear needs AVX2 + FMA or AVX-512 (see small_linear_available)");
#endif
}

// x: [M, K] float32 contiguous; weight: [N, K] float32 contiguous; bias: [N] or none. Returns [M, N].
torch::Tensor small_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  return small_linear_cat(x, {weight}, {bias}, {}, {});
}
