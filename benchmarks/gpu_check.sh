#!/usr/bin/env bash
# The GPU check, in one call: CUDA tests, then `magicdec bench` on a Llama-3.1-8B-shaped bf16 model
# with random weights. Needs only torch, transformers, pyarrow, typer, rich (no network, no deepspeed,
# no flash-attn). Writes everything under OUT_DIR. Usage: benchmarks/gpu_check.sh OUT_DIR [LAYERS]
#
# LAYERS (default 8): how many of Llama-3.1-8B's 32 layers to build. Every layer costs the same, so
# the per-step ratios (T_D/T_T, T_V/T_T) of 8 layers are those of the model; the KV cache of
# batch 64 x 32K for all 32 layers (275 GB in bf16) would not fit one GPU, for 8 layers it is 69 GB.
# TEST_TIMEOUT / BENCH_TIMEOUT (seconds, default 240 / 420) and GAMMA (default 1,2,3,4) fit it to a
# shorter device lease. To exercise the script without a GPU: DEVICE=cpu MODEL=tiny-shape DTYPE=float32 BATCH=2,4 CONTEXT=256,512
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR [LAYERS]}
layers=${2:-8}
mkdir -p "$out"
python=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi || true; "$python" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; } \
  > "$out/environment.txt" 2>&1
timeout "${TEST_TIMEOUT:-240}" "$python" -m pytest -q -rs tests/test_attention.py tests/test_gpu.py -p no:cacheprovider \
  > "$out/cuda_tests.txt" 2>&1
echo "cuda tests exit code: $?" >> "$out/cuda_tests.txt"
timeout "${BENCH_TIMEOUT:-420}" "$python" -m magicdec_cli.main bench --model "${MODEL:-llama-3.1-8b-shape}" --layers "$layers" \
  --dtype "${DTYPE:-bfloat16}" --device "${DEVICE:-cuda}" --batch "${BATCH:-16,32,64}" \
  --context "${CONTEXT:-8192,32768}" --methods none,streamingllm --budget 512 \
  --gamma "${GAMMA:-1,2,3,4}" --new-tokens 8 --no-hf --out "$out/bench" > "$out/bench.txt" 2>&1
echo "bench exit code: $?" >> "$out/bench.txt"
tail -n 3 "$out/cuda_tests.txt" "$out/bench.txt"
