"""Orbax checkpoints: HF -> Orbax conversion, restore per stage and per DWDP rank, atomicity, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.cli import main
from jax_dwdp.config import ModelConfig
from jax_dwdp.prefill import jit_prefill
from jax_dwdp.weights import convert_hf_to_orbax, is_orbax_checkpoint, load_orbax_checkpoint, orbax_store
from jax_dwdp.weights.hf_loader import load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import CheckpointError
from tests.hf_reference import random_hf_model, rel_err, save_hf

CFG = ModelConfig.preset("tiny").replace(num_hidden_layers=5, vocab_size=70)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return save_hf(random_hf_model(CFG, seed=17), tmp_path_factory.mktemp("hf") / "ckpt")


@pytest.fixture(scope="module")
def orbax_dir(hf_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("orbax") / "ckpt"
    convert_hf_to_orbax(hf_dir, out, dtype=jnp.float32, progress=None)
    return out


def flat(model) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


def test_orbax_restore_equals_hf_load(hf_dir, orbax_dir, rng):
    a, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32)
    b, report = load_orbax_checkpoint(orbax_dir, dtype=jnp.float32)
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for path in fa:
        np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))
    tokens = rng.integers(0, CFG.vocab_size, (2, 40)).astype(np.int32)
    assert rel_err(jit_prefill(b)(tokens)[0], jit_prefill(a)(tokens)[0]) == 0.0
    marker = json.loads((orbax_dir / "jax_dwdp.json").read_text())
    assert marker["tensors"] == report.tensors_loaded and marker["layers"] == 5


def test_load_checkpoint_fused_swiglu_layout(hf_dir, orbax_dir, rng):
    """load_checkpoint(fused_swiglu=True) from either format: the same model in the interleaved layout."""
    from jax_dwdp.model import fused_swiglu_enabled
    from jax_dwdp.weights import load_checkpoint

    ref, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32)
    tokens = rng.integers(0, CFG.vocab_size, (2, 24)).astype(np.int32)
    want = jit_prefill(ref)(tokens)[0]
    for source in (hf_dir, orbax_dir):
        default, _ = load_checkpoint(source, dtype=jnp.float32)
        assert not fused_swiglu_enabled(default)  # the default keeps the checkpoint layout
        model, _ = load_checkpoint(source, dtype=jnp.float32, fused_swiglu=True)
        assert fused_swiglu_enabled(model)
        assert rel_err(jit_prefill(model)(tokens)[0], want) <= 1e-6


def test_convert_parses_each_shard_header_once(hf_dir, orbax_dir, tmp_path, monkeypatch):
    """Conversion keeps one open checkpoint across its per-layer loads: each of the 3 shard headers is parsed once
    (not once per layer), and the result restores bit for bit equal to the HF load."""
    from safetensors.numpy import load_file, save_file

    from jax_dwdp.weights import safetensors_reader

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    shutil.copy(hf_dir / "config.json", sharded / "config.json")
    tensors = load_file(hf_dir / "model.safetensors")
    names, weight_map = sorted(tensors), {}
    for s in range(3):
        fname = f"model-{s + 1:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in names[s::3]}, sharded / fname)
        weight_map.update({k: fname for k in names[s::3]})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    parsed = []
    real = safetensors_reader._read_header
    monkeypatch.setattr(safetensors_reader, "_read_header", lambda path: parsed.append(path.name) or real(path))
    out = tmp_path / "out"
    summary = convert_hf_to_orbax(sharded, out, dtype=jnp.float32, progress=None)
    assert sorted(parsed) == sorted(set(weight_map.values())), parsed  # 3 parses, not 3 per layer
    assert summary["tensors"] == json.loads((orbax_dir / "jax_dwdp.json").read_text())["tensors"]
    monkeypatch.undo()
    ref, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32)
    got, _ = load_orbax_checkpoint(out, dtype=jnp.float32)
    fa, fb = flat(ref), flat(got)
    assert fa.keys() == fb.keys()
    for path in fa:
        np.testing.assert_array_equal(fa[path], fb[path], err_msg=str(path))


def test_convert_drops_each_finished_item_from_page_cache(hf_dir, orbax_dir, tmp_path, monkeypatch):
    """Page reuse: every item (embed, each layer, head) is made durable and dropped from the page cache exactly
    once, only after it is complete (its Orbax metadata is there). Items are plain zarr, not OCDBT."""
    dropped = []
    real = orbax_store._drop_written_pages

    def spy(item):
        assert (item / "_METADATA").is_file() or (item / "_CHECKPOINT_METADATA").is_file(), sorted(item.iterdir())
        dropped.append(item.relative_to(item.parents[0 if item.name in ("embed", "head") else 1]).as_posix())
        real(item)

    monkeypatch.setattr(orbax_store, "_drop_written_pages", spy)
    convert_hf_to_orbax(hf_dir, tmp_path / "reuse", dtype=jnp.float32, progress=None)
    want = ["embed", "head"] + [f"layers/{i:03d}" for i in range(CFG.num_hidden_layers)]
    assert sorted(dropped) == sorted(want), dropped
    assert not list((tmp_path / "reuse").rglob("manifest.ocdbt"))


def test_restore_reads_ocdbt_items(hf_dir, tmp_path, monkeypatch):
    """Items in Orbax's OCDBT format (Orbax's default, that of older jax_dwdp checkpoints) restore equal to the HF
    load. The converter writes plain zarr only, so this test hands it an OCDBT checkpointer."""
    import orbax.checkpoint as ocp

    monkeypatch.setattr(orbax_store, "checkpointer",
                        lambda **_: ocp.PyTreeCheckpointer(use_compression=False, use_ocdbt=True))
    convert_hf_to_orbax(hf_dir, tmp_path / "ocdbt", dtype=jnp.float32, progress=None)
    monkeypatch.undo()
    assert list((tmp_path / "ocdbt").rglob("manifest.ocdbt"))
    ref = flat(load_hf_checkpoint(hf_dir, dtype=jnp.float32)[0])
    got = flat(load_orbax_checkpoint(tmp_path / "ocdbt", dtype=jnp.float32)[0])
    assert got.keys() == ref.keys() and all(np.array_equal(ref[p], got[p]) for p in ref)


def test_stage_restore_reads_no_other_layer(hf_dir, orbax_dir, tmp_path):
    """Delete every folder the stage [1, 3) must not read; it still restores, equal to the HF weights."""
    damaged = tmp_path / "damaged"
    shutil.copytree(orbax_dir, damaged)
    for name in ("embed", "head", "layers/000", "layers/003", "layers/004"):
        shutil.rmtree(damaged / name)
    stage, report = load_orbax_checkpoint(damaged, dtype=jnp.float32, start_layer=1, end_layer=3)
    ref, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32, start_layer=1, end_layer=3)
    fa, fb = flat(ref), flat(stage)
    assert fa.keys() == fb.keys() and all(np.array_equal(fa[p], fb[p]) for p in fa)
    with pytest.raises(CheckpointError, match="layers/003: missing"):
        load_orbax_checkpoint(damaged, dtype=jnp.float32, start_layer=2, end_layer=4)


@pytest.mark.devices(2)
def test_dwdp_rank_restores_its_expert_slice(hf_dir, orbax_dir):
    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("dwdp",))

    def placement(path, shape, dtype):
        split = path[-3:-1] == ("mlp", "experts")
        return NamedSharding(mesh, P("dwdp") if split else P())

    model, _ = load_orbax_checkpoint(orbax_dir, dtype=jnp.float32, start_layer=2, end_layer=3, placement=placement)
    ref, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32, start_layer=2, end_layer=3)
    gate_up = model.layers[0].mlp.experts.gate_up_proj[...]
    full = np.asarray(ref.layers[0].mlp.experts.gate_up_proj[...])
    half = CFG.num_experts // 2
    for shard in gate_up.addressable_shards:
        rank = devices.index(shard.device)
        assert shard.data.shape[0] == half
        np.testing.assert_array_equal(np.asarray(shard.data), full[rank * half:(rank + 1) * half])
    # Stored one expert per chunk: reading a rank's block touches only its own experts' chunks.
    import orbax.checkpoint as ocp

    meta = ocp.PyTreeCheckpointer().metadata(orbax_dir / "layers" / "002").item_metadata
    for name in ("gate_up_proj", "down_proj"):
        array = meta["mlp"]["experts"][name]
        assert array.storage.chunk_shape == (1, *array.shape[1:]), array.storage
    assert meta["mlp"]["gate"]["weight"].storage.chunk_shape[0] == CFG.num_experts  # others: default chunking


_RANK_WORKER = r"""
import hashlib, json, os, sys
rank, ranks, port, ckpt, layer = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=ranks, process_id=rank)
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax_dwdp.weights.orbax_store import load_orbax_checkpoint

mesh = Mesh(np.array(jax.devices()), ("dwdp",))  # one device per process: process r is DWDP rank r
placement = lambda path, shape, dtype: NamedSharding(mesh, P("dwdp") if path[-3:-1] == ("mlp", "experts") else P())
io = lambda: int(next(l for l in open("/proc/self/io") if l.startswith("rchar:")).split()[1])
load_orbax_checkpoint(ckpt, dtype="float32", start_layer=layer + 1, end_layer=layer + 2, placement=placement)  # warm-up
reads = []
for verify in (False, True):  # Orbax's reads alone; then with the checksums of the files it reads
    before = io()
    model, _ = load_orbax_checkpoint(ckpt, dtype="float32", start_layer=layer, end_layer=layer + 1,
                                     placement=placement, verify=verify)
    reads.append(io() - before)
experts = model.layers[0].mlp.experts
digest = {name: [(int(s.index[0].start or 0), hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest())
                 for s in getattr(experts, name)[...].addressable_shards] for name in ("gate_up_proj", "down_proj")}
print(json.dumps({"rank": rank, "rchar": reads[0], "rchar_verified": reads[1], "digest": digest}))
"""


def _rchar() -> int:
    """Bytes this process has read through read()/pread() so far, all threads (tensorstore's too), page cache
    hits included (unlike read_bytes): the bytes a restore asks the files for."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _layer_bytes(orbax_dir: Path, layer: int) -> tuple[int, int]:
    """(expert bytes, other bytes) of one layer, from a full restore."""
    model, _ = load_orbax_checkpoint(orbax_dir, dtype=jnp.float32, start_layer=layer, end_layer=layer + 1,
                                     verify=False)
    sizes = [(p[-3:-1] == ("mlp", "experts"), v.get_value().nbytes) for p, v in nnx.to_flat_state(nnx.state(model))]
    return sum(n for e, n in sizes if e), sum(n for e, n in sizes if not e)


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_restore_reads_only_own_bytes(hf_dir, orbax_dir):
    """Counts the bytes read (/proc/self/io rchar: every read syscall of the process, tensorstore's threads
    included). A pipeline stage reads its own layers' bytes and no more; each of 4 DWDP ranks (4 processes joined by
    jax.distributed, one CPU device each) reads 1/4 of a layer's expert bytes plus the replicated non-expert
    tensors, far from a full restore, and gets exactly its own experts. Checking the checksums reads the same
    files once more: a rank checks only its own experts' chunks."""
    from jax_dwdp.distributed import reserve_port

    layer, ranks = 2, 4
    expert, other = _layer_bytes(orbax_dir, layer)
    # Per Orbax item opened: its metadata files (_METADATA, manifests), about 9.4 KB measured here; per load: the
    # marker, which lists every file's checksum.
    marker = (orbax_dir / "jax_dwdp.json").stat().st_size
    slack = 16 * 1024
    assert expert * (ranks - 1) // ranks > 4 * slack + 2 * marker  # reading all experts could not hide in the slack

    # Full restore of one layer: rchar sees it all (so it is a valid counter of tensorstore's reads).
    before = _rchar()
    load_orbax_checkpoint(orbax_dir, dtype=jnp.float32, start_layer=layer, end_layer=layer + 1, verify=False)
    full = _rchar() - before
    assert expert + other <= full <= expert + other + slack + marker, (full, expert, other)
    # A stage [1, 3) reads layers 1 and 2 and nothing of the others (nor of embed/head).
    sizes = [sum(_layer_bytes(orbax_dir, i)) for i in (1, 2)]
    before = _rchar()
    load_orbax_checkpoint(orbax_dir, dtype=jnp.float32, start_layer=1, end_layer=3, verify=False)
    stage = _rchar() - before
    assert sum(sizes) <= stage <= sum(sizes) + 2 * slack + marker, (stage, sizes)  # 2 items; one more layer: +290 KB

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    results = []
    with reserve_port() as held:  # the coordinator's port, held until the launch ends
        port = held.getsockname()[1]
        procs = [subprocess.Popen([sys.executable, "-c", _RANK_WORKER, str(r), str(ranks), str(port),
                                   str(orbax_dir), str(layer)], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
                 for r in range(ranks)]
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=240)
                assert proc.returncode == 0, err[-3000:]
                results.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for proc in procs:  # a failed rank leaves the others waiting in jax.distributed
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    ref, _ = load_hf_checkpoint(hf_dir, dtype=jnp.float32, start_layer=layer, end_layer=layer + 1)
    block = CFG.num_experts // ranks
    for res in results:
        r = res["rank"]
        # Its expert slice and the replicated rest; reading all experts would add 3/4 of `expert`, far over.
        assert expert // ranks + other <= res["rchar"] <= expert // ranks + other + slack + marker, (res, expert, other)
        own = res["rchar"]
        assert own + expert // ranks + other <= res["rchar_verified"] <= 2 * own + slack, (res, expert, other)
        for name in ("gate_up_proj", "down_proj"):
            full_array = np.asarray(getattr(ref.layers[0].mlp.experts, name)[...])
            want = hashlib.sha256(full_array[r * block:(r + 1) * block].tobytes()).hexdigest()
            assert res["digest"][name] == [[r * block, want]], (r, name)


def test_existing_output_is_not_overwritten_without_flag(hf_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="already exists; pass --overwrite"):
        convert_hf_to_orbax(hf_dir, out, progress=None)
    with pytest.raises(CheckpointError, match="not a jax_dwdp checkpoint"):  # --overwrite replaces only a
        convert_hf_to_orbax(hf_dir, out, progress=None, overwrite=True)    # checkpoint or an empty folder
    assert (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    for _ in range(2):  # an empty folder, then a checkpoint
        convert_hf_to_orbax(hf_dir, out, dtype=jnp.float32, progress=None, overwrite=True)
        assert is_orbax_checkpoint(out)
    assert not list(tmp_path.glob("out.*"))  # no partial or old folders left behind


# `jax-dwdp convert` with orbax_store's hook replaced: SIGKILL right after the second layer is saved.
_KILLED_AFTER_TWO_LAYERS = r"""
import os, signal, sys
from jax_dwdp.weights import orbax_store
assert callable(orbax_store._after_layer_saved)  # the hook replaced below: a renamed hook fails here, not silently

def kill(layer_id):
    if layer_id == 1:
        os.kill(os.getpid(), signal.SIGKILL)

orbax_store._after_layer_saved = kill
from jax_dwdp.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_killed_conversion_leaves_nothing_and_rerun_succeeds(hf_dir, tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", _KILLED_AFTER_TWO_LAYERS, "convert", str(hf_dir), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr  # SIGKILL after two layers
    assert not out.exists() and list(tmp_path.glob("out.partial-*"))
    assert list(tmp_path.glob("out.partial-*/layers/001"))  # killed with two layers written, not before
    proc = subprocess.run([sys.executable, "-m", "jax_dwdp.cli", "convert", str(hf_dir), str(out), "--json"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert is_orbax_checkpoint(out) and not list(tmp_path.glob("out.partial-*"))
    summary = json.loads(proc.stdout)
    assert summary["tensors"] > 0 and summary["peak_rss_bytes"] > 0


def test_production_code_reads_no_test_switch():
    """Fault injection lives in the tests (they replace hooks such as orbax_store._after_layer_saved), not in
    environment variables that the library reads."""
    root = Path(__file__).resolve().parents[1] / "jax_dwdp"
    readers = [str(p.relative_to(root.parent)) for p in root.rglob("*.py") if "JAX_DWDP_TEST_" in p.read_text()]
    assert readers == []


def test_bad_source_leaves_nothing(hf_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) - 1000])  # truncated
    code = main(["convert", str(bad), str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "truncated" in err and "model.safetensors" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))


def test_prefill_cli_accepts_orbax_folder(orbax_dir, hf_dir, tmp_path, capsys, rng):
    tokens = rng.integers(0, CFG.vocab_size, (2, 12)).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    outs = {}
    for name, d in (("orbax", orbax_dir), ("hf", hf_dir)):
        code = main(["prefill", "--checkpoint", str(d), "--tokens", str(tmp_path / "t.npy"), "--dtype", "float32",
                     "--iters", "1", "--logits-out", str(tmp_path / f"{name}.npy"), "--json"])
        assert code == 0, capsys.readouterr().err
        outs[name] = np.load(tmp_path / f"{name}.npy")
    np.testing.assert_array_equal(outs["orbax"], outs["hf"])


def _truncate_header_offsets(directory: Path) -> None:
    """Rewrites the header so that one tensor's offsets run past the end of the file (a header that lies)."""
    f = directory / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = sorted(k for k in header if k != "__metadata__")[0]
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin + 10**9, end + 10**9]
    raw = json.dumps(header).encode()
    raw += b" " * (n - len(raw)) if len(raw) <= n else b""
    f.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + n:])


def _index_names_missing_shard(directory: Path) -> None:
    weight_map = {"lm_head.weight": "model-00002-of-00002.safetensors"}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _config_mismatch(directory: Path) -> None:
    cfg = json.loads((directory / "config.json").read_text())
    cfg["hidden_size"] = 48
    (directory / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(directory: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def _missing_tensor(directory: Path) -> None:  # layer 3: found only after layers 0-2 were written
    _edit_tensors(directory, lambda t: t.pop("model.layers.3.mlp.shared_expert.up_proj.weight"))


def _extra_tensor(directory: Path) -> None:
    rng = np.random.default_rng()
    _edit_tensors(directory, lambda t: t.update({"model.layers.2.mlp.extra.weight": rng.standard_normal((3, 64),
                                                                                                        np.float32)}))


def _wrong_shape_tensor(directory: Path) -> None:
    rng = np.random.default_rng()
    _edit_tensors(directory, lambda t: t.update({"model.layers.4.mlp.gate.weight": rng.standard_normal((9, 64),
                                                                                                       np.float32)}))


def _wrong_shape_expert_piece(directory: Path) -> None:
    rng = np.random.default_rng()
    _edit_tensors(directory, lambda t: t.update({"model.layers.1.mlp.experts.5.down_proj.weight":
                                                 rng.standard_normal((64, 31), np.float32)}))


@pytest.mark.parametrize("damage,message", [
    (_truncate_header_offsets, "model.safetensors"),
    (_index_names_missing_shard, "model-00002-of-00002.safetensors"),
    (_config_mismatch, "expected"),
    (_missing_tensor, "model.safetensors: missing tensor model.layers.3.mlp.shared_expert.up_proj.weight "
                      "(expected shape (32, 64))"),
    (_extra_tensor, "model.safetensors: unexpected tensor model.layers.2.mlp.extra.weight"),
    (_wrong_shape_tensor, "model.safetensors: tensor model.layers.4.mlp.gate.weight has shape (9, 64); "
                          "expected (8, 64)"),
    (_wrong_shape_expert_piece, "model.safetensors: tensor model.layers.1.mlp.experts.5.down_proj.weight has "
                                "shape (64, 31); expected (64, 32)"),
])
def test_bad_sources_fail_cleanly(hf_dir, tmp_path, capsys, damage, message):
    """Through `jax-dwdp convert` itself: exit 2, one line naming the file and the tensor, no traceback, and no
    OUT_DIR or partial folder left, even when the bad tensor is found after some layers were written."""
    bad = tmp_path / "bad"
    shutil.copytree(hf_dir, bad)
    damage(bad)
    code = main(["convert", str(bad), str(tmp_path / "out")])
    captured = capsys.readouterr()
    lines = [line for line in captured.err.replace("\r", "\n").splitlines() if line.strip()]
    bars = [line for line in lines if line.startswith("[") and "layers" in line]  # the progress bar's frames
    assert code == 2 and "Traceback" not in captured.err + captured.out, captured.err
    assert len(lines) == len(bars) + 1 and lines[-1].startswith("error: ") and message in lines[-1], captured.err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.partial-*"))
