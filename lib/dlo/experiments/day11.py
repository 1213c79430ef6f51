"""Day 11's experiments: transfer learning three ways against the labelled examples, and early stopping.

Two tasks from one image source: A = classes 0-4 (the pretraining task), B = classes 5-9 relabelled 0-4 (the
target). SmallCNN is pretrained once on A and saved (Day 3's atomic checkpoint); on B it is reused three
ways (`dlo.tuning.transfer`): a new head on frozen features, fine-tuning everything at lr / finetune_factor,
and training from scratch; plus a control, a new head on frozen *random* features, which tells what the
pretraining gave from what a head alone can do. Every arm of one seed starts from the same head
initialisation and sees the same batches: the comparisons are paired by seed.
The searches, the killed and resumed study, tracking and energy are `dlo.experiments.day11_search`.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from dlo.checkpoint import save_atomic
from dlo.data.cifar import cifar10
from dlo.models.small import SmallCNN
from dlo.progress import tqdm
from dlo.tuning.early import EarlyStopping, fit
from dlo.tuning.transfer import freeze, new_head, train_frozen

WAYS = ("new head, frozen features", "fine-tune all, small lr", "from scratch", "head on random features (control)")
CLASSES = 5


def tasks(P, data_dir, seed: int, device) -> dict[str, TensorDataset]:
    """Task A's training images, task B's pool of labelled ones and task B's test images (on `device`)."""
    n = 2 * max(P.n_pretrain, max(P.labelled), P.es_train) + 2 * P.n_test
    train, test = cifar10(data_dir, n_train=n, n_test=2 * P.n_test, seed=seed, image_size=P.image_size)

    def part(ds, lo):
        x, y = ds.tensors
        keep = (y >= lo) & (y < lo + CLASSES)
        return x[keep].to(device), (y[keep] - lo).to(device)

    a, b = part(train, 0), part(train, CLASSES)
    return {"A": TensorDataset(a[0][:P.n_pretrain], a[1][:P.n_pretrain]), "B": TensorDataset(*b),
            "B test": TensorDataset(*part(test, CLASSES))}


def train_steps(model: nn.Module, params, ds: TensorDataset, steps: int, batch: int, lr: float, seed: int,
                frozen: bool = False, log=None, tag: str = "") -> list[float]:
    """`steps` AdamW steps on batches drawn (with replacement) from `ds` by a generator seeded `seed`."""
    opt = torch.optim.AdamW(params, lr=lr)
    gen = torch.Generator().manual_seed(seed)
    x, y = ds.tensors
    losses = []
    train_frozen(model) if frozen else model.train()   # a frozen part's BatchNorm stays in eval mode
    for step in range(steps):
        i = torch.randint(0, len(y), (min(batch, len(y)),), generator=gen).to(x.device)
        loss = nn.functional.cross_entropy(model(x[i]), y[i])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if log is not None:
            log.add_scalar(f"{tag}/loss", losses[-1], step)
    return losses


@torch.no_grad()
def accuracy(model: nn.Module, ds: TensorDataset) -> float:
    model.eval()
    x, y = ds.tensors
    return (model(x).argmax(1) == y).float().mean().item()


def pretrain(P, data: dict, seed: int, device, folder: Path, log=None) -> Path:
    """SmallCNN trained on task A, saved atomically to folder/pretrained.pt (the file the transfers load)."""
    torch.manual_seed(seed)
    model = SmallCNN(num_classes=CLASSES, width=P.width).to(device)
    train_steps(model, model.parameters(), data["A"], P.pretrain_steps, P.batch_size, P.lr, seed, log=log,
                tag="pretrain")
    path = Path(folder) / "pretrained.pt"
    save_atomic({"model": model.state_dict(), "task": "A: classes 0-4", "steps": P.pretrain_steps}, path)
    return path


def transfer_once(P, way: str, pretrained: Path, labelled: TensorDataset, test: TensorDataset, seed: int,
                  device, log=None) -> float:
    """One arm for one seed: the test accuracy on task B."""
    torch.manual_seed(seed)
    model = SmallCNN(num_classes=CLASSES, width=P.width).to(device)   # random features (scratch, control)
    if way in WAYS[:2]:
        model.load_state_dict(torch.load(pretrained, map_location=device, weights_only=False)["model"])
    torch.manual_seed(seed + 1)   # every arm of a seed draws the same fresh head
    head = new_head(model, "head", CLASSES, freeze_rest=False)
    if way in (WAYS[0], WAYS[3]):
        freeze(model.features)
        params, lr = head.parameters(), P.lr
    elif way == WAYS[1]:
        params, lr = model.parameters(), P.lr / P.finetune_factor
    else:
        params, lr = model.parameters(), P.lr
    tag = f"transfer/{way.split(',')[0].replace(' ', '_')}/n{len(labelled)}/seed{seed}"
    train_steps(model, params, labelled, P.transfer_steps, P.batch_size, lr, seed, frozen=way in (WAYS[0], WAYS[3]),
                log=log, tag=tag)
    return accuracy(model, test)


def transfer_curve(P, data: dict, pretrained: Path, seeds: list[int], device, log=None) -> dict:
    """acc[way][n] = [test accuracy per seed], n labelled examples of task B drawn per seed."""
    acc = {way: {n: [] for n in P.labelled} for way in WAYS}
    jobs = [(n, s, way) for n in P.labelled for s in seeds for way in WAYS]
    for n, s, way in tqdm(jobs, desc="transfer"):
        g = torch.Generator().manual_seed(1000 + s)
        pick = torch.randperm(len(data["B"]), generator=g)[:n].to(data["B"].tensors[1].device)
        labelled = TensorDataset(*(t[pick] for t in data["B"].tensors))
        acc[way][n].append(transfer_once(P, way, pretrained, labelled, data["B test"], s, device, log))
    return acc


def early_stopping(P, data: dict, seeds: list[int], device, folder: Path) -> list[dict]:
    """Per seed: training from scratch on es_train images of task B for max_epochs, evaluated each epoch, once
    with early stopping (patience, the best weights restored) and then continued to max_epochs: the same run
    (the stopped one is the prefix of the full one), so the difference is what stopping gave up."""
    x, y = data["B"].tensors
    train = TensorDataset(x[:P.es_train], y[:P.es_train])
    val = TensorDataset(x[P.es_train:P.es_train + P.n_test], y[P.es_train:P.es_train + P.n_test])
    return [_early_one(P, train, val, data["B test"], s, device, Path(folder) / f"seed{s}")
            for s in tqdm(seeds, desc="early stopping")]


def _early_one(P, train: TensorDataset, val: TensorDataset, test: TensorDataset, seed: int, device,
               folder: Path) -> dict:
    torch.manual_seed(seed)
    model = SmallCNN(num_classes=CLASSES, width=P.width).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=P.lr)
    gen = torch.Generator().manual_seed(seed)
    val_losses, test_accs = [], []

    def epoch(_):
        model.train()
        for i in torch.randperm(P.es_train, generator=gen).to(device).split(P.batch_size):
            loss = nn.functional.cross_entropy(model(train.tensors[0][i]), train.tensors[1][i])
            opt.zero_grad()
            loss.backward()
            opt.step()

    @torch.no_grad()
    def evaluate():
        model.eval()
        val_losses.append(nn.functional.cross_entropy(model(val.tensors[0]), val.tensors[1]).item())
        test_accs.append(accuracy(model, test))
        return val_losses[-1]

    report = fit(epoch, evaluate, model, P.max_epochs, EarlyStopping(folder, patience=P.patience))
    restored = accuracy(model, test)   # fit restored the best epoch's weights from the checkpoint
    for e in range(report.epochs_run, P.max_epochs):   # to the end: the same run continued
        epoch(e)
        evaluate()
    return {"seed": seed, "best epoch": report.best_epoch, "epochs run": report.epochs_run,
            "epochs saved": report.epochs_saved, "acc stopped (best restored)": restored,
            "acc at best epoch (logged)": test_accs[report.best_epoch], "acc to the end": test_accs[-1],
            "val losses": val_losses}


def successive_halving_steps(min_steps: int, max_steps: int, eta: int, n: int) -> int:
    """Steps synchronous successive halving runs: rung k holds floor(n / eta^k) configs, each resumed from the
    previous rung, so it trains r_k - r_(k-1) more steps (Li et al. 2020, 3.1)."""
    from dlo.tuning.search import rung_steps

    rungs = rung_steps(min_steps, max_steps, eta)
    return sum(n // eta ** k * (r - prev) for k, (r, prev) in enumerate(zip(rungs, [0] + rungs[:-1])))


def plan(preset, *, gpus: int, gpu_mem_gb: float) -> list[dict]:
    """`dlo plan day11_learning_faster`: one trial's memory (SmallCNN, AdamW, fp32, one batch, on the meta device)
    and the study's steps: every trial is one process on one GPU, so `gpus` sets the array's waves, not the rows'
    bytes. ASHA's cost counts each rung's configs x its steps (a promoted trial resumes: only the difference)."""
    from dlo.accounting import optimizer_bytes
    from dlo.plan import activation_bytes, param_bytes, row
    from dlo.tuning.search import rung_steps

    with torch.device("meta"):
        model = SmallCNN(num_classes=10, width=preset.width)
        x = torch.randn(preset.batch_size, 3, preset.image_size, preset.image_size)
        y = torch.randint(0, 10, (preset.batch_size,))
    n = param_bytes(model)
    acts = activation_bytes(lambda: nn.functional.cross_entropy(model(x), y), exclude=list(model.parameters()))
    rungs = rung_steps(preset.min_steps, preset.trial_steps, preset.eta)
    alive = [preset.trials // preset.eta ** k for k in range(len(rungs))]
    asha = successive_halving_steps(preset.min_steps, preset.trial_steps, preset.eta, preset.trials)
    waves = -(-preset.trials // gpus)
    per_gpu = dict(params=n, grads=n, optimizer=optimizer_bytes("adamw", n), activations=acts, gpu_mem_gb=gpu_mem_gb)
    return [row("one trial (SmallCNN, AdamW, fp32)", 1, **per_gpu, main=True,
                note=f"width {preset.width}, {preset.image_size}x{preset.image_size} images, "
                     f"batch {preset.batch_size}"),
            row(f"random or grid, {preset.trials} trials", gpus, **per_gpu,
                note=f"one trial per GPU: {preset.trials * preset.trial_steps} steps in {waves} wave(s)"),
            row(f"ASHA, {preset.trials} configs, eta {preset.eta}", gpus, **per_gpu,
                note=f"one trial per GPU: {asha} steps; rungs {rungs}, at most {alive} configs each")]
