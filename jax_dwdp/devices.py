"""The device mesh: axis 'pipeline' (stages) x axis 'dwdp' (ranks that share each stage's experts)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

AXES = ("pipeline", "dwdp")


def builder_device(row) -> jax.Device:
    """The device of a mesh row (an array of devices) that this process builds a stage's weights on before they are
    placed on the row: the first one it drives (with one process per device, its own), else the row's first."""
    flat = list(np.asarray(row).flat)
    mine = [d for d in flat if d.process_index == jax.process_index()]
    return mine[0] if mine else flat[0]


def put(value, sharding):
    """jax.device_put onto `sharding`, also when the sharding spans devices of other processes (one process per
    device, jax.distributed): there every process passes the same whole value (a host array, or an array on one of
    its own devices) and keeps only its own devices' shards."""
    if jax.process_count() == 1 or sharding.is_fully_addressable:
        return jax.device_put(value, sharding)  # (a tuple of values: one call)
    if isinstance(value, tuple):
        return tuple(put(v, sharding) for v in value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:  # already a global array
        return jax.device_put(value, sharding)
    return jax.make_array_from_callback(np.shape(value), sharding, lambda index: value[index])


def make_mesh(pipeline: int = 1, dwdp: int = 1, devices: list[jax.Device] | None = None) -> Mesh:
    """A (pipeline, dwdp) mesh over the first pipeline * dwdp devices (all of them by default).

    Stage s owns row s of the mesh. On the CPU, tests get several devices with
    XLA_FLAGS=--xla_force_host_platform_device_count=N.
    """
    if pipeline < 1 or dwdp < 1:
        raise ValueError(f"mesh sizes must be >= 1, got pipeline={pipeline} dwdp={dwdp}")
    devices = list(jax.devices()) if devices is None else list(devices)
    need = pipeline * dwdp
    if len(devices) < need:
        raise ValueError(
            f"a mesh of pipeline={pipeline} x dwdp={dwdp} needs {need} devices; {len(devices)} "
            f"{devices[0].platform if devices else ''} device(s) are available"
        )
    return Mesh(np.array(devices[:need]).reshape(pipeline, dwdp), AXES)


def place(arrays, device: jax.Device | None = None) -> tuple:
    """The arrays on `device` by one transfer call (each call is host time before a prefill's first layer, the GPU
    idle: 0.08-0.3 ms between two copies in H100 traces); a host array goes without the copy program jnp.asarray
    would enqueue behind it. device None: host arrays to the default device, jax Arrays kept where they are."""
    arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for x in arrays]
    if device is not None:
        return tuple(jax.device_put(arrays, device))  # (an array already on `device` is not copied)
    moved = iter(jax.device_put([x for x in arrays if not isinstance(x, jax.Array)]))
    return tuple(x if isinstance(x, jax.Array) else next(moved) for x in arrays)
