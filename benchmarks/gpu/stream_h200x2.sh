#!/usr/bin/env bash
# Two H200s (issue 16): build the DWDP FFI library, run the DEP / memory GPU tests, then the request-stream
# benchmark: DWDP (VMM store, independent ranks) vs DEP (lockstep) vs replicated weights, balanced and uneven streams.
#   LAYERS=8 REQUESTS=8 BUCKET=4096 TESTS=1 [TEST_K=pytest-k-expr] [BENCH=0] bash benchmarks/gpu/stream_h200x2.sh
# Logs and JSON under $OUT: tests.log, stream.log, stream_35b_a3b.json (plus the prologue's gpu.txt, build.log).
# The grouped matmul is the CUTLASS kernel when jax_dwdp/_lib/libjax_dwdp_gmm.so is there (gpu/grouped_matmul_h200.sh
# step 1 builds it), else Mosaic; the log's first line says which. The same for all three schemes.
source benchmarks/gpu/_dwdp_prologue.sh
python3 -c "from jax_dwdp.kernels import _cutlass; print('grouped matmul:', 'cutlass' if _cutlass.available() else 'mosaic')" \
  2>&1 | tail -1 | tee "$OUT/stream.log"

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests (DEP vs one GPU; peak memory per rank vs plan)"
  timeout ${TEST_TIMEOUT:-480} python3 -m pytest -q -rA -x -s tests/test_gpu_dep.py ${TEST_K:+-k "$TEST_K"} 2>&1 | filter \
    | grep -v "^PASSED\|^tests/" | tail -60 | tee "$OUT/tests.log"
fi

[ "${BENCH:-1}" = 1 ] || exit 0
echo "== request streams"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_TIMEOUT:-900} python3 benchmarks/bench_stream.py --preset 35b-a3b \
  --num-layers ${LAYERS:-8} --requests ${REQUESTS:-8} --bucket ${BUCKET:-4096} --scheme-timeout ${SCHEME_TIMEOUT:-420} \
  --out "$OUT/stream_35b_a3b.json" 2>&1 | filter | tee -a "$OUT/stream.log"
