"""1-bit Adam (Tang et al. 2021): data-parallel Adam whose communication shrinks to one bit per value.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) makes 1-bit compression work for SGD and
momentum SGD: compress x + e to sign(x + e) times a scale, keep what was lost, e <- x + e - C(x + e),
and add it to the next message, so that no error is lost for good. It fails for Adam, whose update
m / sqrt(v) is not linear in the gradient. Tang et al. observed that Adam's variance v stops changing
early in training, and split the run in two:

1. **warm-up** (`warmup_steps`): plain Adam, gradients averaged by a full-precision all-reduce;
2. **compression**: v frozen at its warm-up value, so Adam becomes momentum SGD with a fixed
   per-coordinate learning rate lr / sqrt(v), which is linear: each rank updates the momentum with
   its *local* gradient, m_i = b1 m + (1 - b1) g_i, and the ranks average the m_i with a compressed
   all-reduce (`compressed_allreduce`: 1 bit per value plus one fp32 scale per chunk, error feedback
   on the sender and on the "server" that owns each chunk). Every rank gets the same averaged m.

Bytes per compressed step (ring model, n values, N ranks): 2 (N-1)/N * n (1/8 + 4/chunk) against
2 (N-1)/N * 4n for an fp32 all-reduce: 1/32 + 1/chunk, the "97% less" of the paper (94% against fp16).
The warm-up is full precision, so a whole run saves less (`dlo.experiments.day4.onebit_adam`).
0/1 Adam (Lu et al. 2022) goes further: the variance is frozen adaptively (no fixed warm-up) and
rounds are skipped altogether with local steps; not implemented here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from dlo.distributed.collectives import all_gather_single

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(x: Tensor) -> Tensor:
    """(n,) float, n a multiple of 8 -> (n / 8,) uint8: bit k of byte j is 1 where x[8 j + k] >= 0."""
    if x.dim() != 1 or x.numel() % 8:
        raise ValueError(f"pack_signs: need a flat tensor of a multiple of 8 values, got shape {tuple(x.shape)}")
    bits = (x >= 0).view(-1, 8).to(torch.uint8)  # (n/8, 8)
    return (bits * _BITS.to(x.device)).sum(1, dtype=torch.uint8)


def unpack_signs(packed: Tensor) -> Tensor:
    """(n / 8,) uint8 -> (n,) float32 of +1 and -1 (the inverse of `pack_signs` on the signs)."""
    bits = (packed.unsqueeze(1) & _BITS.to(packed.device)) != 0  # (n/8, 8)
    return bits.flatten().to(torch.float32) * 2 - 1


def compress(x: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """1-bit compression of a flat x (its length a multiple of `chunk`, `chunk` of 8): the packed signs
    and one scale per chunk, the mean |x| of the chunk (the scale s minimising |x - s sign(x)|^2)."""
    return pack_signs(x), x.view(-1, chunk).abs().mean(1)  # (n/8,) uint8, (n/chunk,) float32


def decompress(packed: Tensor, scales: Tensor, chunk: int) -> Tensor:
    """sign times the scale of its chunk: (n,) float32."""
    return (unpack_signs(packed).view(-1, chunk) * scales.unsqueeze(1)).flatten()


def padded_size(n: int, world_size: int, chunk: int) -> int:
    """n rounded up so that every rank's part is a whole number of chunks."""
    return math.ceil(n / (world_size * chunk)) * world_size * chunk


def _message(bits: Tensor, scales: Tensor, parts: int) -> Tensor:
    """Signs and scales in one uint8 buffer (parts, bytes of one part), so one collective carries both."""
    return torch.cat([bits.view(parts, -1), scales.view(torch.uint8).view(parts, -1)], dim=1)


def _split(msg: Tensor, parts: int, n_bits: int) -> tuple[Tensor, Tensor]:
    """The inverse of `_message`: (packed signs, float32 scales), each flat."""
    msg = msg.view(parts, -1)
    return msg[:, :n_bits].reshape(-1), msg[:, n_bits:].contiguous().view(torch.float32).reshape(-1)


def compressed_allreduce(x: Tensor, worker_error: Tensor, server_error: Tensor, chunk: int, group=None) -> Tensor:
    """The mean of x over the ranks, sent with 1 bit per value (Tang et al. 2021, Algorithm 1).

    x, worker_error: (n,) with n a multiple of N * chunk; server_error: (n / N,), this rank's part.
    1. worker: compress x + e_w, keep the residual in e_w;
    2. all-to-all: rank r receives every rank's compressed part r (signs and scales, one message);
    3. server: rank r averages the N decompressed parts, adds e_s, compresses again, keeps the residual;
    4. all-gather of the compressed parts: every rank decompresses the same averaged vector.
    The error buffers are updated in place; the result is a new (n,) tensor, equal on every rank."""
    world_size = dist.get_world_size(group)
    n = x.numel()
    if n % (world_size * chunk) or chunk % 8 or server_error.numel() * world_size != n:
        raise ValueError(f"compressed_allreduce: {n} values do not split into {world_size} parts of whole "
                         f"{chunk}-value chunks (chunk a multiple of 8, server_error of n / world_size values)")
    part_bits = n // world_size // 8
    v = x + worker_error
    bits, scales = compress(v, chunk)
    worker_error.copy_(v - decompress(bits, scales, chunk))
    msg = _message(bits, scales, world_size)  # (N, part bytes): row r goes to rank r
    received = torch.empty_like(msg)
    dist.all_to_all_single(received, msg, group=group)
    r_bits, r_scales = _split(received, world_size, part_bits)  # every rank's part r
    part = decompress(r_bits, r_scales, chunk).view(world_size, -1).mean(0) + server_error  # (n / N,)
    s_bits, s_scales = compress(part, chunk)
    server_error.copy_(part - decompress(s_bits, s_scales, chunk))
    mine = _message(s_bits, s_scales, 1).flatten()
    gathered = torch.empty(world_size * mine.numel(), dtype=mine.dtype, device=x.device)
    all_gather_single(gathered, mine, group=group)
    g_bits, g_scales = _split(gathered, world_size, part_bits)
    return decompress(g_bits, g_scales, chunk)


class OneBitAdam:
    """Data-parallel Adam (AdamW's decoupled weight decay) with 1-bit communication after a warm-up.

    Use without a DDP wrapper: every rank runs forward and backward on its own batch, then
    `step()` does the communication. Rank 0's parameters are broadcast at construction. During the
    first `warmup_steps` steps it is data-parallel AdamW (fp32 all-reduce of the gradients, the same
    numbers as torch's AdamW on the averaged gradient); afterwards v is frozen and the momentum is
    averaged by `compressed_allreduce` (or, with compression=False, the control, by an fp32
    all-reduce). Bias corrections: m by 1 - b1^t, the frozen v by 1 - b2^T_w.

    Coordinates that got no gradient at all during the warm-up (v = 0: a dead ReLU unit's weights)
    keep a zero momentum afterwards: 1-bit compression would give them +-scale, and divided by
    sqrt(v) + eps ~ eps that is an enormous step. DeepSpeed's `exp_avg_mask` does the same for
    embedding rows it knows to be unused.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 warmup_steps: int = 100, chunk: int = 1024, compression: bool = True, group=None):
        if chunk % 8 or chunk < 8 or warmup_steps < 1:
            raise ValueError(f"OneBitAdam: chunk must be a multiple of 8 and warmup_steps >= 1 (the variance needs "
                             f"a full-precision warm-up), got chunk={chunk}, warmup_steps={warmup_steps}")
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.warmup_steps, self.chunk, self.compression, self.group = warmup_steps, chunk, compression, group
        self.world_size = dist.get_world_size(group)
        with torch.no_grad():
            for p in self.params:
                dist.broadcast(p, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        self.numel = sum(p.numel() for p in self.params)
        n = padded_size(self.numel, self.world_size, chunk)
        ref = self.params[0]
        self.m, self.v = ref.new_zeros(n, dtype=torch.float32), ref.new_zeros(n, dtype=torch.float32)
        self.worker_error = ref.new_zeros(n, dtype=torch.float32)
        self.server_error = ref.new_zeros(n // self.world_size, dtype=torch.float32)
        self.t, self.mask = 0, None

    @property
    def compressing(self) -> bool:
        """True once the warm-up is over (the next step sends 1 bit per value)."""
        return self.t >= self.warmup_steps

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _flat_grad(self) -> Tensor:
        g = self.m.new_zeros(self.m.numel())
        offset = 0
        for p in self.params:
            if p.grad is not None:
                g[offset:offset + p.numel()] = p.grad.reshape(-1)
            offset += p.numel()
        return g

    @torch.no_grad()
    def step(self) -> None:
        b1, b2 = self.betas
        g = self._flat_grad()  # this rank's gradient, zero-padded
        compressing = self.compressing
        self.t += 1
        if not compressing:  # warm-up: Adam on the averaged gradient
            dist.all_reduce(g, group=self.group)
            g /= self.world_size
            self.m.mul_(b1).add_(g, alpha=1 - b1)
            self.v.mul_(b2).addcmul_(g, g, value=1 - b2)
        else:  # compression: local momentum, averaged with 1 bit per value; v frozen
            if self.mask is None:  # coordinates without any gradient in the warm-up keep m = 0 (see class doc)
                self.mask = self.v > 0
            local = self.m * b1 + g * (1 - b1)
            if self.compression:
                m = compressed_allreduce(local, self.worker_error, self.server_error, self.chunk, self.group)
            else:  # the control: frozen variance, momentum averaged in full precision
                dist.all_reduce(local, group=self.group)
                m = local / self.world_size
            self.m.copy_(m * self.mask)
        # torch's AdamW, in its order of operations: decay, then p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** min(self.t, self.warmup_steps)  # v stopped at the warm-up
        denom = (self.v.sqrt() / math.sqrt(bc2)).add_(self.eps)
        offset = 0
        for p in self.params:
            k = slice(offset, offset + p.numel())
            p.mul_(1 - self.lr * self.weight_decay)
            p.addcdiv_(self.m[k].view_as(p), denom[k].view_as(p), value=-self.lr / bc1)
            offset += p.numel()
