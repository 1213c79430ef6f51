"""`parallelize_llama(model, dims)`: tensor parallelism, activation checkpointing, compile and FSDP
composed on a 2-D DeviceMesh, in torchtitan's order.

The mesh is ("dp", "tp"): the tensor-parallel dimension innermost, so that the t ranks of one TP
group are neighbours (the GPUs of one node, on NVLink) and FSDP's all-gathers and reduce-scatters,
which move parameters once per step, cross the slower links between nodes (Narayanan et al. 2021,
takeaway 1: tensor parallelism up to the GPUs of a server, other parallelisms across servers).

The order matters:
1. TP first (`apply_tp`): it turns the weights into DTensors sharded on "tp";
2. activation checkpointing per block (`apply_ac`): wraps the blocks, so a block's recomputation
   reruns its TP communication too;
3. compile per block (`apply_compile`): after AC, so the compiled region includes the recomputation
   policy; before FSDP, so FSDP's hooks stay outside the compiled graph;
4. FSDP last (`apply_fsdp` on "dp"): it shards the TP shards once more along "dp" (placements
   `(_StridedShard(0), Shard(0))`) and all-gathers each block's "dp" shards before it runs.
The AC, compile and FSDP steps are Day 5's (`dlo.distributed.fsdp`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from dlo.distributed.current import rank_device
from dlo.distributed.tensor_parallel import apply_tp, check_tp_degree


@dataclass(frozen=True)
class ParallelDims:
    """How to split a Llama over dp * tp ranks, and the per-block techniques to apply."""

    dp: int = 1                    # FSDP degree (across nodes)
    tp: int = 1                    # tensor-parallel degree (inside a node); must divide the KV heads
    ac: str = "none"               # activation checkpointing mode of apply_ac ("none", "full", ...)
    compile: bool = False          # torch.compile each block
    param_dtype: torch.dtype | None = None   # FSDP's compute dtype (bf16 on GPUs), None: the parameters'
    reduce_dtype: torch.dtype | None = None  # FSDP's gradient reduce-scatter dtype
    reshard_after_forward: bool = True       # ZeRO-3 (True) or keep the gathered blocks until backward
    cpu_offload: bool = False
    loss_parallel: bool = True     # leave the logits sharded by vocabulary (loss_parallel)
    fsdp: bool | None = None       # FSDP on "dp": None when dp > 1 (torchtitan's rule); True also at dp = 1
                                   # (Day 5's recipe: its MixedPrecisionPolicy whatever the world size)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp

    def validate(self, cfg, world_size: int | None = None) -> None:
        """ValueError (one line) before any process starts: degrees that do not divide the model or the world."""
        if self.dp < 1 or self.tp < 1:
            raise ValueError(f"dp and tp must be >= 1, got dp={self.dp}, tp={self.tp}")
        check_tp_degree(cfg, self.tp)
        if self.fsdp is False and self.dp > 1:
            raise ValueError(f"dp={self.dp} without FSDP would train {self.dp} unsynchronised replicas")
        if world_size is not None and world_size != self.world_size:
            raise ValueError(f"dp={self.dp} x tp={self.tp} = {self.world_size} ranks, but the world has {world_size}")

    def build_mesh(self, device_type: str = "cpu"):
        """The ("dp", "tp") DeviceMesh over every rank of the process group (tp innermost)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))


def parallelize_llama(model: nn.Module, dims: ParallelDims, mesh=None) -> nn.Module:
    """TP (+ sequence parallelism), activation checkpointing, compile, then FSDP, in place.

    `model` is preferably on the meta device (nothing is allocated before sharding: call
    `model.to_empty(device=...)` and `model.init_weights(seed)` afterwards). `mesh` defaults to
    `dims.build_mesh()` on the process group's device type."""
    dims.validate(model.config)
    if mesh is None:

        mesh = dims.build_mesh(rank_device().type)
    if dims.tp > 1:
        apply_tp(model, mesh["tp"], loss_parallel=dims.loss_parallel)
    fsdp = dims.dp > 1 if dims.fsdp is None else dims.fsdp
    if dims.ac != "none" or dims.compile or fsdp:
        from dlo.distributed.fsdp import apply_ac, apply_compile, apply_fsdp
        if dims.ac != "none":
            apply_ac(model, dims.ac)
        if dims.compile:
            apply_compile(model)
        if fsdp:
            apply_fsdp(model, mesh["dp"], param_dtype=dims.param_dtype, reduce_dtype=dims.reduce_dtype,
                       reshard_after_forward=dims.reshard_after_forward, cpu_offload=dims.cpu_offload)
    return model
