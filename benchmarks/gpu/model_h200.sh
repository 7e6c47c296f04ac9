#!/usr/bin/env bash
# One H200: GPU tests of the model and kernels, then the 35b-a3b prefill benchmark (MFU against 781 TFLOP/s and
# against the dense matmul rate measured after it in the same process). Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
JAX_DWDP_TEST_GPU=1 timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu.py -q -s -p no:cacheprovider ${GPU_TEST_ARGS:-} 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "err|passed|failed|Error" | grep -v "^\[transformers\]" | tail -15
# Whole-program vs layer-wise compilation on 4 layers (same numbers; compile time and dispatch overhead).
for mode in "" "--layerwise"; do
  timeout 120 python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers 4 --seq-lens 4096 16384 --iters 5 $mode \
    --out "$OUT/prefill_35b_a3b_4layers${mode:+_layerwise}.json" 2>&1 | grep -v "^\s*@\|^E1130\|^\*\*\*\|slow_operation\|Very slow\|^$"
done
timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_prefill.py --preset 35b-a3b --seq-lens 4096 16384 --layerwise \
  --iters 5 --dense-rate 400 --out "$OUT/prefill_35b_a3b.json" 2>&1 | tee "$OUT/bench_prefill.log"
