#!/usr/bin/env bash
# One GPU: the DWDP expert store read in place (the MoE reads each layer's experts from the store's composite range;
# only the peers' blocks are copied, into slots). Steps ($STEPS, default "build tests bench"):
#   build  the store's libraries (jax_dwdp_ffi, jax_dwdp_ffi_testing) into jax_dwdp/_lib with CMake, against this
#          machine's jax; without cmake the carried ones are used
#   tests  tests/test_gpu_store_in_place.py (two ranks of one store in this process on this GPU: poisoned and
#          delayed copies, a runner in place vs its own experts, write-after-read, the slot-set refusal, memory vs
#          plan), tests/test_gpu_process_store.py (two processes sharing the GPU, blocks off the granularity: the
#          copy-out path) and tests/test_gpu_process_launch.py (two jax.distributed processes, the tiny model)
#   bench  benchmarks/bench_dwdp.py in-place: $LAYERS (default 8) layers of 35b-a3b at $SEQS (default 4096 16384
#          32768) tokens, local experts vs in place without and with the peer copy vs copied out; JSON in
#          $OUT/in_place.json
# Steps not in the default:
#   rehearsal  tests/test_gpu_process_launch.py -k "rehearses or nccl" (prefill --num-processes 2 --dwdp 2 --experts
#              ffi --share-gpu vs one device; NCCL refusing two ranks on one GPU) and tests/test_gpu.py -k "nemotron or
#              prefill_matches" (both families' prefill, GPU vs CPU fp32)
#   profile    benchmarks/profile_gpu.py --tokens $PROFILE_TOKENS (default 4096 16384) --copy-layers 4 --reps 3
#              --link nvlink4: a measured GPU profile for the planner in $OUT/profile.json
#   probe      benchmarks/probe_in_place_cost.py --seq-lens 4096 with XLA's command buffers on (the default) and off
#              (--xla_gpu_enable_command_buffer=; $PROBE_CB, default "on off"): whether the store's custom calls
#              cost by splitting them; with PROBE_TRACE=1 each variant also traced (local vs nolink's kernels and
#              idle gaps printed; the summaries in the JSON)
# Run from the repository root (carry ["jax_dwdp/_lib"] for the grouped GEMM library). Each command's limit is cut
# to what is left of $DEADLINE seconds (default 560; _limits.sh). Logs under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
DEADLINE=${DEADLINE:-560}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"build tests bench"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source benchmarks/gpu/_limits.sh
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    build)
      if command -v cmake > /dev/null; then
        cmake -S ffi -B /tmp/ffib -DXLA_FFI_INCLUDE_DIR="$(python3 -c 'import jax; print(jax.ffi.include_dir())')" \
          -DJAX_DWDP_LIB_DIR="$PWD/jax_dwdp/_lib" -DCMAKE_BUILD_TYPE=Release > "$OUT/build.log" 2>&1 \
          && cmake --build /tmp/ffib -j 16 --target jax_dwdp_ffi jax_dwdp_ffi_testing >> "$OUT/build.log" 2>&1
        echo "== build rc $? ($SECONDS s)"
      else
        echo "== build: no cmake, the carried libraries"
      fi ;;
    tests)
      timeout "$(limit 300)" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu_store_in_place.py \
        tests/test_gpu_process_store.py tests/test_gpu_process_launch.py > "$OUT/tests.log" 2>&1
      echo "== tests rc $? ($SECONDS s)"; grep -E "passed|failed|FAILED|Error|in place|store .* GiB" "$OUT/tests.log" \
        | grep -v "^E  " | tail -16 ;;
    bench)
      timeout "$(limit 400)" python3 benchmarks/bench_dwdp.py in-place --num-layers "${LAYERS:-8}" \
        --seq-lens ${SEQS:-4096 16384 32768} --iters 5 --out "$OUT/in_place.json" 2>&1 | quiet > "$OUT/bench.log"
      echo "== bench rc $? ($SECONDS s)"; grep -E "^\||store bytes|Error|error" "$OUT/bench.log" | tail -12 ;;
    rehearsal)
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
      for cb in ${PROBE_CB:-on off}; do
        time_for "probe $cb" || continue
        flags=$([ $cb = off ] && echo "--xla_gpu_enable_command_buffer=" || echo "")
        XLA_FLAGS="$flags" timeout "$(limit 150)" python3 benchmarks/probe_in_place_cost.py --seq-lens 4096 \
          ${PROBE_TRACE:+--trace /tmp/probe_traces_$cb} --out "$OUT/probe_cb_$cb.json" 2>&1 | quiet \
          > "$OUT/probe_cb_$cb.log"
        echo "== probe, command buffers $cb: rc $? ($SECONDS s)"; grep -E "^\| [0-9]" "$OUT/probe_cb_$cb.log"
        [ -n "${PROBE_TRACE:-}" ] && grep -A14 "^== traces at .* local vs nolink" "$OUT/probe_cb_$cb.log"
      done ;;
  esac
done
