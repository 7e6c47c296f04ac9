#!/usr/bin/env bash
# Two H200s: build the DWDP FFI library, run the DWDP GPU tests, then FFI vs XLA DWDP vs replicated weights.
#   SEQS="16384 32768" LAYERS=16 TESTS=1 [TEST_K=pytest-k-expr] [EXTRAS=1] [BENCH=0] bash benchmarks/gpu/dwdp_h200x2.sh
# (logs under $OUT; a device call returns at most 8 files: with EXTRAS=1 use BENCH=0). EXTRAS=1 adds the CLI's FFI backend and the independent-ranks benchmark; BENCH=0 skips bench_dwdp.py stage.
source benchmarks/gpu/_dwdp_prologue.sh

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests (DWDP FFI)"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rA -x -s tests/test_gpu_dwdp.py ${TEST_K:+-k "$TEST_K"} 2>&1 | filter \
    | grep -v "^PASSED\|^tests/" | tail -60 | tee "$OUT/tests.log"
fi

if [ "${EXTRAS:-0}" = 1 ]; then  # the CLI's FFI backend (logits vs XLA) and independent ranks (concurrency, FFI)
  rm -f /tmp/logits_xla.npy /tmp/logits_ffi.npy
  [ "${CLI:-1}" = 1 ] && echo "== CLI prefill --dwdp 2 --dwdp-backend xla|ffi"
  [ "${CLI:-1}" = 1 ] && for b in xla ffi; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 -m jax_dwdp.cli prefill --preset 35b-a3b --num-layers 4 \
      --batch 2 --seq-len 256 --dwdp 2 --dwdp-backend $b --layerwise --iters 2 --json --logits-out /tmp/logits_$b.npy \
      2>&1 | filter | tail -3 | tee -a "$OUT/cli.log"
  done
  [ "${CLI:-1}" = 1 ] && python3 -c "import numpy as np; a, b = np.load('/tmp/logits_ffi.npy'), np.load('/tmp/logits_xla.npy'); \
d = np.abs(a - b); print('CLI ffi vs xla logits', a.shape, 'finite', bool(np.isfinite(a).all()), 'max abs diff', \
float(d.max()), 'max |logit|', float(np.abs(b).max()), 'relative (norm)', float(np.linalg.norm(a - b) / np.linalg.norm(b)))" \
    | tee -a "$OUT/cli.log"
  echo "== independent ranks (one rank alone vs both, XLA copies vs FFI store)"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${PAR_TIMEOUT:-200} python3 benchmarks/bench_dwdp.py ranks \
    --preset 35b-a3b --num-layers 8 --seq-len 16384 --iters 3 --ffi --skip-xla-dwdp --out "$OUT/independent_35b_a3b.json" 2>&1 \
    | filter | tee "$OUT/independent.log"
  echo "== host time of one rank's layer-wise prefill, by call (bench_dwdp.py dispatch)"
  for b in xla ffi; do
    XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 150 python3 benchmarks/bench_dwdp.py dispatch --preset 35b-a3b \
      --num-layers 8 --seq-len 16384 --backend $b --out "$OUT/dispatch_$b.json" 2>&1 | filter
  done
fi

[ "${BENCH:-1}" = 1 ] || exit 0
echo "== benchmark"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_dwdp.py stage --preset 35b-a3b \
  --num-layers ${LAYERS:-16} --seq-lens ${SEQS:-16384 32768} --iters ${ITERS:-3} \
  --out "$OUT/dwdp_35b_a3b.json" 2>&1 | filter | tee "$OUT/bench.log"
