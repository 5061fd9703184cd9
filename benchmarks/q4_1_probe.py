"""How much a few-row GEMM reading the GGUF's Q4_1 blocks would save on one decode step's layers.

Not a test and not the engine: the probe that sized this lever before the engine read the blocks
(BENCHMARKS.md section 18; the engine's own path is timed by `block_gemm_bench.py`, section 19).
It reads the default model's GGUF, checks that `d * q + m` in float32 gives exactly the weights the
engine's conversion wrote (q/k rows come permuted: transformers undoes llama.cpp's RoPE row order),
then times the 210 layer GEMMs of one step (30 x q/k/v/o/gate/up/down, distinct weights, so they come
from memory) at M rows: the engine's float32 kernel (`small_linear`) against the two probe kernels of
`q4_1_probe.cpp` (one output at a time; two per pass), which read the 4-bit blocks (0.625 bytes a
weight against 4). AVX-512 only.
The lm_head (Q8_0 in the file) is not in it. Writes JSON.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/q4_1_probe.py --rows 1,4,13,16 --out benchmarks/results/q4_1_probe.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.cpp_extension import load

from decode_setup import median_seconds, write_result
from engine.core import kernels
from engine.models.gguf import converted_gguf_folder
from engine.models.gguf_blocks import LAYER_LINEARS, ROPE_PERMUTED, dequantise, unpermute_rope_rows
from engine.models.registry import DEFAULT_MODEL, packaged_gguf

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,13,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not {"avx512f", "avx512bw", "avx512vl", "f16c"} <= set(kernels.cpu_flags().split()):
        raise SystemExit("q4_1_probe: the probe kernel needs AVX-512 (F, BW, VL) and F16C")

    gguf_path = packaged_gguf(DEFAULT_MODEL)
    converted = load_file(converted_gguf_folder(gguf_path) / "model.safetensors")

    probe = load("magicdec_q4_1_probe", [str(Path(__file__).with_suffix(".cpp"))],
                 extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mf16c", "-mfma", "-fopenmp",
                                "-ffp-contract=off"])
    fp32_kernel = kernels.load()
    reader = gguf.GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}

    layers, exact, permuted = [], 0, 0
    for layer in range(30):
        for proj, hf_name in LAYER_LINEARS.items():
            t = tensors[f"blk.{layer}.{proj}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1, (t.name, t.tensor_type)
            n_out = int(t.shape[1])
            blocks = torch.from_numpy(np.ascontiguousarray(np.asarray(t.data)).copy()).reshape(n_out, -1, 20)
            weight = dequantise(blocks, "q4_1").contiguous()
            engine_weight = converted[f"model.layers.{layer}.{hf_name}.weight"]
            if torch.equal(weight, engine_weight):
                exact += 1
            else:  # q/k: llama.cpp interleaves each 64-row head's two RoPE halves; transformers undoes it
                assert proj in ROPE_PERMUTED, t.name
                assert torch.equal(dequantise(unpermute_rope_rows(blocks, 64), "q4_1"), engine_weight), t.name
                permuted += 1
            layers.append((blocks.reshape(-1).contiguous(), weight, n_out))

    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        blocks, weight, n_out = layers[0]
        row = {"rows": rows}
        for pairs in (False, True):
            got = probe.q4_1_linear(xs[576], blocks, n_out, pairs)
            key = "max_abs_err_vs_torch_matmul" + ("_two_outputs" if pairs else "_one_output")
            row[key] = (got - xs[576] @ weight.T).abs().max().item()
        fp32, one, two = (1e3 * median_seconds(fn, args.repeats) for fn in (
            lambda: [fp32_kernel.small_linear(xs[w.shape[1]], w, None) for _, w, _ in layers],
            lambda: [probe.q4_1_linear(xs[w.shape[1]], b, n, False) for b, w, n in layers],
            lambda: [probe.q4_1_linear(xs[w.shape[1]], b, n, True) for b, w, n in layers]))
        row.update({"fp32_kernel_ms": round(fp32, 2), "q4_1_one_output_ms": round(one, 2),
                    "q4_1_two_outputs_ms": round(two, 2), "ratio_one": round(fp32 / one, 2),
                    "ratio_two": round(fp32 / two, 2)})
        results.append(row)
        print(results[-1], flush=True)
    write_result(args.out, weights_exact=exact, weights_row_permuted=permuted,
                 layer_gemms_per_step=len(layers), results=results)


if __name__ == "__main__":
    main()
