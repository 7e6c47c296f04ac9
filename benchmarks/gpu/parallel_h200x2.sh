#!/usr/bin/env bash
# Two H200s: pipeline 2 vs one GPU (bubble per stage) and DWDP over XLA vs independent ranks vs replicated.
set -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_MEM_FRACTION=0.9
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m | head -3 | tee -a "$OUT/gpu.txt"
timeout ${PIPE_TIMEOUT:-150} python3 benchmarks/bench_pipeline.py --preset 35b-a3b --num-layers 8 --seq-len 4096 \
  --microbatches 1 2 4 8 --iters 2 --out "$OUT/pipeline_35b_a3b_8layers.json" 2>&1 | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tee "$OUT/pipeline.log"
timeout ${DWDP_TIMEOUT:-150} python3 benchmarks/bench_dwdp.py ranks --preset 35b-a3b --num-layers 2 --seq-len 16384 \
  --iters 3 --out "$OUT/dwdp_xla_35b_a3b_2layers.json" 2>&1 | grep -v "^\s*@\|^E11\|^\*\*\*\|slow_op\|Very slow\|^$" | tee "$OUT/dwdp.log"
