#!/usr/bin/env bash
# One H200, from the repository root: build the CUTLASS grouped GEMM FFI library (ffi/grouped_gemm), smoke-test it,
# run tests/test_grouped_matmul.py on the GPU, then benchmarks/bench_grouped_matmul.py (calls, kernels, fusion). Logs
# under $OUT.
# Each step runs even if an earlier one failed; look for the "=== step" and "=== result" markers.
# Needs the nvidia-cutlass wheel (headers only) at .whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl (or $CUTLASS_WHL).
# Env: STEPS (default "0 1 2 3 4"; 5 = kernel-only times under Nsight Compute; 6 = the fused SwiGLU benchmark,
# FUSION_ARGS/FUSION_TIMEOUT), BENCH_TIMEOUT (s, default 330),
# BENCH_ARGS (extra benchmark flags), TEST_TIMEOUT (s, default 240), GMM_LIB_DIR (build the library there instead of
# jax_dwdp/_lib, and point the later steps at it through JAX_DWDP_GMM_LIB).
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$(date +%s)
step() { echo; echo "=== step $1 ($(( $(date +%s) - T0 )) s)"; }
result() { echo "=== result $1: $2 ($(( $(date +%s) - T0 )) s)"; }
want() { [[ " ${STEPS:-0 1 2 3 4} " == *" $1 "* ]]; }  # STEPS="2 3" runs only those steps
# bench NAME TIMEOUT COMMAND JSON LOG [ARGS...]: a subcommand of benchmarks/bench_grouped_matmul.py with its JSON under
# $OUT, output filtered and logged.
bench() {
  local name=$1 limit=$2 command=$3 json=$4 log=$5; shift 5
  timeout "$limit" python3 benchmarks/bench_grouped_matmul.py "$command" --out "$OUT/$json" "$@" 2>&1 \
    | grep -v "^\s*$\|slow_operation\|Very slow" \
    | tee "$OUT/$log"
  result "$name" "rc=${PIPESTATUS[0]} (124: timed out; the JSON has the rows finished)"
}
[ -n "${GMM_LIB_DIR:-}" ] && export JAX_DWDP_GMM_LIB=$GMM_LIB_DIR/libjax_dwdp_gmm.so

if want 0; then
step "0: machine"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvcc --version | tail -2; cmake --version | head -1
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, jax.devices())"
  python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda)" 2>&1 | tail -1; } 2>&1 | tee "$OUT/gpu.txt"
fi
if want 1; then
step "1: build libjax_dwdp_gmm.so"
WHL=${CUTLASS_WHL:-$PWD/.whl/nvidia_cutlass-4.2.0.0-py3-none-any.whl}
CUTLASS_ROOT=/tmp/nvidia_cutlass_whl
BUILD=/tmp/jax_dwdp_gmm_build
LIB_DIR=${GMM_LIB_DIR:-$PWD/jax_dwdp/_lib}
rm -f "$LIB_DIR/libjax_dwdp_gmm.so"
(
  set -e
  test -f "$WHL" || { echo "no CUTLASS wheel at $WHL"; exit 1; }
  rm -rf "$CUTLASS_ROOT" && python3 -m zipfile -e "$WHL" "$CUTLASS_ROOT"
  CUTLASS_INCLUDE_DIR=$CUTLASS_ROOT/cutlass_library/source/include
  test -f "$CUTLASS_INCLUDE_DIR/cutlass/gemm/group_array_problem_shape.hpp"
  XLA_FFI_INCLUDE_DIR=$(python3 -c "import jax; print(jax.ffi.include_dir())")
  rm -rf "$BUILD"
  cmake -S ffi/grouped_gemm -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DXLA_FFI_INCLUDE_DIR="$XLA_FFI_INCLUDE_DIR" -DCUTLASS_INCLUDE_DIR="$CUTLASS_INCLUDE_DIR" -DJAX_DWDP_LIB_DIR="$LIB_DIR"
  time cmake --build "$BUILD" -j "$(nproc)"
  ls -la "$LIB_DIR"
  nm -D --defined-only "$LIB_DIR/libjax_dwdp_gmm.so" | grep JaxDwdp
) > "$OUT/build.log" 2>&1
rc=$?; tail -n 12 "$OUT/build.log"; result build "rc=$rc"
if [ $rc -ne 0 ]; then grep -a -n -m 20 -A 4 "error" "$OUT/build.log"; fi
fi
if want 2; then
step "2: smoke test (one small grouped matmul, eager, errors shown in full)"
timeout 150 python3 - <<'EOF' 2>&1 | tee "$OUT/smoke.log" | grep -v "^\s*$" | tail -n 25
import time, numpy as np, jax, jax.numpy as jnp
from jax_dwdp.kernels import _cutlass
t = time.time()
print("library", _cutlass.library_path(), "exists", _cutlass.available(), "configs", _cutlass.config_names())
rng = np.random.default_rng(0)
g, n, k, m = 6, 256, 192, 700
sizes = np.array([0, 300, 1, 0, 257, 100])  # empty first group, groups > one tile, 42 rows past the sum
x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
w = jnp.asarray(rng.standard_normal((g, n, k)) * k**-0.5, jnp.bfloat16)
xs, ws = np.asarray(x, np.float64), np.asarray(w, np.float64)
ref = np.zeros((m, n)); s = 0
for i, c in enumerate(sizes):
    ref[s:s + c] = xs[s:s + c] @ ws[i].T; s += c
for cfg in range(len(_cutlass.config_names())):
    try:
        out = np.asarray(_cutlass.grouped_matmul(x, w, jnp.asarray(sizes, jnp.int32), config=cfg).astype(jnp.float32))
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        print(f"SMOKE config {cfg} {_cutlass.config_names()[cfg]}: rel err {err:.2e}, tail zeros "
              f"{np.all(out[sizes.sum():] == 0)}, finite {np.isfinite(out).all()}, "
              f"per-group err {[float(np.abs(out[a:b] - ref[a:b]).max()) if b > a else 0 for a, b in zip(np.cumsum(sizes) - sizes, np.cumsum(sizes))]}")
    except Exception as e:
        import traceback; traceback.print_exc()
        print(f"SMOKE config {cfg} FAILED: {type(e).__name__}: {e}")
import importlib; gm = importlib.import_module("jax_dwdp.kernels.grouped_matmul")
i2 = n // 2
gate, up = ref[:, :i2], ref[:, i2:]
ref_sw = gate / (1 + np.exp(-gate)) * up
for cfg in range(len(_cutlass.swiglu_config_names())):
    try:
        out = np.asarray(_cutlass.grouped_matmul_swiglu(x, gm.interleave_gate_up(w), jnp.asarray(sizes, jnp.int32),
                                                        config=cfg).astype(jnp.float32))
        err = np.linalg.norm(out - ref_sw) / np.linalg.norm(ref_sw)
        print(f"SMOKE swiglu config {cfg} {_cutlass.swiglu_config_names()[cfg]}: rel err {err:.2e}, tail zeros "
              f"{np.all(out[sizes.sum():] == 0)}, finite {np.isfinite(out).all()}")
    except Exception as e:
        import traceback; traceback.print_exc()
        print(f"SMOKE swiglu config {cfg} FAILED: {type(e).__name__}: {e}")
print(f"smoke done in {time.time() - t:.1f} s")
EOF
rc=${PIPESTATUS[0]}; result smoke "rc=$rc"
if grep -q "FAILED\|Error\|error" "$OUT/smoke.log" && command -v compute-sanitizer >/dev/null; then
  step "2b: smoke under compute-sanitizer (first failing launch)"
  JAX_DWDP_GMM_CMD_BUFFER=0 timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -c "
import numpy as np, jax.numpy as jnp
from jax_dwdp.kernels import _cutlass
x = jnp.ones((300, 64), jnp.bfloat16); w = jnp.ones((3, 64, 64), jnp.bfloat16)
print(np.asarray(_cutlass.grouped_matmul(x, w, jnp.asarray([100, 0, 150], jnp.int32), config=0)[::50, 0]))
" 2>&1 | tee -a "$OUT/smoke.log" | tail -n 30
fi
fi
if want 3; then
step "3: GPU tests (tests/test_grouped_matmul.py)"
JAX_DWDP_TEST_GPU=1 timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -s -p no:cacheprovider tests/test_grouped_matmul.py \
  2>&1 | tee "$OUT/tests.log" | grep -E "cutlass|xla grouped|passed|failed|Error|error|FAILED" | tail -n 40
result tests "rc=${PIPESTATUS[0]} (0: all passed; 5: nothing ran)"
fi
if want 4; then
step "4: benchmark"
bench bench "${BENCH_TIMEOUT:-330}" calls bench_grouped_matmul.json bench.log ${BENCH_ARGS:-}
fi
if want 5; then
step "5: GEMM kernel alone, every config vs torch's (ncu gpu__time_duration, clocks left alone)"
timeout ${NCU_TIMEOUT:-150} ncu --clock-control none --kernel-name regex:device_kernel --metrics gpu__time_duration.sum \
  --csv --print-units base --log-file "$OUT/ncu.csv" \
  python3 benchmarks/bench_grouped_matmul.py kernels run --plan "$OUT/ncu_plan.json" 2>&1 | tail -n 5
rc=${PIPESTATUS[0]}
python3 benchmarks/bench_grouped_matmul.py kernels report --plan "$OUT/ncu_plan.json" --csv "$OUT/ncu.csv" 2>&1 \
  | tee "$OUT/ncu_report.txt"
result ncu "rc=$rc (124: timed out; the report covers the cases finished)"
fi
if want 6; then
step "6: fused SwiGLU epilogue vs unfused vs torch, gate_up stage and whole routed-expert block"
bench fusion "${FUSION_TIMEOUT:-300}" fusion bench_moe_fusion.json fusion.log ${FUSION_ARGS:-}
fi
echo "=== total $(( $(date +%s) - T0 )) s"
