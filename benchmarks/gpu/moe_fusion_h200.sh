#!/usr/bin/env bash
# One H200, from the repository root: build the grouped GEMM library, its GPU tests, the fused-SwiGLU benchmark with
# the block breakdown, the model's GPU tests (no Mosaic-forced variant), then 35B-A3B prefill (8 layers, 16K tokens)
# with CUTLASS + the fused SwiGLU layout, CUTLASS unfused (the default), and Mosaic. Logs under $OUT.
# Env: MODEL_TESTS=0 (skip tests/test_gpu.py), MODEL_TEST_K (its pytest -k), PREFILL=0 (skip the prefill runs), FUSION_EXTRA,
# CMDBUF=1 (the prefill again with XLA command buffers for while loops; a device call returns at most 8 files, so
# with CMDBUF=1 skip one of the others, e.g. MODEL_TESTS=0). Needs .whl/ (see grouped_matmul_h200.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS="1 3 6" TEST_TIMEOUT=120 FUSION_TIMEOUT=${FUSION_TIMEOUT:-150} FUSION_ARGS="--iters 7 --breakdown ${FUSION_EXTRA:-}" \
  bash benchmarks/gpu/grouped_matmul_h200.sh 2>&1 | grep -v "^\.\?cutlass n=\|^cutlass \(all\|one\|single\|full\|over\|inside\|vs\|twice\)"
if [ "${MODEL_TESTS:-1}" = 1 ]; then
echo "=== model GPU tests"
JAX_DWDP_TEST_GPU=1 timeout ${MODEL_TEST_TIMEOUT:-120} python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k "${MODEL_TEST_K:-not mosaic}" 2>&1 \
  | tee "$OUT/gpu_tests.log" | grep -E "err|passed|failed|Error" | grep -v "^\[transformers\]" | tail -8
fi
if [ "${PREFILL:-1}" = 1 ]; then
echo "=== 35B-A3B prefill, ${PREFILL_LAYERS:-8} layers: CUTLASS fused / CUTLASS unfused (default) / Mosaic"
for v in fused unfused mosaic; do
  env=""; flag=""
  [ $v = mosaic ] && env="JAX_DWDP_GROUPED_MATMUL=mosaic"; [ $v = fused ] && flag="--fused-swiglu"
  env $env timeout ${PREFILL_TIMEOUT:-90} python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers ${PREFILL_LAYERS:-8} \
    --seq-lens ${PREFILL_SEQS:-16384} --layerwise --iters 5 $flag --out "$OUT/prefill_$v.json" 2>&1 \
    | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tail -3
done
fi
if [ "${CMDBUF:-0}" = 1 ]; then
  # Hypothesis (from an H200 run, 2026-11-30): a linear-attention layer launches its chunk scan's small kernels one by one
  # (256 steps at 16K tokens), which would explain 6.6 ms of host time per layer call. CUDA graphs for while loops
  # (XLA command buffers with WHILE) would launch each step as one graph.
  echo "=== 35B-A3B prefill, ${PREFILL_LAYERS:-8} layers, XLA command buffers with WHILE loops vs the default"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" \
    timeout ${PREFILL_TIMEOUT:-90} python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers ${PREFILL_LAYERS:-8} \
    --seq-lens ${PREFILL_SEQS:-16384} --layerwise --iters 5 --out "$OUT/prefill_cmdbuf_while.json" 2>&1 \
    | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tail -3
fi
