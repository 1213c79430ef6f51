"""A real trial for the searches: the course's SmallCNN trained on CIFAR-10 (or its synthetic stand-in),
resumable from Day 3's checkpoints, so that an ASHA promotion or a PBT exploit continues training.

    small_cnn_trial(config, steps, workdir) -> [{"train_loss": ...}, ..., {"train_loss", "val_loss", "val_acc"}]

config: lr (required), weight_decay (0), width (8), batch_size (32), n_train (512), n_test (256),
image_size (8), data_dir (None: the synthetic stand-in), seed (0: the data and the initial weights),
device ("cpu"; "cuda" on a GPU node: the checkpoint is read back to the CPU, then into the model).
The search's metric is "val_loss" (or "val_acc" with the sign flipped by the caller). The checkpoint holds
the model, the optimizer, the batch position and every RNG (`dlo.checkpoint.training_state`), so training
to 6 steps and resuming to 12 is training to 12 at once, bit for bit; a changed lr or weight decay (PBT's
explore) is applied to the restored optimizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from dlo.checkpoint import CheckpointManager, ResumableBatches, restore_training_state, training_state
from dlo.data.cifar import cifar10
from dlo.models.small import SmallCNN


def small_cnn_trial(config: dict, steps: int, workdir: Path) -> list[dict]:
    c = {"weight_decay": 0.0, "width": 8, "batch_size": 32, "n_train": 512, "n_test": 256, "image_size": 8,
         "data_dir": None, "seed": 0, "device": "cpu", **config}
    device = torch.device(c["device"])
    train, test = cifar10(c["data_dir"], n_train=c["n_train"], n_test=c["n_test"], seed=c["seed"],
                          image_size=c["image_size"])
    train, test = (TensorDataset(*(t.to(device) for t in ds.tensors)) for ds in (train, test))
    torch.manual_seed(c["seed"])
    model = SmallCNN(num_classes=10, width=c["width"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], weight_decay=c["weight_decay"])
    batches = ResumableBatches(train.tensors, c["batch_size"], seed=c["seed"])
    manager = CheckpointManager(workdir, keep_last=1)
    state, _ = manager.load_latest()
    done = restore_training_state(state, model, opt, loader=batches) if state is not None else 0
    for group in opt.param_groups:   # the config's hyperparameters win over the checkpoint's (PBT explores)
        group["lr"], group["weight_decay"] = c["lr"], c["weight_decay"]
    metrics = []
    model.train()
    for _ in range(done, steps):
        x, y = next(batches)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        metrics.append({"train_loss": loss.item()})
    manager.save(training_state(model, opt, loader=batches, step=steps), steps)
    model.eval()
    with torch.no_grad():
        logits = model(test.tensors[0])
        val = {"val_loss": torch.nn.functional.cross_entropy(logits, test.tensors[1]).item(),
               "val_acc": (logits.argmax(1) == test.tensors[1]).float().mean().item()}
    if not metrics:   # killed after its checkpoint, before its result: evaluate the checkpoint (counted as 1)
        metrics.append({})
    metrics[-1].update(val)
    return metrics
