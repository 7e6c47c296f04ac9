#!/usr/bin/env bash
# One GPU (H100 or H200): Mamba-2's SSD scan as Pallas kernels (jax_dwdp/kernels/ssd_pallas.py) beside mamba_ssm's
# Triton kernels, transformers' torch path and the XLA scan, on identical inputs. Steps ($STEPS, default
# "tests bench variants"):
#   tests     tests/test_gpu_ssd.py: the kernel (default Tuning and other state blocks, warps, row blocks) against
#             float64 and the XLA scan at 30B-A3B's heads on a batch of lengths 4000, 1, 63, 64, 65, 1000 with zero
#             and random initial states; the kernel as the model's choice at single lengths; two pieces against one;
#             the bf16 mixer with the kernel against XLA
#   bench     benchmarks/bench_ssd.py at $SEQS (default 4096 16384 32768) tokens, $BENCH_ARGS added (--parts:
#             each pallas_call alone): $OUT/ssd.json
#   variants  bench_ssd.py --variants alone at $VARIANTS_TOKENS (default 16384 32768) tokens (the kernel's Tuning:
#             the states loop's blocks, warps and stages, the output's warps, row blocks and heads per program),
#             only with $VARIANTS_MIN_LEFT (default 60) seconds left: $OUT/ssd_variants.json
# The wheels in .whl/ (mamba_ssm 2.3.2.post1 built without its CUDA extensions, einops) go into /tmp/site; without
# them bench_ssd.py skips mamba_ssm's rows and says why. Run from the repository root; nothing needs to be carried
# but .whl/ (git-ignored: carry [".whl"]). Each command's limit is cut to what is left of $DEADLINE seconds (default
# 340, so that the whole script ends within 6 minutes with JIT and Triton's autotuning included; _limits.sh).
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
DEADLINE=${DEADLINE:-340}
STEPS=${STEPS:-"tests bench variants"}
source benchmarks/gpu/_limits.sh
source benchmarks/gpu/_bundle_out.sh
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 || echo "== wheels not installed: $(tail -1 "$OUT/pip.log")"
else
  echo "== no wheels in .whl/: mamba_ssm's rows will be skipped"
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax, torch, triton; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, \
'triton', triton.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpu.txt"
for step in $STEPS; do
  case $step in
    tests)
      time_for "$step" || continue
      echo "== tests/test_gpu_ssd.py ($SECONDS s)"
      JAX_DWDP_TEST_GPU=1 timeout "$(limit ${TEST_TIMEOUT:-150})" python3 -m pytest -q -rs -s -p no:cacheprovider \
        tests/test_gpu_ssd.py > "$OUT/tests.log" 2>&1
      echo "rc $?"; grep -E "seq 0|T=|pieces|mixer|XLA scan|passed|failed|skipped|FAILED|rror" "$OUT/tests.log" \
        | grep -v "^E  " | tail -${TEST_LINES:-30} ;;
    bench)
      time_for "$step" || continue
      echo "== bench_ssd.py ($SECONDS s)"
      timeout "$(limit ${BENCH_TIMEOUT:-170})" python3 benchmarks/bench_ssd.py --seq-lens ${SEQS:-4096 16384 32768} \
        ${BENCH_ARGS:-} --out "$OUT/ssd.json" 2>&1 | quiet > "$OUT/bench.log"
      echo "rc $?"; grep -E "^\||^part|skipped|torch rows|rror" "$OUT/bench.log" | tail -40 ;;
    variants)
      MIN_LEFT=${VARIANTS_MIN_LEFT:-60} time_for "$step" || continue
      echo "== bench_ssd.py --variants ($SECONDS s)"
      timeout "$(limit 300)" python3 benchmarks/bench_ssd.py --seq-lens --variants --no-mamba --no-torch \
        --variants-tokens ${VARIANTS_TOKENS:-16384 32768} --out "$OUT/ssd_variants.json" 2>&1 | quiet > "$OUT/variants.log"
      echo "rc $?"; grep -E "^variant|^best|rror" "$OUT/variants.log" | sed 's/, "y_max_abs_err[^,]*//' | tail -16 ;;
    *) echo "== unknown step $step" ;;
  esac
done
echo "== done ($SECONDS s)"
bundle_out "$OUT"
