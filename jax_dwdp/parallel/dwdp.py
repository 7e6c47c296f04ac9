"""DWDP (distributed weight data parallelism) over XLA: the reference path, on every platform.

N ranks (the 'dwdp' axis of a stage's mesh row) each run their own sequences against all experts. Each rank
stores one block of every MoE layer's experts (`ExpertLayout`); non-expert weights are replicated. No token
leaves its rank: the expert weights come to the tokens.

Two ways to run it:
- `DwdpProgram` (SPMD, equal shapes): one jitted `shard_map` over the ranks. Before layer l's MoE, layer l's
  experts are all-gathered over 'dwdp'; the gather for layer l+1 is issued when layer l starts, tied to layer l's
  input by an optimization barrier so that XLA can overlap it with layer l but cannot hoist every layer's gather
  to the start (which would hold all layers' experts at once).
- `IndependentRanks`: each rank runs its own batch, of its own length, as its own programs (one per layer type),
  and pulls the peers' expert blocks for layer l+1 with device-to-device copies issued before layer l runs. Ranks
  share no collective, so a rank with a short sequence never waits for one with a long sequence.

The CUDA VMM custom call (issue 5's FFI path) replaces the gather with peer reads through a composite virtual
address; this module is the reference it must match.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.model import Cache, Qwen35MoeForCausalLM
from jax_dwdp.model.qwen35_moe import LogitsMode
from jax_dwdp.parallel.expert_layout import ExpertLayout
from jax_dwdp.parallel.mesh import cpu_barrier
from jax_dwdp.prefill import StaticGraph, _precision, canonical_graphs

AXIS = "dwdp"
_EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def is_expert_weight(path: tuple) -> bool:
    return len(path) == 5 and path[0] == "layers" and path[2:4] == ("mlp", "experts") and path[4] in _EXPERT_WEIGHTS


def pad_experts(array, layout: ExpertLayout):
    """[E, ...] -> [N * ceil(E/N), ...] with zero padding slots at the end."""
    pad = layout.padded_experts - array.shape[0]
    if pad == 0:
        return array
    return jnp.concatenate([array, jnp.zeros((pad, *array.shape[1:]), array.dtype)], axis=0)


def shard_model(model: Qwen35MoeForCausalLM, mesh: Mesh) -> tuple[nnx.GraphDef, nnx.State, ExpertLayout]:
    """Places a model (or stage) on a 1-D 'dwdp' mesh: expert weights split by rank, the rest replicated."""
    layout = ExpertLayout(model.cfg.num_experts, mesh.shape[AXIS])
    graphdef, state = nnx.split(model)
    split, replicated = NamedSharding(mesh, P(AXIS)), NamedSharding(mesh, P())
    leaves = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if is_expert_weight(path):
            placed = jax.device_put(pad_experts(value, layout), split)
        else:
            placed = jax.device_put(value, replicated)
        leaves.append((path, type(var)(placed)))
    return graphdef, nnx.from_flat_state(leaves), layout


def _specs(state: nnx.State):
    """The shard_map in_specs of a sharded state: P('dwdp') for expert weights, P() otherwise."""
    flat = [(path, type(var)(P(AXIS) if is_expert_weight(path) else P())) for path, var in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def _cache_spec(model: Qwen35MoeForCausalLM) -> Cache:
    batch = P(None, AXIS)
    return Cache(key=batch, value=batch, conv=batch, recurrent=batch, lengths=P(AXIS),
                 full_layer_ids=model.full_layer_ids, linear_layer_ids=model.linear_layer_ids)


def expert_blocks(state: nnx.State) -> list[tuple[jax.Array, jax.Array]]:
    """Each layer's (gate_up_proj, down_proj) of a (DWDP-sharded) stage state, in the stage's layer order."""
    layers: dict = {}
    for path, var in nnx.to_flat_state(state):
        if is_expert_weight(path):
            layers.setdefault(path[1], {})[path[4]] = var.get_value()
    return [(layers[i]["gate_up_proj"], layers[i]["down_proj"]) for i in sorted(layers)]


def gather_experts(local: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map: every rank's block of one layer -> the layer's full (padded) expert set."""
    return tuple(jax.lax.all_gather(w, AXIS, tiled=True) for w in local)


class DwdpProgram:
    """A model or pipeline stage run as DWDP over a 1-D 'dwdp' mesh, one SPMD program with all-gathered experts.

    Called like StageProgram: (x, lengths) with the batch split evenly over the ranks (rank r gets rows
    [r B/N, (r+1) B/N)). Returns (logits or hidden states, Cache), both sharded by batch over the ranks.
    """

    def __init__(self, model: Qwen35MoeForCausalLM, mesh: Mesh, *, logits: LogitsMode = "all",
                 cache_len: int | None = None, sharded=None):
        """`sharded`: the result of shard_model(model, mesh), to share one placement among several programs."""
        self.model, self.mesh = model, mesh
        self.graphdef, self.state, self.layout = sharded or shard_model(model, mesh)
        self.ranks = mesh.shape[AXIS]
        self.batch_sharding = NamedSharding(mesh, P(AXIS))
        out_spec = None if (model.is_last and logits == "none") else P(AXIS)
        body = functools.partial(self._body, logits=logits, cache_len=cache_len)
        self._run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(_specs(self.state), P(AXIS), P(AXIS)),
                                          out_specs=(out_spec, _cache_spec(model)), check_vma=False))

    def _body(self, state, x, lengths, *, logits, cache_len):
        model = nnx.merge(self.graphdef, state)
        ids = [layer.layer_id for layer in model.layers]
        local = {layer.layer_id: (layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...])
                 for layer in model.layers}
        ready = {ids[0]: gather_experts(local[ids[0]])}

        def run_layer(layer, h, positions, lengths, _):
            i = ids.index(layer.layer_id)
            experts = ready.pop(layer.layer_id)
            if i + 1 < len(ids):
                # Prefetch layer l+1 while layer l computes: the barrier makes its gather wait for layer l's input.
                h, next_local = jax.lax.optimization_barrier((h, local[ids[i + 1]]))
                ready[ids[i + 1]] = gather_experts(next_local)
            return layer(h, positions, lengths, experts)

        with _precision(self.model.dtype):
            return model.forward(x, lengths, logits=logits, cache_len=cache_len, run_layer=run_layer)

    def place(self, x):
        return jax.device_put(x, self.batch_sharding)

    def __call__(self, x, lengths):
        if x.shape[0] % self.ranks:
            raise ValueError(f"batch {x.shape[0]} cannot be split evenly over {self.ranks} DWDP ranks")
        return self._run(self.state, self.place(x), self.place(lengths))

    def compile(self, x, lengths) -> None:
        self._run.lower(self.state, self.place(x), self.place(lengths)).compile()


@functools.partial(jax.jit, static_argnums=(0,))
def _layer_with_experts(graph: StaticGraph, state, h, positions, lengths, gate_up_blocks, down_blocks):
    with _precision(h.dtype):
        experts = (jnp.concatenate(gate_up_blocks, axis=0), jnp.concatenate(down_blocks, axis=0))
        return nnx.merge(graph.value, state)(h, positions, lengths, experts)


class IndependentRanks:
    """DWDP ranks that run independently: each its own batch and length, no collective between them.

    Rank r holds the non-expert weights and its own expert blocks on device r. To run layer l it needs every
    peer's block of layer l: those are copied device-to-device (jax.device_put), the copies for layer l+1 issued
    before layer l is enqueued, so they overlap layer l's compute; at most two layers of remote experts are
    resident per rank. Layers run as one compiled program per layer type (see StageProgram's layer-wise mode).

    backend="ffi" (GPUs): the blocks move into a CUDA VMM ExpertStore instead (jax_dwdp.parallel.dwdp_ffi); rank r's
    copy of layer l+1's experts runs on its device's copy stream, enqueued just before layer l, and its MoE waits
    for it. `close()` releases the store.
    """

    def __init__(self, model: Qwen35MoeForCausalLM, devices: list[jax.Device], *, backend: str = "xla"):
        if not (model.is_first and model.is_last):
            raise ValueError("independent DWDP ranks run whole models (use a Pipeline for stages)")
        if backend not in ("xla", "ffi"):
            raise ValueError(f"DWDP backend {backend!r}: choose 'xla' or 'ffi'")
        self.backend, self.store = backend, None
        if backend == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import require_gpus

            require_gpus(devices)  # before any weights are placed
        self.model, self.devices = model, list(devices)
        self._wait = cpu_barrier(self.devices[0].platform)
        self.layout = ExpertLayout(model.cfg.num_experts, len(devices))
        slots = self.layout.slots_per_rank
        self.graphdef = nnx.graphdef(model)
        self.canonical = canonical_graphs(model)
        self.ranks = []
        for r, device in enumerate(self.devices):
            dense, blocks = {}, {}
            for layer in model.layers:
                state = nnx.state(layer)
                flat = []
                for path, var in nnx.to_flat_state(state):
                    if path[:2] == ("mlp", "experts"):
                        # Dense placeholder of the right dtype: the layer program receives experts as arguments.
                        flat.append((path, type(var)(jnp.zeros((), var.get_value().dtype))))
                    else:
                        flat.append((path, type(var)(jax.device_put(var.get_value(), device))))
                dense[layer.layer_id] = nnx.from_flat_state(flat)
                blocks[layer.layer_id] = tuple(
                    jax.device_put(pad_experts(w, self.layout)[r * slots:(r + 1) * slots], device)
                    for w in (layer.mlp.experts.gate_up_proj[...], layer.mlp.experts.down_proj[...]))
            top = jax.device_put(nnx.state(model, nnx.Not(nnx.PathContains("layers"))), device)
            self.ranks.append({"device": device, "dense": dense, "blocks": blocks,
                               "top": _TopState(self.graphdef, top, dense)})
        self.layer_ids = [layer.layer_id for layer in model.layers]
        self._programs: dict = {}
        self._programs_lock = threading.Lock()
        if backend == "ffi":
            self._make_store()

    def _make_store(self) -> None:
        from jax_dwdp.parallel.dwdp_ffi import ExpertStore

        blocks = [[[rank["blocks"][layer_id][w] for rank in self.ranks] for w in range(2)]
                  for layer_id in self.layer_ids]
        self.store = ExpertStore.from_blocks(self.devices, blocks, self.model.cfg.num_experts)
        for rank in self.ranks:  # the store holds the only copy of each rank's experts
            rank["blocks"] = None

    def _ffi_program(self, kind, key):
        """(FFI backend) the one-call prefetch program of layer index `key`, or the layer program of type `key`."""
        with self._programs_lock:  # prefill_all's threads may ask for the same program at once
            return self._ffi_program_locked(kind, key)

    def _ffi_program_locked(self, kind, key):
        if (kind, key) not in self._programs:
            store = self.store
            if kind == "prefetch":
                self._programs[(kind, key)] = jax.jit(lambda h: store.prefetch(h, key))
            else:
                graphdef = self.canonical[key].value

                def run(state, h, positions, lengths, gate_up, down):
                    with _precision(h.dtype):
                        return nnx.merge(graphdef, state)(h, positions, lengths,
                                                          lambda x: store.wait((gate_up, down), x))
                self._programs[(kind, key)] = jax.jit(run)
        return self._programs[(kind, key)]

    def close(self, exc: BaseException | None = None) -> None:
        """Releases the FFI store, if any; while `exc` propagates, a failure to close only warns (close_store)."""
        if self.store is not None:
            from jax_dwdp.parallel.dwdp_ffi import close_store

            close_store(self.store, exc)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc)

    def _fetch(self, rank: int, layer_id: int):
        """Every rank's block of one layer, on `rank`'s device (peer blocks copied, own block as is)."""
        device = self.ranks[rank]["device"]
        blocks = [peer["blocks"][layer_id] if p == rank else jax.device_put(peer["blocks"][layer_id], device)
                  for p, peer in enumerate(self.ranks)]
        return self._wait((tuple(b[0] for b in blocks), tuple(b[1] for b in blocks)))

    def prefill(self, rank: int, tokens, lengths=None, *, logits: LogitsMode = "all", cache_len: int | None = None):
        """Rank `rank` prefills its own batch; returns (logits, cache) on its device.

        The call returns once the rank's layers are enqueued, but that takes host time (tens of ms for a deep model
        on GPUs), so calling it for each rank in turn starts each rank only after the previous one is enqueued: use
        `prefill_all` to run the ranks at the same time."""
        tokens, lengths = self._check(rank, tokens, lengths, cache_len)
        return self._prefill(rank, tokens, lengths, logits, cache_len, sync_on_error=True)

    def _check(self, rank: int, tokens, lengths, cache_len):
        from jax_dwdp.prefill import check_tokens

        if not 0 <= rank < len(self.ranks):
            raise ValueError(f"rank {rank} is not one of this driver's {len(self.ranks)} ranks")
        tokens, lengths = check_tokens(tokens, self.model.cfg.vocab_size, lengths)
        if cache_len is not None and cache_len < tokens.shape[1]:
            raise ValueError(f"cache_len {cache_len} is shorter than rank {rank}'s prompt ({tokens.shape[1]} tokens)")
        return tokens, lengths

    def _prefill(self, rank, tokens, lengths, logits, cache_len, *, sync_on_error):
        """prefill on inputs `_check` has already validated."""
        from jax_dwdp.prefill import _embed, _head

        model, r = self.model, self.ranks[rank]
        tokens, lengths = jax.device_put(tokens, r["device"]), jax.device_put(lengths, r["device"])
        ids = self.layer_ids
        top = r["top"]
        h = _embed(top.graphdef, top.state, tokens)
        if self.backend == "ffi":
            return self._prefill_ffi(r, h, lengths, logits, cache_len, sync_on_error)
        pending = {ids[0]: self._fetch(rank, ids[0])}

        def run_layer(layer, h, positions, lens, _):
            i = ids.index(layer.layer_id)
            experts = pending.pop(layer.layer_id)
            if i + 1 < len(ids):
                pending[ids[i + 1]] = self._fetch(rank, ids[i + 1])  # copies overlap this layer's compute
            return self._wait(_layer_with_experts(self.canonical[layer.layer_type], r["dense"][layer.layer_id], h,
                                                  positions, lens, *experts))

        h, cache = model.forward_layers(h, lengths, cache_len=cache_len, run_layer=run_layer)
        return _head(top.graphdef, top.state, h, lengths, logits), cache

    def prefill_all(self, work, *, logits: LogitsMode = "all", cache_len: int | None = None,
                    threads: bool | None = None) -> dict:
        """Every rank's own batch at once: work = {rank: (tokens, lengths or None)} -> {rank: (logits, cache)}.

        Each rank's layers are enqueued from its own host thread (threads=None: on GPUs, not on the CPU), so the
        host time one rank spends dispatching its layer programs does not hold back the next rank's first layer.
        Every rank's input is checked before any rank starts. If a rank fails, the others are waited for, the
        FFI store's pending copies are drained once, and the first error is raised.
        """
        from concurrent.futures import ThreadPoolExecutor, wait

        work = {r: self._check(r, t, n, cache_len) for r, (t, n) in dict(work).items()}
        if threads is None:
            # XLA's CPU client runs every host "device" on one small thread pool; two dispatching threads can
            # deadlock it (seen with jax 0.10.2, see cpu_barrier), so the CPU runs the ranks in turn.
            threads = len(work) > 1 and self.devices[0].platform != "cpu"
        if not threads:
            return {r: self._prefill(r, t, n, logits, cache_len, sync_on_error=True) for r, (t, n) in work.items()}
        with ThreadPoolExecutor(max_workers=len(work), thread_name_prefix="dwdp-rank") as pool:
            # No rank drains the store on its own error: that would drop the other ranks' pending copies.
            futures = {r: pool.submit(self._prefill, r, t, n, logits, cache_len, sync_on_error=False)
                       for r, (t, n) in work.items()}
            wait(futures.values())
        errors = [f.exception() for f in futures.values() if f.exception() is not None]
        if errors:
            if self.store is not None:
                self.store.sync()  # copies may still be running into prefetch outputs the failed ranks dropped
            raise errors[0]
        return {r: f.result() for r, f in futures.items()}

    def _prefill_ffi(self, r, h, lengths, logits, cache_len, sync_on_error=True):
        from jax_dwdp.prefill import _head

        ids, top = self.layer_ids, r["top"]
        pending = [self._ffi_program("prefetch", 0)(h)]

        def run_layer(layer, h, positions, lens, _):  # positions come placed on h's device (forward_layers)
            i = ids.index(layer.layer_id)
            # Layer i+1's copy is enqueued before layer i: it starts when layer i-1 is done and runs under layer i.
            nxt = self._ffi_program("prefetch", i + 1)(h) if i + 1 < len(ids) else None
            out = self._ffi_program("layer", layer.layer_type)(r["dense"][layer.layer_id], h, positions, lens,
                                                               *pending[0])
            pending[0] = nxt
            return out

        try:
            h, cache = self.model.forward_layers(h, lengths, cache_len=cache_len, run_layer=run_layer)
        except BaseException:
            if sync_on_error:  # (prefill_all drains once, after every rank has stopped)
                self.store.sync()  # a copy may still be running into a prefetch output this error dropped
            raise
        return _head(top.graphdef, top.state, h, lengths, logits), cache


class _TopState:
    """The whole model's graphdef with a state holding the rank's embedding, final norm and lm_head (the layers'
    entries are the dense placeholders, never touched by embed/head)."""

    def __init__(self, graphdef, top_state, dense_layers):
        self.graphdef = StaticGraph.of(graphdef)
        flat = list(nnx.to_flat_state(top_state))
        for i, layer_id in enumerate(sorted(dense_layers)):
            flat += [(("layers", i, *path), var) for path, var in nnx.to_flat_state(dense_layers[layer_id])]
        self.state = nnx.from_flat_state(flat)


class LayerwiseDwdp:
    """DWDP over a 1-D 'dwdp' mesh with one compiled program per layer type, the layers driven from Python.

    Same numbers and call as DwdpProgram ((x, lengths), batch split evenly over the ranks), but the compile time
    does not grow with depth, and the expert fetch has two backends:

    - "xla": layer l's program also all-gathers layer l+1's experts, issued after an optimization barrier on
      layer l's input so that XLA overlaps the gather with layer l's compute.
    - "replicated" (benchmarks): every rank holds all experts, nothing moves; the bound the others approach.
    - "ffi": the CUDA VMM expert store (jax_dwdp.parallel.dwdp_ffi). A one-call program per layer starts the copy
      of layer l+1's experts on the store's copy stream just before layer l is enqueued; layer l+1's MoE waits for
      it. The ranks' expert blocks move into the store (the XLA copies are deleted), so they are stored once.
      `timing=True` records each layer's copy time (`self.store.copy_ms()`); `poison=True` (tests) fills each
      copy's destination with NaN first, so a byte the copy misses shows up; `delay_copies=True` (tests) holds each
      copy 20 ms, so a read that does not wait for it sees the NaN.
    """

    def __init__(self, model: Qwen35MoeForCausalLM, mesh: Mesh, *, backend: str = "xla", logits: LogitsMode = "all",
                 cache_len: int | None = None, sharded=None, store=None, timing: bool = False,
                 poison: bool = False, delay_copies: bool = False):
        if backend not in ("xla", "ffi", "replicated"):
            raise ValueError(f"DWDP backend {backend!r}: choose 'xla' or 'ffi'")
        self.model, self.mesh, self.backend = model, mesh, backend
        self.logits, self.cache_len = logits, cache_len
        graphdef, state, self.layout = sharded or shard_model(model, mesh)
        self.ranks = mesh.shape[AXIS]
        self.batch_sharding = NamedSharding(mesh, P(AXIS))
        replicated = NamedSharding(mesh, P())
        # The model's state with every expert weight replaced by a replicated scalar placeholder: what the embed,
        # head and layer programs take (the experts reach the layers as separate arguments).
        flat = []
        for path, var in nnx.to_flat_state(state):
            if is_expert_weight(path):
                var = type(var)(jax.device_put(jnp.zeros((), var.get_value().dtype), replicated))
            flat.append((path, var))
        self.graphdef, self.dense_state = graphdef, nnx.from_flat_state(flat)
        self.dense_model = dense_model = nnx.merge(graphdef, self.dense_state)
        self.layer_ids = [layer.layer_id for layer in dense_model.layers]
        self.layer_states = [nnx.state(layer) for layer in dense_model.layers]
        self.canonical = canonical_graphs(dense_model)
        blocks = expert_blocks(state)
        self.store, self.owns_store = None, False
        if backend == "ffi":
            from jax_dwdp.parallel.dwdp_ffi import ExpertStore

            self.owns_store = store is None  # a store passed in (a Pipeline's, shared) is closed by its owner
            self.store = store or ExpertStore.from_sharded(blocks, model.cfg.num_experts, timing=timing,
                                                                   poison=poison, delay_copies=delay_copies)
            self.local = None
        elif backend == "replicated":  # the no-communication bound: every rank holds every expert
            self.local = [tuple(jax.device_put(w, replicated) for w in pair) for pair in blocks]
        else:
            self.local = blocks
        self._programs: dict = {}

    # ---- programs --------------------------------------------------------------------------------------------
    def _program(self, key):
        if key not in self._programs:
            self._programs[key] = self._build(*key)
        return self._programs[key]

    def _build(self, kind, *arg):
        mesh, b = self.mesh, P(AXIS)
        pair = (b, b)
        smap = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
        dtype = self.model.dtype
        if kind == "embed":
            def embed(state, x):
                return nnx.merge(self.graphdef, state).embed(x)
            return jax.jit(smap(embed, in_specs=(P(), b), out_specs=b))
        if kind == "head":
            def head(state, h, lengths):
                with _precision(dtype):
                    return nnx.merge(self.graphdef, state).head(h, lengths, self.logits)
            return jax.jit(smap(head, in_specs=(P(), b, b), out_specs=b))
        if kind == "gather":  # layer 0's experts (XLA backend)
            return jax.jit(smap(gather_experts, in_specs=(pair,), out_specs=pair))
        if kind == "prefetch":  # (FFI backend) the copy of one layer's experts
            (index,) = arg
            return jax.jit(smap(lambda h: self.store.prefetch(h, index), in_specs=(b,), out_specs=pair))
        layer_type, has_next = arg
        graphdef = self.canonical[layer_type].value

        if self.backend == "replicated":
            def run(state, h, positions, lengths, experts):
                with _precision(dtype):
                    return nnx.merge(graphdef, state)(h, positions, lengths, experts)
            return jax.jit(smap(run, in_specs=(P(), b, b, b, (P(), P())), out_specs=(b, b)))

        if self.backend == "ffi":
            def run(state, h, positions, lengths, experts):
                with _precision(dtype):
                    return nnx.merge(graphdef, state)(h, positions, lengths, lambda x: self.store.wait(experts, x))
            return jax.jit(smap(run, in_specs=(P(), b, b, b, pair), out_specs=(b, b)))

        def run(state, h, positions, lengths, experts, next_local):
            nxt = None
            if has_next:
                h, next_local = jax.lax.optimization_barrier((h, next_local))
                nxt = gather_experts(next_local)
            with _precision(dtype):
                out = nnx.merge(graphdef, state)(h, positions, lengths, experts)
            return out, nxt
        return jax.jit(smap(run, in_specs=(P(), b, b, b, pair, pair if has_next else None),
                            out_specs=((b, b), pair if has_next else None)))

    # ---- running ---------------------------------------------------------------------------------------------
    def place(self, x):
        return jax.device_put(x, self.batch_sharding)

    def __call__(self, x, lengths):
        if x.shape[0] % self.ranks:
            raise ValueError(f"batch {x.shape[0]} cannot be split evenly over {self.ranks} DWDP ranks")
        model, n = self.model, len(self.layer_ids)
        x, lengths = self.place(x), self.place(lengths)
        h = self._program(("embed",))(self.dense_state, x) if model.is_first else x
        ffi = self.backend == "ffi"
        if ffi:
            pending = [self._program(("prefetch", 0))(h)]
        else:
            pending = [None if self.backend == "replicated" else self._program(("gather",))(self.local[0])]

        def run_layer(layer, h, positions, lens, _):  # positions come placed like h (forward_layers)
            i = self.layer_ids.index(layer.layer_id)
            has_next = i + 1 < n
            if self.backend == "replicated":
                nxt = None
                out = self._program(("layer", layer.layer_type, False))(self.layer_states[i], h, positions, lens,
                                                                        self.local[i])
            elif ffi:
                # Enqueued before layer i: the copy of layer i+1 starts once layer i-1 is done and overlaps layer i.
                nxt = self._program(("prefetch", i + 1))(h) if has_next else None
                out = self._program(("layer", layer.layer_type, False))(self.layer_states[i], h, positions, lens,
                                                                        pending[0])
            else:
                out, nxt = self._program(("layer", layer.layer_type, has_next))(
                    self.layer_states[i], h, positions, lens, pending[0], self.local[i + 1] if has_next else None)
            pending[0] = nxt
            return out

        try:
            h, cache = self.dense_model.forward_layers(h, lengths, cache_len=self.cache_len, run_layer=run_layer)
        except BaseException:
            if ffi:  # a copy may still be running into a prefetch output this error dropped
                self.store.sync()
            raise
        if not model.is_last:
            return h, cache
        out = None if self.logits == "none" else self._program(("head",))(self.dense_state, h, lengths)
        return out, cache

    def compile(self, x, lengths) -> None:
        """Compiles every program for these shapes (by one run)."""
        jax.block_until_ready(self(x, lengths))

    def copy_only(self, x) -> None:
        """(FFI backend, benchmarks) Every layer's prefetch with no compute around it; store.copy_ms() then holds
        the copy times of an idle GPU."""
        h = self._program(("embed",))(self.dense_state, self.place(x))
        for i in range(len(self.layer_ids)):
            jax.block_until_ready(self._program(("prefetch", i))(h))
            self.store.sync()  # nobody waits for these copies: finish them before their outputs are freed

    def close(self, exc: BaseException | None = None) -> None:
        """Releases the FFI store if this program made it (nothing to do for the other backends); while `exc`
        propagates, a failure to close only warns (close_store)."""
        if self.store is not None and self.owns_store:
            from jax_dwdp.parallel.dwdp_ffi import close_store

            close_store(self.store, exc)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(exc)
