"""Per-day presets: one frozen dataclass per day, one instance per profile.

`tiny` fits a 2-core CPU in about a minute; `full` is the real scale on GPU nodes.
Notebooks never hold these numbers: they call `dlo.setup(day, profile=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Day1Preset:
    """Day 1 (optimizers and LR schedules). Defaults are the `tiny` scale: synthetic 16x16 images."""

    n_train: int = 2048            # training images
    n_test: int = 512              # held-out images for eval_acc
    image_size: int = 16           # 32 is CIFAR-10's size; smaller keeps the CPU profile fast
    width: int = 16                # SmallCNN base width (about 100k params at 16, 1.6M at 64)
    small_batch: int = 32
    large_batch: int = 256         # the "large batch" regime where LAMB and warmup matter
    max_steps: int = 50            # optimizer steps of each training run
    warmup_steps: int = 5
    sgd_lr: float = 0.1            # SGD with momentum 0.9
    adamw_lr: float = 5e-3
    lamb_lr: float = 3e-2          # relative to each layer's weight norm (trust ratio), hence larger
    momentum: float = 0.9
    sgd_weight_decay: float = 5e-4  # coupled (added to the gradient)
    adamw_weight_decay: float = 0.05  # decoupled (applied to the weights)
    lamb_weight_decay: float = 0.01
    clip: float = 1.0              # global gradient-norm clipping threshold
    lr_finder_steps: int = 40
    bench_numel: int = 1 << 20     # total parameters in the optimizer-step timing table


PRESETS: dict[str, dict[str, object]] = {
    "day1_optimizers": {
        "tiny": Day1Preset(),
        "full": Day1Preset(n_train=50_000, n_test=10_000, image_size=32, width=64, small_batch=128,
                           large_batch=4096, max_steps=2000, warmup_steps=200, sgd_lr=0.1, adamw_lr=3e-3,
                           lamb_lr=2e-2, lr_finder_steps=200, bench_numel=1 << 26),
    },
}
