#!/usr/bin/env bash
# One H200: the Pallas gated delta rule's GPU tests, then the kernel benchmark against flash-linear-attention 0.6
# (carried as wheels in .whl/: flash-linear-attention, fla-core). Logs and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
if [ "${GDN_TESTS:-1}" = 1 ]; then
  JAX_DWDP_TEST_GPU=1 timeout ${GPU_TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu_gdn.py -q -s -x \
    -p no:cacheprovider ${GPU_TEST_ARGS:-} 2>&1 | tee "$OUT/gdn_tests.log" | grep -E "seq 0|T=|pieces|passed|failed|Error" \
    | tail -${GPU_TEST_LINES:-30}
fi
timeout ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_gdn.py ${BENCH_ARGS:---sweep --mixer} --out "$OUT/gdn_h200.json" \
  2>&1 | tee "$OUT/bench_gdn.log" | grep -v "^\s*@\|^E1130\|^\*\*\*\|slow_operation\|Very slow\|^$\|Warning\|warn(" \
  | grep -v "^sweep" | tail -40
grep "^best" "$OUT/bench_gdn.log"
