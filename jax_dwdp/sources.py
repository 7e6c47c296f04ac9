"""Where a layer's experts come from: one small class per way, chosen once, when a stage runner is built.

The stage runner (jax_dwdp.runner) owns the layer loop and decides *when* layer l+1's experts start to
move (just before layer l is enqueued, so that they move while layer l computes); a source decides *how*:

- `LocalSource`: each layer's own expert weights. One device, or every DWDP rank holding all experts (the replicated
  baseline DWDP is measured against). Nothing moves.
- `XlaGatherSource`: DWDP over XLA. Each rank of a 'dwdp' mesh holds its block of every layer; layer l's program also
  all-gathers layer l+1's blocks (a collective overlaps compute only inside one program).
- `XlaPeerCopySource`: independent ranks (one device each, no collective): the peers' blocks of layer l+1 are copied
  device-to-device with jax.device_put.
- `FfiStoreSource`: the CUDA VMM expert store (jax_dwdp.parallel.dwdp_ffi): a custom call starts layer l+1's copy on
  the store's copy stream (in place: inside layer l's program; copying out: a program of its own); layer l+1's MoE
  waits for it. The store is made, owned and closed by whoever chose it.
- `DepDispatchSource`: DEP, what DWDP replaces. Each rank of a 'dwdp' mesh holds its block of every layer, as with `XlaGatherSource`,
  but nothing moves ahead of time: inside each MoE the tokens travel to the ranks that hold their experts and
  their partial outputs come back (`DispatchedExperts`), and every rank waits for every other there.

A source answers, for the runner:
  first(h)             the first layer's experts (or what its program needs to get them), host side;
  prefetch(index, h)   start fetching layer `index` (called right before layer index - 1 is enqueued);
  overlap(h, ahead)    (traced, sources with `gathers`) issue that fetch inside layer index - 1's program;
  delivered(ahead, fetched)
                       what layer `index` gets: `ahead` (prefetch's answer) or `fetched` (what the program of layer
                       index - 1 returned for it, sources with `gathers`);
  experts(pending)     (traced) the experts for the layer's MoE: arrays, AwaitedExperts (arrays a copy is still
                       writing, waited for right before the MoE's first grouped matmul), or None for the layer's own
                       weights;
  abort()              after a failed prefill: make sure no copy still writes into a buffer the failure dropped.

Layers without routed experts (Nemotron-H's Mamba-2, attention and MLP layers) have nothing to fetch: a source
answers None for them (`blocks[i]` is None; the FFI store holds the expert layers only, `layers` mapping a stage's
layer to its store layer), and the layer computes without. So layer l+1's experts still move under layer l,
whatever layer l is. The sources never look at the experts' shapes or activation: DEP's exchange runs the calling
MoE's own routed-expert function (SwiGLU or relu^2).
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jax_dwdp.model.moe import AwaitedExperts, routed_experts

AXIS = "dwdp"


def gather_experts(local: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Inside shard_map: every rank's block of one layer -> the layer's full (padded) expert set."""
    return tuple(jax.lax.all_gather(w, AXIS, tiled=True) for w in local)


class ExpertSource:
    """How the layers of one stage get their experts (see the module doc for the protocol)."""

    replaces_experts = True  # the layers' own expert weights are not used: the runner does not keep them
    gathers = False  # the next layer's fetch is issued inside the current layer's program (overlap)
    whole_program = False  # can run inside one program for the whole stage (operands / bind)

    def first(self, h):
        return self.prefetch(0, h)

    def prefetch(self, index: int, h):
        raise NotImplementedError

    def overlap(self, h, ahead):
        raise NotImplementedError

    def delivered(self, ahead, fetched):
        return fetched if self.gathers else ahead

    def experts(self, pending):
        return pending

    def abort(self) -> None:
        """Nothing can still be writing for sources whose transfers are XLA operations."""

    def operands(self) -> tuple:
        """(whole_program sources) the arrays the source reads, passed into a whole-stage program."""
        return ()

    def bind(self, operands) -> ExpertSource:
        """(whole_program sources) the source inside a whole-stage program, over its traced operands."""
        return self


class LocalSource(ExpertSource):
    """Each layer's own expert weights (one device; or the replicated baseline, every rank holding all experts)."""

    replaces_experts = False
    whole_program = True

    def first(self, h):
        return None

    def prefetch(self, index, h):
        return None

    def __eq__(self, other) -> bool:  # stateless: every runner's LocalSource shares the module-level executables
        return type(other) is LocalSource

    def __hash__(self) -> int:
        return hash(LocalSource)


class XlaGatherSource(ExpertSource):
    """DWDP over XLA: rank r of `mesh` holds block r of every layer; the layers all-gather them one layer ahead.

    `blocks[i]` = layer i's (gate_up, down), sharded P('dwdp') over the mesh. The gather for layer l+1 is issued in
    layer l's program after an optimization barrier on layer l's input, so that XLA can overlap it with layer l
    but cannot hoist every layer's gather to the start (which would hold all layers' experts at once).
    """

    gathers = True
    whole_program = True

    def __init__(self, blocks: list[tuple[jax.Array, jax.Array]], mesh=None):
        """mesh=None: the source inside a traced whole-stage program (bind)."""
        self.blocks = blocks
        self._gather_first = gather_experts if mesh is None else jax.jit(jax.shard_map(
            gather_experts, mesh=mesh, in_specs=(P(AXIS),), out_specs=P(AXIS), check_vma=False))

    def first(self, h):
        return None if self.blocks[0] is None else self._gather_first(self.blocks[0])

    def prefetch(self, index, h):
        return self.blocks[index]  # gathered by `overlap`, inside the program of layer index - 1 (None: no experts)

    def overlap(self, h, ahead):
        h, ahead = jax.lax.optimization_barrier((h, ahead))
        return h, gather_experts(ahead)

    def operands(self):
        return tuple(self.blocks)

    def bind(self, operands):
        return XlaGatherSource(list(operands))


class XlaPeerCopySource(ExpertSource):
    """Independent ranks: `blocks[i][r]` = rank r's (gate_up, down) of layer i, on devices[r]. A rank pulls its
    peers' blocks of the next layer with device-to-device copies, issued before the current layer is enqueued;
    at most two layers of remote experts are resident per rank."""

    def __init__(self, devices, blocks):
        self.devices, self.blocks = list(devices), blocks

    def prefetch(self, index, h):
        layer = self.blocks[index]
        if layer is None:  # a layer without experts
            return None
        device = next(iter(h.devices()))
        own = self.devices.index(device)
        copies = [block if r == own else jax.device_put(block, device) for r, block in enumerate(layer)]
        return tuple(b[0] for b in copies), tuple(b[1] for b in copies)

    def experts(self, pending):
        if pending is None:
            return None
        gate_up, down = pending
        return jnp.concatenate(gate_up, axis=0), jnp.concatenate(down, axis=0)


class FfiStoreSource(ExpertSource):
    """The CUDA VMM expert store (an open dwdp_ffi.ExpertStore, owned by the caller).

    With `mesh`, the programs run over the mesh's ranks (inside shard_map); without, each runs on the device of
    its input (independent ranks). The prefetch is one custom call that forks the copy of a layer's peer experts
    onto the device's copy stream after everything enqueued before it.
    - In place (the store's views): layer l+1's call sits inside layer l's program (`gathers`), ahead of the layer's
      work, given layer l+1's views as an operand (the call finds the layer from their address, so one compiled
      layer program still serves every layer); layer l+1 then gets those views (`ExpertStore.layer_experts`) as its
      experts. Only the first layer's prefetch is a program of its own.
    - Copying out: a one-call program per layer, launched before layer l is enqueued, into XLA buffers that layer
      l+1 gets.
    `experts` hands the MoE the experts with the store's wait (AwaitedExperts): XLA's stream waits for the copy right
    before the MoE's first grouped matmul, beside that matmul's custom call.

    `layers` (a stage whose layers do not all have experts): per layer of the stage, its layer in the store (the
    stage's expert layers in order, `model.expert_slots`) or None; default: layer i is the store's layer i.
    """

    def __init__(self, store, mesh=None, layers: tuple[int | None, ...] | None = None):
        self.store, self.mesh, self.layers = store, mesh, layers
        self.gathers = store.in_place
        self._programs: dict[int | str, object] = {}
        self._sharded: dict[int, tuple[jax.Array, jax.Array]] = {}  # over a mesh: each layer's views, sharded
        self._lock = threading.Lock()  # independent ranks' threads may ask for the same program at once

    def _program(self, key, fetch):
        with self._lock:
            if key not in self._programs:
                if self.mesh is not None:
                    fetch = jax.shard_map(fetch, mesh=self.mesh, in_specs=(P(AXIS),) * (1 + (key == "in_place")),
                                          out_specs=P(AXIS), check_vma=False)
                self._programs[key] = jax.jit(fetch)
            return self._programs[key]

    def _views(self, layer, h):
        if self.mesh is not None:
            # The store's views do not move while it is open: one sharded pair per layer serves every prefill.
            with self._lock:
                if layer not in self._sharded:
                    self._sharded[layer] = self.store.sharded_layer_experts(layer, self.mesh)
                return self._sharded[layer]
        device, = h.devices()
        return self.store.layer_experts(layer, device)

    def _store_layer(self, index):
        layer = index if self.layers is None else self.layers[index]
        if layer is not None:
            self.store.check_open()  # the compiled programs would still call into a closed store
        return layer

    def fetch_now(self, index, h):
        """Layer `index`'s prefetch as a program of its own, launched now; returns what the layer gets (None: a
        layer without experts). The first layer's prefetch (no layer before it to issue it in), and every layer's
        when the store copies out."""
        layer = self._store_layer(index)
        if layer is None:
            return None
        if self.store.in_place:
            views = self._views(layer, h)
            self._program("in_place", self.store.prefetch_in_place)(h, views)
            return views
        return self._program(layer, lambda h: self.store.prefetch(h, layer))(h)

    def first(self, h):
        return self.fetch_now(0, h)

    def prefetch(self, index, h):
        if not self.gathers:
            return self.fetch_now(index, h)
        layer = self._store_layer(index)
        return None if layer is None else self._views(layer, h)  # copied by `overlap`, in the layer before's program

    def overlap(self, h, ahead):
        """In place: the next layer's prefetch, ahead of this layer's work (the barrier makes the layer's input
        wait for the call, so the copy starts under this layer, not after it)."""
        token = self.store.prefetch_in_place(h, ahead)
        h, token = jax.lax.optimization_barrier((h, token))
        return h, token

    def delivered(self, ahead, fetched):
        return ahead  # in place, the views: the layer program's token output only keeps the call in it

    def experts(self, pending):
        if pending is None:
            return None
        return AwaitedExperts(pending, self.store.wait)

    def abort(self):
        self.store.sync()  # a copy may still be running into a prefetch output the failure dropped


class DepDispatchSource(ExpertSource):
    """DEP: rank r of `mesh` holds block r of every layer (as for `XlaGatherSource`); the tokens go to the experts.

    `blocks[i]` = layer i's (gate_up, down), sharded P('dwdp') over the mesh. A layer's MoE gets its own rank's
    block (`DispatchedExperts`), so no expert weight ever moves.
    """

    whole_program = True

    def __init__(self, blocks: list[tuple[jax.Array, jax.Array]]):
        self.blocks = blocks

    def prefetch(self, index, h):
        return self.blocks[index]

    def experts(self, pending):
        return None if pending is None else DispatchedExperts(*pending)

    def operands(self):
        return tuple(self.blocks)

    def bind(self, operands):
        return DepDispatchSource(list(operands))


class DispatchedExperts:
    """Inside shard_map over 'dwdp': this rank's block of a layer's experts, and the token exchange around it.

    The exchange is drop-free with static shapes: every rank's tokens (with their routing, computed on their own
    rank) are all-gathered, which is an all-to-all whose per-destination capacity is the worst case, all M tokens
    of a rank (jax.lax.ragged_all_to_all would send only the tokens routed to each rank, but XLA:CPU does not
    implement it, jax 0.10.2, and at top-8 of 256 experts over 2 ranks 99.3% of tokens need both ranks anyway,
    under uniform routing).
    Each rank computes, for every token, the sum over its top-k slots whose expert it holds; the partial sums go
    back to the tokens' ranks with one all-to-all and are added there in fp32. No token is dropped whatever the
    routing: the buffers hold N * M * k slots, every slot of every rank's tokens.
    """

    def __init__(self, gate_up: jax.Array, down: jax.Array):
        """This rank's block of the layer's two expert weights (Qwen3.5: gate_up_proj, down_proj; Nemotron-H:
        up_proj, down_proj)."""
        self.gate_up, self.down = gate_up, down

    def routed(self, x, ids, weights, *, gate_up_interleaved: bool = False, kernels=None, experts_fn=None):
        """x [M, H], ids / weights [M, k] of this rank's tokens -> their routed-expert output [M, H]. `experts_fn`:
        the MoE's routed-expert function (x, ids, weights, w0, w1, *, valid=, kernels=) (default: the SwiGLU
        experts, `moe.routed_experts`, in the `gate_up_interleaved` layout)."""
        compute = experts_fn or functools.partial(routed_experts, gate_up_interleaved=gate_up_interleaved)
        m = x.shape[0]
        slots = self.gate_up.shape[0]
        ranks = jax.lax.axis_size(AXIS)
        all_x, all_ids, all_weights = (jax.lax.all_gather(a, AXIS, tiled=True) for a in (x, ids, weights))
        local = all_ids - jax.lax.axis_index(AXIS) * slots
        mine = (local >= 0) & (local < slots)
        # Slots held elsewhere get the id `slots`: sorted after every group of this block, so no kernel computes
        # them, and masked out of the sum.
        partial = compute(all_x, jnp.where(mine, local, slots), jnp.where(mine, all_weights, 0), self.gate_up,
                          self.down, valid=mine, kernels=kernels)
        back = jax.lax.all_to_all(partial.reshape(ranks, m, -1), AXIS, 0, 0, tiled=False)  # [N, M, H]: per source
        return jnp.sum(back.astype(jnp.float32), axis=0).astype(x.dtype)
