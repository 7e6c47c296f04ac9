#!/usr/bin/env bash
# Two H200s: issue 15's pipeline bar (BAR=1, first: the 40-layer 35b-a3b pipeline over the two GPUs vs one GPU at 4
# and 8 microbatches of one 8K sequence, layer-wise then scanned stages; each row also times the stages from one host
# thread; 40 layers need H200s: the one-GPU baseline and stage 0 share GPU 0), pipeline 2 vs one GPU on 8 layers
# (bubble per stage) and DWDP over XLA vs independent ranks vs replicated.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m | head -3 | tee -a "$OUT/gpu.txt"
filter() { grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$"; }
if [ "${BAR:-1}" = 1 ]; then
  for scan in "" "--scan"; do
    timeout ${BAR_TIMEOUT:-280} python3 benchmarks/bench_pipeline.py --preset 35b-a3b --num-layers ${BAR_LAYERS:-40} \
      --seq-len 8192 --microbatches 4 8 --iters 3 $scan --out "$OUT/pipeline40${scan:+_scan}.json" 2>&1 | filter \
      | tee "$OUT/pipeline40${scan:+_scan}.log"
  done
fi
timeout ${PIPE_TIMEOUT:-150} python3 benchmarks/bench_pipeline.py --preset 35b-a3b --num-layers 8 --seq-len 4096 \
  --microbatches 1 2 4 8 --iters 2 --out "$OUT/pipeline_35b_a3b_8layers.json" 2>&1 | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tee "$OUT/pipeline.log"
timeout ${DWDP_TIMEOUT:-150} python3 benchmarks/bench_dwdp.py ranks --preset 35b-a3b --num-layers 2 --seq-len 16384 \
  --iters 3 --out "$OUT/dwdp_xla_35b_a3b_2layers.json" 2>&1 | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tee "$OUT/dwdp.log"
