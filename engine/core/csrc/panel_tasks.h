// How the kernels that multiply 16-output GGUF panels (cpu_linear.cpp's float32 panels, cpu_int8_panels.cpp's
// int8 ones) split their work: one task per 16 outputs of any weight side by side, in parallel, each
// task over all M rows in near-equal tiles of at most `max_rows` (13 rows: one tile; 16: 8 + 8; 26:
// 13 + 13). Holds no arithmetic: the caller's function multiplies one tile.
#pragma once
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

namespace magicdec_panels {

// first_task[i]: the first task of weight i (its panels: first_task[i + 1] - first_task[i]), with
// first_task.back() tasks in all. tile(i, g, m, rows): panel g of weight i (outputs 16 g ..) over rows
// [m, m + rows).
template <typename Tile>
void for_panel_tiles(const std::vector<int64_t>& first_task, int64_t M, int64_t max_rows, Tile&& tile) {
  const int64_t tiles = (M + max_rows - 1) / max_rows;
  at::parallel_for(0, first_task.back(), 1, [&](int64_t first, int64_t last) {
    size_t i = 0;
    for (int64_t t = first; t < last; ++t) {
      while (t >= first_task[i + 1]) ++i;
      const int64_t g = t - first_task[i];
      for (int64_t k = 0, m = 0; k < tiles; ++k) {
        const int64_t rows = (M - m) / (tiles - k);
        tile(static_cast<int64_t>(i), g, m, rows);
        m += rows;
      }
    }
  });
}

}  // namespace magicdec_panels
