// The guided draft view's selection after a round, one task per (layer, row, KV head), in one pass.
//
// Row b keeps [0, min(sink, kept_end[b])) and the `top` positions of [sink, kept_end[b]) with the
// highest rank (all of them when there are no more than `top`). A position's rank is its score if the
// score reaches floor x the uniform share (floor / kept_end[b] as a per-query probability), else a
// value under that bar growing with the position: the positions attention found are taken by score,
// the faint ones newest first (floor 0: by score alone). Where the positions at or above the bar fit
// in `top`, two scans (the cutoff of the newest faint ones, then the kept list) and no selection;
// otherwise the top `top` all score above the bar, and the selection is by score: a partial selection
// of the top-th score (std::nth_element on a copy of the scores), then one branch-free scan taking
// every score above it and the lowest positions among those equal to it, instead of a sort. The kept
// list of the row's slot is rewritten in place. With a compact store (the lean draft's bf16 copy of
// the view), a position that was kept before keeps its entry; each newly kept position takes a freed
// entry (lowest first) and its K/V are copied there from the float32 cache, so only changed entries
// are written. The rule and its torch twin are `engine/spec/compressors/guided.py`; this file only
// computes them. With `successors` > 0 each position first takes the highest score of itself and the
// positions just before it (a copy; the rule is the same on those raised scores).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The two scans that pick scores out of a task's positions, vectorized by AVX-512 where the build
// has it (a compare gives a 16-lane mask, a compress moves the passing lanes together in a register
// and the whole register is stored: the store form of the compress is slow on Zen 4), else scalar,
// branch-free (a store always, the count advanced by the comparison: about one score in seven
// passes, and a branch on it mispredicts often enough to double a task). Both write up to 16 entries
// past their count: their buffers keep that much room.

// values[0, count) = the scores s[p] >= pivot of p in [from, to), in order; returns count.
static inline int64_t scores_at_least(const float* __restrict s, int64_t from, int64_t to, float pivot,
                                      float* __restrict values) {
  int64_t count = 0, p = from;
#if defined(__AVX512F__)
  const __m512 bar = _mm512_set1_ps(pivot);
  for (; p + 16 <= to; p += 16) {
    const __m512 x = _mm512_loadu_ps(s + p);
    const __mmask16 pass = _mm512_cmp_ps_mask(x, bar, _CMP_GE_OQ);
    _mm512_storeu_ps(values + count, _mm512_maskz_compress_ps(pass, x));
    count += __builtin_popcount(pass);
  }
#endif
  for (; p < to; ++p) {
    values[count] = s[p];
    count += s[p] >= pivot;
  }
  return count;
}

// Appends to out[n, ...) the positions p in [from, to) with s[p] >= bar or p >= newest_from, in
// order; returns the new n.
static inline int64_t positions_at_least(const float* __restrict s, int64_t from, int64_t to, float bar,
                                         int64_t newest_from, int64_t* __restrict out, int64_t n) {
  int64_t p = from;
#if defined(__AVX512F__)
  const __m512 bar_v = _mm512_set1_ps(bar);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i newest = _mm512_set1_epi32(static_cast<int32_t>(std::min<int64_t>(newest_from, to)));
  for (; p + 16 <= to; p += 16) {  // positions fit int32: a task's scores number far fewer
    const __m512i where = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(p)), lanes);
    const __mmask16 pass = _mm512_cmp_ps_mask(_mm512_loadu_ps(s + p), bar_v, _CMP_GE_OQ) |
                           _mm512_cmpge_epi32_mask(where, newest);
    const __m512i packed = _mm512_maskz_compress_epi32(pass, where);
    _mm512_storeu_si512(out + n, _mm512_cvtepi32_epi64(_mm512_castsi512_si256(packed)));
    _mm512_storeu_si512(out + n + 8, _mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(packed, 1)));
    n += __builtin_popcount(pass);
  }
#endif
  for (; p < to; ++p) {
    out[n] = p;
    n += (s[p] >= bar) | (p >= newest_from);
  }
  return n;
}

// scores: [layers, B, kv_heads, N] float32 contiguous; slots, kept_end, old_count: [B] int64;
// kept: [layers, slots, kv_heads, K] int64 contiguous, K >= sink + top, updated in place (entries
// [0, count) of each task; count = min(sink, kept_end) + min(top, kept_end - sink)); old_count: the
// entries that held positions before (only read with a store). kept_end[b] <= N. hint: [layers, B,
// kv_heads] float32, the previous round's threshold per task times hint_scale (<= 0: none; the
// scale makes rounds of different scores' scales comparable; scores x hint_scale are per-query
// probabilities), updated in place (a speed-up only: the result does not depend on it). floor >= 0.
// successors >= 0: each position ranks by the highest score of itself and the `successors` positions
// before it (the raised scores are a per-task copy; `scores` is not written).
// k_store, v_store: [layers, slots, kv_heads, S, D] bfloat16 and k_cache, v_cache [layers, slots,
// kv_heads, capacity, D] float32, all given or none. Returns the number of store entries rewritten.
int64_t guided_select(torch::Tensor scores, torch::Tensor slots, torch::Tensor kept_end, torch::Tensor old_count,
                      torch::Tensor kept, torch::Tensor hint, double hint_scale, double floor, int64_t sink,
                      int64_t top, int64_t successors, c10::optional<torch::Tensor> k_store,
                      c10::optional<torch::Tensor> v_store, c10::optional<torch::Tensor> k_cache,
                      c10::optional<torch::Tensor> v_cache) {
  TORCH_CHECK(scores.dtype() == torch::kFloat32 && scores.is_contiguous() && scores.dim() == 4, "scores [L, B, H, N] float32");
  TORCH_CHECK(kept.dtype() == torch::kInt64 && kept.is_contiguous() && kept.dim() == 4, "kept [L, slots, H, K] int64");
  for (const auto& t : {slots, kept_end, old_count})
    TORCH_CHECK(t.dtype() == torch::kInt64 && t.is_contiguous() && t.numel() == scores.size(1), "[B] int64");
  const bool with_store = k_store.has_value();
  TORCH_CHECK(with_store == v_store.has_value() && with_store == k_cache.has_value() && with_store == v_cache.has_value(),
              "a store comes with its cache");
  const int64_t layers = scores.size(0), B = scores.size(1), KVH = scores.size(2), N = scores.size(3);
  const int64_t n_slots = kept.size(1), K = kept.size(3);
  TORCH_CHECK(kept.size(0) == layers && kept.size(2) == KVH && K >= sink + top, "kept shape");
  TORCH_CHECK(successors >= 0, "successors >= 0");
  const float* sp = scores.data_ptr<float>();
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* end_p = kept_end.data_ptr<int64_t>();
  const int64_t* old_p = old_count.data_ptr<int64_t>();
  int64_t* kp = kept.data_ptr<int64_t>();
  TORCH_CHECK(hint.dtype() == torch::kFloat32 && hint.is_contiguous() && hint.numel() == layers * B * KVH,
              "hint [L, B, H] float32");
  float* hp = hint.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(end_p[b] <= N && slot_p[b] >= 0 && slot_p[b] < n_slots, "kept_end within the scores, slots in range");
  int64_t S = 0, capacity = 0, D = 0;
  at::BFloat16 *ks = nullptr, *vs = nullptr;
  const float *kc = nullptr, *vc = nullptr;
  if (with_store) {
    TORCH_CHECK(k_store->dtype() == torch::kBFloat16 && v_store->dtype() == torch::kBFloat16, "bfloat16 store");
    TORCH_CHECK(k_cache->dtype() == torch::kFloat32 && v_cache->dtype() == torch::kFloat32, "float32 cache");
    TORCH_CHECK(k_store->is_contiguous() && v_store->is_contiguous() && k_cache->is_contiguous() && v_cache->is_contiguous(),
                "contiguous store and cache");
    S = k_store->size(3), D = k_store->size(4), capacity = k_cache->size(3);
    TORCH_CHECK(k_store->dim() == 5 && k_store->size(0) == layers && k_store->size(1) == n_slots &&
                k_store->size(2) == KVH && S >= K && v_store->sizes() == k_store->sizes(), "store shape");
    TORCH_CHECK(k_cache->dim() == 5 && k_cache->size(0) == layers && k_cache->size(1) == n_slots &&
                k_cache->size(2) == KVH && k_cache->size(4) == D && v_cache->sizes() == k_cache->sizes(),
                "cache shape");
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(end_p[b] <= capacity, "kept_end within the cache");
    ks = k_store->data_ptr<at::BFloat16>(), vs = v_store->data_ptr<at::BFloat16>();
    kc = k_cache->data_ptr<float>(), vc = v_cache->data_ptr<float>();
  }
  std::atomic<int64_t> changed{0};
  at::parallel_for(0, layers * B * KVH, 1, [&](int64_t begin, int64_t stop) {
    std::vector<int64_t> chosen(sink + top + 16);  // the scans write up to 16 entries past the kept ones
    std::vector<float> values(std::max<int64_t>(N - sink, 0) + 16);
    std::vector<float> raised(successors > 0 ? N : 0);
    std::vector<uint8_t> mark(with_store ? N : 0, 0), stays;
    std::vector<std::pair<int64_t, int64_t>> moves;  // (store entry, position) to copy
    int64_t local = 0;
    for (int64_t task = begin; task < stop; ++task) {
      const int64_t l = task / (B * KVH), b = (task / KVH) % B, h = task % KVH;
      const float* s = sp + task * N;
      const int64_t end = end_p[b];
      if (successors > 0) {  // a running maximum over each position and the `successors` before it
        std::copy(s, s + end, raised.begin());
        for (int64_t back = 1; back <= successors; ++back)
          for (int64_t p = back; p < end; ++p) raised[p] = std::max(raised[p], s[p - back]);
        s = raised.data();
      }
      const int64_t sinks = std::min(sink, std::max<int64_t>(end, 0));
      const int64_t candidates = std::max<int64_t>(end - sink, 0);
      const int64_t take = std::min(candidates, top);
      const int64_t count = sinks + take;
      for (int64_t i = 0; i < sinks; ++i) chosen[i] = i;
      // With a floor, the positions at or above the bar: if they fit, the rest of the room goes to the
      // newest faint ones (no selection at all); if not, the top by score are all above it.
      const float bar = static_cast<float>(floor / static_cast<double>(std::max<int64_t>(end, 1)) / hint_scale);
      int64_t above = 0;
      if (floor > 0.0 && candidates > top)
        for (int64_t p = sink; p < end; ++p) above += s[p] >= bar;
      if (candidates <= top) {
        for (int64_t i = 0; i < take; ++i) chosen[sinks + i] = sink + i;
      } else if (floor > 0.0 && above <= top) {
        // The newest `top - above` faint positions are those from `cutoff` on.
        int64_t need = top - above, cutoff = end;
        for (int64_t p = end - 1; need > 0; --p) {
          const bool faint = s[p] < bar;
          need -= faint;
          cutoff = faint ? p : cutoff;
        }
        positions_at_least(s, sink, end, bar, cutoff, chosen.data(), sinks);
        hp[task] = 0.0f;  // no score threshold to start the next round's selection from
      } else {
        // The top-th largest score, then one scan: every score above it and, lowest positions
        // first, as many equal to it as there is room for.
        // Scores move little between rounds: with half the previous round's threshold as a pivot,
        // the selection runs over the few scores above it (exact whenever at least `top` are).
        const float pivot = hp[task] * 0.5f / static_cast<float>(hint_scale);
        int64_t passed = 0;
        if (pivot > 0.0f) passed = scores_at_least(s, sink, end, pivot, values.data());
        if (passed < top) {
          std::copy(s + sink, s + end, values.begin());
          passed = end - sink;
        }
        std::nth_element(values.begin(), values.begin() + (top - 1), values.begin() + passed, std::greater<float>());
        const float threshold = values[top - 1];
        hp[task] = threshold * static_cast<float>(hint_scale);
        int64_t above = 0, equal = 0;
        for (int64_t p = sink; p < end; ++p) {
          above += s[p] > threshold;
          equal += s[p] == threshold;
        }
        int64_t ties = top - above, n = sinks;
        if (equal == ties) {  // the usual case: every score equal to the threshold fits
          positions_at_least(s, sink, end, threshold, end, chosen.data(), n);
        } else {
          for (int64_t p = sink; p < end; ++p) {
            const bool tie = s[p] == threshold;
            const bool take = (s[p] > threshold) | (tie & (ties > 0));
            ties -= tie & take;
            chosen[n] = p;
            n += take;
          }
        }
      }
      const int64_t plane = (l * n_slots + slot_p[b]) * KVH + h;  // (layer, slot, head)
      int64_t* kept_row = kp + plane * K;
      if (!with_store) {
        std::copy(chosen.begin(), chosen.begin() + count, kept_row);
        continue;
      }
      // Positions kept before keep their entry; the others take the freed entries, lowest first.
      for (int64_t i = 0; i < count; ++i) mark[chosen[i]] = 1;
      stays.assign(count, 0);
      const int64_t old = std::min(old_p[b], count);
      for (int64_t i = 0; i < old; ++i) {
        const int64_t p = kept_row[i];
        if (p >= 0 && p < N && mark[p]) {
          stays[i] = 1;
          mark[p] = 0;
        }
      }
      // First pair each freed entry with its new position, then copy: the source rows are scattered
      // over the slot's cache, so each is prefetched a few copies ahead (the copy is bound by
      // their memory latency, not by its arithmetic).
      moves.clear();
      int64_t next = 0;  // the next chosen position not held yet (marks left set)
      for (int64_t i = 0; i < count; ++i) {
        if (stays[i]) continue;
        while (!mark[chosen[next]]) ++next;
        const int64_t p = chosen[next++];
        mark[p] = 0;
        kept_row[i] = p;
        moves.emplace_back(i, p);
      }
      constexpr size_t kAhead = 12;
      for (size_t j = 0; j < moves.size(); ++j) {
        if (j + kAhead < moves.size()) {
          const int64_t ahead = (plane * capacity + moves[j + kAhead].second) * D;
          for (int64_t d = 0; d < D; d += 16) {  // 64-byte lines of float32
            __builtin_prefetch(kc + ahead + d);
            __builtin_prefetch(vc + ahead + d);
          }
        }
        const auto [i, p] = moves[j];
        const float* k_src = kc + (plane * capacity + p) * D;
        const float* v_src = vc + (plane * capacity + p) * D;
        at::BFloat16* k_dst = ks + (plane * S + i) * D;
        at::BFloat16* v_dst = vs + (plane * S + i) * D;
        for (int64_t d = 0; d < D; ++d) {
          k_dst[d] = at::BFloat16(k_src[d]);  // round to nearest even, as torch's .to(bfloat16)
          v_dst[d] = at::BFloat16(v_src[d]);
        }
      }
      local += static_cast<int64_t>(moves.size());
    }
    changed += local;
  });
  return changed.load();
}
