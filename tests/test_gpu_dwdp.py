"""DWDP's FFI path (CUDA VMM expert store) on two or more GPUs (skipped otherwise; run with JAX_DWDP_TEST_GPU=1).

- the FFI path equals the XLA path and one GPU (fp32 <= 1e-5, bf16 <= 2e-2), with blocks that are and are not a
  multiple of the VMM granularity (padded strides vs rank blocks adjacent in the composite VA; the store copies
  each rank's block separately in both);
- poison: every prefetch destination is filled with NaN before its copy, and each copy is held back 20 ms (so a
  read of the experts that does not wait for the copy would see NaN); the output stays finite and equal;
- leak: 20 store set-up/tear-down cycles leave no CUDA object alive and return device free memory;
- an injected CUDA error surfaces as a Python exception naming the call and the code, and the store still works.
Poison, delay and injected errors come from tests/store_testing.py (the test-only handler library), not from the
production store.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_dwdp.config import ModelConfig
from jax_dwdp.model import Cache, init_model
from jax_dwdp.parallel import Pipeline
from tests.hf_reference import rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu" or jax.device_count() < 2,
                       reason="needs two CUDA GPUs (set JAX_DWDP_TEST_GPU=1)"),
]

# 6 experts over 2 ranks: 3 per rank; small experts, so blocks are not granularity-aligned (padded strides).
# moe_intermediate_size 64: the Mosaic grouped matmul (bf16) needs K % 64 == 0.
SMALL = ModelConfig.preset("tiny").replace(num_hidden_layers=4, vocab_size=300, num_experts=6, num_experts_per_tok=2,
                                           moe_intermediate_size=64)
# Experts of 2 MiB multiples (bf16: gate_up 2 x 512 x 1024 x 2 B = 2 MiB, down 1 MiB x 4 slots): rank blocks
# adjacent in the composite VA.
ALIGNED = SMALL.replace(hidden_size=1024, moe_intermediate_size=512, num_experts=8, num_experts_per_tok=2)


def _tokens(rng, cfg, batch, seq):
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, batch).astype(np.int32)
    lengths[0] = seq
    return tokens, lengths


def _compare(cfg, dtype, rng, bound, *, poison=False):
    model = init_model(cfg, dtype=dtype, seed=int(rng.integers(1 << 30)))
    tokens, lengths = _tokens(rng, cfg, 4, 96)
    one, one_caches = Pipeline.from_model(model, 1).prefill(tokens, lengths, microbatches=2, cache_len=96)
    xla, xla_caches = Pipeline.from_model(model, 1, dwdp=2).prefill(tokens, lengths, cache_len=96)
    if poison:  # a stage runner over a store of its own that poisons and delays every copy
        from jax.sharding import Mesh

        from jax_dwdp.parallel.placement import expert_blocks, place_model
        from jax_dwdp.sources import FfiStoreSource
        from jax_dwdp.runner import StageRunner
        from tests.store_testing import FaultyExpertStore

        mesh = Mesh(np.array(jax.devices()[:2]), ("dwdp",))
        placed = place_model(model, mesh)
        with FaultyExpertStore.from_sharded(expert_blocks(placed), cfg.num_experts, poison=True,
                                            delay_ms=20) as store:
            runner = StageRunner(placed, FfiStoreSource(store, mesh), mesh=mesh)
            for _ in range(2):  # the second call reuses the store, its events and the compiled programs
                ffi, ffi_cache = runner(tokens, lengths, cache_len=96)
            ffi_caches = [ffi_cache]
    else:
        with Pipeline.from_model(model, 1, dwdp=2, experts="ffi") as pipe:
            for _ in range(2):
                ffi, ffi_caches = pipe.prefill(tokens, lengths, cache_len=96)
    assert np.isfinite(np.asarray(ffi, np.float32)).all()
    merged = {name: Cache.concat_layers(c, jax.devices()[0]) for name, c in
              [("one", one_caches), ("xla", xla_caches), ("ffi", ffi_caches)]}
    for field in ("logits", "key", "value", "conv", "recurrent"):
        get = (lambda name, out: out) if field == "logits" else (lambda name, out: getattr(merged[name], field))
        f, x, o = get("ffi", ffi), get("xla", xla), get("one", one)
        e_xla, e_one = rel_err(f, x), rel_err(f, o)
        print(f"{cfg.hidden_size=} {jnp.dtype(dtype).name} poison={poison} {field}: ffi vs xla {e_xla:.1e}, "
              f"ffi vs one GPU {e_one:.1e} (bound {bound})")
        assert e_xla <= bound and e_one <= bound, field


@pytest.mark.parametrize("cfg", [SMALL, ALIGNED], ids=["padded-strides", "adjacent-blocks"])
def test_ffi_equals_xla_and_one_gpu_fp32(rng, cfg):
    _compare(cfg, jnp.float32, rng, 1e-5)


@pytest.mark.parametrize("cfg", [SMALL, ALIGNED], ids=["padded-strides", "adjacent-blocks"])
def test_ffi_equals_xla_and_one_gpu_bf16(rng, cfg):
    _compare(cfg, jnp.bfloat16, rng, 2e-2)


def test_poisoned_destinations_are_fully_overwritten(rng):
    _compare(ALIGNED, jnp.bfloat16, rng, 2e-2, poison=True)
    _compare(SMALL, jnp.float32, rng, 1e-5, poison=True)


def test_store_blocks_are_the_ranks_experts(rng):
    """The store holds each rank's own block: a prefetch returns exactly the layer's experts in order."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.store_testing import FaultyExpertStore

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("dwdp",))
    e, shapes = 5, ((6, 8), (8, 3))  # 5 experts over 2 ranks: 3 slots, the last one padding
    full = [[rng.standard_normal((e, *s)).astype(np.float32) for s in shapes] for _ in range(3)]
    padded = [[np.concatenate([w, np.zeros((1, *w.shape[1:]), w.dtype)]) for w in layer] for layer in full]
    sharded = [tuple(jax.device_put(w, NamedSharding(mesh, P("dwdp"))) for w in layer) for layer in padded]
    with FaultyExpertStore.from_sharded(sharded, e, poison=True) as store:
        for layer in range(3):
            run = jax.jit(jax.shard_map(lambda h, layer=layer: store.wait(store.prefetch(h, layer), h), mesh=mesh,
                                        in_specs=P("dwdp"), out_specs=((P("dwdp"), P("dwdp")), P("dwdp")),
                                        check_vma=False))
            (gu, dn), _ = run(jnp.ones((2, 4), jnp.float32))
            for got, want in ((gu, full[layer][0]), (dn, full[layer][1])):
                got = np.asarray(got).reshape(2, *want.shape)  # each device's full copy
                np.testing.assert_array_equal(got[0], want)
                np.testing.assert_array_equal(got[1], want)


def test_twenty_setup_teardown_cycles_release_everything(rng):
    """Each cycle: a store of 4 layers with 2 MiB-multiple blocks (>= 24 MiB of VMM memory per device), one
    prefetch + wait per layer checked against the source, close. Afterwards no CUDA object of the store is alive
    and the driver's free memory is back where it was."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dwdp.parallel.dwdp_ffi import ExpertStore, device_memory, live_objects

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("dwdp",))
    shapes = ((1024, 1024), (1024, 512))  # bf16 experts of 2 MiB and 1 MiB; 4 experts, 2 per rank
    layers = [[rng.standard_normal((4, *s)).astype(np.float32) for s in shapes] for _ in range(4)]
    spec = NamedSharding(mesh, P("dwdp"))

    def cycle():
        sharded = [tuple(jax.device_put(jnp.asarray(w, jnp.bfloat16), spec) for w in layer) for layer in layers]
        with ExpertStore.from_sharded(sharded, 4) as store:
            live = live_objects()
            assert live["stores"] == 1 and live["allocations"] == 2 * 4 * 2 and live["contexts"] == 2, live
            for i in range(len(layers)):
                run = jax.jit(jax.shard_map(lambda h, i=i: store.wait(store.prefetch(h, i), h), mesh=mesh,
                                            in_specs=P("dwdp"), out_specs=((P("dwdp"), P("dwdp")), P("dwdp")),
                                            check_vma=False))
                (gu, _), _ = run(jnp.ones((2, 8), jnp.bfloat16))
                want = np.asarray(jnp.asarray(layers[i][0], jnp.bfloat16))
                np.testing.assert_array_equal(np.asarray(gu)[4:], want)  # device 1's full copy

    cycle()  # warm-up: lets XLA's pool reach its size
    before = [device_memory(d)[0] for d in devices]
    for _ in range(20):
        cycle()
    after = [device_memory(d)[0] for d in devices]
    live = live_objects()
    print(f"free memory before {before} after {after}; live objects {live}")
    assert all(v == 0 for v in live.values()), live
    # 24 MiB of VMM memory per device per cycle (480 MiB over 20 cycles) must all come back.
    assert all(a >= b - (8 << 20) for a, b in zip(after, before)), (before, after)


def test_injected_cuda_error_raises_and_store_recovers(rng):
    from tests.store_testing import FaultyFfiBackend

    model = init_model(SMALL, dtype=jnp.float32, seed=5)
    tokens, lengths = _tokens(rng, SMALL, 2, 32)
    with Pipeline.from_model(model, 1, dwdp=2, experts=FaultyFfiBackend()) as pipe:
        good, _ = pipe.prefill(tokens, lengths)
        good = np.asarray(good)
        pipe.stores[0].inject_error(2)  # CUDA_ERROR_OUT_OF_MEMORY
        with pytest.raises(Exception, match=r"dwdp_prefetch.*CUDA_ERROR_OUT_OF_MEMORY \(2\)"):
            out, _ = pipe.prefill(tokens, lengths)
            jax.block_until_ready(out)
        again, _ = pipe.prefill(tokens, lengths)
        np.testing.assert_array_equal(np.asarray(again), good)
    # Closed with the pipeline: nothing of the store is left, and the pipeline says so instead of running.
    from jax_dwdp.parallel.dwdp_ffi import StoreError, live_objects

    assert all(v == 0 for v in live_objects().values()), live_objects()
    with pytest.raises(StoreError, match="is closed"):
        pipe.prefill(tokens, lengths)


def test_wait_on_a_buffer_no_prefetch_wrote_is_an_error():
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_dwdp.parallel.dwdp_ffi import ExpertStore

    devices = jax.devices()[:2]
    mesh = Mesh(np.array(devices), ("dwdp",))
    w = [tuple(jax.device_put(jnp.ones((4, *s)), NamedSharding(mesh, P("dwdp"))) for s in ((2, 2), (2, 1)))]
    with ExpertStore.from_sharded(w, 4) as store:
        run = jax.jit(jax.shard_map(lambda a, b, h: store.wait((a, b), h), mesh=mesh, in_specs=P("dwdp"),
                                    out_specs=P("dwdp"), check_vma=False))
        with pytest.raises(Exception, match="not written by dwdp_prefetch"):
            jax.block_until_ready(run(jnp.ones((8, 2, 2)), jnp.ones((8, 2, 1)), jnp.ones((2, 4))))


@pytest.mark.skipif(jax.device_count() < 4, reason="needs four GPUs")
def test_ffi_on_four_ranks_and_pipeline_2_x_dwdp_2(rng):
    """DWDP 4 (6 experts: 4 ranks do not divide them) and pipeline 2 x DWDP 2 through the FFI path, against the
    XLA path and one GPU on the same per-rank batches (fp32 <= 1e-5)."""
    model = init_model(SMALL, dtype=jnp.float32, seed=int(rng.integers(1 << 30)))
    tokens, lengths = _tokens(rng, SMALL, 8, 64)
    for pipeline, dwdp in ((1, 4), (2, 2)):
        one, _ = Pipeline.from_model(model, 1).prefill(tokens, lengths, microbatches=dwdp)
        xla, _ = Pipeline.from_model(model, pipeline, dwdp=dwdp).prefill(tokens, lengths)
        with Pipeline.from_model(model, pipeline, dwdp=dwdp, experts="ffi") as pipe:
            ffi, _ = pipe.prefill(tokens, lengths)
            e_xla, e_one = rel_err(ffi, xla), rel_err(ffi, one)
        print(f"pipeline {pipeline} x dwdp {dwdp}: ffi vs xla {e_xla:.1e}, vs one GPU {e_one:.1e} (bound 1e-5)")
        assert e_xla <= 1e-5 and e_one <= 1e-5


def test_independent_ffi_ranks_run_their_own_batches_and_lengths(rng):
    """IndependentRanks(experts="ffi"): rank 0 prefills 3 sequences of 80 tokens while rank 1 prefills one of 41,
    peer experts read through the store; each equals one GPU (fp32 <= 1e-5), and the XLA-copy ranks agree."""
    from jax_dwdp.parallel.dwdp import IndependentRanks
    from jax_dwdp.parallel.dwdp_ffi import live_objects
    from jax_dwdp.prefill import jit_prefill

    model = init_model(SMALL, dtype=jnp.float32, seed=int(rng.integers(1 << 30)))
    tokens, lengths = _tokens(rng, SMALL, 3, 80)
    work = {0: (tokens, lengths), 1: (tokens[:1, :41], None)}
    with IndependentRanks(model, jax.devices()[:2], experts="ffi") as ranks:
        outs = {r: ranks.prefill(r, t, n, cache_len=82) for r, (t, n) in work.items()}  # both enqueued first
        for r, (t, n) in work.items():
            logits, cache = outs[r]
            want, want_cache = jit_prefill(model, cache_len=82)(t, n)
            errs = {"logits": rel_err(logits, want), "recurrent": rel_err(cache.recurrent, want_cache.recurrent),
                    "key": rel_err(cache.key, want_cache.key)}
            print(f"independent FFI rank {r}: " + " ".join(f"{k}={v:.1e}" for k, v in errs.items()))
            assert all(v <= 1e-5 for v in errs.values()), errs
        both = ranks.prefill_all(work, cache_len=82)  # one host thread per rank, same numbers
        for r in work:
            np.testing.assert_array_equal(np.asarray(both[r][0]), np.asarray(outs[r][0]))
    assert live_objects()["stores"] == 0
