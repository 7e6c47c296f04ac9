#!/usr/bin/env bash
# One GPU: the DWDP expert store whose control plane is Python through cuda.bindings (jax_dwdp/parallel/cuda_vmm.py)
# and whose library is only the two custom calls (ffi/dwdp_store/). Steps ($STEPS, default "build setup store launch
# model"):
#   build   the store's two libraries (targets jax_dwdp_ffi and jax_dwdp_ffi_testing) into jax_dwdp/_lib with CMake;
#           without cmake here, the carried ones are used
#   setup   the store's set-up time for a 35b-a3b-shaped layer set: one rank's half of the experts at N = 2 (128 of
#           256 experts: gate_up [128, 1024, 2048], down [128, 2048, 512], bf16, 0.75 GiB a layer) for $LAYERS layers
#           (default 40, 30 GiB), on this GPU: ExpertStore creation, fill (every block from one XLA array), close;
#           median of $REPEATS (default 3), JSON in $OUT/store_setup.json. With $OLD (a tree exported by
#           `bash benchmarks/gpu/store_cuda_python_one_gpu.sh export` here and carried), the same probe on the old
#           tree right after, on the same GPU, for old vs new
#   store   tests/test_gpu_process_store.py (two processes sharing this GPU over the process store; the one-process
#           store on one device; 20 store cycles without a leak) and tests/test_gpu_dwdp.py (needs two GPUs: skips)
#   launch  tests/test_gpu_process_launch.py (two jax.distributed processes sharing this GPU, random and HF weights)
#   model   tests/test_gpu.py (the model on the GPU; no store), in what is left of the deadline. On one H100, a fresh
#           machine: build 19 s, setup ~20 s (both trees), store 46 s, launch 74 s, and test_gpu.py passed 10 of its
#           11 tests in the 240 s it had then; on the same machine warm, all 11 in 88 s
# Run from the repository root (the device tool carries the tree; carry ["jax_dwdp/_lib"] for the grouped GEMM
# library, ["build/old_store"] for $OLD). Each command's limit is cut to what is left of $DEADLINE seconds (default
# 540: fits a 9-minute call; _limits.sh). Logs and JSON under $OUT.
#
#   here:        bash benchmarks/gpu/store_cuda_python_one_gpu.sh export     # build/old_store <- git archive $OLD_REV
#   GPU machine: OLD=build/old_store bash benchmarks/gpu/store_cuda_python_one_gpu.sh
if [ "${1:-}" = export ]; then  # here: the tree before this store (C++ control plane, ctypes C API)
  set -e
  rev=${OLD_REV:-c12db6c}
  rm -rf build/old_store && mkdir -p build/old_store
  git archive "$rev" | tar -x -C build/old_store
  echo "build/old_store: $(git rev-parse "$rev"); carry [\"build/old_store\"]"
  exit 0
fi
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
DEADLINE=${DEADLINE:-540}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"build setup store launch model"}
LAYERS=${LAYERS:-40} REPEATS=${REPEATS:-3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, cuda.bindings; print('jax', jax.__version__, 'cuda-bindings', cuda.bindings.__version__, \
jax.devices())"
source benchmarks/gpu/_limits.sh

build() {  # build TREE TARGETS...: the store library of TREE into TREE/jax_dwdp/_lib
  local tree=$1; shift
  local dir=/tmp/ffib_$(basename "$tree")
  cmake -S "$tree/ffi" -B "$dir" -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
    -DJAX_DWDP_LIB_DIR="$tree/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build_$(basename "$tree").log" 2>&1 \
    && for t in "$@"; do cmake --build "$dir" -j 16 --target "$t" >> "$OUT/build_$(basename "$tree").log" 2>&1 \
    || return 1; done
}

# The set-up probe: the public API both trees have (ExpertStore(devices, layers, experts, shapes, dtype), fill, close).
PROBE='
import json, os, sys, time
import jax, jax.numpy as jnp, numpy as np
import jax_dwdp
from jax_dwdp.parallel.dwdp_ffi import ExpertStore, live_objects
layers, repeats = int(os.environ["LAYERS"]), int(os.environ["REPEATS"])
experts, h, i = 128, 2048, 512
shapes = ((2 * i, h), (h, i))
dev = jax.devices()[0]
blocks = [jax.device_put(jnp.full((experts, *s), 0.5, jnp.bfloat16), dev).block_until_ready() for s in shapes]
rows = []
for _ in range(repeats + 1):  # the first: warm-up (library load, driver state)
    t0 = time.perf_counter()
    store = ExpertStore([dev], layers, experts, shapes, jnp.bfloat16)
    t1 = time.perf_counter()
    for layer in range(layers):
        for w in range(2):
            store.fill(layer, w, 0, blocks[w])
    t2 = time.perf_counter()
    store.close()
    t3 = time.perf_counter()
    rows.append({"create_ms": (t1 - t0) * 1e3, "fill_ms": (t2 - t1) * 1e3, "close_ms": (t3 - t2) * 1e3})
med = {k: round(float(np.median([r[k] for r in rows[1:]])), 1) for k in rows[0]}
gib = layers * sum(experts * np.prod(s) * 2 for s in shapes) / 2**30
out = {"tree": os.path.dirname(os.path.dirname(jax_dwdp.__file__)), "layers": layers, "store_gib": round(gib, 2),
       "median": med, "runs": rows[1:], "live_after": live_objects(), "device": str(dev.device_kind)}
print(json.dumps(out))
'

for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    build)
      echo "== build"; t0=$SECONDS
      if command -v cmake > /dev/null; then
        build "$PWD" jax_dwdp_ffi jax_dwdp_ffi_testing || { tail -30 "$OUT/build_$(basename "$PWD").log"; exit 1; }
        if [ -n "${OLD:-}" ]; then
          rm -f "$OLD"/jax_dwdp/_lib/libjax_dwdp_ffi.so
          build "$(realpath "$OLD")" jax_dwdp_ffi || { tail -30 "$OUT/build_$(basename "$OLD").log"; exit 1; }
        fi
      fi
      echo "built in $((SECONDS - t0)) s"; ls -la jax_dwdp/_lib ;;
    setup)
      echo "== store set-up: $LAYERS layers of 35b-a3b, 128 experts (one rank's half at N = 2)"
      LAYERS=$LAYERS REPEATS=$REPEATS timeout $(limit ${SETUP_TIMEOUT:-120}) python3 -c "$PROBE" 2>&1 | quiet \
        | tee "$OUT/store_setup.log" | grep "^{" | tee "$OUT/store_setup.json"
      if [ -n "${OLD:-}" ] && time_for "setup (old tree)"; then
        echo "== the same on the old tree ($OLD)"
        old=$(realpath "$OLD")
        (cd "$old" && PYTHONPATH=$old JAX_DWDP_FFI_LIB=$old/jax_dwdp/_lib/libjax_dwdp_ffi.so LAYERS=$LAYERS \
          REPEATS=$REPEATS timeout $(limit ${SETUP_TIMEOUT:-120}) python3 -c "$PROBE") 2>&1 | quiet \
          | tee "$OUT/store_setup_old.log" | grep "^{" | tee "$OUT/store_setup_old.json"
      fi ;;
    store)
      echo "== tests/test_gpu_process_store.py tests/test_gpu_dwdp.py"
      timeout $(limit ${STORE_TIMEOUT:-240}) python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/test_gpu_process_store.py tests/test_gpu_dwdp.py > "$OUT/tests_store.log" 2>&1
      echo "rc $?"; grep -E "^rank|free memory|passed|failed|FAILED|rror" "$OUT/tests_store.log" | tail -25 ;;
    launch)
      echo "== tests/test_gpu_process_launch.py"
      timeout $(limit ${LAUNCH_TIMEOUT:-200}) python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/test_gpu_process_launch.py > "$OUT/tests_launch.log" 2>&1
      echo "rc $?"; grep -E "^process|^row|passed|failed|FAILED|rror" "$OUT/tests_launch.log" | tail -20 ;;
    model)
      echo "== tests/test_gpu.py"
      timeout $(limit ${MODEL_TIMEOUT:-480}) python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        > "$OUT/tests_gpu.log" 2>&1
      echo "rc $?"; grep -E "^GPU|passed|failed|FAILED|rror" "$OUT/tests_gpu.log" | tail -20 ;;
  esac
done
