#!/usr/bin/env bash
# One GPU: the one-GPU rehearsal of a multi-process DWDP launch, the GPU profile for the planner, and where the
# in-place store's fixed per-layer cost goes. Steps ($STEPS, default "build tests profile probe"):
#   build    the store's libraries (jax_dwdp_ffi, jax_dwdp_ffi_testing) into jax_dwdp/_lib with CMake, against this
#            machine's jax
#   tests    tests/test_gpu_process_launch.py -k "rehearses or nccl" (prefill --num-processes 2 --dwdp 2 --experts
#            ffi --share-gpu vs one device; NCCL refusing two ranks on one GPU) and tests/test_gpu.py -k "nemotron or
#            prefill_matches" (both families' prefill, GPU vs CPU fp32)
#   profile  benchmarks/profile_gpu.py --tokens $PROFILE_TOKENS (default 4096 16384) --copy-layers 4 --reps 3
#            --link nvlink4: the measured profile in $OUT/profile.json
#   probe    benchmarks/probe_in_place_cost.py --seq-lens 4096, with XLA's command buffers on (the default) and off
#            (--xla_gpu_enable_command_buffer=): whether the store's custom calls cost by splitting them
# Run from the repository root (carry ["jax_dwdp/_lib"]). Each command's limit is cut to what is left of $DEADLINE
# seconds (default 560; _limits.sh). Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"build tests profile probe"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source benchmarks/gpu/_limits.sh
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    build)
      cmake -S ffi -B /tmp/ffib -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
        -DJAX_DWDP_LIB_DIR="$PWD/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
        && cmake --build /tmp/ffib -j 16 --target jax_dwdp_ffi jax_dwdp_ffi_testing >> "$OUT/build.log" 2>&1
      echo "== build rc $? ($SECONDS s)" ;;
    tests)
      timeout "$(limit 200)" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu_process_launch.py \
        -k "rehearses or nccl" > "$OUT/launch.log" 2>&1
      echo "== launch tests rc $? ($SECONDS s)"; grep -E "passed|failed|share-gpu vs|Error" "$OUT/launch.log" | tail -4
      timeout "$(limit 200)" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        -k "nemotron or prefill_matches" > "$OUT/test_gpu.log" 2>&1
      echo "== test_gpu rc $? ($SECONDS s)"; grep -E "passed|failed|GPU vs CPU|Error" "$OUT/test_gpu.log" | tail -4 ;;
    profile)
      timeout "$(limit 220)" python3 benchmarks/profile_gpu.py --tokens ${PROFILE_TOKENS:-4096 16384} \
        --copy-layers 4 --reps 3 --link nvlink4 --out "$OUT/profile.json" 2>&1 | quiet > "$OUT/profile.log"
      echo "== profile rc $? ($SECONDS s)"; grep -E "tokens|rate|Error|error" "$OUT/profile.log" | tail -8 ;;
    probe)
      for cb in on off; do
        time_for "probe $cb" || continue
        flags=$([ $cb = off ] && echo "--xla_gpu_enable_command_buffer=" || echo "")
        XLA_FLAGS="$flags" timeout "$(limit 120)" python3 benchmarks/probe_in_place_cost.py --seq-lens 4096 \
          --out "$OUT/probe_cb_$cb.json" 2>&1 | quiet > "$OUT/probe_cb_$cb.log"
        echo "== probe, command buffers $cb: rc $? ($SECONDS s)"; grep -E "^\| [0-9]" "$OUT/probe_cb_$cb.log"
      done ;;
  esac
done
