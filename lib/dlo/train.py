"""The course's one training loop, evaluation and deterministic data loaders.

Deliberately small: every optimisation of later days (mixed precision, distillation, DDP, ...) is
a different *step* (`step_fn`) run by this same loop, which keeps what every run needs: the
learning rate (`lr_fn` or a scheduler), a progress bar, the history, the divergence check, periodic
evaluation and TensorBoard logging (one tag per metric name, so runs logged to different folders
overlay).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler, TensorDataset

from dlo.optim import clip_grad_norm, grad_norm
from dlo.progress import tqdm


def make_loader(dataset: Dataset, batch_size: int, *, seed: int, shuffle: bool = True,
                drop_last: bool = True) -> DataLoader:
    """A DataLoader whose order depends only on `seed` (its own generator, num_workers=0)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if drop_last and len(dataset) < batch_size:
        raise ValueError(f"batch_size={batch_size} > dataset size {len(dataset)} with drop_last: no batch at all")
    gen = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(dataset, generator=gen) if shuffle else SequentialSampler(dataset)
    if isinstance(dataset, TensorDataset):
        # Index the tensors with a whole batch of indices at once instead of collating B single samples:
        # same batches, much less Python per step.
        return DataLoader(dataset, sampler=BatchSampler(sampler, batch_size, drop_last), batch_size=None)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, num_workers=0)


def cycle(batches: Iterable) -> Iterator:
    """Re-iterate `batches` forever (a DataLoader reshuffles on each pass)."""
    while True:
        empty = True
        for batch in batches:
            empty = False
            yield batch
        if empty:
            raise ValueError("batches yielded no batch (an exhausted iterator? pass a list or a DataLoader)")


@torch.no_grad()
def evaluate(model: nn.Module, data, device, batch_size: int = 512) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) over `data`: a Dataset, a DataLoader or an (x, y) pair of tensors."""
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        data = TensorDataset(*data)
    loader = data if isinstance(data, DataLoader) else make_loader(data, batch_size, seed=0, shuffle=False,
                                                                   drop_last=False)
    was_training = model.training
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)  # (B, classes)
        loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
        correct += (logits.argmax(dim=1) == y).sum().item()
        count += y.shape[0]
    model.train(was_training)
    if count == 0:
        raise ValueError("evaluate got no samples")
    return loss_sum / count, correct / count


StepFn = Callable[[nn.Module, torch.optim.Optimizer, tuple], dict]


def cross_entropy_step(clip: float | None = None) -> StepFn:
    """The default step: cross-entropy on (x, y), backward, global-norm clipping when `clip` is set,
    optimizer step. Metrics: "loss" and "grad_norm" (the norm before clipping)."""
    def step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple) -> dict:
        x, y = batch[0], batch[1]
        loss = F.cross_entropy(model(x), y)  # (B, classes) logits
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        params = [p for g in optimizer.param_groups for p in g["params"]]
        norm = clip_grad_norm(params, clip) if clip is not None else grad_norm(params)
        optimizer.step()
        return {"loss": loss, "grad_norm": norm}
    return step


def _to(batch, device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return tuple(_to(t, device) for t in batch)


def _value(v) -> float:
    return v.item() if isinstance(v, torch.Tensor) else float(v)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, batches: Iterable, *, steps: int, device,
          step_fn: StepFn | None = None, scheduler=None, lr_fn: Callable[[int], float] | None = None,
          clip: float | None = None, writer=None, tag: str = "", eval_data=None, eval_every: int = 0,
          progress: bool = True) -> dict:
    """Run `steps` optimizer steps of `step_fn(model, optimizer, batch) -> {metric: value}` over
    `batches` (cycled; each batch moved to `device`); returns the history.

    The default step is `cross_entropy_step(clip)`; a custom step does its own clipping, so `clip`
    goes with the default only. The lr comes from `lr_fn(step)` (set on every param group before
    the step) or from `scheduler` (stepped after each optimizer step), not both. The loop stops early,
    with history["diverged"] = True, when the loss is not finite, unless the step reports a true
    "skipped" metric (a loss scaler skipped it). History: lists "step", "lr" and one per metric the
    step returns ("loss", ...); "time_s" (wall time of the loop); with `eval_data`, "eval_loss" and
    "eval_acc" at the end and lists "eval_steps"/"eval_losses"/"eval_accs" every `eval_every` steps.
    `writer` (a SummaryWriter) gets one tag per metric and "lr", "eval_loss", "eval_acc": runs written
    to different folders overlay in TensorBoard. `tag` labels the progress bar.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if scheduler is not None and lr_fn is not None:
        raise ValueError("give either lr_fn or scheduler, not both: they would fight over the lr")
    if step_fn is not None and clip is not None:
        raise ValueError("clip goes with the default step; a custom step_fn clips (or not) itself")
    step_fn = step_fn or cross_entropy_step(clip)
    history: dict = {"step": [], "lr": [], "diverged": False}
    if eval_data is not None and eval_every > 0:
        history.update(eval_steps=[], eval_losses=[], eval_accs=[])
    model.to(device).train()
    it = cycle(batches)
    start = time.perf_counter()
    bar = tqdm(range(steps), disable=not progress, desc=tag or "train", leave=False)
    for step in bar:
        if lr_fn is not None:
            for group in optimizer.param_groups:
                group["lr"] = lr_fn(step)
        lr = optimizer.param_groups[0]["lr"]
        metrics = {k: _value(v) for k, v in step_fn(model, optimizer, _to(next(it), device)).items()}
        if scheduler is not None:
            scheduler.step()
        history["step"].append(step)
        history["lr"].append(lr)
        for key, value in metrics.items():
            history.setdefault(key, []).append(value)
        if writer is not None:
            for key, value in (*metrics.items(), ("lr", lr)):
                writer.add_scalar(key, value, step)
        if not math.isfinite(metrics["loss"]) and not metrics.get("skipped"):
            history["diverged"] = True
            break
        if progress and step % 10 == 0:
            bar.set_postfix(loss=f"{metrics['loss']:.3f}", lr=f"{lr:.2e}")
        if eval_data is not None and eval_every > 0 and (step + 1) % eval_every == 0:
            eval_loss, eval_acc = evaluate(model, eval_data, device)
            history["eval_steps"].append(step + 1)
            history["eval_losses"].append(eval_loss)
            history["eval_accs"].append(eval_acc)
            if writer is not None:
                writer.add_scalar("eval_acc", eval_acc, step + 1)
                writer.add_scalar("eval_loss", eval_loss, step + 1)
    bar.close()
    history["time_s"] = time.perf_counter() - start
    if eval_data is not None:
        history["eval_loss"], history["eval_acc"] = evaluate(model, eval_data, device)
    return history
