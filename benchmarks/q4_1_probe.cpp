// A probe, not the engine's kernel: a few-row GEMM that reads the default model's GGUF Q4_1 blocks
// (per 32 weights: fp16 scale d, fp16 minimum m, 16 bytes of nibbles; weight j is the low nibble of
// byte j for j < 16, the high nibble of byte j - 16 after) and de-quantises each block in float32
// as gguf-py does (d * q, then + m, two roundings: built with -ffp-contract=off so they stay
// unfused), then multiplies it by the rows.
// Two shapes, to size the lever before building it into engine/core/csrc: one output at a time with
// a horizontal sum (the simplest), and two outputs per pass sharing each row's loads. AVX-512 only.
// Used by benchmarks/q4_1_probe.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// One half of a Q4_1 block as 16 float32 weights: d * q + m (high: the high nibbles, weights 16-31).
static inline __m512 q4_1_half(const uint8_t* block, bool high) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(block)));
  const __m512 m = _mm512_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(block + 2)));
  __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
  if (high) q = _mm_srli_epi16(q, 4);
  const __m512 q32 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, _mm_set1_epi8(0x0F))));
  return _mm512_add_ps(_mm512_mul_ps(d, q32), m);
}

template <int ROWS>
static void q4_1_rows(const float* x, const uint8_t* blocks, float* out, int64_t n_out, int64_t k_in) {
  // x [ROWS, k_in] row-major, blocks [n_out, k_in / 32, 20 bytes], out [ROWS, n_out]
  const int64_t per_row = k_in / 32;
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      __m512 acc[ROWS];
      for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
      const uint8_t* block = blocks + n * per_row * 20;
      for (int64_t j = 0; j < per_row; ++j, block += 20) {
        const __m512 w_lo = q4_1_half(block, false);
        const __m512 w_hi = q4_1_half(block, true);
        const float* xk = x + j * 32;
        for (int r = 0; r < ROWS; ++r) {
          acc[r] = _mm512_fmadd_ps(w_lo, _mm512_loadu_ps(xk + r * k_in), acc[r]);
          acc[r] = _mm512_fmadd_ps(w_hi, _mm512_loadu_ps(xk + r * k_in + 16), acc[r]);
        }
      }
      for (int r = 0; r < ROWS; ++r) out[r * n_out + n] = _mm512_reduce_add_ps(acc[r]);
    }
  });
}

// Two outputs per pass: each row's x loads feed both outputs' FMAs.
template <int ROWS>
static void q4_1_rows_pair(const float* x, const uint8_t* blocks, float* out, int64_t n_out, int64_t k_in) {
  const int64_t per_row = k_in / 32;
  at::parallel_for(0, n_out / 2, 8, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n = 2 * p;
      __m512 acc0[ROWS], acc1[ROWS];
      for (int r = 0; r < ROWS; ++r) { acc0[r] = _mm512_setzero_ps(); acc1[r] = _mm512_setzero_ps(); }
      const uint8_t* b0 = blocks + n * per_row * 20;
      const uint8_t* b1 = b0 + per_row * 20;
      for (int64_t j = 0; j < per_row; ++j, b0 += 20, b1 += 20) {
        const float* xk = x + j * 32;
        for (int half = 0; half < 2; ++half) {  // weights 0-15, then 16-31 of both blocks
          const __m512 w0 = q4_1_half(b0, half), w1 = q4_1_half(b1, half);
          for (int r = 0; r < ROWS; ++r) {
            const __m512 xv = _mm512_loadu_ps(xk + r * k_in + 16 * half);
            acc0[r] = _mm512_fmadd_ps(w0, xv, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(w1, xv, acc1[r]);
          }
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        out[r * n_out + n] = _mm512_reduce_add_ps(acc0[r]);
        out[r * n_out + n + 1] = _mm512_reduce_add_ps(acc1[r]);
      }
    }
  });
}

torch::Tensor q4_1_linear(torch::Tensor x, torch::Tensor blocks, int64_t n_out, bool pairs) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.size(1) % 32 == 0, "x: [rows, 32k] float32");
  const int64_t rows = x.size(0), k_in = x.size(1);
  TORCH_CHECK(blocks.numel() == n_out * (k_in / 32) * 20, "blocks: n_out * k_in / 32 blocks of 20 bytes");
  TORCH_CHECK(!pairs || n_out % 2 == 0, "pairs: an even number of outputs");
  auto out = torch::empty({rows, n_out}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  auto kernel = [&](auto one, auto two) { pairs ? two(xp, bp, op, n_out, k_in) : one(xp, bp, op, n_out, k_in); };
  switch (rows) {
    case 1: kernel(q4_1_rows<1>, q4_1_rows_pair<1>); break;
    case 4: kernel(q4_1_rows<4>, q4_1_rows_pair<4>); break;
    case 13: kernel(q4_1_rows<13>, q4_1_rows_pair<13>); break;
    case 16: kernel(q4_1_rows<16>, q4_1_rows_pair<16>); break;
    default: TORCH_CHECK(false, "the probe is built for 1, 4, 13 or 16 rows");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("q4_1_linear", &q4_1_linear); }
