"""dlo.distill: the loss against its definition, T^2 scaling, and a student that learns from a teacher."""

import pytest
import torch
import torch.nn.functional as F

from dlo.distill import distillation_loss, train_distill
from dlo.models import MLP


def test_loss_matches_definition():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    y = torch.randint(0, 5, (6,), generator=gen)
    T, lam = 3.0, 0.5
    p_t = F.softmax(t / T, -1)
    kl = (p_t * (p_t.log() - F.log_softmax(s / T, -1))).sum(-1).mean()
    want = T * T * kl + lam * F.cross_entropy(s, y)
    torch.testing.assert_close(distillation_loss(s, t, y, T, lam), want)
    assert distillation_loss(t, t, None, T).abs() < 1e-6  # identical logits: zero divergence
    with pytest.raises(ValueError, match="same shape"):
        distillation_loss(s, t[:, :4])


def test_student_learns_teacher():
    torch.manual_seed(0)
    teacher, student = MLP(10, 32, 4), MLP(10, 8, 4)
    x = torch.randn(256, 10)
    y = teacher(x).argmax(1)
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, 256, 64)]
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    hist = train_distill(student, teacher, opt, batches, steps=120, device="cpu", progress=False)
    assert hist["loss"][-1] < 0.5 * hist["loss"][0]
    assert (student(x).argmax(1) == y).float().mean() > 0.8
