"""A preemptible training run: resumes from its newest good checkpoint, saves and exits on SIGTERM.

    python -m dlo.resumable --ckpt-dir DIR --steps N [--save-every K] [--model cnn|mlp]

trains dlo.models.SmallCNN (or, much cheaper on a CPU, dlo.models.MLP) on deterministic synthetic
CIFAR-10 (dlo.data.cifar.synthetic_cifar10) with AdamW and a warmup schedule. At start it restores
the newest checkpoint in DIR that loads (dlo.checkpoint.CheckpointManager); it saves every K steps
and at the end. SIGTERM or SIGUSR1 (what slurm/preemptible.sbatch sends before the time limit) only
sets a flag: the current step finishes, the state is saved, and the process exits 0 so that Slurm
can requeue the job. Model, optimizer, scheduler, data position and every RNG are in the checkpoint,
so an interrupted and resumed run prints the very same losses as an uninterrupted one (on a GPU
with deterministic kernels).
"""

from __future__ import annotations

import argparse
import math
import signal

import torch
import torch.nn.functional as F
from torch import nn

from dlo.checkpoint import CheckpointManager, ResumableBatches, restore_training_state, training_state
from dlo.config import resolve_device, seed_everything
from dlo.data.cifar import synthetic_cifar10
from dlo.models import MLP, SmallCNN

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m dlo.resumable", description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", required=True, help="folder of the checkpoints (created if missing)")
    p.add_argument("--steps", type=int, required=True, help="total optimizer steps of the run")
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every K steps (and at the end)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints kept in --ckpt-dir")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda[:i]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-train", type=int, default=4096, help="synthetic training images")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--model", choices=("cnn", "mlp"), default="cnn")
    p.add_argument("--width", type=int, default=16, help="SmallCNN width (the MLP's hidden size is 8x)")
    p.add_argument("--lr", type=float, default=2e-3)
    args = p.parse_args(argv)
    if args.steps < 1 or args.save_every < 1:
        p.error("--steps and --save-every must be >= 1")
    return args


def build(args, device: torch.device):
    """Model, optimizer, scheduler and loader as at step 0; a resume then overwrites their state."""
    seed_everything(args.seed)
    if args.model == "cnn":
        model = SmallCNN(width=args.width, dropout=0.1)
    else:  # input dropout, so that the torch RNG matters here too
        model = nn.Sequential(nn.Dropout(0.1), MLP(3 * args.image_size ** 2, 8 * args.width, 10, depth=3))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    data = synthetic_cifar10(args.n_train, seed=args.seed, image_size=args.image_size)
    return model, opt, sched, ResumableBatches(data, args.batch_size, seed=args.seed)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    if device.type == "cuda":  # bit-identical resumes need deterministic convolutions
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    stop: list[int] = []
    for sig in STOP_SIGNALS:  # the handler only records: saving inside it could interrupt a step or a save
        signal.signal(sig, lambda signum, frame: stop.append(signum))

    model, opt, sched, loader = build(args, device)
    mgr = CheckpointManager(args.ckpt_dir, keep_last=args.keep_last)
    state, path = mgr.load_latest()
    step, loss = 0, math.nan
    if state is not None:
        step, loss = restore_training_state(state, model, opt, sched, None, loader), state["loss"]
        print(f"resumed from {path} at step {step}", flush=True)

    def save() -> None:
        mgr.save({**training_state(model, opt, sched, None, loader, step=step), "loss": loss}, step)

    model.train()
    while step < args.steps:
        x, y = (t.to(device) for t in next(loader))
        batch_loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        batch_loss.backward()
        opt.step()
        sched.step()
        step, loss = step + 1, batch_loss.item()
        print(f"step {step} loss {loss!r}", flush=True)
        if stop:
            save()
            print(f"{signal.Signals(stop[0]).name}: saved step {step}, exiting for requeue", flush=True)
            return 0
        if step % args.save_every == 0 or step == args.steps:
            save()
    print(f"done step {step} loss {loss!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
