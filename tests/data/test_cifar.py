"""CIFAR-10 binary reader (on small fake files) and the synthetic stand-in."""

import numpy as np
import pytest
import torch

from dlo.data import DataError, cifar10, load_cifar10_binary, synthetic_cifar10
from dlo.models import MLP

NAMES = [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]


def _write_fake_cifar(folder, records_per_file=3, seed=0):
    """Write random records (1 label byte + 3072 pixel bytes) into each file; return them per file."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    written = {}
    for name in NAMES:
        rec = rng.integers(0, 256, size=(records_per_file, 3073), dtype=np.uint8)
        rec[:, 0] = rng.integers(0, 10, size=records_per_file)
        rec.tofile(folder / name)
        written[name] = rec
    return written


@pytest.mark.parametrize("sub", ["", "cifar-10-batches-bin"])
def test_binary_round_trip(tmp_path, sub):
    written = _write_fake_cifar(tmp_path / sub if sub else tmp_path)
    x, y = load_cifar10_binary(tmp_path, train=True)
    assert x.dtype == torch.uint8 and x.shape == (15, 3, 32, 32)
    assert y.dtype == torch.int64 and y.shape == (15,)
    first = np.concatenate([written[n] for n in NAMES[:5]])
    assert y.tolist() == first[:, 0].tolist()
    # Pixel byte 1 + c * 1024 + h * 32 + w is channel c, row h, column w.
    assert x[4, 2, 5, 31].item() == first[4, 1 + 2 * 1024 + 5 * 32 + 31]
    assert x[9, 0, 31, 0].item() == first[9, 1 + 31 * 32]
    xt, yt = load_cifar10_binary(tmp_path, train=False)
    assert xt.shape == (3, 3, 32, 32) and yt.tolist() == written["test_batch.bin"][:, 0].tolist()
    assert np.array_equal(xt.reshape(3, -1).numpy(), written["test_batch.bin"][:, 1:])


def test_missing_or_truncated_files(tmp_path):
    with pytest.raises(DataError, match="has no cifar-10-batches-bin/"):
        load_cifar10_binary(tmp_path / "nowhere")
    _write_fake_cifar(tmp_path)
    with open(tmp_path / "test_batch.bin", "ab") as f:
        f.write(b"\x00" * 10)
    with pytest.raises(DataError, match="records"):
        load_cifar10_binary(tmp_path, train=False)


def test_cifar10_reads_real_files_and_normalises(tmp_path, capsys):
    _write_fake_cifar(tmp_path, records_per_file=4)
    train, test = cifar10(tmp_path, n_train=12, n_test=3, seed=1, image_size=16)
    assert "CIFAR-10 from" in capsys.readouterr().out
    x, y = train.tensors
    assert x.shape == (12, 3, 16, 16) and x.dtype == torch.float32 and len(test) == 3
    torch.testing.assert_close(x.mean(dim=(0, 2, 3)), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(x.std(dim=(0, 2, 3)), torch.ones(3), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="only 20"):
        cifar10(tmp_path, n_train=21, n_test=3)


def test_cifar10_is_synthetic_only_without_a_data_dir(tmp_path, capsys):
    """No data_dir (None or ""): the synthetic stand-in. A data_dir without the binary files: an error,
    never a silent fallback (it used to print "synthetic" and go on)."""
    for data_dir in (None, ""):
        train, test = cifar10(data_dir, n_train=64, n_test=16, image_size=8)
        assert "synthetic" in capsys.readouterr().out
        assert train.tensors[0].shape == (64, 3, 8, 8) and test.tensors[0].shape == (16, 3, 8, 8)
        assert not torch.equal(train.tensors[0][:16], test.tensors[0])
    with pytest.raises(DataError, match="has no cifar-10-batches-bin/"):
        cifar10(tmp_path, n_train=64, n_test=16, image_size=8)


def test_synthetic_is_deterministic_per_seed():
    x1, y1 = synthetic_cifar10(50, seed=3, image_size=12)
    x2, y2 = synthetic_cifar10(50, seed=3, image_size=12)
    x3, _ = synthetic_cifar10(50, seed=4, image_size=12)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)
    assert x1.shape == (50, 3, 12, 12) and x1.dtype == torch.float32 and set(y1.tolist()) <= set(range(10))
    with pytest.raises(ValueError, match="num_classes"):
        synthetic_cifar10(10, num_classes=1)


def test_synthetic_is_learnable_but_not_trivial():
    train, test = cifar10(None, n_train=1024, n_test=512, seed=0, image_size=16)
    (x, y), (xt, yt) = train.tensors, test.tensors
    torch.manual_seed(0)
    model = MLP(3 * 16 * 16, 0, 10, depth=1)  # a linear model: only colour cues survive the random shifts
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        idx = torch.randint(0, len(y), (128,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    acc = (model(xt).argmax(1) == yt).float().mean().item()
    assert 0.25 < acc < 0.85, acc  # chance is 0.10
