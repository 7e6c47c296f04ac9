# Sourced by dwdp_h200x2.sh and dwdp_h200x4.sh, from the repository root: the environment, $OUT, the log filter,
# the machine's GPUs (into $OUT/gpu.txt), then the DWDP FFI libraries built into jax_dwdp/_lib (the store's handlers,
# and the test-only one tests/test_gpu_dwdp.py loads for its poisoned, delayed and failing copies; log: $OUT/build.log).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m | head -$(( $(nvidia-smi -L | wc -l) + 1 )) | tee -a "$OUT/gpu.txt"

echo "== build"; t0=$(date +%s)
cmake -S ffi -B /tmp/ffib -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
  -DJAX_DWDP_LIB_DIR="$PWD/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
  && cmake --build /tmp/ffib -j 16 --target jax_dwdp_ffi jax_dwdp_ffi_testing >> "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"; ls -la jax_dwdp/_lib
