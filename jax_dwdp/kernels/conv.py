"""Causal depthwise conv + SiLU of Gated DeltaNet's q/k/v channels: XLA and a Pallas (Triton) kernel.

out[b, t, c] = silu(sum_j w[c, j] * x[b, t - (K-1) + j, c]), zeros (or the cached inputs `history`) before t = 0,
in fp32, cast to x's dtype. XLA computes it as K shifted multiply-adds, a fusion at about 1.8 TB/s on the H200
(0.30 ms for 16K tokens x 8192 channels; it lays the projection out T-minor and transposes it back). The kernel
reads each [BT, BC] tile's K shifted windows (the overlap hits L1/L2) and writes the output once; rows before
t = 0 are masked loads (zeros), and with `history` the first K-1 rows, the only ones that read it, are recomputed
by the reference and written over the kernel's. With `splits` it reads each of q's, k's and v's channel ranges in
place and writes them as three arrays, so the split costs no copy.
Measured on an H200 (2026-12-01; benchmarks/RESULTS.md, "Gated DeltaNet kernels", the older rows in
benchmarks/history/RESULTS-2026-11-to-12.md): alone the kernel is 1.15-1.18x faster than XLA's conv at 16K-32K
tokens and slower at 4K. Writing one array, the whole mixer was 2-4% slower with it (the q/k/v slices became
copies); writing the three, the linear-attention layer is 1.6% / 0.5% faster at 16K / 32K, and 1.9% slower at 4K.
So the kernel is the default on CUDA from PALLAS_MIN_TOKENS tokens on (8,192: between the measured sizes, not
measured itself); `KernelChoices.conv` = xla|pallas chooses for every size. Tile: 32 rows x up to 128 channels (MAX_BLOCK_C), 4 warps: the fastest of six shapes inside the mixer (2026-12-01), and of seven
(rows, warps, channel block) tiles alone and inside the mixer at 16K and 32K (H200, 2026-12-03: 256- and 512-wide
channel blocks 5-98% slower alone).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_dwdp.kernels._backend import IMPLEMENTATIONS, check
from jax_dwdp.kernels.choices import SILU_FORMS, KernelChoices, resolve

PALLAS_MIN_TOKENS = 8192  # the default: the kernel from this many tokens (B x T) on, XLA below
_F32 = jnp.float32
BLOCK_T = 32  # rows of a program's tile
NUM_WARPS = 4
MAX_BLOCK_C = 128  # the widest channel block a program takes (a power of two; the kernel uses the widest dividing C)
ROWS_PER_PROGRAM = 1  # row tiles of BLOCK_T a program computes one after another (2-8 measured slower)
# SiLU inside the kernel (`KernelChoices.conv_silu`, or `silu=`): "ex2" (x * rcp.approx(1 + ex2.approx(-x log2 e)): an
# error of about 2 + 1.2|x| fp32 ulps, far below a bf16 step, so the bf16 output rounds as the exact form's but for
# one step at most), the default: the kernel 0.256 / 0.468 ms at 16K / 32K tokens against 0.271 / 0.520 with
# x / (1 + exp(-x)) from libdevice's exp (benchmarks/RESULTS.md, "Gated DeltaNet kernels": one H100, 2026-12-05,
# the three q / k / v calls of 35b-a3b). "tanh" (x/2 (1 + tanh.approx(x/2)): an absolute error of about 2^-12 |x|,
# which for negative x is the whole of the small value (cancellation); measured up to two bf16 steps off on
# unit-scale inputs) is kept as an option: as fast (0.250 / 0.462 ms, the mixer 2.834 vs 2.791 ms at 16K, within
# the mixer's run-to-run spread) but less accurate, so not the default.
_LOG2E = 1.4426950408889634


def causal_conv_silu_xla(x: jax.Array, weight: jax.Array, history: jax.Array | None = None) -> jax.Array:
    """x [B, T, C]; weight [C, 1, K]; history [B, K-1, C] or None (zeros). Returns silu(conv) in x's dtype."""
    return causal_conv_bias_silu_xla(x, weight, None, history)


def causal_conv_bias_silu_xla(x: jax.Array, weight: jax.Array, bias: jax.Array | None,
                              history: jax.Array | None = None) -> jax.Array:
    """silu(causal depthwise conv + bias) (Mamba-2's conv1d has a bias): x [B, T, C]; weight [C, 1, K]; bias [C] or
    None; history [B, K-1, C] or None (zeros). In fp32, returned in x's dtype."""
    kernel = weight.shape[-1]
    b, t, c = x.shape
    if history is None:
        history = jnp.zeros((b, kernel - 1, c), x.dtype)
    padded = jnp.concatenate([history.astype(x.dtype), x], axis=1).astype(_F32)
    w = weight[:, 0, :].astype(_F32)  # [C, K]
    out = sum(padded[:, j : j + t, :] * w[:, j] for j in range(kernel))
    if bias is not None:
        out = out + bias.astype(_F32)
    return jax.nn.silu(out).astype(x.dtype)


def _block_c(c: int) -> int:
    """The largest power of two <= MAX_BLOCK_C (read at each call) that divides C (0: none >= 16, the kernel does
    not apply)."""
    bc = MAX_BLOCK_C
    while bc >= 16:
        if c % bc == 0:
            return bc
        bc //= 2
    return 0


def supported(c: int, kernel: int) -> bool:
    return _block_c(c) > 0 and kernel & (kernel - 1) == 0


def _range_supported(c0: int, c1: int, c: int, kernel: int) -> bool:
    """The kernel can take channels [c0, c1) of c: supported widths, starting at a whole block."""
    return 0 <= c0 < c1 <= c and supported(c1 - c0, kernel) and c0 % _block_c(c1 - c0) == 0


def _silu(x, form: str, interpret: bool):
    """silu(x) of an fp32 tile inside a Pallas Triton kernel in one of SILU_FORMS (see above for each form's error).
    In interpret mode (no PTX) each form is its exact formula."""
    from jax.experimental.pallas import triton as plgpu

    if form == "tanh":
        half = 0.5 * x
        return half + half * (jnp.tanh(half) if interpret else plgpu.approx_tanh(half))
    if form == "ex2":
        if interpret:
            return x / (1.0 + jnp.exp2(x * -_LOG2E))

        def asm(op, v):
            return plgpu.elementwise_inline_asm(f"{op} $0, $1;", args=[v], constraints="=f,f", pack=1,
                                                result_shape_dtypes=[jax.ShapeDtypeStruct(v.shape, v.dtype)])[0]

        return x * asm("rcp.approx.ftz.f32", 1.0 + asm("ex2.approx.ftz.f32", x * -_LOG2E))
    raise ValueError(f"conv SiLU form {form!r} is none of {SILU_FORMS}")  # (callers check the form)


def conv_silu_rows(x_ref, w_ref, start, rows: int, *, t: int, kernel: int, offset: int, silu: str,
                   interpret: bool = False):
    """Inside a Pallas Triton kernel: silu(causal conv) of rows [start, start + rows) of x_ref [T(+padding), BC]
    with taps w_ref [K, BC], in fp32, and those rows' indices ([rows, BC], to mask what is stored). Rows before 0
    and past T are masked loads: no memory is read there. `offset` > 0 only in interpret mode, where x is
    left-padded (the interpreter clamps out-of-range slices instead of masking them)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    w = w_ref[...].astype(_F32)  # [K, BC]
    tap = lax.broadcasted_iota(jnp.int32, w.shape, 0)
    shape = (rows, x_ref.shape[-1])
    row = start + lax.broadcasted_iota(jnp.int32, shape, 0)
    acc = jnp.zeros(shape, _F32)
    for j in range(kernel):
        shift = kernel - 1 - j
        src = row - shift
        xs = plgpu.load(x_ref.at[pl.ds(start - shift + offset, rows), :], mask=(src >= 0) & (src < t),
                        other=jnp.zeros((), x_ref.dtype))
        acc = acc + xs.astype(_F32) * jnp.sum(jnp.where(tap == j, w, 0.0), axis=0)[None, :]
    return _silu(acc, silu, interpret), row


def _conv_kernel(x_ref, w_ref, *refs, t: int, kernel: int, offset: int, rows: int, silu: str, interpret: bool):
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    o_ref = refs[-1]  # (refs[0] is the aliased output buffer when one is given)
    span = o_ref.shape[0]  # rows x the tiles of one program
    for i in range(span // rows):
        out, row = conv_silu_rows(x_ref, w_ref, pl.program_id(1) * span + i * rows, rows, t=t, kernel=kernel,
                                  offset=offset, silu=silu, interpret=interpret)
        plgpu.store(o_ref.at[pl.ds(i * rows, rows), :], out.astype(o_ref.dtype), mask=row < t)


def causal_conv_silu_pallas(x: jax.Array, weight: jax.Array, history: jax.Array | None = None, *,
                            out: jax.Array | None = None, channels: tuple[int, int] | None = None,
                            block_t: int | None = None, num_warps: int | None = None,
                            rows_per_program: int | None = None, silu: str | None = None,
                            interpret: bool = False) -> jax.Array:
    """The kernel over channels [c0, c1) of x (`channels`; all by default): returns [B, T, c1 - c0], read in place
    (no slice of x is copied). `out` (tests): a buffer of the output's shape the kernel writes into (a poisoned one
    shows unwritten rows). `block_t`, `num_warps`, `rows_per_program`, `silu`: the tile's rows, the warps per
    program, the row tiles one program computes in turn and the SiLU's form (default: the module's BLOCK_T,
    NUM_WARPS, ROWS_PER_PROGRAM, and the process's `KernelChoices.conv_silu`)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, t, c = x.shape
    # (the module's, read at each call)
    block_t = BLOCK_T if block_t is None else block_t
    num_warps = NUM_WARPS if num_warps is None else num_warps
    reps = ROWS_PER_PROGRAM if rows_per_program is None else rows_per_program
    silu = check(silu or resolve(None).conv_silu, SILU_FORMS, "causal_conv_silu_pallas: silu")
    if min(block_t, num_warps, reps) < 1:
        raise ValueError(f"causal_conv_silu_pallas: block_t {block_t}, num_warps {num_warps}, rows_per_program "
                         f"{reps}: each must be >= 1")
    c0, c1 = channels or (0, c)
    kernel = weight.shape[-1]
    bc = _block_c(c1 - c0)
    if not _range_supported(c0, c1, c, kernel):
        raise ValueError(f"causal_conv_silu_pallas: channels {c1 - c0} (of {c}, from {c0}) need a power-of-two "
                         f"block >= 16 dividing them and their start, and a power-of-two kernel width (got {kernel})")
    offset = kernel - 1 if interpret else 0
    span = block_t * reps  # rows per program
    xin = jnp.pad(x, ((0, 0), (offset, span), (0, 0))) if interpret else x
    w = jnp.swapaxes(weight[:, 0, :], 0, 1)  # [K, C]
    first = c0 // bc  # the channel block the range starts at
    out_spec = pl.BlockSpec((None, span, bc), lambda i, n, j: (i, n, j))
    y = pl.pallas_call(
        functools.partial(_conv_kernel, t=t, kernel=kernel, offset=offset, rows=block_t, silu=silu,
                          interpret=interpret),
        grid=(b, pl.cdiv(t, span), (c1 - c0) // bc),
        in_specs=[pl.BlockSpec((None, xin.shape[1], bc), lambda i, n, j: (i, 0, j + first)),
                  pl.BlockSpec((kernel, bc), lambda i, n, j: (0, j + first))] + ([] if out is None else [out_spec]),
        out_specs=out_spec,
        input_output_aliases={} if out is None else {2: 0},
        out_shape=jax.ShapeDtypeStruct((b, t, c1 - c0), x.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gdn_causal_conv_silu",
    )(xin, w, *([] if out is None else [out]))
    if history is not None:  # the first K-1 rows read the cached inputs: the reference recomputes them
        head = min(kernel - 1, t)
        y = y.at[:, :head].set(causal_conv_silu_xla(x[:, :head, c0:c1], weight[c0:c1], history[..., c0:c1]))
    return y


def causal_conv_silu(x: jax.Array, weight: jax.Array, history: jax.Array | None = None, *,
                     implementation: str | None = None, splits: tuple[int, ...] = (),
                     kernels: KernelChoices | None = None):
    """silu(causal depthwise conv) of x [B, T, C] with weight [C, 1, K], zeros or `history` [B, K-1, C] before
    t = 0; fp32 math, x's dtype out. `splits` (channel indices, as jnp.split's): returns the pieces of the output
    instead, which the kernel writes as separate arrays (no copy of a slice; Gated DeltaNet's q, k, v).
    The kernel where the computation is lowered for a CUDA GPU (16-bit inputs, supported shapes) from
    PALLAS_MIN_TOKENS tokens (B x T) on, XLA below and elsewhere; "xla" / "pallas" (`implementation`, else
    `kernels.conv`; default the process's `KernelChoices`) choose for every size, the kernel still only where
    lowered for CUDA. Its SiLU: `kernels.conv_silu`."""
    kernels = resolve(kernels)
    c, kernel = x.shape[-1], weight.shape[-1]
    bounds = list(zip((0, *splits), (*splits, c)))

    def xla(x, weight, history):
        out = causal_conv_silu_xla(x, weight, history)
        return tuple(jnp.split(out, list(splits), axis=-1)) if splits else out

    def pallas(x, weight, history):
        pieces = tuple(causal_conv_silu_pallas(x, weight, history, channels=r, silu=kernels.conv_silu)
                       for r in bounds)
        return pieces if splits else pieces[0]

    if implementation is not None:
        check(implementation, IMPLEMENTATIONS, "causal_conv_silu: implementation")
    impl = implementation or kernels.conv
    if impl is None:  # the kernel from PALLAS_MIN_TOKENS tokens on (measured faster there, see the module doc)
        impl = "pallas" if x.shape[0] * x.shape[1] >= PALLAS_MIN_TOKENS else "xla"
    fits = all(_range_supported(a, b, c, kernel) for a, b in bounds)
    if impl == "xla" or x.dtype not in (jnp.bfloat16, jnp.float16) or not fits:
        return xla(x, weight, history)
    # Decided when lowered: a CPU computation on a GPU host takes the XLA path.
    return lax.platform_dependent(x, weight, history, cuda=pallas, default=xla)
