"""How a `data_dir` is laid out, and the one error every data check raises.

The days read two things from `data_dir` (`dlo.registry.DaySpec.data` says which day reads which):
"cifar10", CIFAR-10's binary version (`cifar-10-batches-bin/`: five training batches and a test batch
of 10000 records each), and "tokens", `tokens.npy` (a 1-D array of Llama token ids, made by `dlo data
tokens`). Compute nodes are offline: both are prepared on a login node. A leaf module: the checks
(`dlo.data.cifar`, `dlo.data.tokens`, `dlo.data.check`) import it, it imports none of them.
"""

from __future__ import annotations

KINDS = ("cifar10", "tokens")  # what a day may read from data_dir (DaySpec.data's values)

CIFAR_BIN = "cifar-10-batches-bin"        # the folder cifar-10-binary.tar.gz unpacks to
CIFAR_PY = "cifar-10-batches-py"          # the Python (pickle) version's folder: not what the course reads
CIFAR_BIN_TAR = "cifar-10-binary.tar.gz"
CIFAR_BIN_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz"
TOKENS = "tokens.npy"
OFFLINE = "on a login node (compute nodes are offline)"


class DataError(ValueError):
    """A data folder that does not hold what a day reads (one line: what is wrong and what to do)."""


def how_to_get_cifar10(data_dir) -> str:
    """The fix for a folder without CIFAR-10's binary version, said the same way everywhere."""
    return (f"{OFFLINE} download {CIFAR_BIN_URL} and unpack it there (tar xzf {CIFAR_BIN_TAR} -C {data_dir}: "
            f"it makes {CIFAR_BIN}/)")


def how_to_make_tokens(data_dir) -> str:
    """The fix for a folder without a usable tokens.npy."""
    return (f"make it {OFFLINE} with `dlo data tokens CORPUS --tokenizer tokenizer.json --out {data_dir}` "
            "(the model's own tokenizer.json, a folder of .txt files)")


__all__ = ["CIFAR_BIN", "CIFAR_BIN_TAR", "CIFAR_BIN_URL", "CIFAR_PY", "DataError", "KINDS", "OFFLINE", "TOKENS",
           "how_to_get_cifar10", "how_to_make_tokens"]
