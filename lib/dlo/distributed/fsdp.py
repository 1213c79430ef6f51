"""FSDP2 on a Llama: torchtitan's short `apply_*` steps, each with explicit arguments.

PyTorch's `fully_shard` (FSDP2) is ZeRO-3 (`dlo.distributed.zero.ZeRO3`) done per parameter: every
parameter becomes a DTensor sharded on dim 0 over the mesh (`Shard(0)`), and each module given to
`fully_shard` is one *unit* whose parameters are all-gathered together before its forward (and
again before its backward when `reshard_after_forward`), while its gradients are reduce-scattered
after its backward. FSDP1 instead flattened a unit's parameters into one `FlatParameter` sharded as
a whole (the layout of our ZeRO engines): simpler collectives, but per-parameter dtypes, freezing
and optimizer state were awkward. FSDP2's DTensors keep each parameter's identity and shape.

The order matters, and is torchtitan's (`parallelize_llama`):

    apply_tp(model, tp_mesh)        # 1. tensor parallel (Day 7): DTensor plans on the blocks
    apply_ac(model, "full")         # 2. activation checkpointing wraps each block (Day 3)
    apply_compile(model)            # 3. torch.compile each block (repeated blocks compile once)
    apply_fsdp(model, dp_mesh, ...) # 4. fully_shard each block, then the root: outermost wrapper

FSDP goes last so that its hooks see the checkpointed, compiled block as one unit (recomputation
in backward then re-runs inside the unit while its parameters are gathered), and its all-gathers
stay outside the compiled graph. A tied embedding (Llama 3.2) must stay in one unit with the output
head, so both belong to the root.
"""

from __future__ import annotations

import torch
from torch import nn

AC_MODES = ("none", "full", "selective")


def _blocks(model: nn.Module) -> nn.ModuleDict:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleDict):
        raise TypeError(f"expected a model with a `layers` ModuleDict of blocks (dlo.models.llama.Llama), got "
                        f"{type(model).__name__}")
    return layers


def apply_ac(model: nn.Module, mode: str = "full") -> nn.Module:
    """Activation checkpointing per block (Chen et al. 2016; Day 3): "full" wraps every block,
    "selective" every second one (torchtitan's per-layer selective AC), "none" nothing. Only the
    block inputs stay saved; backward recomputes each block's forward."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from dlo.activation_ckpt import every_kth

    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    layers = _blocks(model)
    if mode == "none":
        return model
    names = list(layers.keys())
    chosen = range(len(names)) if mode == "full" else every_kth(len(names), 2)
    for i in chosen:
        # preserve_rng_state=False: a Llama has no dropout, so there is no RNG to replay
        layers.register_module(names[i], checkpoint_wrapper(layers[names[i]], preserve_rng_state=False))
    return model


def apply_compile(model: nn.Module) -> nn.Module:
    """torch.compile each block on its own (torchtitan): the blocks are identical, so the graph is
    compiled once and reused; fullgraph=True fails loudly on a graph break."""
    layers = _blocks(model)
    for name, block in list(layers.named_children()):
        layers.register_module(name, torch.compile(block, fullgraph=True))
    return model


def apply_fsdp(model: nn.Module, mesh, *, param_dtype: torch.dtype | None = torch.bfloat16,
               reduce_dtype: torch.dtype | None = torch.float32, reshard_after_forward: bool = True,
               cpu_offload: bool = False) -> nn.Module:
    """fully_shard each block, then the root (torchtitan's order), with a MixedPrecisionPolicy.

    param_dtype: the dtype parameters are all-gathered in and computed with (bf16 halves the
    all-gather bytes); the sharded fp32 parameters stay the optimizer's master copy. reduce_dtype:
    the dtype gradients are reduce-scattered in (fp32 keeps the sum exact enough over many ranks).
    None keeps the parameters' own dtype. reshard_after_forward: free a block's gathered parameters
    after its forward and gather them again for backward (ZeRO-3, 3 Psi) or keep them (2 Psi, more
    memory). cpu_offload: the shards, their gradients and the optimizer step live in host memory
    (ZeRO-Offload, Ren et al. 2021), moved to the GPU for each use.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kw = {"mesh": mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)}
    if cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    for unit, reshard in fsdp_units(model, reshard_after_forward):
        fully_shard(unit, reshard_after_forward=reshard, **kw)
    return model


def fsdp_units(model: nn.Module, reshard_after_forward: bool = True) -> list[tuple[nn.Module | list, bool]]:
    """The units `apply_fsdp` wraps, inner first (the root last), each with its reshard_after_forward:
    the one place that decides which units stay gathered after forward (Day 5's report counts the bytes
    sent from it). An untied embedding and every block but the last follow `reshard_after_forward`; the
    last block stays gathered (its backward comes right after its forward: resharding would only gather
    it again), and so do the final norm with an untied output head (backward starts there); the root
    holds what is left (a tied embedding and head) and follows `reshard_after_forward`."""
    embed, output = getattr(model, "tok_embeddings", None), getattr(model, "output", None)
    tied = embed is not None and output is not None and output.weight is embed.weight
    blocks = list(_blocks(model).values())
    units = [(embed, reshard_after_forward)] if embed is not None and not tied else []
    units += [(block, reshard_after_forward and i < len(blocks) - 1) for i, block in enumerate(blocks)]
    if output is not None and not tied:
        units.append(([model.norm, output], False))
    return units + [(model, reshard_after_forward)]


__all__ = ["AC_MODES", "apply_ac", "apply_compile", "apply_fsdp", "fsdp_units"]
