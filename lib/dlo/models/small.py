"""Small models for the CPU-sized experiments: a conv-bn-relu CNN for CIFAR-like images and an MLP."""

from __future__ import annotations

from torch import Tensor, nn


def conv_bn_relu(c_in: int, c_out: int) -> nn.Sequential:
    # No conv bias: BatchNorm's shift makes it redundant.
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))


class SmallCNN(nn.Module):
    """Four conv-bn-relu blocks (width w, 2w, 4w, 8w), two max-pools, global average pool, linear head.

    About 390k parameters at width 32. The global pool makes it work for any input size (the tiny
    profile uses 16x16 or 8x8 images); 32x32 CIFAR-10 is the design size.
    """

    def __init__(self, num_classes: int = 10, width: int = 32, in_channels: int = 3, dropout: float = 0.0):
        super().__init__()
        if width < 1 or num_classes < 1 or in_channels < 1:
            raise ValueError(f"num_classes, width and in_channels must be >= 1, "
                             f"got {num_classes}, {width}, {in_channels}")
        w = width
        self.features = nn.Sequential(
            conv_bn_relu(in_channels, w),
            conv_bn_relu(w, 2 * w), nn.MaxPool2d(2),      # (B, 2w, H/2, W/2)
            conv_bn_relu(2 * w, 4 * w), nn.MaxPool2d(2),  # (B, 4w, H/4, W/4)
            conv_bn_relu(4 * w, 8 * w),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),        # (B, 8w)
        )
        self.head = nn.Sequential(nn.Dropout(dropout), nn.Linear(8 * w, num_classes))

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4:
            raise ValueError(f"SmallCNN expects images (B, C, H, W), got shape {tuple(x.shape)}")
        return self.head(self.features(x))  # (B, num_classes)


class MLP(nn.Module):
    """`depth` Linear layers (depth - 1 hidden layers of size `hidden`, ReLU between); input is flattened.

    depth=1 is a linear (softmax-regression) model. norm=True puts a BatchNorm1d after each hidden
    Linear (before its ReLU), as in the Day 4 local vs synchronized BatchNorm experiment.
    """

    def __init__(self, in_features: int, hidden: int, out_features: int, depth: int = 2, norm: bool = False):
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth is the number of Linear layers and must be >= 1, got {depth}")
        sizes = [in_features] + [hidden] * (depth - 1) + [out_features]
        layers: list[nn.Module] = [nn.Flatten()]
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(a, b))
            if i < depth - 1:
                layers += [nn.BatchNorm1d(b), nn.ReLU()] if norm else [nn.ReLU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)  # (B, out_features)
