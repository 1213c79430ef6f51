"""Day 11's freezing check (its discriminative learning rates: `dlo.checks.day11_groups`).

The student's function acts on modules, so it runs in a worker (`run_student`) on models made here; the worker
trains two steps and returns plain data (the tensors before and after, the flags, the modules' classes). The
reference is `dlo.tuning.transfer.freeze` on an identical copy of each model.
"""

from __future__ import annotations

import copy
import random

import torch
from torch import nn

from dlo.grading.api import case_seed, check, run_student
from dlo.grading.compare import ok
from dlo.tuning.transfer import NORMS, freeze

TRANSFER = ("dlo.tuning.transfer.*",)

# What the freeze worker reads with, taken when this module is imported: the worker runs in the student's process
# after the student's code, which once rebound torch.equal, made Parameter.requires_grad a property and swapped
# each BatchNorm's class for one whose `training` lied to the worker (a red team, 2026-12-01). The C getter of
# the flag, the C clone and the instance dicts are out of its reach (TensorBase is immutable); the comparisons
# (torch.equal) are the check's, on its side.
_DICT = object.__getattribute__
_TYPE, _ID, _ITEMS, _DICT_GET = type, id, dict.items, dict.get
_QUALNAME, _MODULE = type.__dict__["__qualname__"].__get__, type.__dict__["__module__"].__get__
_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"].__get__
_DETACH, _CLONE = torch._C.TensorBase.detach, torch._C.TensorBase.clone
_NO_OVERRIDES = torch._C.DisableTorchFunction   # no tensor subclass's or mode's __torch_function__ consulted
_SGD, _CROSS_ENTROPY, _SEED = torch.optim.SGD, nn.functional.cross_entropy, torch.manual_seed
_EQUAL = torch.equal


def _norm2d(c: int, three_d: bool) -> nn.Module:
    """A BatchNorm2d, or a BatchNorm3d between two views (BatchNorm1d and 2d named one by one miss it)."""
    return nn.Sequential(nn.Unflatten(1, (c, 1)), nn.BatchNorm3d(c), nn.Flatten(1, 2)) if three_d else nn.BatchNorm2d(c)


def _model(rng: random.Random, t: int) -> nn.Module:
    """A small convnet with BatchNorm (1d, 2d, in case 0 a 3d, in case 1 a SyncBatchNorm), a Dropout and a nested
    block in its features, Identity layers at random places (the BatchNorm layers have no fixed index: a red team
    put the check's three in eval mode by their indices, 2026-11-30); a Linear head. A SyncBatchNorm without a
    process group normalises as a BatchNorm, also in train mode on a CPU (torch 2.13)."""
    c, h = rng.choice([3, 4, 5]), rng.choice([6, 7, 9])
    norm1d = nn.SyncBatchNorm(h) if t == 1 or rng.random() < 0.3 else nn.BatchNorm1d(h)  # 1d-3d named miss it
    layers = [nn.Conv2d(2, c, 3, padding=1), _norm2d(c, t == 0 or rng.random() < 0.3), nn.ReLU(),
              nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), _norm2d(c, rng.random() < 0.3)), nn.ReLU(),
              nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, h), norm1d, nn.Dropout(0.25), nn.ReLU()]
    for _ in range(rng.randint(1, 3)):
        layers.insert(rng.randint(0, len(layers)), nn.Identity())
    model = nn.Sequential(nn.Sequential(*layers), nn.Linear(h, rng.choice([2, 3, 5]))).train()
    # modules in eval mode before the freeze stay so: case 1 the Dropout, then a random one of the others (a freeze
    # that sets every other module to train mode passed while all started in it)
    others = [m for m in model[0].modules() if m is not model[0] and not isinstance(m, NORMS)]
    for m in [next(m for m in others if isinstance(m, nn.Dropout))] * (t == 1) + rng.sample(others, 1):
        m.eval()
    return model


def _walk(module: nn.Module, prefix: str = ""):
    """(name, module) of `module` and of every module under it, named as named_modules() names them, found through
    the instance dicts (named_modules is a method the student's code could replace)."""
    yield prefix, module
    for name, child in _ITEMS(_DICT(module, "__dict__")["_modules"]):
        if child is not None:
            yield from _walk(child, f"{prefix}.{name}" if prefix else name)


def _tensors(model: nn.Module, kinds=("_parameters", "_buffers")) -> dict:
    """Every parameter and buffer of `model` by its state_dict name, read from the modules' own dicts."""
    return {f"{n}.{k}" if n else k: t for n, m in _walk(model) for kind in kinds
            for k, t in _ITEMS(_DICT(m, "__dict__")[kind]) if t is not None}


def _copies(model: nn.Module) -> dict:
    with _NO_OVERRIDES():
        return {k: _CLONE(_DETACH(t)) for k, t in _tensors(model).items()}


def _classes(model: nn.Module) -> dict:
    """Each module's class, as its qualified name and the identity of the class object (a look-alike class can
    copy the name)."""
    return {n: [f"{_MODULE(c)}.{_QUALNAME(c)}", _ID(c)] for n, m in _walk(model) for c in (_TYPE(m),)}


def _freeze_worker(freeze_fn, model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict:
    """The student's freeze on the features, then two SGD steps on every parameter: the raw tensors before and after
    (the check compares them), the flags and modes as the instance dicts and C getters hold them."""
    classes = _classes(model)
    count = freeze_fn(_DICT(model, "__dict__")["_modules"]["0"])
    classes = [classes, _classes(model)]
    modes = {n: _DICT_GET(_DICT(m, "__dict__"), "training") for n, m in _walk(model)}   # None: not there any more
    params = _tensors(model, ("_parameters",))
    with _NO_OVERRIDES():
        grad = {k: _REQUIRES_GRAD(p) for k, p in params.items()}
    before = _copies(model)
    # all of them: requires_grad must keep the frozen ones still
    opt = _SGD(list({_ID(p): p for p in params.values()}.values()), lr=0.5)
    _SEED(seed)
    for _ in range(2):
        loss = _CROSS_ENTROPY(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {"count": count, "classes": classes, "modes": modes, "grad": grad, "before": before,
            "after": _copies(model)}


def _replaced(got: dict) -> str | None:
    """What the student's call did to the modules themselves, beyond requires_grad and their modes: None if
    nothing."""
    before, after = got["classes"]
    for n, (cls, _) in before.items():
        if n not in after:
            return f"module {n} ({cls.rsplit('.', 1)[-1]}) is gone"
        if after[n] != before[n]:
            same = " (another class of the same name)" if after[n][0] == cls else ""
            return f"module {n} is now of another class: {cls} became {after[n][0]}{same}"
    new = [n for n in after if n not in before]
    if new:
        return f"module {new[0]} was added"
    gone = [n for n, m in got["modes"].items() if m is None]
    if gone:
        return f"module {gone[0]} has no `training` attribute of its own any more"
    if set(got["before"]) != set(got["after"]):
        return "a parameter or buffer of the model was added or removed during the training after the freeze"
    return None


def _complete(name: str, got: dict, ref: nn.Module, case: str) -> None:
    """Every module's class and mode, every parameter's flag and every tensor before and after, as the model made here
    has them: a record left out of the reply is a module, a flag or a tensor the check would not look at."""
    modules, tensors = [n for n, _ in _walk(ref)], set(_tensors(ref))
    params = set(_tensors(ref, ("_parameters",)))
    before, after = got["classes"]
    for what, have, want in (("classes before the call", set(before), set(modules)),
                             ("classes after it", set(after), set(modules)), ("modes", set(got["modes"]), set(modules)),
                             ("requires_grad flags", set(got["grad"]), params),
                             ("tensors before the training", set(got["before"]), tensors),
                             ("tensors after it", set(got["after"]), tensors)):
        if have != want:
            raise AssertionError(f"{name}: the grader got the {what} of {len(have & want)} of the model's {len(want)} "
                                 f"(missing: {sorted(want - have)[:3]}; unknown: {sorted(have - want)[:3]}): "
                                 f"modules and their tensors stay as they are, only their flags and modes change "
                                 f"({case})")


@check(forbid=TRANSFER, hint="set requires_grad and the BatchNorm layers' mode yourself")
def check_freeze(freeze_fn, seed: int = 0, trials: int = 3) -> None:
    """`freeze_fn(module) -> int`: no parameter of `module` trains, its BatchNorm statistics stay, the other
    modules keep their mode; the number of frozen parameters (elements) returned. Against dlo's `freeze`."""
    name, rng = "freeze", random.Random(case_seed(seed))
    for t in range(trials):
        torch.manual_seed(rng.randrange(1 << 30))
        model = _model(rng, t)
        norms = [m for m in model[0].modules() if isinstance(m, NORMS)]
        norms[1].weight = norms[0].weight             # one tensor in two BatchNorms (c channels each): counted once
        for p in rng.sample(list(model[0].parameters()), 2):
            p.requires_grad_(False)                   # frozen before: still counted, still frozen
        x = torch.randn(rng.choice([6, 10]), 2, 5, 5)
        y = torch.randint(0, model[1].out_features, (x.shape[0],))
        ref = copy.deepcopy(model)
        want_count = freeze(ref[0])
        want_modes = {n: m.training for n, m in ref.named_modules()}
        got = run_student(_freeze_worker, freeze_fn, model, x, y, t)
        case = f"case {t}: {sum(p.numel() for p in ref.parameters())} parameters, {want_count} of them in features"
        _complete(name, got, ref, case)
        replaced = _replaced(got)
        if replaced:
            raise AssertionError(f"{name}: {replaced}: the freeze must not replace the modules' classes or "
                                 f"attributes; set requires_grad=False on the parameters and call .eval() on the "
                                 f"BatchNorm layers, nothing else ({case})")
        # compared here, not where the student's code ran (a red team's torch.equal said nothing moved there)
        changed = {k: not _EQUAL(v, got["after"][k]) for k, v in got["before"].items()}
        moved = [k for k, c in changed.items() if c and k.startswith("0.")]
        stats = [k for k in moved if "running" in k or "num_batches" in k]
        weights = [k for k in moved if k not in stats]
        if weights:
            raise AssertionError(f"{name}: frozen parameters still updated by the optimizer ({', '.join(weights[:3])}"
                                 f"): set requires_grad=False on every parameter of the module, biases and nested "
                                 f"blocks included ({case})")
        if stats:
            raise AssertionError(f"{name}: BatchNorm statistics still moving in the frozen part "
                                 f"({', '.join(stats[:3])}): requires_grad does not stop them; put every BatchNorm "
                                 f"layer in eval mode (1d, 2d and 3d, SyncBatchNorm too: every "
                                 f"nn.modules.batchnorm._BatchNorm) ({case})")
        still = [k for k, g in got["grad"].items() if k.startswith("0.") and g]
        if still:
            raise AssertionError(f"{name}: {still[0]} still has requires_grad=True: set requires_grad=False on every "
                                 f"parameter of the module (a hook that zeroes its gradient is not frozen: weight "
                                 f"decay or momentum still move it) ({case})")
        head = [k for k, g in got["grad"].items() if k.startswith("1.") and not g]
        if head or not any(c for k, c in changed.items() if k.startswith("1.")):
            raise AssertionError(f"{name}: the head no longer trains: freeze only the module given, not the model "
                                 f"({case})")
        wrong_modes = [n for n, m in got["modes"].items() if n.startswith("0") and m != want_modes[n]]
        if wrong_modes:
            which = dict(ref.named_modules())[wrong_modes[0]]
            what = ("BatchNorm layers go to eval mode" if isinstance(which, NORMS) else
                    f"only the BatchNorm layers change mode: every other module keeps the mode it had (here "
                    f"{'train' if want_modes[wrong_modes[0]] else 'eval'}), set nothing else")
            raise AssertionError(f"{name}: module {wrong_modes[0]} ({type(which).__name__}) is in "
                                 f"{'train' if got['modes'][wrong_modes[0]] else 'eval'} mode: {what} ({case})")
        if got["count"] != want_count:
            raise AssertionError(f"{name}: returned {got['count']}, expected {want_count}: the number of frozen "
                                 f"parameter elements, sum of p.numel() over module.parameters(): every one, "
                                 f"trainable before or not, a tensor shared by two layers once ({case})")
    ok(name, f"{trials} models: parameters still, BatchNorm statistics still, head trains, count")
