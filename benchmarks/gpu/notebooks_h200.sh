#!/usr/bin/env bash
# One H200: notebook 03 top to bottom with its fresh runs (JAX_DWDP_FRESH_RUNS=1: layer parts, the GDN kernel with
# fla, the grouped matmul with torch), as a user on a GPU machine would run it. Needs the notebook wheels (nbclient,
# nbformat, ipykernel, matplotlib and their dependencies, cp312) in .whl/nb/ and fla in .whl/ (docs/notebooks.md).
# Writes the executed notebook and its text outputs under $OUT. NOTEBOOK= picks another notebook.
set -o pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_DWDP_FRESH_RUNS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  .whl/nb/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site MPLCONFIGDIR=/tmp/mpl
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout ${NOTEBOOK_TIMEOUT:-420} python3 - "${NOTEBOOK:-notebooks/03_layer_time_and_kernels.ipynb}" "$OUT" <<'PY'
import sys, time, pathlib
import nbformat
from nbclient import NotebookClient
path, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
nb = nbformat.read(path, as_version=4)
t0 = time.time()
try:
    NotebookClient(nb, timeout=400, kernel_name="python3", resources={"metadata": {"path": "."}}).execute()
    status = "ran to the end"
except Exception as e:  # a failed cell: report which, keep what ran
    status = f"stopped: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
nbformat.write(nb, out / path.name)
lines = []
for i, c in enumerate(nb.cells):
    for o in c.get("outputs", []) if c.cell_type == "code" else []:
        if o.output_type == "stream":
            lines += [f"[{i}] {l}" for l in o.text.splitlines()]
        elif o.output_type == "error":
            lines += [f"[{i}] ERROR {o.ename}: {o.evalue}"]
        elif "image/png" in o.get("data", {}):
            lines.append(f"[{i}] <png {len(o['data']['image/png'])} bytes>")
(out / "notebook_outputs.txt").write_text("\n".join(lines))
print("\n".join(l for l in lines if "fresh" in l or "ERROR" in l or "png" in l or "GPUs" in l))
print(f"{path.name}: {status} in {time.time() - t0:.0f} s")
PY
