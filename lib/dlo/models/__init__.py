"""Models of the course: small ones for CPU-sized experiments."""

from torch import nn

from dlo.models.small import MLP, SmallCNN


def count_parameters(model: nn.Module) -> int:
    """Number of parameters, a tied (shared) one counted once (parameters() yields it once); DTensors
    count their global size; meta tensors count too."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MLP", "SmallCNN", "count_parameters"]
