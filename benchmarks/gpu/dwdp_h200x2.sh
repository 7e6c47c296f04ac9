#!/usr/bin/env bash
# Two H200s: build the DWDP FFI library, run the DWDP GPU tests, then FFI vs XLA DWDP vs replicated weights.
#   SEQS="16384 32768" LAYERS=16 TESTS=1 [TEST_K=pytest-k-expr] bash benchmarks/gpu/dwdp_h200x2.sh      (logs under $OUT)
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m | head -3 | tee -a "$OUT/gpu.txt"

echo "== build"; t0=$(date +%s)
cmake -S ffi -B /tmp/ffib -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
  -DJAX_DWDP_LIB_DIR="$PWD/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
  && cmake --build /tmp/ffib -j 16 --target jax_dwdp_ffi >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; ls -la jax_dwdp/_lib

if [ "${TESTS:-1}" = 1 ]; then
  echo "== GPU tests (DWDP FFI)"
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rA -x -s tests/test_gpu_dwdp.py ${TEST_K:+-k "$TEST_K"} 2>&1 | filter \
    | grep -v "^PASSED\|^tests/" | tail -60 | tee "$OUT/tests.log"
fi

echo "== benchmark"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_dwdp.py --preset 35b-a3b \
  --num-layers ${LAYERS:-16} --seq-lens ${SEQS:-16384 32768} --iters ${ITERS:-3} \
  --out "$OUT/dwdp_35b_a3b.json" 2>&1 | filter | tee "$OUT/bench.log"
