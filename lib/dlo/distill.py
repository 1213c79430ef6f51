"""Knowledge distillation (Hinton et al. 2015; DistilBERT, Sanh et al. 2019).

    L = T^2 KL(softmax(z_t / T) || softmax(z_s / T)) + lambda CE(y, z_s)

The temperature T > 1 softens both distributions so the student also learns the teacher's ranking
of the wrong classes ("dark knowledge"); the T^2 factor keeps the soft-target gradients, which scale
as 1 / T^2, comparable to the hard-label term when T changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlo.train import train


def distillation_loss(student_logits: Tensor, teacher_logits: Tensor, targets: Tensor | None = None,
                      temperature: float = 2.0, lam: float = 1.0) -> Tensor:
    """Batch-mean T^2 KL(p_teacher^T || p_student^T) + lam * cross-entropy(student, targets)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p_s = F.log_softmax(student_logits / temperature, dim=-1)
    log_p_t = F.log_softmax(teacher_logits.detach() / temperature, dim=-1)
    loss = temperature ** 2 * F.kl_div(log_p_s, log_p_t, log_target=True, reduction="batchmean")
    if targets is not None and lam != 0:
        loss = loss + lam * F.cross_entropy(student_logits, targets)
    return loss


def distill_step(teacher: nn.Module, temperature: float = 2.0, lam: float = 1.0):
    """A step function of `dlo.train.train`: the student learns from the frozen teacher's soft
    targets and the labels (`distillation_loss`). Metric: "loss"."""
    def step(student: nn.Module, optimizer: torch.optim.Optimizer, batch) -> dict:
        x, y = batch[0], batch[1]
        with torch.no_grad():
            t_logits = teacher(x)  # (B, classes)
        loss = distillation_loss(student(x), t_logits, y, temperature, lam)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return {"loss": loss}
    return step


def train_distill(student: nn.Module, teacher: nn.Module, optimizer: torch.optim.Optimizer, loader, *,
                  steps: int, device, temperature: float = 2.0, lam: float = 1.0, progress: bool = True,
                  writer=None) -> dict:
    """Train `student` on the teacher's soft targets (teacher frozen, in eval mode): `dlo.train.train`
    with `distill_step`; returns its history."""
    teacher.to(device).eval()
    return train(student, optimizer, loader, steps=steps, device=device,
                 step_fn=distill_step(teacher, temperature, lam), writer=writer, tag="distill", progress=progress)
