"""The DWDP expert store with one process per rank (`ProcessExpertStore`): each process allocates only its own
rank's blocks, exports them as POSIX file descriptors, trades them over UNIX sockets (`FdExchange`) and maps the
peers' blocks. Runs on ONE GPU (two processes on the same device: the descriptor path is the same as across
NVLinked GPUs) and skips without a GPU (JAX_DWDP_TEST_GPU=1 on a GPU machine).

- every layer's prefetch returns every rank's experts exactly, into NaN-poisoned destinations;
- rank 1 closes its store and its process has exited before rank 0 reads: the imported blocks keep the memory alive;
- each process ends with no live CUDA object of the store (allocations, mappings, ranges, streams, events, stores);
- importing the same peer twice is a clear error; ranks of different configurations fail on both sides, naming
  the difference.
The NaN-poisoned destinations come from tests/store_testing.py (the test-only handler library).
"""

from __future__ import annotations

import multiprocessing
import os
import secrets

import jax
import numpy as np
import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU (set JAX_DWDP_TEST_GPU=1)"),
]

LAYERS, EXPERTS, SHAPES = 3, 7, ((24, 40), (40, 12))  # 4 slots per rank: rank 1 holds 3 experts and a padding slot


def _block(rank: int, layer: int, weight: int, slots: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * rank + 10 * layer + weight)
    return rng.standard_normal((slots, *SHAPES[weight])).astype(np.float32)


def _worker(job: str, rank: int, world: int, layers: int, queue, gone=None, shapes=SHAPES) -> None:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        import jax.numpy as jnp

        from jax_dwdp.parallel.dwdp_ffi import StoreError, live_objects
        from jax_dwdp.parallel.fd_exchange import FdExchange
        from tests.store_testing import FaultyProcessExpertStore

        dev = jax.devices()[0]
        report = {}
        with FdExchange(job, rank, world, timeout_s=120) as fx:
            store = FaultyProcessExpertStore(dev, rank, world, layers, EXPERTS, shapes, jnp.float32, poison=True)
            slots = store.layout.slots_per_rank
            for layer in range(layers):
                for w in range(2):
                    store.fill(layer, w, rank, jax.device_put(_block(rank, layer, w, slots) if shapes == SHAPES else
                                                        np.ones((slots, *shapes[w]), np.float32), dev))
            try:
                store.connect(fx)
            except StoreError as e:
                store.close()
                queue.put((rank, "connect failed", {"error": str(e), "live": live_objects()}))
                return
            try:
                store.import_peer(1 - rank, [0] * (layers * 2))
            except StoreError as e:
                report["twice"] = str(e)
            if rank == 1:  # closes and leaves first; rank 0 reads rank 1's blocks afterwards
                store.close()
                report["live"] = live_objects()
                queue.put((rank, "ok", report))
                return
            if not gone.wait(120):  # the parent saw rank 1's process exit
                raise RuntimeError("rank 1's process did not exit")
            errs = []
            for layer in range(layers):
                def run(dep, layer=layer):  # (experts, after): the `after` output keeps the wait in the program
                    return store.wait(store.prefetch(dep, layer), dep)

                got, _ = jax.jit(run)(jnp.ones((4,), jnp.float32))
                for w in range(2):
                    want = np.concatenate([_block(r, layer, w, slots) for r in range(world)])[:EXPERTS]
                    errs.append(float(np.max(np.abs(np.asarray(got[w]) - want))))
            report["max_err"] = max(errs)
            report["finite"] = all(np.isfinite(e) for e in errs)
            store.close()
            report["live"] = live_objects()
        queue.put((rank, "ok", report))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


def test_two_processes_share_their_blocks_on_one_gpu():
    ctx = multiprocessing.get_context("spawn")
    job, queue = secrets.token_hex(6), ctx.Queue()
    gone = ctx.Event()
    procs = [ctx.Process(target=_worker, args=(job, r, 2, LAYERS, queue, gone)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, report = queue.get(timeout=240)
        results[rank] = (status, report)
        if rank == 1:
            procs[1].join(timeout=60)
            assert procs[1].exitcode == 0, f"rank 1 exited with {procs[1].exitcode}"
            gone.set()
    for p in procs:
        p.join(timeout=60)
    for rank, (status, report) in sorted(results.items()):
        assert status == "ok", f"rank {rank}: {report}"
        print(f"rank {rank}: {report}")
        assert "already imported" in report["twice"]
        assert all(v == 0 for v in report["live"].values()), report["live"]
    assert results[0][1]["finite"] and results[0][1]["max_err"] == 0.0, results[0][1]
    assert all(p.exitcode == 0 for p in procs)


def test_ranks_of_different_configurations_fail_on_both_sides():
    ctx = multiprocessing.get_context("spawn")
    job, queue = secrets.token_hex(6), ctx.Queue()
    other = (SHAPES[0], (40, 16))  # rank 1's down projection is wider
    procs = [ctx.Process(target=_worker, args=(job, r, 2, 1, queue, None, SHAPES if r == 0 else other))
             for r in range(2)]
    for p in procs:
        p.start()
    results = dict((rank, (status, report)) for rank, status, report in (queue.get(timeout=240) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    for rank, (status, report) in sorted(results.items()):
        assert status == "connect failed", (rank, status, report)
        assert "differs" in report["error"] and "'shapes'" in report["error"], report["error"]
        assert all(v == 0 for v in report["live"].values()), report["live"]


def test_process_store_bad_arguments():
    import jax.numpy as jnp

    from jax_dwdp.parallel.dwdp_ffi import ProcessExpertStore, StoreError
    from jax_dwdp.parallel.fd_exchange import FdExchange

    dev = jax.devices()[0]
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, 2\)"):
        ProcessExpertStore(dev, 2, 2, 1, 4, SHAPES, jnp.float32)
    store = ProcessExpertStore(dev, 0, 2, 1, 4, SHAPES, jnp.float32)
    try:
        with pytest.raises(StoreError, match="not a peer rank"):
            store.import_peer(0, [0, 0])
        with pytest.raises(StoreError, match="1 descriptors, the store has 2 blocks"):
            store.import_peer(1, [0])
        with FdExchange(secrets.token_hex(6), 1, 3) as fx, pytest.raises(ValueError, match="exchange of rank 1 / 3"):
            store.connect(fx)
        with pytest.raises(StoreError, match="connect.exchange. first"):
            store.prefetch(jnp.ones(2), 0)
        with pytest.raises(ValueError, match=r"rank 1: this store fills the blocks of rank\(s\) \[0\] only"):
            store.fill(0, 0, 1, jax.device_put(_block(1, 0, 0, store.layout.slots_per_rank), dev))
        with pytest.raises(TypeError, match="holds one rank's blocks"):
            ProcessExpertStore.from_sharded([], 4)
        from jax_dwdp.parallel.dwdp_ffi import ExpertStore

        with pytest.raises(Exception, match="rank 1's blocks are not mapped here yet"):  # the base class's own check
            jax.block_until_ready(jax.jit(lambda d: ExpertStore.prefetch(store, d, 0))(jnp.ones(2)))
    finally:
        store.close()


def test_single_process_store_on_one_gpu():
    """The one-process store (VmmStore.build, the handlers) on one device: a rank's blocks come back exactly, poisoned
    destinations and all; nothing is left alive after close."""
    import jax.numpy as jnp

    from jax_dwdp.parallel.dwdp_ffi import live_objects
    from tests.store_testing import FaultyExpertStore

    dev = jax.devices()[0]
    blocks = [[[jax.device_put(_block(0, layer, w, EXPERTS), dev)] for w in range(2)] for layer in range(2)]
    want = [[np.asarray(blocks[layer][w][0]) for w in range(2)] for layer in range(2)]
    with FaultyExpertStore.from_blocks([dev], blocks, EXPERTS, poison=True) as store:
        for layer in range(2):
            got, _ = jax.jit(lambda d, layer=layer: store.wait(store.prefetch(d, layer), d))(jnp.ones(3))
            for w in range(2):
                np.testing.assert_array_equal(np.asarray(got[w]), want[layer][w])
    assert all(v == 0 for v in live_objects().values()), live_objects()


CYCLE_SHAPES = ((1024, 1024), (1024, 512))  # bf16 experts of 2 MiB and 1 MiB; 4 experts, 2 per rank


def _cycles_worker(job: str, rank: int, world: int, cycles: int, queue) -> None:
    """`cycles` + 1 store lifetimes (create, fill, connect, prefetch + wait every layer into poisoned buffers,
    check, close), the driver's free memory read after the first (XLA's pool warmed up) and after the last, both
    ranks between barriers so that neither holds a store while the other reads."""
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    try:
        import jax.numpy as jnp

        from jax_dwdp.parallel.dwdp_ffi import device_memory, live_objects
        from jax_dwdp.parallel.fd_exchange import FdExchange
        from tests.store_testing import FaultyProcessExpertStore

        dev = jax.devices()[0]
        layers = 3

        def block(r, layer, w):
            rng = np.random.default_rng(100 * r + 10 * layer + w)
            return np.asarray(jnp.asarray(rng.standard_normal((2, *CYCLE_SHAPES[w])), jnp.bfloat16))

        want = [[np.concatenate([block(r, layer, w) for r in range(world)]) for w in range(2)]
                for layer in range(layers)]

        def cycle(n: int) -> None:
            in_place = n % 2 == 1  # the blocks are 2 MiB multiples: odd cycles read in place, even ones copy out
            with FdExchange(f"{job}-{n}", rank, world, timeout_s=120) as fx:
                store = FaultyProcessExpertStore(dev, rank, world, layers, 2 * world, CYCLE_SHAPES, jnp.bfloat16,
                                                 poison=True, in_place=in_place)
                try:
                    assert store.in_place == in_place, store.info()
                    for layer in range(layers):
                        for w in range(2):
                            store.fill(layer, w, rank, jax.device_put(block(rank, layer, w), dev))
                    store.connect(fx)
                    dep = jnp.ones((4,), jnp.float32)
                    for layer in range(layers):
                        if in_place:
                            jax.jit(store.prefetch_in_place)(dep, store.layer_experts(layer))
                            got, _ = jax.jit(lambda g, w, d: store.wait((g, w), d))(*store.layer_experts(layer), dep)
                        else:
                            got, _ = jax.jit(lambda d, layer=layer: store.wait(store.prefetch(d, layer), d))(dep)
                        for w in range(2):
                            np.testing.assert_array_equal(np.asarray(got[w]), want[layer][w])
                finally:
                    store.close()

        with FdExchange(job, rank, world, timeout_s=120) as control:
            cycle(0)
            control.barrier()
            before = device_memory(dev)[0]
            control.barrier()
            for n in range(1, cycles + 1):
                cycle(n)
            control.barrier()
            after = device_memory(dev)[0]
            control.barrier()
        queue.put((rank, "ok", {"before": before, "after": after, "live": live_objects()}))
    except Exception as e:  # noqa: BLE001 (reported to the test)
        import traceback

        queue.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))


def test_twenty_cycles_across_processes_release_everything():
    """Two processes, 20 store lifetimes each after a warm-up (each: 3 layers, a rank's blocks of 4 and 2 MiB, the
    peer's imported; every other one read in place, with its slots and views): every prefetch into NaN-poisoned
    buffers or slots returns both ranks' experts exactly, no CUDA object of a store is left alive, and the driver's
    free memory (both processes' together, on the shared GPU) comes back."""
    ctx = multiprocessing.get_context("spawn")
    job, queue = secrets.token_hex(6), ctx.Queue()
    procs = [ctx.Process(target=_cycles_worker, args=(job, r, 2, 20, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((rank, (status, report)) for rank, status, report in (queue.get(timeout=400) for _ in procs))
        for p in procs:
            p.join(timeout=60)
    finally:  # a worker that died or hangs does not outlive the test
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    for rank, (status, report) in sorted(results.items()):
        assert status == "ok", f"rank {rank}: {report}"
        print(f"rank {rank}: free memory before {report['before'] >> 20} MiB, after {report['after'] >> 20} MiB; "
              f"live objects {report['live']}")
        assert all(v == 0 for v in report["live"].values()), report["live"]
        assert report["after"] >= report["before"] - (8 << 20), report
    assert all(p.exitcode == 0 for p in procs)
