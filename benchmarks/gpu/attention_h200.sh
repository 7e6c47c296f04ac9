#!/usr/bin/env bash
# One H200: the prefill attention core, cuDNN against Pallas Mosaic GPU's attention_mgpu (issue 15's attention item).
# Run from the repository root with the FFI library in jax_dwdp/_lib (carried). Steps ($STEPS, default
# "bench tests probe"):
#   bench    bench_attention.py: both cores at $ATTN_TOKENS (float64 reference rows, the diff to cuDNN, TF/s; with
#            $BENCH_EXTRA, default --trace: each call's kernel time and span beside its wall time)
#   tests    the attention GPU tests (tests/test_gpu.py -k "cudnn or projections")
#   probe    probe_layer_kernels.py at $PROBE_TOKENS: both layers' kernels by name (today's defaults)
# Logs and JSON under $OUT/attention.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}/attention; mkdir -p "$OUT"
STEPS=${STEPS:-"bench tests probe"}
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    bench)
      echo "== bench"
      timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/bench_attention.py --tokens ${ATTN_TOKENS:-4096 16384 32768} \
        ${BENCH_EXTRA:---trace} --out "$OUT/bench.json" 2>&1 | filter > "$OUT/bench.log"
      echo "bench rc $?"; grep -v "^tokens\|^NVIDIA" "$OUT/bench.log" | cut -c1-160 | tail -40 ;;
    tests)
      echo "== tests"
      timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        -k "${TEST_K:-cudnn or projections}" > "$OUT/tests.log" 2>&1
      echo "tests rc $?"; grep -E "attention|passed|failed|Error" "$OUT/tests.log" | tail -12 ;;
    probe)
      echo "== probe"
      timeout ${PROBE_TIMEOUT:-100} python3 benchmarks/probe_layer_kernels.py --tokens ${PROBE_TOKENS:-16384} \
        --out-dir "$OUT/probe" 2>&1 | filter > "$OUT/probe.log"
      echo "probe rc $?"; grep -A30 "tokens:" "$OUT/probe.log" | cut -c1-150 | head -64 ;;
  esac
done
