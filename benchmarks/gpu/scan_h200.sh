#!/usr/bin/env bash
# One GPU: the scanned layer stack for the whole model and for pipeline stages (jax_dwdp.scan,
# Pipeline(..., scan=True)) against the layer-wise programs, in one run. Run from the repository root with the FFI
# libraries in jax_dwdp/_lib (built on the CPU machine, carried). Steps ($STEPS, default "tests prefill pipeline
# probe"):
#   tests     the GPU tests of the scanned stage and of the layer-wise runner (tests/test_gpu.py)
#   prefill   bench_prefill.py, $LAYERS layers of 35b-a3b at $SEQS tokens: --layerwise, then --scan, one process
#             each; each traces one call per length (kernels and idle gaps; the Perfetto files in
#             $OUT/traces/traces.tgz, the scan's kernels against the layer-wise ones'; $TRACE=0 skips it) and profiles
#             one call's host time
#   pipeline  the CLI on $PLAYERS layers, batch 4 x $PSEQ tokens in 4 microbatches (Pipeline with one stage on this
#             GPU): each of $PIPE_MODES (default "--layerwise --scan")
#   cli       the CLI's one-device prefill on $PLAYERS layers, batch 1 x $PSEQ tokens: --layerwise, then --scan
#   probe     probe_scan.py --run at 16K: memory after restacking, the scanned program's memory, one run's peak
# Not in the default:
#   flags     whether XLA reads the scan's dense weights inside the stacks under other GEMM lowerings: for each
#             XLA_FLAGS set in $FLAG_SETS (";"-separated; default: legacy cuBLAS with neither cuBLASLt nor Triton
#             GEMMs, whose __cublas$gemm XLA's dynamic-slice fusion takes as its hero; then Triton GEMMs with no
#             cuBLAS fallback, whose fusions take a dynamic-slice of the weight), the layer-wise and the scanned
#             prefill at $FLAG_SEQS (default 16384) tokens, traced, and trace_summary.py of the two (the
#             device-to-device copies, kernel time)
# $LAYERS defaults to 40 on a GPU with more than 100 GB (H200), else 32 (H100). Each command's time limit is cut to
# what is left of $DEADLINE seconds (default 570), and a command with under 40 s left is skipped (_limits.sh). Logs
# and JSON under $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_DWDP_TEST_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=${STEPS:-"tests prefill pipeline probe"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
source benchmarks/gpu/_limits.sh
LAYERS=${LAYERS:-$(by_memory 40 32)}
PLAYERS=${PLAYERS:-20}
PSEQ=${PSEQ:-8192}
SEQS=${SEQS:-"4096 16384 32768"}
CLI=(python3 -c "import sys; from jax_dwdp.entry import main; sys.argv[0] = 'jax-dwdp'; sys.exit(main())")
ls -la jax_dwdp/_lib
echo "layers $LAYERS, pipeline layers $PLAYERS"
for step in $STEPS; do
  time_for "$step" || continue
  case $step in
    tests)
      echo "== tests"
      timeout $(limit ${TEST_TIMEOUT:-200}) python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_gpu.py \
        -k "${TEST_K:-scanned_stage or prefill_matches_cpu}" > "$OUT/tests.log" 2>&1
      echo "tests rc $?"; grep -E "^GPU|passed|failed|rror" "$OUT/tests.log" | tail -20 ;;
    prefill)
      echo "== prefill, $LAYERS layers"
      rm -rf /tmp/traces  # (a warm machine may hold an earlier run's)
      rows() { grep -E "finite=|^device events|^idle between" "$1" | cut -c1-200; }
      for name in layerwise scan; do  # one process each
        time_for "prefill $name" || continue
        trace=""; [ "${TRACE:-1}" = 1 ] && trace="--trace /tmp/traces/$name"
        mode=--$name
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(limit ${PREFILL_TIMEOUT:-240}) \
          python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers "$LAYERS" --seq-lens $SEQS $mode \
          --iters 5 $trace --host-profile ${HOST_PROFILE:-25} --out "$OUT/prefill_$name.json" 2>&1 | quiet \
          > "$OUT/prefill_$name.log"
        echo "$name rc $?"; rows "$OUT/prefill_$name.log"
      done
      if [ "${TRACE:-1}" = 1 ]; then  # (under $OUT/traces/: outside logs.tgz, so a large bundle loses no log)
        mkdir -p "$OUT/traces"
        (cd /tmp/traces && find . -name "perfetto_trace.json.gz" | tar czf "$OUT/traces/traces.tgz" -T -)
        for t in $SEQS; do  # the scan against the layer-wise programs
          [ -d "/tmp/traces/layerwise/$t" ] && [ -d "/tmp/traces/scan/$t" ] && \
            python3 benchmarks/trace_summary.py "/tmp/traces/layerwise/$t" --versus "/tmp/traces/scan/$t" --top 8
        done
      fi ;;
    pipeline)
      for mode in ${PIPE_MODES:---layerwise --scan}; do
        time_for "pipeline $mode" || continue
        echo "== pipeline (one stage) $mode"
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(limit ${PIPE_TIMEOUT:-100}) "${CLI[@]}" prefill --preset 35b-a3b \
          --num-layers "$PLAYERS" --batch 4 --seq-len "$PSEQ" --microbatches 4 --iters 3 $mode \
          > "$OUT/pipeline${mode}.log" 2>&1
        echo "rc $?"; quiet < "$OUT/pipeline${mode}.log" | grep -E "model:|compile|tokens/s|peak|rror" | tail -6
      done ;;
    cli)
      for mode in --layerwise --scan; do
        time_for "cli $mode" || continue
        echo "== cli (one device) $mode"
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(limit ${PIPE_TIMEOUT:-100}) "${CLI[@]}" prefill --preset 35b-a3b \
          --num-layers "$PLAYERS" --batch 1 --seq-len "$PSEQ" --iters 3 $mode > "$OUT/cli${mode}.log" 2>&1
        echo "rc $?"; quiet < "$OUT/cli${mode}.log" | grep -E "model:|compile|tokens/s|peak|rror" | tail -6
      done ;;
    flags)
      IFS=';' read -ra sets <<< "${FLAG_SETS:---xla_gpu_enable_cublaslt=false --xla_gpu_enable_triton_gemm=false;--xla_gpu_cublas_fallback=false}"
      for i in "${!sets[@]}"; do
        echo "== flags $i: XLA_FLAGS=${sets[$i]}"
        for name in layerwise scan; do
          time_for "flags $i $name" || continue
          XLA_FLAGS="${sets[$i]}" XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(limit ${PREFILL_TIMEOUT:-200}) \
            python3 benchmarks/bench_prefill.py --preset 35b-a3b --num-layers "$LAYERS" --seq-lens ${FLAG_SEQS:-16384} \
            --$name --iters 5 --trace "/tmp/flag_traces/$i/$name" --out "$OUT/flags${i}_$name.json" 2>&1 | quiet \
            > "$OUT/flags${i}_$name.log"
          echo "$name rc $?"; grep -E "finite=|^device events" "$OUT/flags${i}_$name.log" | cut -c1-200
        done
        for t in ${FLAG_SEQS:-16384}; do
          [ -d "/tmp/flag_traces/$i/layerwise/$t" ] && [ -d "/tmp/flag_traces/$i/scan/$t" ] && \
            python3 benchmarks/trace_summary.py "/tmp/flag_traces/$i/layerwise/$t" \
              --versus "/tmp/flag_traces/$i/scan/$t" --top 8 | tee "$OUT/flags${i}_trace_$t.txt"
        done
      done ;;
    probe)
      echo "== probe_scan"
      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout $(limit ${PROBE_TIMEOUT:-120}) python3 benchmarks/probe_scan.py \
        --preset 35b-a3b --num-layers "$LAYERS" --tokens 16384 --run --out-dir /tmp/probe 2>&1 | quiet \
        > "$OUT/probe_scan.log"
      echo "probe rc $?"; cut -c1-300 "$OUT/probe_scan.log" | tail -20 ;;
  esac
done
source benchmarks/gpu/_bundle_out.sh
bundle_out "$OUT"  # past 8 files, one $OUT/logs.tgz (the device tool returns at most 8)
