"""Day 11's freezing check (its discriminative learning rates: `dlo.checks.day11_groups`).

The student's function acts on modules, so it runs in a worker (`run_student`) on models made here; the worker
returns plain data: what the call set (each parameter's requires_grad, each module's mode), the modules' classes
and the count. The check sets those flags and modes on its own copy of the model and trains that copy two steps
here: what moved is decided on this side, never read from the student's process (whose reply can be forged: a red
team rewrote the worker's tensors on their way out, 2026-12-03). The reference is `dlo.tuning.transfer.freeze` on
another copy.
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
# the flag, the C clone and the instance dicts are out of its reach (TensorBase is immutable). Whatever it reads,
# the reply can still be rewritten on its way out: what moved is the check's, trained on its side (`_trained`).
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
    """The student's freeze on the features: the flags and modes it left, as the instance dicts and C getters hold
    them, and the modules' classes before and after. Then two SGD steps on every parameter here, whose only use is
    the wording of a failure (`stilled`: the parameters that kept still in the student's process although their
    flag says they train, a hook that zeroes their gradient); the check trains its own copy to decide."""
    classes = _classes(model)
    count = freeze_fn(_DICT(model, "__dict__")["_modules"]["0"])
    classes = [classes, _classes(model)]
    modes = {n: _DICT_GET(_DICT(m, "__dict__"), "training") for n, m in _walk(model)}   # None: not there any more
    params = _tensors(model, ("_parameters",))
    with _NO_OVERRIDES():
        grad = {k: _REQUIRES_GRAD(p) for k, p in params.items()}
    before = _copies(model)
    _two_steps(model, params, x, y, seed)
    after = _copies(model)
    stilled = sorted(k for k, g in grad.items() if g and k in before and k in after and _EQUAL(before[k], after[k]))
    return {"count": count, "classes": classes, "modes": modes, "grad": grad, "stilled": stilled}


def _two_steps(model: nn.Module, params: dict, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    """Two SGD steps on `params` (each tensor once), the same in the worker and on the check's copy."""
    opt = _SGD(list({_ID(p): p for p in params.values()}.values()), lr=0.5)
    _SEED(seed)
    for _ in range(2):
        loss = _CROSS_ENTROPY(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _flag(value) -> bool:
    """A flag or mode of the reply as a bool: anything else is no flag (the reply is the student's to shape)."""
    if value is True or value is False:
        return value
    raise AssertionError(f"freeze: the grader got {value!r} for a requires_grad flag or a module's mode, not a "
                         f"bool: modules and their tensors stay as they are, only their flags and modes change")


def _trained(model: nn.Module, grad: dict, modes: dict, x: torch.Tensor, y: torch.Tensor, seed: int) -> dict:
    """The check's own copy of the model with the flags and modes the student's call left (`grad`, `modes`) set on
    it, trained two SGD steps here as the worker trained the student's: {tensor name: whether it moved}."""
    params = _tensors(model, ("_parameters",))
    flags: dict[int, bool] = {}
    for k, p in params.items():
        flag = _flag(grad[k])
        if flags.setdefault(id(p), flag) != flag:   # one tensor under two names (two BatchNorms share a weight)
            raise AssertionError(f"freeze: the grader got two requires_grad flags for one tensor ({k} and the other "
                                 f"name of it): a tensor has one flag")
        p.requires_grad_(flag)
    for n, m in _walk(model):
        m.training = _flag(modes[n])
    before = _copies(model)
    with torch.random.fork_rng(devices=[]):
        _two_steps(model, params, x, y, seed)
    after = _copies(model)
    return {k: not _EQUAL(v, after[k]) for k, v in before.items()}


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
    return None


def _complete(name: str, got: dict, ref: nn.Module, case: str) -> None:
    """Every module's class and mode and every parameter's flag, as the model made here has them: a record left out
    of the reply is a module or a flag the check would not look at."""
    if not isinstance(got, dict) or not {"count", "classes", "modes", "grad", "stilled"} <= set(got):
        raise AssertionError(f"{name}: the grader got no record of the model after your call ({case})")
    modules, params = [n for n, _ in _walk(ref)], set(_tensors(ref, ("_parameters",)))
    classes = got["classes"]
    if not isinstance(classes, list) or len(classes) != 2 or not all(isinstance(c, dict) for c in classes) \
            or not all(isinstance(got[k], dict) for k in ("modes", "grad")) or not isinstance(got["stilled"], list):
        raise AssertionError(f"{name}: the grader got a malformed record of the model after your call ({case})")
    before, after = classes
    for what, have, want in (("classes before the call", set(before), set(modules)),
                             ("classes after it", set(after), set(modules)), ("modes", set(got["modes"]), set(modules)),
                             ("requires_grad flags", set(got["grad"]), params)):
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
        ref, mine = copy.deepcopy(model), copy.deepcopy(model)   # mine: trained here with the student's flags
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
        # trained here, with the flags and modes the call left: what the student's process says moved decides
        # nothing (a red team's freeze did nothing and rewrote the worker's tensors and flags on the wire)
        changed = _trained(mine, got["grad"], got["modes"], x, y, t)
        moved = [k for k, c in changed.items() if c and k.startswith("0.")]
        stats = [k for k in moved if "running" in k or "num_batches" in k]
        weights = [k for k in moved if k not in stats]
        hooked = [k for k in weights if k in got["stilled"]]   # still there: only the wording
        if weights and len(hooked) < len(weights):
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
