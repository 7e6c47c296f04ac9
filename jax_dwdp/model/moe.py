"""Sparse MoE block: softmax router with top-k renormalisation, routed experts, sigmoid-gated shared expert.

The routed experts are a pure function of (tokens, routing, stacked expert weights), `routed_experts`, so the
parallel paths (DWDP, EP) can hand it expert weights that came from elsewhere without touching the module.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_dwdp.config import ModelConfig
from jax_dwdp.kernels import (
    GROUPED_MATMUL_ROW_MULTIPLE,
    combine_rows,
    deinterleave_gate_up,
    dispatch_rows,
    grouped_matmul,
    grouped_matmul_gather_swiglu,
    grouped_matmul_swiglu,
    interleave_gate_up,
    routing,
)
from jax_dwdp.kernels.choices import KernelChoices, resolve
from jax_dwdp.kernels.grouped_matmul import SWIGLU_BLOCK, default_implementation, swiglu
from jax_dwdp.model.layers import Linear, matmul_precision, normal_init


class AwaitedExperts(NamedTuple):
    """Expert weights that a copy may still be writing (DWDP's CUDA VMM store): `wait(weights, after)` returns
    (`weights` usable once XLA's stream has waited for that copy, `after` handed on), and the caller computes from
    the returned `after`: that data keeps the wait in the program and orders it. The routed experts call it with
    their first grouped matmul's input, right before that matmul: the latest the wait can be, so the copy has
    the most compute to hide under (on one H100 it cost the same as a wait at the MoE's input: benchmarks/RESULTS.md,
    "zero-copy DWDP")."""

    weights: tuple[jax.Array, jax.Array]
    wait: Callable[[tuple[jax.Array, jax.Array], jax.Array], tuple[tuple[jax.Array, jax.Array], jax.Array]]


def split_awaited(experts) -> tuple[object, Callable | None]:
    """(the weights, their `wait` or None) of what a MoE was handed as its experts."""
    if isinstance(experts, AwaitedExperts):
        return experts.weights, experts.wait
    return experts, None


def route(x: jax.Array, router_weight: jax.Array, top_k: int,
          kernels: KernelChoices | None = None) -> tuple[jax.Array, jax.Array]:
    """x [M, H] -> (expert ids [M, k] int32, weights [M, k] in x's dtype), softmax in fp32, renormalised top-k
    (`kernels.routing.topk_softmax`: one Pallas kernel on the GPU)."""
    logits = jnp.einsum("mh,eh->me", x, router_weight, precision=matmul_precision(x.dtype))
    return route_logits(logits, top_k, x.dtype, kernels)


def route_logits(logits: jax.Array, top_k: int, dtype,
                 kernels: KernelChoices | None = None) -> tuple[jax.Array, jax.Array]:
    """Router logits [M, E] -> (expert ids [M, k] int32, renormalised top-k weights [M, k] in `dtype`)."""
    ids, weights = routing.topk_softmax(logits, top_k, kernels=kernels)
    return ids, weights.astype(dtype)


def sort_by_expert(expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """Flattened (token, slot) pairs sorted by expert: (order [M*k], group_sizes [E] int32). Ids >= E (DEP's slots
    held elsewhere) sort after every group and count in no group."""
    flat = expert_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, group_sizes


MERGED_PROJECTION_DEFAULT = True  # the router, the shared expert's gate_proj / up_proj and its sigmoid gate as one
# matmul: XLA's dot merger joins the first three by itself but leaves the gate, a [M, 1] GEMV, apart. On an H200 the
# merged projection took 0.164 vs 0.194 ms at 16K tokens and 0.092 vs 0.098 ms at 4K (2026-12-04, layer-parts
# --fusions rows, the weights stacked unpadded outside the timed call: benchmarks/history/RESULTS-2026-11-to-12.md);
# the whole MoE block 2.145 vs 2.171 ms at 16K on an H100 (benchmarks/RESULTS.md, "MoE block").
MERGED_PROJECTION_MIN_TOKENS = 1024  # ... from this many tokens per call: the four weights are stacked anew in every
# call (35b-a3b: 2 x 5.2 MB of copy per layer, ~2-3 us of HBM time; 397b-a17b: 2 x 21 MB), which a short chunk or a
# decode step, bound by reading the weights once, would pay for nothing (an estimate from the bytes). At 1,024 tokens
# the merged block still measured 2.6% faster (0.725 vs 0.744 ms, an H100, 2026-12-06: benchmarks/RESULTS.md,
# "MoE block"); below, not timed.


def merged_projection(tokens: int | None = None, kernels: KernelChoices | None = None) -> bool:
    """Whether `SparseMoe` projects the tokens through its router, shared gate / up and shared-expert gate in one
    matmul (`SparseMoe._token_projections`): `kernels.moe_merged_projection` (default: the process's
    `KernelChoices`) when set, else MERGED_PROJECTION_DEFAULT where `tokens` (None: not known) >=
    MERGED_PROJECTION_MIN_TOKENS. Same products either way; only how they are grouped into GEMMs differs. (The
    separate projections are also the path below that many tokens, so forcing them stays a choice.)"""
    chosen = resolve(kernels).moe_merged_projection
    if chosen is not None:
        return chosen
    return MERGED_PROJECTION_DEFAULT and (tokens is None or tokens >= MERGED_PROJECTION_MIN_TOKENS)


GATHER_DEFAULT = True  # where the gate_up matmul is the CUTLASS kernel, it gathers the tokens itself ...
# ... on the shapes where that measured faster than the Pallas dispatch (the routed-expert block, one H200,
# 2026-12-02 and 12-03, benchmarks/RESULTS.md, "MoE block"): hidden 2048 (35b-a3b) at every length,
# 1.00-1.08x; hidden 3072 / 4096 (122b-a10b / 397b-a17b) at 4K tokens, 1.02x / 1.07-1.08x, but not at 16K (0.96x
# both; 397b's whole MoE block 10.30 vs 9.89 ms) or 32K (1.01x / 0.98-0.99x). So: always up to GATHER_MAX_HIDDEN,
# and wider only up to GATHER_MAX_WIDE_ROWS sorted (token, slot) rows (397b at 4K tokens: 40,960).
GATHER_MAX_HIDDEN = 2048
GATHER_MAX_WIDE_ROWS = 40960


def gather_in_gemm(gather: bool | None = None, implementation: str | None = None, *, hidden: int | None = None,
                   rows: int | None = None, kernels: KernelChoices | None = None) -> bool:
    """Whether `routed_experts` reads the tokens inside the gate_up grouped matmul (no dispatched copy): the
    argument, else `kernels.moe_gather` (default: the process's `KernelChoices`) when set, else GATHER_DEFAULT where
    the grouped matmul `implementation` (None: the choices' for bf16) is "cutlass", the one kernel that fuses the
    gather (elsewhere the gather would be a separate XLA pass, slower than the Pallas dispatch), on the shapes it
    measured faster: `hidden` (the tokens' width) <= GATHER_MAX_HIDDEN, or `rows` (tokens x top-k) <=
    GATHER_MAX_WIDE_ROWS (None: not known, taken as fitting). (The dispatch stays a choice: it is the path of the
    wider shapes and of the interleaved gate_up layout.)"""
    if gather is not None:
        return bool(gather)
    kernels = resolve(kernels)
    if kernels.moe_gather is not None:
        return kernels.moe_gather
    impl = implementation or default_implementation(jnp.bfloat16, kernels)
    shape_fits = hidden is None or hidden <= GATHER_MAX_HIDDEN or rows is None or rows <= GATHER_MAX_WIDE_ROWS
    return GATHER_DEFAULT and impl == "cutlass" and shape_fits


def routed_experts(
    x: jax.Array,
    expert_ids: jax.Array,
    expert_weights: jax.Array,
    gate_up_proj: jax.Array,
    down_proj: jax.Array,
    *,
    wait: Callable | None = None,
    grouped_matmul_impl: str | None = None,
    gate_up_interleaved: bool = False,
    valid: jax.Array | None = None,
    add: jax.Array | None = None,
    gather: bool | None = None,
    kernels: KernelChoices | None = None,
) -> jax.Array:
    """sum_k w_k * down_e(silu(gate_e(x)) * up_e(x)) over each token's top-k experts e (+ `add`, e.g. the shared
    expert's output, added in the un-permute's pass: XLA fuses it there). The weights are used in x's dtype.

    x [M, H]; expert_ids, expert_weights [M, k]; gate_up_proj [E, 2I, H] (gate rows first, or, with
    `gate_up_interleaved`, in `kernels.interleave_gate_up`'s layout, which lets the GPU kernel fuse SiLU(gate) * up
    into the projection's epilogue); down_proj [E, H, I].
    The (token, slot) pairs are put in expert order (`kernels.dispatch_rows`), pushed through two grouped matmuls,
    and brought back with the weighted top-k sum (`kernels.combine_rows`). With `gather` (`gather_in_gemm`: the
    argument, else `kernels.moe_gather`, else on where the grouped matmul is the CUTLASS kernel) the gate_up matmul
    reads each sorted row's token from x itself and applies SiLU(gate) * up before writing
    (`kernels.grouped_matmul_gather_swiglu`; on the GPU inside the CUTLASS kernel's loads and epilogue), so neither
    the dispatched [M*k, H] copy nor the [M*k, 2I] projection is written (by default on the shapes where that
    measured faster: see GATHER_MAX_HIDDEN); the interleaved layout keeps the dispatch.
    `valid` [M, k] (DEP, a rank holding a block of the experts): only these slots count; the others must carry an
    id >= E, which sorts them after every group (no kernel computes them) and their rows, unspecified for some
    kernels, are masked out.
    `kernels`: the model's `KernelChoices` (default: the process's), handed to every kernel here;
    `grouped_matmul_impl` forces the grouped matmuls' form. `wait` (AwaitedExperts.wait): the expert weights are
    read only after `wait((gate_up_proj, down_proj), first matmul's input)`, whose returned input the matmul reads.
    """
    kernels = resolve(kernels)
    m, k = expert_ids.shape
    num_experts, two_i, _ = gate_up_proj.shape
    order, inverse, group_sizes = expert_order(expert_ids, num_experts, valid, kernels)
    # Row count padded to the kernels' row multiple; the padded rows belong to no group and are never read back.
    pad = (-m * k) % GROUPED_MATMUL_ROW_MULTIPLE
    gemm = functools.partial(grouped_matmul, implementation=grouped_matmul_impl, kernels=kernels)

    def ready(after):
        return ((gate_up_proj, down_proj), after) if wait is None else wait((gate_up_proj, down_proj), after)
    if gate_up_interleaved:
        rows = dispatch_rows(x, order, inverse, k, m * k + pad, kernels=kernels)  # [M*k + pad, H]
        (gate_up_proj, down_proj), rows = ready(rows)
        act = grouped_matmul_swiglu(rows, gate_up_proj, group_sizes, implementation=grouped_matmul_impl,
                                    kernels=kernels)
    else:
        if gather_in_gemm(gather, grouped_matmul_impl or default_implementation(x.dtype, kernels), hidden=x.shape[-1],
                          rows=m * k, kernels=kernels):
            # sorted row r reads token order[r] // k; the padded rows are in no group
            # (SiLU(gate) * up in the same kernel's epilogue, from bf16-rounded gate and up as below)
            row_token = jnp.pad((order // k).astype(jnp.int32), (0, pad))
            (gate_up_proj, down_proj), row_token = ready(row_token)
            act = grouped_matmul_gather_swiglu(x, row_token, gate_up_proj, group_sizes,
                                               implementation=grouped_matmul_impl, kernels=kernels)
        else:
            rows = dispatch_rows(x, order, inverse, k, m * k + pad, kernels=kernels)  # [M*k + pad, H]
            (gate_up_proj, down_proj), rows = ready(rows)
            gate_up = gemm(rows, gate_up_proj, group_sizes)
            act = swiglu(gate_up[:, : two_i // 2], gate_up[:, two_i // 2 :], x.dtype)
    out = gemm(act, down_proj, group_sizes)
    if valid is None:
        return combine_rows(out, inverse, expert_weights.astype(x.dtype), add)
    return combine_valid_rows(out, inverse, expert_weights, valid, x.dtype, add)


def expert_order(expert_ids: jax.Array, num_experts: int, valid: jax.Array | None = None,
                 kernels: KernelChoices | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The (token, slot) pairs in expert order: (order [M*k], its inverse, group sizes [E]). Without `valid`, every
    id is in [0, E) and the counting sort (one Pallas kernel on the GPU) gives the inverse too; with it (DEP), the
    ids of slots held elsewhere are >= E and sort after every group."""
    if valid is None:
        return routing.expert_permutation(expert_ids, num_experts, kernels=kernels)
    order, group_sizes = sort_by_expert(expert_ids, num_experts)
    # The inverse permutation is a scatter of iota (no second sort).
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype), unique_indices=True)
    return order, inverse, group_sizes


def combine_valid_rows(out: jax.Array, inverse: jax.Array, expert_weights: jax.Array, valid: jax.Array, dtype,
                       add: jax.Array | None = None) -> jax.Array:
    """DEP's weighted top-k sum: expert rows `out` [M*k + pad, H] back in token order, only the `valid` [M, k] slots
    counted, summed in fp32 (+ `add`). Rows of slots held elsewhere may be garbage (NaN * 0 is NaN): selected out,
    not weighted out."""
    m, k = valid.shape
    out = jnp.where(valid.reshape(-1)[:, None], out[inverse] * expert_weights.reshape(-1)[:, None], 0)
    out = jnp.sum(out.reshape(m, k, -1).astype(jnp.float32), axis=1).astype(dtype)
    return out if add is None else out + add


class Router(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        self.weight = nnx.Param(normal_init(rngs, (cfg.num_experts, cfg.hidden_size), dtype, 1.0))


class Experts(nnx.Module):
    """All experts of one layer as stacked weights: gate_up_proj [E, 2I, H] in the checkpoint's layout (gate rows,
    then up rows), or with `gate_up_interleaved` in `kernels.interleave_gate_up`'s (see `set_fused_swiglu`);
    down_proj [E, H, I]."""

    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nnx.Param(normal_init(rngs, (e, 2 * i, h), dtype, h**-0.5))
        self.down_proj = nnx.Param(normal_init(rngs, (e, h, i), dtype, i**-0.5))
        self.gate_up_interleaved = False


class SharedExpert(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.up_proj = Linear(h, i, dtype=dtype, rngs=rngs)
        self.down_proj = Linear(i, h, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.gate_proj(x), self.up_proj(x), x.dtype)

    def down(self, gate: jax.Array, up: jax.Array, dtype) -> jax.Array:
        """down_proj(SiLU(gate) * up), from the gate and up projections however they were computed."""
        return self.down_proj(swiglu(gate, up, dtype))


class SparseMoe(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, dtype, rngs: nnx.Rngs, kernels: KernelChoices | None = None):
        """`kernels`: the kernel choices of this block's programs (default: the process's), a static attribute."""
        self.gate = Router(cfg, dtype=dtype, rngs=rngs)
        self.experts = Experts(cfg, dtype=dtype, rngs=rngs)
        self.shared_expert = SharedExpert(cfg, dtype=dtype, rngs=rngs)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, dtype=dtype, rngs=rngs)
        self.top_k = cfg.num_experts_per_tok
        self.kernels = resolve(kernels)

    def __call__(self, x: jax.Array, experts=None) -> jax.Array:
        """x [..., H]. `experts` = (gate_up_proj, down_proj) overrides this module's own expert weights (gate_up in
        this module's layout, `self.experts.gate_up_interleaved`); it may also be AwaitedExperts (DWDP's FFI path:
        the layer's expert copy is waited for right before the first grouped matmul), or an object whose
        `routed(x, ids, weights, gate_up_interleaved=)` replaces `routed_experts` (DEP: the tokens travel to the
        ranks holding their experts)."""
        lead = x.shape[:-1]
        flat = x.reshape(-1, x.shape[-1])
        if merged_projection(tokens=flat.shape[0], kernels=self.kernels):
            logits, shared_gate, shared_up, shared_gate_logit = self._token_projections(flat)
            ids, weights = route_logits(logits, self.top_k, x.dtype, self.kernels)
            shared_out = self.shared_expert.down(shared_gate, shared_up, x.dtype)
        else:
            ids, weights = route(flat, self.gate.weight[...], self.top_k, self.kernels)
            shared_gate_logit, shared_out = self.shared_expert_gate(flat), self.shared_expert(flat)
        interleaved = self.experts.gate_up_interleaved
        shared = jax.nn.sigmoid(shared_gate_logit.astype(jnp.float32)).astype(x.dtype) * shared_out
        if hasattr(experts, "routed"):
            out = experts.routed(flat, ids, weights, gate_up_interleaved=interleaved, kernels=self.kernels) + shared
        else:
            experts, wait = split_awaited(experts)
            gate_up, down = experts if experts is not None else (self.experts.gate_up_proj[...],
                                                                 self.experts.down_proj[...])
            out = routed_experts(flat, ids, weights, gate_up, down, wait=wait, gate_up_interleaved=interleaved,
                                 add=shared, kernels=self.kernels)
        return out.reshape(*lead, -1)

    def _token_projections(self, flat: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The four projections of the tokens, as one matmul over the weights stacked (router [E, H], shared
        gate_proj and up_proj [I, H] each, shared_expert_gate [1, H], zero rows to a multiple of 8 so the output's
        rows stay 16-byte aligned), returned in that row order: router logits [M, E], shared gate and up [M, I]
        each, shared-expert gate logit [M, 1]."""
        ws = [self.gate.weight[...], self.shared_expert.gate_proj.weight[...],
              self.shared_expert.up_proj.weight[...], self.shared_expert_gate.weight[...]]
        sizes = [w.shape[0] for w in ws]
        w = jnp.pad(jnp.concatenate(ws), ((0, -sum(sizes) % 8), (0, 0)))
        y = jnp.einsum("mh,oh->mo", flat, w, precision=matmul_precision(jnp.result_type(flat, w)))
        bounds = np.cumsum(sizes)
        return tuple(y[:, start:stop] for start, stop in zip([0, *bounds[:-1]], bounds))


# --- The gate_up weight layout: the checkpoint's, or interleaved for the fused SwiGLU epilogue ---------------------


def _experts_of(model) -> list[Experts]:
    """The SwiGLU expert modules of a model's layers (Qwen3.5: every layer's; a Nemotron-H model has none)."""
    return [layer.mlp.experts for layer in model.layers if isinstance(getattr(layer, "mlp", None), SparseMoe)]


def fused_swiglu_enabled(model) -> bool:
    """True when the model's expert weights are in the interleaved (fused SwiGLU) layout."""
    flags = {experts.gate_up_interleaved for experts in _experts_of(model)}
    if len(flags) > 1:
        raise ValueError("the model's layers mix gate_up layouts (some interleaved, some not)")
    return flags.pop() if flags else False


@functools.lru_cache(maxsize=64)
def _permuter(interleave: bool, sharding):
    fn = interleave_gate_up if interleave else deinterleave_gate_up
    return jax.jit(fn, out_shardings=sharding)


def set_fused_swiglu(model, enable: bool, *, permute: bool = True, donate: bool = False):
    """A model whose expert gate_up weights are in the interleaved layout (enable=True: gate and up rows in
    alternating blocks of 8, which lets the CUTLASS kernel fuse SiLU(gate) * up into the projection's epilogue) or
    in the checkpoint's. It computes the same function. Opt-in: on an H200 the fused kernel measured at parity with
    the unfused path (0.95-1.07x, 2026-11-30: benchmarks/RESULTS.md, "Variants measured slower"), so models keep the
    checkpoint layout by default.

    Returns a new model that shares every other weight. `model` itself is left as it was, so programs already built
    from it stay valid. The rows are permuted on the weights' own devices, with their shardings kept.
    - `donate=True` frees each layer's old gate_up as soon as its permuted copy exists, so the peak is one layer's
      gate_up, not all of them. `model` is then unusable: its gate_up arrays are deleted, and any use raises.
    - `permute=False` only marks the layout, for weights that are already in it.
    """
    experts = _experts_of(model)
    if enable and not experts and len(model.layers):
        raise ValueError("fused_swiglu: this model has no SwiGLU experts (Nemotron-H's are relu^2: no gate to fuse)")
    if all(e.gate_up_interleaved == enable for e in experts):
        return model
    if enable and experts[0].gate_up_proj.get_value().shape[1] % (2 * SWIGLU_BLOCK):
        raise ValueError(f"set_fused_swiglu: the interleaved layout needs moe_intermediate_size % {SWIGLU_BLOCK} == 0, "
                         f"got gate_up_proj {tuple(experts[0].gate_up_proj.get_value().shape)}")
    graphdef, state = nnx.split(model)
    new = nnx.merge(graphdef, state)  # new module objects: the flags below do not touch `model`'s graph
    for e in _experts_of(new):
        if e.gate_up_interleaved == enable:
            continue
        if permute:
            w = e.gate_up_proj.get_value()
            e.gate_up_proj = nnx.Param(_permuter(enable, w.sharding)(w))  # a new Variable: `model`'s keeps its array
            if donate:
                w.delete()
        e.gate_up_interleaved = enable
    return new
