#!/usr/bin/env bash
# Four H200s (issue 7): the DWDP GPU tests on four GPUs, FFI vs XLA DWDP vs replicated at N = 4, and pipeline 2 x
# DWDP 2 against pipeline 2 alone and DWDP 4 alone. Logs under $OUT.
#   LAYERS=16 SEQS="16384 32768" bash benchmarks/gpu/dwdp_h200x4.sh
source benchmarks/gpu/_dwdp_prologue.sh
echo "== GPU tests on four GPUs"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -rA -s tests/test_gpu_dwdp.py 2>&1 | filter | grep -v "^PASSED" \
  | tail -40 | tee "$OUT/tests.log"
echo "== DWDP N = 4"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/bench_dwdp.py stage --ranks 4 \
  --num-layers ${LAYERS:-16} --seq-lens ${SEQS:-16384 32768} --out "$OUT/dwdp4.json" 2>&1 | filter | tee "$OUT/dwdp4.log"
echo "== layouts"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${LAYOUT_TIMEOUT:-200} python3 benchmarks/bench_dwdp.py layouts \
  --num-layers ${LAYERS:-16} --seq-len 16384 --sequences 8 --layouts 2x2:ffi 2x1 1x4:ffi 1x4:xla \
  --out "$OUT/layouts.json" 2>&1 | filter | tee "$OUT/layouts.log"
