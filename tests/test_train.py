"""The training loop, evaluation and the deterministic loaders."""

import math

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from dlo.data import synthetic_cifar10
from dlo.models import MLP
from dlo.schedules import warmup_cosine
from dlo.train import evaluate, make_loader, train


@pytest.fixture(scope="module")
def data():
    x, y = synthetic_cifar10(256, seed=0, image_size=8)
    return TensorDataset((x - x.mean()) / x.std(), y)


def _model(seed=0):
    torch.manual_seed(seed)
    return MLP(3 * 8 * 8, 32, 10, depth=2)


class ListDataset(Dataset):
    def __init__(self, n):
        self.items = [(torch.tensor([float(i)]), torch.tensor(i)) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("dataset", [TensorDataset(torch.arange(23.0)[:, None], torch.arange(23)), ListDataset(23)])
def test_loader_is_deterministic_and_covers_an_epoch(dataset):
    order = lambda seed: [b[1].tolist() for b in make_loader(dataset, 5, seed=seed)]  # noqa: E731
    first = order(0)
    assert first == order(0) and first != order(1)
    assert [len(b) for b in first] == [5] * 4  # drop_last drops the 3 left over
    assert len(set(sum(first, []))) == 20
    plain = [b[1].tolist() for b in make_loader(dataset, 5, seed=0, shuffle=False, drop_last=False)]
    assert sum(plain, []) == list(range(23))
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(dataset, 24, seed=0)


def test_train_with_lr_fn_learns_and_records_history(data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=123.0, momentum=0.9)
    lr_fn = lambda s: warmup_cosine(s, base_lr=0.05, warmup_steps=3, total_steps=30)  # noqa: E731
    hist = train(model, opt, make_loader(data, 32, seed=0), steps=30, device="cpu", lr_fn=lr_fn,
                 eval_data=data, eval_every=10, progress=False)
    assert hist["step"] == list(range(30)) and not hist["diverged"]
    assert hist["lr"] == [lr_fn(s) for s in range(30)]
    assert len(hist["loss"]) == len(hist["grad_norm"]) == 30
    assert sum(hist["loss"][-5:]) < 0.8 * sum(hist["loss"][:5])
    assert hist["eval_steps"] == [10, 20, 30] and len(hist["eval_accs"]) == 3
    assert (hist["eval_loss"], hist["eval_acc"]) == pytest.approx((hist["eval_losses"][-1], hist["eval_accs"][-1]))
    assert model.training


def test_train_steps_a_torch_scheduler(data):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    batches = [data[i * 16:(i + 1) * 16] for i in range(3)]  # a plain list is cycled
    hist = train(model, opt, batches, steps=10, device="cpu", scheduler=sched, progress=False)
    assert hist["lr"] == pytest.approx([1e-2] * 4 + [5e-3] * 4 + [2.5e-3] * 2)
    assert "eval_acc" not in hist
    with pytest.raises(ValueError, match="not both"):
        train(model, opt, batches, steps=1, device="cpu", scheduler=sched, lr_fn=lambda s: 0.1, progress=False)


def test_clip_bounds_the_update_and_logs_the_norm_before(data):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    hist = train(model, opt, [data[:64]], steps=1, device="cpu", clip=1e-3, progress=False)
    # Plain SGD with lr 1 moves the weights by exactly the clipped gradient.
    moved = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(model.parameters(), before)))
    assert moved == pytest.approx(1e-3, rel=1e-3)
    assert hist["grad_norm"][0] > 1e-2


def test_writer_tags_and_divergence_stop(data):
    class Writer:
        def __init__(self):
            self.calls = []

        def add_scalar(self, tag, value, step):
            self.calls.append((tag, step))

    writer, model = Writer(), _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hist = train(model, opt, make_loader(data, 32, seed=0), steps=20, device="cpu", writer=writer, tag="sgd",
                 lr_fn=lambda s: 0.1 if s < 2 else 1e30, progress=False)
    assert hist["diverged"] and len(hist["loss"]) < 20 and not math.isfinite(hist["loss"][-1])
    # one tag per metric, no run prefix: runs written to different folders overlay in TensorBoard
    assert ("loss", 0) in writer.calls and ("lr", 1) in writer.calls and ("grad_norm", 2) in writer.calls
    assert not any("/" in tag for tag, _ in writer.calls)


def test_custom_step_fn_metrics_become_history(data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []

    def step(m, o, batch):
        x, y = batch
        seen.append(x.device.type)
        loss = torch.nn.functional.cross_entropy(m(x), y)
        o.zero_grad()
        loss.backward()
        o.step()
        return {"loss": loss, "batch": x.shape[0], "skipped": 0}

    hist = train(model, opt, make_loader(data, 16, seed=0), steps=4, device="cpu", step_fn=step, progress=False)
    assert hist["batch"] == [16.0] * 4 and hist["step"] == [0, 1, 2, 3] and "grad_norm" not in hist
    assert seen == ["cpu"] * 4 and all(isinstance(v, float) for v in hist["loss"])
    with pytest.raises(ValueError, match="clip goes with the default step"):
        train(model, opt, [data[:8]], steps=1, device="cpu", step_fn=step, clip=1.0, progress=False)


def test_a_skipped_step_with_a_non_finite_loss_is_not_divergence(data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = iter([math.inf, 1.0, math.nan])

    def step(m, o, batch):  # a loss scaler's step: inf loss, step skipped
        loss = next(losses)
        return {"loss": loss, "skipped": math.isinf(loss)}

    hist = train(model, opt, [data[:8]], steps=3, device="cpu", step_fn=step, progress=False)
    assert hist["diverged"] and hist["skipped"] == [1.0, 0.0, 0.0] and len(hist["loss"]) == 3


def test_exhausted_iterator_is_an_error(data):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="no batch"):
        train(model, opt, iter([data[:8]]), steps=3, device="cpu", progress=False)


def test_evaluate_matches_direct_computation(data):
    model = _model().train()
    x, y = data.tensors
    with torch.no_grad():
        logits = model.eval()(x)
    model.train()
    loss, acc = evaluate(model, data, "cpu", batch_size=50)
    assert loss == pytest.approx(torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5)
    assert acc == pytest.approx((logits.argmax(1) == y).float().mean().item())
    assert evaluate(model, (x, y), "cpu") == pytest.approx((loss, acc), rel=1e-5)
    assert model.training
