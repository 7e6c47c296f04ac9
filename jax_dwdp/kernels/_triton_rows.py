"""Row-masked loads and stores for the Pallas Triton kernels (gdn_pallas, ssd_pallas).

Their sequence arrays are not padded to the chunk: a block's rows at or past the sequence's length t (static) read as
zeros and are not written. When t is a multiple of the chunk nothing is masked and the plain access is traced.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as plgpu


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def load_rows(ref, first, t: int, masked: bool):
    """ref[...], whose row 0 is row `first` of the sequence: rows at or past t read as zeros when `masked`."""
    if not masked:
        return ref[...]
    return plgpu.load(ref, mask=first + iota(ref.shape, 0) < t, other=jnp.zeros((), ref.dtype))


def store_rows(ref, value, first, t: int, masked: bool):
    """ref[...] = value (cast to ref's type), whose row 0 is row `first` of the sequence: rows at or past t are not
    written when `masked`."""
    value = value.astype(ref.dtype)
    if not masked:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=first + iota(ref.shape, 0) < t)
