"""Autograder checks for Day 3 (activation checkpointing, offload, exact resume of training state).

References: plain autograd without checkpointing (same seed, hence the same dropout masks),
`dlo.activation_ckpt` for the saved-memory accounting, and an uninterrupted training run for the
resume check. Checkpointing replays the very same float operations, so gradients must agree exactly
(in float64, tolerance 0); resumed losses must be bit-identical.

The student's Function, hooks and training-state code run inside autograd graphs and training loops,
so each check runs that part in a worker (`dlo.grading.api.run_student`) on modules and inputs made
here; the worker records outputs, gradients, saved bytes and losses, and the references (plain
autograd, an uninterrupted run) are computed here, where the comparison happens. (The day's three
exercises, one section each; an every-k-th-block policy is the text's, not an exercise: it only
copied the rule the text gives.)
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dlo.config import seed_everything
from dlo.grading.api import check, run_student
from dlo.grading.compare import DTYPE, ok
from dlo.measure import SavedTensorMeter

CHECKPOINTS = ("torch.utils.checkpoint.checkpoint", "torch.utils.checkpoint.checkpoint_sequential",
               "torch.utils.checkpoint.CheckpointFunction", "dlo.activation_ckpt.CheckpointFunction",
               "dlo.activation_ckpt.checkpoint")
OFFLOAD = ("dlo.activation_ckpt.offload_pack", "dlo.activation_ckpt.offload_unpack", "dlo.activation_ckpt.cpu_offload",
           "torch.autograd.graph.save_on_cpu")
TRAINING_STATE = ("dlo.checkpoint.training_state", "dlo.checkpoint.restore_training_state", "dlo.checkpoint.rng_state",
                  "dlo.checkpoint.set_rng_state", "dlo.checkpoint.CheckpointManager")


def _device(device=None) -> torch.device:
    """`device` if given, else CUDA when present (where offload and the CUDA RNG matter), else CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _block(rng: random.Random, d: int, p: float) -> nn.Module:
    hidden = rng.choice([5, 9, 17])
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Dropout(p), nn.Linear(hidden, d))


def _grads(module: nn.Module, x: torch.Tensor) -> list[torch.Tensor | None]:
    return [None if t.grad is None else t.grad.clone() for t in (x, *module.parameters())]


def _compare(name: str, what: str, got: list, want: list, hp: dict) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g is None or not torch.equal(g, w):
            err = "missing (None)" if g is None else f"max abs error {(g - w).abs().max().item():.3g}"
            where = "the input" if i == 0 else f"parameter {i - 1}"
            raise AssertionError(f"{name}: {what} of {where} differs from no checkpointing ({hp}): {err}. "
                                 f"Recompute with the RNG state saved in forward (dropout must draw the same mask)"
                                 f" and back-propagate grad_outputs through the recomputed outputs")


# ----------------------------------------------------------------------------- Checkpoint autograd.Function

def _checkpoint_worker(Checkpoint, block, x, gate, two_inputs: bool, seed: int, grad_out) -> dict:
    """Forward through the student's Function (saved bytes metered), the caller's RNG draw, backward;
    the output, the gradients and the RNG stream after backward."""
    block.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    fn = (lambda a, g: block(a) * g) if two_inputs else block
    args = (x, gate) if two_inputs else (x,)
    torch.manual_seed(seed)
    with SavedTensorMeter(exclude=block.parameters()) as meter:
        y = Checkpoint.apply(fn, *args)
    out = {"type": type(y).__name__, "grad_fn": isinstance(y, torch.Tensor) and y.grad_fn is not None,
           "saved": meter.bytes, "inputs": sum(a.untyped_storage().nbytes() for a in args)}
    if not out["grad_fn"] or meter.bytes > out["inputs"]:
        return out
    out["y"] = y.detach()
    torch.randn_like(y)  # the reference's draw of grad_out: backward must not rewind the caller's RNG
    y.backward(grad_out)
    return {**out, "grads": _grads(block, x), "after": torch.rand(4, device=x.device)}


@check(forbid=CHECKPOINTS)
def check_checkpoint_function(Checkpoint, seed: int = 0, trials: int = 4, device=None) -> None:
    """`Checkpoint.apply(fn, *args)`: same output, input and parameter grads as fn(*args), dropout
    included; saves no more than the inputs; leaves the caller's RNG stream as it found it.
    Runs on `device` (default: CUDA when available, else CPU)."""
    name, rng, dev = "checkpoint_function", random.Random(seed), _device(device)
    for t in range(trials):
        d, p = rng.choice([3, 6, 11]), rng.choice([0.2, 0.5])
        hp = dict(trial=t, features=d, dropout=p, batch=rng.choice([1, 4, 7]), two_inputs=t % 2 == 1)
        block = _block(rng, d, p).to(dev, DTYPE).train()
        x = torch.randn(hp["batch"], d, device=dev, dtype=DTYPE, requires_grad=True)
        gate = torch.rand(hp["batch"], d, device=dev, dtype=DTYPE)  # an input that needs no grad
        fn = (lambda a, g, block=block: block(a) * g) if hp["two_inputs"] else block
        args = (x, gate) if hp["two_inputs"] else (x,)
        torch.manual_seed(seed * 100 + t)
        want_y = fn(*args)
        grad_out = torch.randn_like(want_y)  # a draw between forward and backward, as a training loop may make
        want_y.backward(grad_out)
        want, want_after = [g.cpu() for g in _grads(block, x)], torch.rand(4, device=dev).cpu()
        got = run_student(_checkpoint_worker, Checkpoint, block, x, gate, hp["two_inputs"], seed * 100 + t, grad_out)
        if not got["grad_fn"]:
            raise AssertionError(f"{name}: Checkpoint.apply must return a tensor with a grad_fn ({hp}); got "
                                 f"{got['type']}{' without grad_fn' if got['type'] == 'Tensor' else ''}")
        if got["saved"] > got["inputs"]:
            raise AssertionError(f"{name}: forward kept {got['saved']} bytes for backward but the inputs are only "
                                 f"{got['inputs']}: run fn under torch.no_grad() and save only the inputs ({hp})")
        if not torch.equal(got["y"].cpu(), want_y.detach().cpu()):
            raise AssertionError(f"{name}: forward output differs from fn(*args) ({hp})")
        _compare(name, "gradient", [None if g is None else g.cpu() for g in got["grads"]], want, hp)
        if not torch.equal(got["after"].cpu(), want_after):
            raise AssertionError(f"{name}: after backward the global RNG is in another state than without "
                                 f"checkpointing: restore the saved state inside torch.random.fork_rng() ({hp})")
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- CPU offload hooks

def _tensors_in(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors_in(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors_in(o)]
    return []


def _offload_worker(pack, unpack, xs: list, seed: int, dev: str) -> dict:
    """pack/unpack on each tensor (stopping at the first one that goes wrong: what went wrong), then
    the gradients of a small model trained under saved_tensors_hooks(pack, unpack)."""
    trials = []
    for x in xs:
        x = x.to(dev)
        packed = pack(x)
        held = _tensors_in(packed)
        obs = {"n_held": len(held), "devices": [str(h.device) for h in held],
               "same_storage": any(h.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for h in held)}
        trials.append(obs)
        if not held or any(h.device.type != "cpu" for h in held) or obs["same_storage"]:
            return {"trials": trials}
        back = unpack(packed)
        obs["back_ok"] = (isinstance(back, torch.Tensor) and back.device == x.device and back.dtype == x.dtype
                          and back.shape == x.shape and torch.equal(back, x))
        obs["back"] = [str(getattr(back, "device", None)), str(getattr(back, "dtype", None)),
                       list(getattr(back, "shape", ()))]
        if not obs["back_ok"]:
            return {"trials": trials}
    model, x = _offload_model(seed, torch.device(dev))
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        model(x).pow(2).sum().backward()
    return {"trials": trials, "grads": [p.grad for p in model.parameters()]}


def _offload_model(seed: int, dev: torch.device):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3)).to(dev, DTYPE)
    return model, torch.randn(5, 7, device=dev, dtype=DTYPE)


@check(forbid=OFFLOAD)
def check_offload_hooks(pack, unpack, seed: int = 0, trials: int = 4, device=None) -> None:
    """`pack(t)` returns a host-memory copy (plus whatever unpack needs); `unpack(pack(t))` gives t back
    on its device with its dtype and values; a model trained under the hooks gets identical grads.
    Tensors live on `device` (default: CUDA when available, else CPU)."""
    name, rng, gen = "offload_hooks", random.Random(seed), torch.Generator().manual_seed(seed)
    dev = _device(device)
    xs, cases = [], []
    for t in range(trials):
        shape = tuple(rng.choice([1, 3, 7, 13]) for _ in range(rng.choice([1, 2, 3])))
        dtype = [torch.float32, torch.float64, torch.bfloat16, torch.int64][t % 4]
        xs.append((torch.randn(shape, generator=gen) * 10).to(dtype))
        cases.append((shape, dtype))
    got = run_student(_offload_worker, pack, unpack, xs, seed, str(dev))
    for (shape, dtype), obs in zip(cases, got["trials"]):
        if not obs["n_held"]:
            raise AssertionError(f"{name}: pack returned no tensor (shape {shape}, {dtype})")
        if any(not d.startswith("cpu") for d in obs["devices"]):
            raise AssertionError(f"{name}: pack must keep the tensor in host memory (.to('cpu')), got devices "
                                 f"{obs['devices']}")
        if obs["same_storage"]:
            raise AssertionError(f"{name}: pack kept the original tensor (same storage): make a copy in host "
                                 f"memory so the device memory can be freed, e.g. torch.empty(..., device='cpu')"
                                 f".copy_(t)")
        if not obs["back_ok"]:
            b_dev, b_dtype, b_shape = obs["back"]
            raise AssertionError(f"{name}: unpack(pack(t)) must equal t on {dev} with dtype {dtype} and "
                                 f"shape {shape}; got {b_dev}, {b_dtype}, {tuple(b_shape)}")
    model, x = _offload_model(seed, dev)
    model(x).pow(2).sum().backward()
    want = [p.grad.cpu() for p in model.parameters()]
    if not all(g is not None and torch.equal(g.cpu(), w) for g, w in zip(got["grads"], want)):
        raise AssertionError(f"{name}: gradients under saved_tensors_hooks(pack, unpack) differ from plain autograd")
    ok(name, f"{trials} trials, seed={seed}")


# ----------------------------------------------------------------------------- exact resume

def _objects(init_seed: int, data_seed: int):
    from dlo.checkpoint import ResumableBatches

    torch.manual_seed(init_seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.ReLU(), nn.Dropout(0.25), nn.Linear(9, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.3 * s))  # lr depends on the step count
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 6, growth_interval=1)
    gen = torch.Generator().manual_seed(data_seed)
    data = (torch.randn(29, 6, generator=gen), torch.randint(0, 4, (29,), generator=gen))
    loader = ResumableBatches(data, batch_size=rng_batch(data_seed), seed=data_seed)
    return dict(model=model, optimizer=opt, scheduler=sched, scaler=scaler, loader=loader)


def rng_batch(data_seed: int) -> int:
    return [4, 5, 7][data_seed % 3]


def _train_step(o: dict) -> float:
    x, y = next(o["loader"])
    x = x + 0.05 * torch.from_numpy(np.random.standard_normal(x.shape)).float()  # numpy RNG
    if random.random() < 0.5:  # python RNG
        x = x.flip(1)
    loss = F.cross_entropy(o["model"](x), y)  # torch RNG: dropout
    o["optimizer"].zero_grad(set_to_none=True)
    o["scaler"].scale(loss).backward()
    o["scaler"].step(o["optimizer"])
    o["scaler"].update()
    o["scheduler"].step()
    return loss.item()


def _resume_worker(save_training_state, load_training_state, seed: int, new_seed: int, data_seed: int,
                   steps: int, cut: int) -> dict:
    """The interrupted run: `cut` steps, save, a new "job" (other RNG states and weights), load, go on."""
    seed_everything(seed)
    o = _objects(1, data_seed)
    got = [_train_step(o) for _ in range(cut)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "state.pt"
        save_training_state(path, step=cut, **o)
        seed_everything(new_seed)  # the new job: other RNG states, other initial weights, loader at start
        o = _objects(2, data_seed)
        step = load_training_state(path, **o)
    if step != cut:
        return {"step": step if isinstance(step, (int, float, str)) or step is None else type(step).__name__}
    got += [_train_step(o) for _ in range(steps - cut)]
    return {"step": step, "losses": got, "scale": float(o["scaler"].get_scale())}


@check(forbid=TRAINING_STATE)
def check_resume(save_training_state, load_training_state, seed: int = 0, trials: int = 3) -> None:
    """`save_training_state(path, *, model, optimizer, scheduler, scaler, loader, step)` then, in a fresh
    "job" (other initial weights, other RNG states), `load_training_state(path, *, model, optimizer,
    scheduler, scaler, loader) -> step` must continue with exactly the losses of an uninterrupted run."""
    name, rng = "resume", random.Random(seed)
    for t in range(trials):
        steps, data_seed = rng.choice([9, 12]), rng.randrange(1000)
        cut = rng.randrange(2, steps - 2)
        hp = dict(trial=t, steps=steps, interrupted_after=cut, batch=rng_batch(data_seed))
        seed_everything(seed * 10 + t)
        o = _objects(1, data_seed)
        want = [_train_step(o) for _ in range(steps)]
        scale_want = o["scaler"].get_scale()
        res = run_student(_resume_worker, save_training_state, load_training_state, seed * 10 + t, 12345 + t,
                          data_seed, steps, cut)
        if res["step"] != cut:
            raise AssertionError(f"{name}: load_training_state returned step {res['step']!r}, expected {cut} ({hp})")
        got = res["losses"]
        if got != want:
            first = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            raise AssertionError(
                f"{name}: resumed losses differ from the uninterrupted run from step {first} on ({hp}): "
                f"expected {want[first]!r}, got {got[first]!r}. Saved and restored: model, optimizer, "
                f"scheduler, scaler, loader position (state_dict) and the python, numpy, torch (and CUDA) RNGs?")
        if res["scale"] != scale_want:
            raise AssertionError(f"{name}: the AMP scaler's scale after the resumed run is "
                                 f"{res['scale']}, expected {scale_want}: restore scaler.state_dict()")
    ok(name, f"{trials} trials, seed={seed}")
