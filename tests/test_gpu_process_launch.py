"""DWDP over the CUDA VMM store with one process per rank, through the library's own drivers: `Pipeline(...,
experts="ffi")` in a jax.distributed launch makes a `ProcessExpertStore` per process (`FfiBackend` (parallel/backends.py)), fills
only its own rank's blocks, connects them (`backends.connect_store`: FdExchange named by the launch) and runs the same
shard_map prefetch / wait programs; and `jax-dwdp prefill --num-processes 2 --dwdp 2 --dwdp-backend ffi`.

- Two processes joined through jax.distributed, their prefill's logits (each process's own rows, written by the
  process) equal one process with every expert on its device (fp32, 1e-5); each process ends with no live CUDA
  object of its store. On one GPU the two processes share it (no collective runs: DWDP's ranks exchange no
  tokens, and each process writes its own rows); with two GPUs each has its own.
- Two GPUs: the CLI's launcher with the FFI store equals one process driving both GPUs (fp32 <= 1e-5).
- One GPU: the CLI's launcher rehearses that launch with --share-gpu (both processes on the GPU, the logits
  gathered through the host), equal to one device; and NCCL does not run a psum between two processes on one GPU,
  which is why the rehearsal is the FFI store's DWDP only.
Skips without a GPU (JAX_DWDP_TEST_GPU=1 on a GPU machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jax_dwdp.distributed import reserve_port
from tests.process_store_worker import BATCH, _pipeline, _tokens

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]

ROOT = Path(__file__).resolve().parents[1]


def _gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(len(jax.devices()))]
    return ids


@pytest.mark.parametrize("source", ["random", "aligned", "hf"])
def test_two_processes_run_the_pipeline_over_the_process_store(tmp_path, source):
    """random: each process makes every layer on its device and fills its slice; aligned: the same with rank blocks
    of 2 MiB multiples, so the store reads its experts in place (views of its composite ranges, a mesh across the two
    processes); hf: each process loads its own experts' bytes straight into the split placement
    (CheckpointLayers) and fills the shard it holds. random and hf copy out (the tiny model's blocks are small)."""
    if source == "hf":
        from jax_dwdp.config import ModelConfig
        from tests.checkpoint_helpers import write_hf

        source = str(write_hf(tmp_path / "hf", ModelConfig.preset("tiny").replace(num_hidden_layers=3), seed=5))
    gpus = _gpus()
    port = reserve_port()  # held until the processes end (no other program can take it in between)
    coordinator = f"127.0.0.1:{port.getsockname()[1]}"
    procs, outputs = [], []
    try:  # from the first Popen on: a failed start still kills the started workers and frees the port
        for pid in range(2):
            # As the launcher does: every GPU visible, the process's own named by JAX_DWDP_LOCAL_DEVICE (on one GPU
            # both processes drive it)
            env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES=",".join(gpus),
                       JAX_DWDP_LOCAL_DEVICE=str(pid % len(gpus)), XLA_PYTHON_CLIENT_PREALLOCATE="false")
            env.pop("JAX_PLATFORMS", None)
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.process_store_worker", coordinator, str(pid),
                                           str(tmp_path), source],
                                          env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        for pid, p in enumerate(procs):
            try:
                outputs.append(p.communicate(timeout=400)[0])
            except subprocess.TimeoutExpired:
                p.kill()
                pytest.fail(f"process {pid} ran past 400 s:\n{p.communicate()[0][-4000:]}")
    finally:  # every worker ends, and its pipe is read to the end and closed (no descriptor left open)
        for p in procs:
            if p.poll() is None:
                p.kill()
            if p.stdout is not None and not p.stdout.closed:
                p.communicate()
        port.close()
    for pid, (p, text) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {pid} exited with {p.returncode}:\n{text[-4000:]}"

    # The reference runs each rank's two rows as its own batch on one device: the same matmul shapes as the rank's
    # (a 4-row batch picks other GEMM algorithms, whose fp32 rounding differs by ~2e-5 of the logits' scale)
    with _pipeline(source) as one:
        tokens, lengths = _tokens(one.cfg)
        half = BATCH // 2
        ref = np.concatenate([np.asarray(one.prefill(tokens[r:r + half], lengths[r:r + half], logits="all")[0])
                              for r in (0, half)])
    got = np.full(ref.shape, np.nan, np.float32)
    for f in tmp_path.glob("logits_*.npy"):
        start = int(f.stem.split("_")[2])
        block = np.load(f)
        got[start:start + block.shape[0]] = block
    for pid in range(2):
        report = json.loads((tmp_path / f"report_{pid}.json").read_text())
        print(f"process {pid}: {report}")
        assert report["store"] == "ProcessExpertStore" and report["rank"] == pid
        assert report["mode"] == ("in_place" if source == "aligned" else "copy"), report
        assert all(v == 0 for v in report["live"].values()), report["live"]
    for row in range(BATCH):  # each row's valid positions
        n = int(lengths[row])
        err = float(np.abs(got[row, :n] - ref[row, :n]).max() / np.abs(ref[row, :n]).max())
        print(f"row {row} ({n} tokens): two processes over the store vs one device, the rank's rows: {err:.2e}")
        assert np.isfinite(got[row, :n]).all() and err <= 1e-5, (row, err)


@pytest.mark.skipif(len(jax.devices()) < 2, reason="the launcher gives each process its own GPU: needs two")
def test_launcher_with_the_ffi_store_equals_one_process(tmp_path):
    cli = [sys.executable, "-m", "jax_dwdp.cli", "prefill", "--preset", "tiny", "--batch", "3", "--seq-len", "40",
           "--dtype", "float32", "--iters", "1", "--dwdp", "2", "--dwdp-backend", "ffi"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    runs = {}
    for name, extra in (("one", []), ("two", ["--num-processes", "2"])):
        out = tmp_path / f"{name}.npy"
        proc = subprocess.run(cli + extra + ["--logits-out", str(out)], capture_output=True, text=True, timeout=600,
                              env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = np.load(out)
    err = float(np.abs(runs["two"] - runs["one"]).max() / np.abs(runs["one"]).max())
    print(f"--num-processes 2 --dwdp-backend ffi vs one process on both GPUs: {err:.2e}")
    assert err <= 1e-5




def test_the_launcher_rehearses_dwdp_ffi_on_one_gpu(tmp_path):
    """`prefill --num-processes 2 --dwdp 2 --experts ffi --share-gpu`: the launcher starts both processes on the
    first GPU, each makes its rank's ProcessExpertStore, the two trade descriptors and map each other's blocks, and
    the layer loop prefetches over the copy stream (only the NVLink hop is missing); the logits, gathered through the
    host, equal one process on one device (fp32; the ranks' 2-row batches round differently from the 4-row one:
    bound 1e-4, printed)."""
    cli = [sys.executable, "-m", "jax_dwdp.cli", "prefill", "--preset", "tiny", "--batch", "4", "--seq-len", "40",
           "--dtype", "float32", "--iters", "1"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    runs = {}
    for name, extra in (("one", []), ("two", ["--dwdp", "2", "--experts", "ffi", "--num-processes", "2",
                                               "--share-gpu"])):
        out = tmp_path / f"{name}.npy"
        proc = subprocess.run(cli + extra + ["--logits-out", str(out)], capture_output=True, text=True, timeout=400,
                              env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = np.load(out)
    assert "started 2 processes" in proc.stderr
    err = float(np.abs(runs["two"] - runs["one"]).max() / np.abs(runs["one"]).max())
    print(f"--num-processes 2 --dwdp 2 --experts ffi --share-gpu vs one process on one device: {err:.2e}")
    assert np.isfinite(runs["two"]).all() and err <= 1e-4


NCCL_PROBE = """
import sys
from jax_dwdp.distributed import initialize
initialize(sys.argv[1], 2, int(sys.argv[2]), timeout_s=60)
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("r",))
x = jax.make_array_from_callback((2, 4), NamedSharding(mesh, P("r")), lambda i: np.ones((1, 4), np.float32))
total = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "r"), mesh=mesh, in_specs=P("r"), out_specs=P("r")))(x)
print("PSUM", float(np.asarray(total.addressable_shards[0].data).sum()))
"""


def test_nccl_refuses_two_ranks_on_one_gpu():
    """Why --share-gpu rehearses the FFI store's DWDP and nothing else (distributed.check_layout): a psum between two
    processes on the same GPU does not run (NCCL refuses two ranks on one device, or never completes). Should it run
    one day, this test fails, saying --share-gpu could then rehearse DEP and the XLA path too."""
    port = reserve_port()
    coordinator = f"127.0.0.1:{port.getsockname()[1]}"
    env = dict(os.environ, PYTHONPATH=str(ROOT), XLA_PYTHON_CLIENT_PREALLOCATE="false", JAX_DWDP_LOCAL_DEVICE="0",
               NCCL_NVLS_ENABLE="0")
    env.pop("JAX_PLATFORMS", None)
    procs = [subprocess.Popen([sys.executable, "-c", NCCL_PROBE, coordinator, str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for i in range(2)]
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=120)[0])
            except subprocess.TimeoutExpired:
                outputs.append("(no answer in 120 s)")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
        port.close()
    ran = [("PSUM 8.0" in out) for out in outputs]
    for i, out in enumerate(outputs):
        lines = [line for line in out.splitlines() if "NCCL" in line or "PSUM" in line or "rror" in line]
        print(f"process {i}: exit {procs[i].returncode}; " + " | ".join(lines[-4:])[:600])
    assert not all(ran), "a psum ran between two processes on one GPU: --share-gpu could rehearse DEP and XLA too"
