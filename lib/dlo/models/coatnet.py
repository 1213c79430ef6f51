"""CoAtNet (Dai, Liu, Le, Tan, "CoAtNet: Marrying Convolution and Attention for All Data Sizes",
NeurIPS 2021), the model of the course's model-parallelism practicals, in one file.

Five stages, C-C-T-T (Sec. 2.3, Fig. 4): S0 a convolution stem, S1-S2 MBConv blocks with
squeeze-excitation (Sandler et al. 2018, Hu et al. 2018), S3-S4 transformer blocks with relative
position attention (Eq. 3). Each stage halves the resolution (224 -> 112, 56, 28, 14, 7); a stage's
first block downsamples. A global average pool and a linear layer classify.

For pipeline parallelism the model is an ordered list of blocks, `model.blocks`, each taking and
returning an image-shaped tensor (B, C, H, W), so a pipeline can cut between any two of them:

    stem conv x L0 | MBConv x L1 | MBConv x L2 | Transformer x L3 | Transformer x L4 | head

(`dlo.distributed.pipeline.make_stage_modules(list(model.blocks), bounds)` makes the cut), and
`block_costs(model)` measures what a cut has to balance: parameters per block, forward FLOPs
(`dlo.measure.count_flops`) and the bytes autograd saves for backward (`SavedTensorMeter`), on the
meta device, so the full-size models cost nothing to measure. The stages are very unequal: the
early ones hold the activations (large images, few channels), the late ones the parameters, and S3
most of the compute.

Where the paper leaves a detail open, this file picks the common reading and says so at the line:
MBConv expands its input channels 4x with a squeeze-excitation of 1/4 of the input width; the
stride of a downsampling MBConv is on its first 1x1 convolution (Sec. 2.3, "Conv(DepthConv(Conv(
Norm(x), stride=2)))"); pooling is a 3x3 max-pool with stride 2; heads have 32 channels; the head
is pool + LayerNorm + linear. `count_parameters` lands within 10% of the paper's Table (25M, 42M,
75M, 168M at 224 x 224): see tests/models/test_coatnet.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.models import count_parameters  # one definition; re-exported here


@dataclass(frozen=True)
class CoAtNetConfig:
    """Depths L0..L4 (L0: stem convolutions) and widths D0..D4 of the five stages (Table 3)."""

    depths: tuple[int, ...] = (2, 2, 3, 5, 2)
    widths: tuple[int, ...] = (64, 96, 192, 384, 768)
    image_size: int = 224
    in_chans: int = 3
    num_classes: int = 1000
    head_dim: int = 32      # channels per attention head (Sec. 4: "head size 32")
    expansion: int = 4      # MBConv's inverted bottleneck and the transformer FFN (Sec. 2.3)
    se_ratio: float = 0.25  # squeeze-excitation width, as a fraction of the MBConv's input channels
    name: str = field(default="custom", compare=False)

    # Table 3 of the paper; "tiny" keeps the C-C-T-T layout and the depths of CoAtNet-0 at a CPU size
    PRESETS = {
        "coatnet-0": dict(depths=(2, 2, 3, 5, 2), widths=(64, 96, 192, 384, 768)),
        "coatnet-1": dict(depths=(2, 2, 6, 14, 2), widths=(64, 96, 192, 384, 768)),
        "coatnet-2": dict(depths=(2, 2, 6, 14, 2), widths=(128, 128, 256, 512, 1024)),
        "coatnet-3": dict(depths=(2, 2, 6, 14, 2), widths=(192, 192, 384, 768, 1536)),
        "tiny": dict(depths=(2, 2, 3, 5, 2), widths=(16, 16, 32, 64, 64), image_size=64, num_classes=10,
                     head_dim=16),
    }

    @classmethod
    def from_name(cls, name: str, **overrides) -> CoAtNetConfig:
        """A preset by name ("coatnet-0".."coatnet-3", "tiny"), optionally with fields replaced."""
        if name not in cls.PRESETS:
            raise ValueError(f"unknown CoAtNet {name!r}; presets: {', '.join(cls.PRESETS)}")
        return replace(cls(name=name, **cls.PRESETS[name]), **overrides)

    def __post_init__(self):
        if len(self.depths) != 5 or len(self.widths) != 5 or min(self.depths) < 1:
            raise ValueError(f"CoAtNet needs 5 stages with >= 1 block each, got depths={self.depths}, "
                             f"widths={self.widths}")
        if self.image_size % 32:
            raise ValueError(f"image_size={self.image_size} must be a multiple of 32 (5 stages halve it)")
        for w in self.widths[3:]:
            if w % self.head_dim:
                raise ValueError(f"transformer width {w} is not a multiple of head_dim={self.head_dim}")

    def grid(self, stage: int) -> int:
        """Side of the feature map after stage `stage` (S0 halves the image, each stage again)."""
        return self.image_size // 2 ** (stage + 1)


# ----------------------------------------------------------------------------- S0: the stem

class StemConv(nn.Module):
    """One stem convolution: 3x3 conv, BatchNorm, GELU (S0 is L0 of these, the first with stride 2)."""

    stage = "S0"

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c_out)

    def forward(self, x: Tensor) -> Tensor:
        return F.gelu(self.norm(self.conv(x)))  # (B, C, H/s, W/s)


# ----------------------------------------------------------------------------- S1, S2: MBConv

class SqueezeExcite(nn.Module):
    """Channel gating (Hu et al. 2018): global average pool, bottleneck MLP, sigmoid, rescale."""

    def __init__(self, channels: int, hidden: int):
        super().__init__()
        self.reduce = nn.Conv2d(channels, hidden, 1)
        self.expand = nn.Conv2d(hidden, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s = x.mean((2, 3), keepdim=True)  # (B, C, 1, 1)
        return x * torch.sigmoid(self.expand(F.gelu(self.reduce(s))))


class MBConv(nn.Module):
    """Pre-norm inverted bottleneck (Sandler et al. 2018) with squeeze-excitation (Eq. 5 of the paper
    for the downsampling form): x <- Proj(Pool(x)) + Conv1x1(SE(DepthConv3x3(Conv1x1(Norm(x), stride))))."""

    def __init__(self, c_in: int, c_out: int, stride: int, expansion: int, se_ratio: float, stage: str):
        super().__init__()
        hidden = c_in * expansion  # expand the input width (one reading of "expansion rate 4")
        self.stage = stage
        self.norm = nn.BatchNorm2d(c_in)
        self.expand = nn.Sequential(nn.Conv2d(c_in, hidden, 1, stride=stride, bias=False), nn.BatchNorm2d(hidden),
                                    nn.GELU())
        self.depthwise = nn.Sequential(nn.Conv2d(hidden, hidden, 3, padding=1, groups=hidden, bias=False),
                                       nn.BatchNorm2d(hidden), nn.GELU())
        self.se = SqueezeExcite(hidden, max(1, int(c_in * se_ratio)))
        self.project = nn.Conv2d(hidden, c_out, 1)
        self.pool = nn.MaxPool2d(3, stride, 1) if stride > 1 else nn.Identity()
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:  # (B, C_in, H, W) -> (B, C_out, H/s, W/s)
        h = self.project(self.se(self.depthwise(self.expand(self.norm(x)))))
        return self.shortcut(self.pool(x)) + h


# ----------------------------------------------------------------------------- S3, S4: relative attention

class RelativeAttention(nn.Module):
    """Multi-head self-attention over the H x W grid with a learned relative position bias
    (Eq. 3: softmax(q_i k_j^T / sqrt(d) + w_{i-j}) per head): one scalar per head and 2-D offset
    (i - j), from a table of (2H - 1)(2W - 1) entries, as in Swin and the paper's implementation.
    Written out rather than through F.scaled_dot_product_attention, so that what autograd saves
    (the (N, N) probabilities among it) is the same on every device, the meta device included:
    the bytes `block_costs` counts are the bytes a CPU run holds."""

    def __init__(self, c_in: int, c_out: int, head_dim: int, grid: int):
        super().__init__()
        self.heads, self.grid, self.scale = c_out // head_dim, grid, head_dim ** -0.5
        self.qkv = nn.Linear(c_in, 3 * c_out)
        self.proj = nn.Linear(c_out, c_out)
        self.bias_table = nn.Parameter(torch.zeros(self.heads, (2 * grid - 1) ** 2))
        nn.init.trunc_normal_(self.bias_table, std=0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")).flatten(1)  # (2, N)
        rel = coords[:, :, None] - coords[:, None, :] + grid - 1  # (2, N, N), offsets shifted to >= 0
        self.register_buffer("bias_index", rel[0] * (2 * grid - 1) + rel[1], persistent=False)  # (N, N)

    def forward(self, x: Tensor) -> Tensor:  # (B, N, C_in) -> (B, N, C_out)
        B, N, _ = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)  # 3 x (B, h, N, d)
        scores = q @ k.transpose(-2, -1) * self.scale + self.bias_table[:, self.bias_index]  # (B, h, N, N)
        y = scores.softmax(dim=-1) @ v  # (B, h, N, d)
        return self.proj(y.transpose(1, 2).reshape(B, N, -1))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block on the image grid (Eq. 5's downsampling form in a stage's first
    block): x <- Proj(Pool(x)) + Attention(Pool(Norm(x))), then x <- x + FFN(Norm(x))."""

    def __init__(self, c_in: int, c_out: int, stride: int, head_dim: int, expansion: int, grid: int, stage: str):
        super().__init__()
        self.stage = stage
        self.pool = nn.MaxPool2d(3, stride, 1) if stride > 1 else nn.Identity()
        self.shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else nn.Identity()
        self.norm1 = nn.LayerNorm(c_in)
        self.attn = RelativeAttention(c_in, c_out, head_dim, grid)
        self.norm2 = nn.LayerNorm(c_out)
        self.ffn = nn.Sequential(nn.Linear(c_out, expansion * c_out), nn.GELU(), nn.Linear(expansion * c_out, c_out))

    def forward(self, x: Tensor) -> Tensor:  # (B, C_in, H, W) -> (B, C_out, H/s, W/s)
        x = self.pool(x)
        B, _, H, W = x.shape
        tokens = x.flatten(2).transpose(1, 2)  # (B, N, C_in), N = H W
        y = self.shortcut(x).flatten(2).transpose(1, 2) + self.attn(self.norm1(tokens))  # (B, N, C_out)
        y = y + self.ffn(self.norm2(y))
        return y.transpose(1, 2).reshape(B, -1, H, W)


class Head(nn.Module):
    """Global average pool, LayerNorm, linear classifier: (B, C, H, W) -> (B, classes) logits."""

    stage = "head"

    def __init__(self, channels: int, num_classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.norm(x.mean((2, 3))))  # (B, classes)


# ----------------------------------------------------------------------------- the model

def make_blocks(cfg: CoAtNetConfig) -> list[nn.Module]:
    """The ordered blocks S0..S4 and the head; each stage's first block halves the resolution."""
    d, w = cfg.depths, cfg.widths
    blocks: list[nn.Module] = [StemConv(cfg.in_chans if i == 0 else w[0], w[0], 2 if i == 0 else 1)
                               for i in range(d[0])]
    for s in (1, 2):
        blocks += [MBConv(w[s - 1] if i == 0 else w[s], w[s], 2 if i == 0 else 1, cfg.expansion, cfg.se_ratio,
                          f"S{s}") for i in range(d[s])]
    for s in (3, 4):
        blocks += [TransformerBlock(w[s - 1] if i == 0 else w[s], w[s], 2 if i == 0 else 1, cfg.head_dim,
                                    cfg.expansion, cfg.grid(s), f"S{s}") for i in range(d[s])]
    return blocks + [Head(w[4], cfg.num_classes)]


class CoAtNet(nn.Module):
    """`blocks` in order; forward runs them one after the other: (B, 3, S, S) -> (B, classes)."""

    def __init__(self, cfg: CoAtNetConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(make_blocks(cfg))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def block_costs(model: CoAtNet, batch_size: int = 1, dtype: torch.dtype = torch.float32) -> list[dict]:
    """Per block, on the meta device (no memory, any size): "params", forward "flops" (FlopCounterMode:
    matmuls, convolutions, attention; 2 per multiply-add), "saved_bytes" (what autograd keeps for
    backward in training mode: the block's activations; a storage two blocks save is counted once,
    by the first, so the column sums to the model's total) and the output "shape".

    A copy of the model is built on the meta device, so `model` itself may live anywhere."""
    from dlo.measure import SavedTensorMeter, count_flops

    with torch.device("meta"):
        meta = CoAtNet(model.cfg).to(dtype)
    meta.train()
    params = list(meta.parameters()) + list(meta.buffers())
    cfg, rows, inputs = model.cfg, [], []
    x = torch.empty(batch_size, cfg.in_chans, cfg.image_size, cfg.image_size, device="meta", dtype=dtype)
    with SavedTensorMeter(exclude=params) as meter:
        for i, block in enumerate(meta.blocks):
            before = meter.bytes
            y = block(x)
            rows.append({"block": i, "name": type(block).__name__, "stage": block.stage,
                         "params": count_parameters(block), "saved_bytes": meter.bytes - before,
                         "shape": tuple(y.shape)})
            inputs.append(x.detach())
            x = y
    with torch.no_grad():  # FLOPs in a second pass, outside the meter: its graphs never count as saved
        for r, block, inp in zip(rows, meta.blocks, inputs):
            r["flops"] = count_flops(lambda b=block, x=inp: b(x))
    return rows


def stage_table(rows: list[dict]) -> list[dict]:
    """`block_costs` rows summed per paper stage (S0..S4, head)."""
    out: dict[str, dict] = {}
    for r in rows:
        s = out.setdefault(r["stage"], {"stage": r["stage"], "blocks": 0, "params": 0, "flops": 0, "saved_bytes": 0})
        s["blocks"] += 1
        for k in ("params", "flops", "saved_bytes"):
            s[k] += r[k]
    return list(out.values())


def coatnet(name: str = "coatnet-0", **overrides) -> CoAtNet:
    """CoAtNet by preset name ("coatnet-0".."coatnet-3", "tiny"), config fields overridable."""
    return CoAtNet(CoAtNetConfig.from_name(name, **overrides))


__all__ = ["CoAtNetConfig", "CoAtNet", "coatnet", "make_blocks", "count_parameters", "block_costs", "stage_table",
           "StemConv", "MBConv", "SqueezeExcite", "RelativeAttention", "TransformerBlock", "Head"]
