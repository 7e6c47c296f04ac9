"""Choosing between a kernel's XLA and Pallas implementations, and which platform a computation is lowered for."""

from __future__ import annotations

import os

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


def env_flag(env: str, *, on: str, off: str) -> bool | None:
    """$env as a switch: "1" True, "0" False, unset or empty None (the caller's default); any other value refused,
    naming the variable and what 1 (`on`) and 0 (`off`) mean."""
    value = os.environ.get(env, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${env}={value!r}: use 1 ({on}) or 0 ({off})")
    return None if value == "" else value == "1"


def choose(implementation: str | None, env: str, *, what: str, choices: tuple[str, ...] = IMPLEMENTATIONS,
           arg: str = "implementation") -> str | None:
    """The choice asked for (the argument `arg`, else $env), validated against `choices` (by default a kernel's
    implementations); None when neither asks."""
    impl = implementation or os.environ.get(env) or None
    if impl is not None and impl not in choices:
        where = arg if implementation else env
        raise ValueError(f"{what}: {where}={impl!r} is none of {choices}")
    return impl


def by_platform(xla_fn, pallas_fn, *args, implementation: str | None, env: str, default: str, what: str):
    """Runs xla_fn(*args) or pallas_fn(*args).

    implementation="pallas" (tests, benchmarks): the kernel itself, whatever the platform. "xla" (argument or $env):
    XLA. "pallas" from $env, or `default`="pallas" when nothing asks: the kernel where the computation is lowered
    for a CUDA GPU and XLA elsewhere (decided at lowering, so a CPU computation on a GPU host takes the XLA path).
    """
    impl = choose(implementation, env, what=what) or default
    if implementation == "pallas":
        return pallas_fn(*args)
    if impl == "xla":
        return xla_fn(*args)
    return lax.platform_dependent(*args, cuda=pallas_fn, default=xla_fn)
