#!/usr/bin/env bash
# Two H200s (issue 16): build the DWDP FFI library, run the DEP / memory GPU tests, then the request-stream
# benchmark: DWDP (VMM store, independent ranks) vs DEP (lockstep) vs replicated weights, balanced and uneven streams.
# One call per step keeps each inside a 10-minute command limit (each scheme: ~1 min of set-up, ~25 s of compilation
# per padded prompt length, a few seconds of streams):
#   TESTS=1 BENCH=0 bash benchmarks/gpu/stream_h200x2.sh   # tests.log (if it runs out of time: TEST_K=dep_equals, then TEST_K=peak_memory)
#   TESTS=0 SCHEMES=dwdp bash benchmarks/gpu/stream_h200x2.sh                  # stream_dwdp.json
#   TESTS=0 SCHEMES=dep bash benchmarks/gpu/stream_h200x2.sh                   # stream_dep.json
#   TESTS=0 SCHEMES=replicated bash benchmarks/gpu/stream_h200x2.sh            # stream_replicated.json
#   python3 benchmarks/bench_stream.py --merge stream_dwdp.json stream_dep.json stream_replicated.json  # anywhere
# Knobs: LAYERS=8 REQUESTS=8 BUCKET=4096 STREAMS="balanced uneven" [TEST_K=pytest-k-expr]. Logs and JSON under $OUT.
# The grouped matmul is the CUTLASS kernel when jax_dwdp/_lib/libjax_dwdp_gmm.so is there (gpu/grouped_matmul_h200.sh
# step 1 builds it), else Mosaic; stream_*.log's first line says which. The same for all three schemes.
source benchmarks/gpu/_dwdp_prologue.sh

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests (DEP vs one GPU; peak memory per rank vs plan)"
  timeout ${TEST_TIMEOUT:-540} python3 -m pytest -q -rA -x -s tests/test_gpu_dep.py ${TEST_K:+-k "$TEST_K"} 2>&1 | filter \
    | grep -v "^PASSED\|^tests/" | tail -60 | tee "$OUT/tests.log"
fi

[ "${BENCH:-1}" = 1 ] || exit 0
SCHEMES=${SCHEMES:-dwdp dep replicated}
TAG=$(echo $SCHEMES | tr ' ' '_')
python3 -c "from jax_dwdp.kernels import _cutlass; print('grouped matmul:', 'cutlass' if _cutlass.available() else 'mosaic')" \
  2>&1 | tail -1 | tee "$OUT/stream_$TAG.log"
echo "== request streams: $SCHEMES"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_TIMEOUT:-560} python3 benchmarks/bench_stream.py --preset 35b-a3b \
  --num-layers ${LAYERS:-8} --requests ${REQUESTS:-8} --bucket ${BUCKET:-4096} --schemes $SCHEMES \
  --streams ${STREAMS:-balanced uneven} --scheme-timeout ${SCHEME_TIMEOUT:-540} \
  --out "$OUT/stream_$TAG.json" 2>&1 | filter | tee -a "$OUT/stream_$TAG.log"
