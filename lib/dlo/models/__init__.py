"""Models of the course: small ones for CPU-sized experiments."""

from dlo.models.small import MLP, SmallCNN

__all__ = ["MLP", "SmallCNN"]
