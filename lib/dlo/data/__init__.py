"""Datasets of the course: CIFAR-10 from its binary files, or a synthetic stand-in of the same shape; what
a `data_dir` must hold (`dlo.data.layout`), Day 5's token file (`dlo.data.tokens`) and the checks of
`dlo data` and `dlo.config.resolve` (`dlo.data.check`)."""

from dlo.data.cifar import check_cifar10, cifar10, cifar10_folder, load_cifar10_binary, synthetic_cifar10
from dlo.data.layout import DataError

__all__ = ["DataError", "check_cifar10", "cifar10", "cifar10_folder", "load_cifar10_binary", "synthetic_cifar10"]
