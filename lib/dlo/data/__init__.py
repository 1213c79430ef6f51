"""Datasets of the course: CIFAR-10 from its binary files, or a synthetic stand-in of the same shape."""

from dlo.data.cifar import cifar10, find_cifar10_dir, load_cifar10_binary, synthetic_cifar10

__all__ = ["cifar10", "find_cifar10_dir", "load_cifar10_binary", "synthetic_cifar10"]
