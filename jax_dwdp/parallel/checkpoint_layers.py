"""A checkpoint read one layer range at a time, for drivers that build a stage layer by layer (`build_placed`,
`ScannedModel.from_layers`): an HF folder is opened once for every range, and the ranges' load reports add up."""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_dwdp.families import FamilyConfig
from jax_dwdp.model import CausalLM, is_expert_weight, with_kernels
from jax_dwdp.model.moe import set_fused_swiglu
from jax_dwdp.sources import AXIS
from jax_dwdp.weights import is_orbax_checkpoint, load_checkpoint
from jax_dwdp.weights.hf_loader import LoadReport, _name_index, load_hf_checkpoint
from jax_dwdp.weights.safetensors_reader import SafetensorsCheckpoint


class CheckpointLayers:
    """make_range for build_placed from a checkpoint: layers [a, b) loaded onto `device` (an HF folder is opened
    once for every range), and the LoadReport of everything loaded so far.

    `row` (the stage's mesh row), with one process per device: the expert weights are loaded straight into their
    split placement over the row when the ranks divide the experts (no padding slots), so each process reads only
    its own experts' bytes (Orbax: its chunks; HF: its slices of the mapped file, when no cast is needed)."""

    def __init__(self, directory, cfg: FamilyConfig, dtype, device, *, fused_swiglu: bool = False, row=None,
                 kernels=None):
        """`kernels`: the kernel choices of the models it makes (default: the process's)."""
        self.directory, self.cfg, self.dtype, self.fused_swiglu = directory, cfg, dtype, fused_swiglu
        self.kernels = kernels
        self.sharding = jax.sharding.SingleDeviceSharding(device)
        ranks = 1 if row is None else row.shape[AXIS]
        direct = row is not None and jax.process_count() > 1 and cfg.num_experts % ranks == 0 and not fused_swiglu
        self.split = NamedSharding(row, P(AXIS)) if direct else None
        self.hf = None if is_orbax_checkpoint(directory) else SafetensorsCheckpoint(directory)
        self.reports: list = []

    def __call__(self, start_layer: int, end_layer: int) -> CausalLM:
        def placement(path, shape, dtype):
            return self.split if self.split is not None and is_expert_weight(path) else self.sharding

        if self.hf is None:
            model, report = load_checkpoint(self.directory, cfg=self.cfg, dtype=self.dtype, start_layer=start_layer,
                                            end_layer=end_layer, placement=placement, fused_swiglu=self.fused_swiglu)
        else:
            model, report = load_hf_checkpoint(self.hf, cfg=self.cfg, dtype=self.dtype, start_layer=start_layer,
                                               end_layer=end_layer, placement=placement)
            model = set_fused_swiglu(model, True, donate=True) if self.fused_swiglu else model
        self.reports.append(report)
        return model if self.kernels is None else with_kernels(model, self.kernels)

    def report(self, start_layer: int, end_layer: int):
        """One LoadReport for the range [start_layer, end_layer) loaded piece by piece."""
        total = LoadReport(skipped_non_text=self.reports[0].skipped_non_text if self.reports else 0)
        for r in self.reports:
            total.tensors_loaded += r.tensors_loaded
            total.bytes_read += r.bytes_read
            total.seconds += r.seconds
            for key, n in r.cast.items():
                total.cast[key] = total.cast.get(key, 0) + n
        if self.hf is not None:
            index = _name_index(self.hf)
            total.skipped_other_layers = sum(len(index.by_layer[layer])
                                             for layer in index.select(start_layer, end_layer)[1])
        return total

    def close(self) -> None:
        if self.hf is not None:
            self.hf.close()
