"""ResNet (He et al., "Deep Residual Learning for Image Recognition", CVPR 2016), the classic
data-parallel benchmark model (Li et al. 2020 measure DDP on ResNet-50). torchvision is not a
dependency (no CPU build here), so this is the paper's Table 1 with basic blocks:

    stem 7x7/2 conv + 3x3/2 max-pool, then 4 stages of `blocks[i]` residual blocks with widths
    w, 2w, 4w, 8w (stride 2 at the start of stages 2-4), global average pool, linear classifier.

resnet18() is ResNet-18 (11.7M parameters at width 64, 1000 classes); a small width gives a CPU-sized model.
"""

from __future__ import annotations

from torch import Tensor, nn


class BasicBlock(nn.Module):
    """Two 3x3 convs with batch norm; y = relu(F(x) + shortcut(x)) (He et al. 2016, Fig. 2)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:  # projection shortcut, option (B) of the paper
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, blocks: tuple[int, ...] = (2, 2, 2, 2), width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True), nn.MaxPool2d(3, stride=2, padding=1))
        stages, c_in = [], width
        for i, n in enumerate(blocks):
            c_out = width * 2 ** i
            stages += [BasicBlock(c_in if j == 0 else c_out, c_out, stride=2 if i > 0 and j == 0 else 1)
                       for j in range(n)]
            c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:  # (B, 3, H, W) -> (B, num_classes)
        x = self.stages(self.stem(x))  # (B, 8w, H/32, W/32)
        return self.head(x.mean(dim=(2, 3)))


def resnet18(num_classes: int = 1000, width: int = 64) -> ResNet:
    return ResNet((2, 2, 2, 2), width, num_classes)
