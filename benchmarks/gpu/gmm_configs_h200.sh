#!/usr/bin/env bash
# One H200: the CUTLASS grouped GEMM's configurations. Every built config's GPU correctness test, then whole calls of
# every config (and the automatic choice) beside torch._grouped_mm and a dense matmul of the same FLOPs
# (bench_grouped_matmul.py calls), printed one line per case, fastest config first. Needs jax_dwdp/_lib (the FFI
# libraries built on the CPU machine) carried. Logs and JSON under $OUT. Knobs: TEST_K, TEST_TIMEOUT, BENCH_ARGS,
# BENCH_TIMEOUT.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${TESTS:-1}" = 1 ]; then
  JAX_DWDP_TEST_GPU=1 timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/test_grouped_matmul.py \
    -k "${TEST_K:-cutlass_matches_fp64 or poisoned}" 2>&1 | tee "$OUT/gmm_tests.log" | tail -3
fi
timeout ${BENCH_TIMEOUT:-330} python3 benchmarks/bench_grouped_matmul.py calls --no-mosaic ${BENCH_ARGS:---presets \
  35b-a3b 122b-a10b --tokens 4096 16384 32768 --routing uniform --iters 7 --budget-s 300} --out "$OUT/gmm_calls.json" \
  2>&1 | grep -v "Warning\|warn(" | tail -3
python3 benchmarks/gpu/gmm_configs_summary.py "$OUT/gmm_calls.json"
