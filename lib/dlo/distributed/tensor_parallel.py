"""Tensor parallelism: Megatron-LM's layers written by hand, and the same plan with DTensor.

**By hand** (Shoeybi et al. 2019; Korthikanti et al. 2022 for sequence parallelism), every layer is
built from a full one (`nn.Linear`, `nn.Embedding`) and keeps this rank's slice of it. Rank r of t
holds the r-th contiguous block of the split dimension; the communication is in `tp_comms`:

- `ColumnParallelLinear`: W split by output features (rows of W in torch's (out, in) layout);
  the input is replicated (f before it) and the output stays split (or is all-gathered);
- `RowParallelLinear`: W split by input features; the input arrives split, the partial outputs are
  summed by g (or reduce-scattered along the sequence with sequence parallelism);
- `VocabParallelEmbedding` and `vocab_parallel_cross_entropy`: the vocabulary split across ranks,
  the loss computed without ever building the whole logits on one rank (Megatron-LM's
  `_VocabParallelCrossEntropy`);
- `TensorParallelSwiGLU`, `TensorParallelAttention` and `apply_megatron_tp(model, group)`: the
  Llama's blocks split by hidden units and heads, one all-reduce forward and one backward each.
(`dlo.distributed.tp_gpt` splits Korthikanti et al.'s GPT layer, Day 7's tables' model, with them.)

**With DTensor**, `apply_tp(model, mesh)` gives torch's `parallelize_module` the same plan for the
Llama (torchtitan's `apply_tp`): rowwise embedding, sequence-parallel norms, colwise q/k/v/w1/w3,
rowwise wo/w2, colwise output with the logits left sharded for `loss_parallel`.

`check_tp_degree(cfg, t)` refuses a degree that does not divide the heads, the KV heads, the hidden,
MLP or vocabulary sizes, in one line naming the dimension, before any process starts. (About 300 lines:
the layers by hand and the same split with DTensor, side by side as the day teaches them.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.distributed.tp_comms import (
    all_gather_linear,
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_tp,
    tp_rank,
    tp_size,
)
from dlo.distributed.tp_comms import all_reduce as _sum_over

SEQ_DIM = 1  # activations are (B, T, C): the sequence is dimension 1


# ----------------------------------------------------------------------------- checking a degree

def check_tp_degree(cfg, t: int) -> None:
    """ValueError (one line, naming the dimension) unless t divides every size tensor parallelism
    splits: query heads, KV heads (the bound of grouped-query attention), hidden, MLP and vocabulary."""
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"tensor-parallel degree must be a positive int, got {t!r}")
    for name in ("n_kv_heads", "n_heads", "dim", "ffn_dim", "vocab_size"):
        size = getattr(cfg, name, None)
        if size is not None and size % t:
            raise ValueError(f"tensor-parallel degree {t} does not divide {name}={size}"
                             + (" (each rank needs whole KV heads: t <= n_kv_heads)" if name == "n_kv_heads" else ""))


def _rows(w: Tensor, group, parts: int = 1) -> Tensor:
    """This rank's block of rows of w; with parts > 1 (a fused [q|k|v] weight) each part is split."""
    t, r = tp_size(group), tp_rank(group)
    blocks = w.chunk(parts, 0)
    for i, b in enumerate(blocks):
        if b.shape[0] % t:
            raise ValueError(f"{b.shape[0]} output features{f' in part {i}' if parts > 1 else ''} cannot be split "
                             f"into {t} equal shards")
    return torch.cat([b.chunk(t, 0)[r] for b in blocks]).detach().clone()


# ----------------------------------------------------------------------------- linear layers

class ColumnParallelLinear(nn.Module):
    """Y_r = X W_r^T + b_r with W = [W_0; ...; W_{t-1}] split by output features.

    `comm_input`: apply f to the input here (or, with `sequence_parallel`, all-gather the sequence
    shard, saving only the shard: `tp_comms.AllGatherLinear`, as Megatron-LM does). Set it False when several column
    layers share one input (q, k, v; w1 and w3): the caller applies f or the gather once, otherwise
    backward would all-reduce the same input gradient once per layer. `gather_output` all-gathers
    the output features; `parts` splits a fused [q|k|v] weight part by part.
    """

    def __init__(self, linear: nn.Linear, group=None, *, gather_output: bool = False,
                 sequence_parallel: bool = False, comm_input: bool = True, parts: int = 1):
        super().__init__()
        self.group, self.gather_output, self.sp, self.comm_input = group, gather_output, sequence_parallel, comm_input
        self.weight = nn.Parameter(_rows(linear.weight, group, parts))  # (out/t, in)
        self.bias = nn.Parameter(_rows(linear.bias, group, parts)) if linear.bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        if self.comm_input and self.sp:
            y = all_gather_linear(x, self.weight, self.bias, SEQ_DIM, self.group)  # (B, T, out/t)
        else:
            y = F.linear(copy_to_tp(x, self.group) if self.comm_input else x, self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = sum_r X_r W_r^T + b with W = [W_0, ..., W_{t-1}] split by input features.

    The input arrives split by features (`input_is_parallel`, the output of a column layer) or is
    split here. The partial products are summed by g, or reduce-scattered along the sequence with
    `sequence_parallel`; the bias, replicated, is added once after the sum.
    """

    def __init__(self, linear: nn.Linear, group=None, *, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        self.group, self.input_is_parallel, self.sp = group, input_is_parallel, sequence_parallel
        self.weight = nn.Parameter(_rows(linear.weight.t(), group).t().contiguous())  # (out, in/t)
        self.bias = nn.Parameter(linear.bias.detach().clone()) if linear.bias is not None else None
        if self.bias is not None and sequence_parallel:  # added to this rank's tokens only
            self.bias.sequence_parallel = True

    def forward(self, x: Tensor) -> Tensor:
        x = x if self.input_is_parallel else scatter_to_tp(x, self.group)
        partial = F.linear(x, self.weight)  # (B, T, out): this rank's share of the sum
        y = reduce_scatter_to_sp(partial, SEQ_DIM, self.group) if self.sp else reduce_from_tp(partial, self.group)
        return y + self.bias if self.bias is not None else y


# ----------------------------------------------------------------------------- the vocabulary

class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r V/t, (r+1) V/t) of the table: tokens outside it look up zeros, and the
    sum over ranks (g, or a reduce-scatter of the sequence) gives every token its row."""

    def __init__(self, embedding: nn.Embedding, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.weight = nn.Parameter(_rows(embedding.weight, group))  # (V/t, C)
        self.start = tp_rank(group) * self.weight.shape[0]

    def forward(self, tokens: Tensor) -> Tensor:
        local = tokens - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        partial = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_scatter_to_sp(partial, SEQ_DIM, self.group) if self.sp else reduce_from_tp(partial, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split by vocabulary: three all-reduces of N numbers each
    (the max, the target's logit, the sum of exponentials), never the (N, V) logits."""

    @staticmethod
    def forward(ctx, logits, target, group):
        start = tp_rank(group) * logits.shape[-1]
        logits_max = logits.max(-1).values
        torch.distributed.all_reduce(logits_max, op=torch.distributed.ReduceOp.MAX, group=group)
        z = logits - logits_max[:, None]  # (N, V/t), <= 0: exp cannot overflow
        local = target - start
        outside = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(outside, 0)
        target_z = z.gather(1, local[:, None]).squeeze(1).masked_fill(outside, 0.0)
        torch.distributed.all_reduce(target_z, group=group)
        exp = z.exp()
        sum_exp = exp.sum(-1)
        torch.distributed.all_reduce(sum_exp, group=group)
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local, outside)  # the local softmax slice
        return sum_exp.log() - target_z

    @staticmethod
    def backward(ctx, grad):
        softmax, local, outside = ctx.saved_tensors
        grad_logits = softmax.clone()
        rows = torch.arange(len(local), device=local.device)
        grad_logits[rows, local] -= (~outside).to(grad_logits.dtype)  # d/dz (logsumexp - z_y) = p - onehot
        return grad_logits * grad[:, None], None, None


def vocab_parallel_cross_entropy(logits: Tensor, target: Tensor, group=None, reduction: str = "mean") -> Tensor:
    """Cross-entropy of (..., V/t) logits split by vocabulary against global targets (...)."""
    flat, tgt = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if tp_size(group) == 1:
        return F.cross_entropy(flat, tgt, reduction=reduction)
    losses = _VocabParallelCrossEntropy.apply(flat, tgt, group)
    return {"mean": losses.mean, "sum": losses.sum}.get(reduction, lambda: losses.view(target.shape))()


# ----------------------------------------------------------------------------- the Llama's blocks by hand

def _enter(x: Tensor, group, sp: bool) -> Tensor:
    """Into a tensor-parallel region: f, or the all-gather of the sequence shard."""
    return gather_from_sp(x, SEQ_DIM, group) if sp else copy_to_tp(x, group)


class TensorParallelSwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) with w1, w3 column-parallel and w2 row-parallel: f once at the entry
    (shared by w1 and w3) and g at the exit, one all-reduce forward and one backward."""

    def __init__(self, ffn: nn.Module, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.w1 = ColumnParallelLinear(ffn.w1, group, comm_input=False)
        self.w3 = ColumnParallelLinear(ffn.w3, group, comm_input=False)
        self.w2 = RowParallelLinear(ffn.w2, group, sequence_parallel=sequence_parallel)
        self.ffn_forward = type(ffn).forward  # the block's own maths, run with the sharded layers

    def forward(self, x: Tensor) -> Tensor:
        return self.ffn_forward(self, _enter(x, self.group, self.sp))  # (B, T, C) or (B, T/t, C)


def attention_heads(attention: nn.Module) -> tuple[int, int]:
    """(query heads, KV heads) of a Llama attention, from its projections' shapes."""
    return attention.wq.out_features // attention.head_dim, attention.wk.out_features // attention.head_dim


class TensorParallelAttention(nn.Module):
    """The Llama's grouped-query attention with this rank's n_heads/t query heads and n_kv_heads/t KV
    heads: wq, wk, wv column-parallel (whole heads: a head is a contiguous block of rows), wo
    row-parallel. Query head i reads KV head i // (n_heads / n_kv_heads); contiguous blocks of both
    keep that pairing on one rank, which is why t must divide n_kv_heads. The Llama's forward runs
    unchanged on the shards: it reads the head counts from the shapes."""

    def __init__(self, attention: nn.Module, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        t = tp_size(group)
        n_heads, n_kv_heads = attention_heads(attention)
        for name, n in (("n_kv_heads", n_kv_heads), ("n_heads", n_heads)):
            if n % t:
                raise ValueError(f"tensor-parallel degree {t} does not divide {name}={n}")
        self.group, self.sp, self.head_dim = group, sequence_parallel, attention.head_dim
        self.wq, self.wk, self.wv = (ColumnParallelLinear(getattr(attention, n), group, comm_input=False)
                                     for n in ("wq", "wk", "wv"))
        self.wo = RowParallelLinear(attention.wo, group, sequence_parallel=sequence_parallel)
        self.attention_forward = type(attention).forward

    def forward(self, x: Tensor, *args) -> Tensor:
        return self.attention_forward(self, _enter(x, self.group, self.sp), *args)


def apply_megatron_tp(model: nn.Module, group=None, *, sequence_parallel: bool = False) -> nn.Module:
    """The Llama split by hand, in place: vocabulary-parallel embedding, every block's attention and
    MLP, and a column-parallel output whose logits stay split by vocabulary (use
    `vocab_parallel_cross_entropy`). With `sequence_parallel` the norms and residuals run on 1/t of
    the sequence. Norm weights are replicated: with sequence parallelism each rank's norm sees other
    tokens, so their gradients are all-reduced after backward (`sync_replicated_grads`)."""
    check_tp_degree(model.config, tp_size(group))
    sp = sequence_parallel
    model.tok_embeddings = VocabParallelEmbedding(model.tok_embeddings, group, sequence_parallel=sp)
    for block in model.layers.values():
        block.attention = TensorParallelAttention(block.attention, group, sequence_parallel=sp)
        block.feed_forward = TensorParallelSwiGLU(block.feed_forward, group, sequence_parallel=sp)
    model.output = ColumnParallelLinear(model.output, group, sequence_parallel=sp)  # (B, T, V/t)
    model.tie_weights()  # a tied table: the same rows of the same Parameter again
    if sp:  # replicated norms see only this rank's tokens: their gradients are partial sums
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.sequence_parallel = True
    return model


def sync_replicated_grads(model: nn.Module, group=None) -> int:
    """Sum over the group the gradients of replicated parameters that saw only this rank's tokens
    (marked `p.sequence_parallel = True`: norm weights and row-parallel biases under sequence
    parallelism; Megatron-LM all-reduces them after backward). Returns the number of tensors reduced."""
    n = 0
    for p in model.parameters():
        if p.grad is not None and getattr(p, "sequence_parallel", False):
            p.grad.copy_(_sum_over(p.grad, group))
            n += 1
    return n


# ----------------------------------------------------------------------------- the same with DTensor

def llama_tp_plan(loss_parallel: bool = True) -> tuple[dict, dict]:
    """torchtitan's plan for the Llama: (top-level plan, per-block plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=Shard(1),
                                     output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                     use_local_output=not loss_parallel)}
    block = {"attention_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),  # (x, cos, sin)
                                             desired_input_layouts=(Replicate(), None, None)),
             "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
             "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "ffn_norm": SequenceParallel(),
             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
             "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    return top, block


def apply_tp(model: nn.Module, mesh, *, loss_parallel: bool = True) -> nn.Module:
    """Tensor + sequence parallelism of the Llama over the 1-D `mesh` with DTensor (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    check_tp_degree(model.config, mesh.size())
    top, block_plan = llama_tp_plan(loss_parallel)
    parallelize_module(model, mesh, top)
    model.tie_weights()  # parallelize_module gave each module its own weight: tie them again (both Shard(0))
    for block in model.layers.values():
        parallelize_module(block, mesh, block_plan)  # the attention reads its local head counts from the shapes
    return model
