"""Choosing between a kernel's XLA and Pallas implementations, and which platform a computation is lowered for."""

from __future__ import annotations

import jax
from jax import lax

IMPLEMENTATIONS = ("xla", "pallas")


def default_platform() -> str:
    """The platform of the default backend ('cpu', 'gpu', 'tpu'). Whether the GPU kernels are traced at all depends
    on it (their GPU paths cannot be traced without a GPU: cuDNN's checks, the CUTLASS library); which of a kernel's
    forms runs is decided at lowering (`on_cuda`, `by_platform`), so a computation placed on the CPU of a GPU host
    takes the XLA forms."""
    return jax.default_backend()


def on_gpu() -> bool:
    return default_platform() == "gpu"


def on_cuda(gpu_fn, other_fn, *args):
    """gpu_fn(*args) where the computation is lowered for a CUDA GPU, other_fn(*args) elsewhere: both are traced and
    the choice is made at lowering (`lax.platform_dependent`). Without a GPU backend gpu_fn is not traced at all.
    The choice follows the placement inside jit (the model's programs are always jitted); called eagerly, JAX picks
    by the default backend instead."""
    if not on_gpu():
        return other_fn(*args)
    return lax.platform_dependent(*args, cuda=gpu_fn, default=other_fn)


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def check(value: str, allowed: tuple[str, ...], what: str) -> str:
    """`value` if it is one of `allowed`, else a ValueError naming `what` (e.g. "routing: implementation")."""
    if value not in allowed:
        raise ValueError(f"{what}={value!r} is none of {allowed}")
    return value


def by_platform(xla_fn, pallas_fn, *args, implementation: str | None, choice: str, what: str):
    """Runs xla_fn(*args) or pallas_fn(*args).

    `implementation` (tests, benchmarks) forces a form: "pallas" the kernel whatever the platform, "xla" XLA.
    Otherwise `choice` (the kernel's `KernelChoices` field): "pallas" the kernel where the computation is lowered
    for a CUDA GPU and XLA elsewhere (decided at lowering, so a CPU computation on a GPU host takes the XLA path),
    "xla" XLA.
    """
    if implementation is not None:
        check(implementation, IMPLEMENTATIONS, f"{what}: implementation")
        return pallas_fn(*args) if implementation == "pallas" else xla_fn(*args)
    if check(choice, IMPLEMENTATIONS, f"{what}: KernelChoices") == "xla":
        return xla_fn(*args)
    return lax.platform_dependent(*args, cuda=pallas_fn, default=xla_fn)
