"""References blocked by what they are, not by their names (issue 33).

A class that has read the grader's code submitted, for each exercise, one line: the library reference
rebuilt from its code object under the student's own name, the same fused torch kernel reached through
another holder, or the reference reached through the checks' own modules. Each scored full marks.
Here each is a student cell (a module nothing can import, so that it travels by value as a
notebook's does) graded the way `dlo grade` grades it (`LocalSandbox`: the runner's session child, a
fresh fork per check), and each now fails with `ForbiddenCall` naming the exercise. Honest solutions
written with the same torch primitives keep their marks, and so do the instructors' own solutions, which
share no substantial code with the references their checks forbid.
"""

from __future__ import annotations

import inspect
import textwrap
import types

import pytest
import torch

import dlo.checks
from dlo.checks import day1, day7
from dlo.grading import bytecode, identity
from dlo.grading.forbid import ForbiddenCall, forbidden, plan
from dlo.grading.trusted import LocalSandbox
from tests.checks.conftest import REPO, load_solution
from tests.forked import in_a_fork
from tests.student_cell import student_cell

pytestmark = pytest.mark.trust  # a hostile class's evidence: its own CI step, pytest -m trust

STUDENT = '''
import dis, gc, importlib, inspect, marshal, types
import torch
import dlo.optim.reference as ref

_adamw = inspect.unwrap(ref.adamw_step)  # the plain function under torch.no_grad()

# 1. the reference rebuilt from its code object, under the student's own name
clone = types.FunctionType(_adamw.__code__, _adamw.__globals__, "adamw_step", _adamw.__defaults__)
wrapped = ref.adamw_step.__wrapped__  # the decorated reference's inner function, pickled by value
_blob = marshal.dumps(_adamw.__code__)

def by_marshal(*args, **kwargs):  # the code as bytes in the notebook, made a function in the sandbox
    return types.FunctionType(marshal.loads(_blob), _adamw.__globals__)(*args, **kwargs)

def by_source(*args, **kwargs):  # the reference's own source file, executed under the check
    ns = {}
    exec(compile(open(inspect.getfile(ref)).read(), "mine.py", "exec"), ns)
    return inspect.unwrap(ns["adamw_step"])(*args, **kwargs)

_src = inspect.getsource(_adamw)  # the function's own text, unchanged, read before the check

def by_function_source(*args, **kwargs):  # compiled on its own: 3.11 makes `math.sqrt(x)` LOAD_METHOD there
    ns = dict(_adamw.__globals__)
    exec(compile(_src, "mine", "exec"), ns)
    return inspect.unwrap(ns["adamw_step"])(*args, **kwargs)

def by_reload(*args, **kwargs):  # a fresh module, whose functions no blocker ever saw
    return importlib.reload(ref).adamw_step(*args, **kwargs)

def _maker(c):
    return c

# hand-edited bytecode: MAKE_FUNCTION on whatever code object is passed, with no audit event for what it makes
_maker_code = _maker.__code__.replace(co_code=bytes([dis.opmap["RESUME"], 0, dis.opmap["LOAD_FAST"], 0,
                                                     dis.opmap["MAKE_FUNCTION"], 0, dis.opmap["RETURN_VALUE"], 0]),
                                      co_stacksize=1)

def by_make_function(*args, **kwargs):  # the reference's module run from its own file's code, made by hand
    g = {"__name__": "mine", "__builtins__": __builtins__}
    module = compile(open(inspect.getfile(ref)).read(), inspect.getfile(ref), "exec", dont_inherit=True)
    types.FunctionType(_maker_code, g)(module)()
    return inspect.unwrap(g["adamw_step"])(*args, **kwargs)

def by_gc(*args, **kwargs):  # the original function object, wherever the collector finds it
    gc.unfreeze()  # what a process froze (dlo.distributed._worker, dlo.harness.warm) is out of get_objects' sight
    f = next(o for o in gc.get_objects() if isinstance(o, types.FunctionType) and o.__name__ == "adamw_step"
             and o.__module__ == "dlo.optim.reference" and not hasattr(o, "__wrapped__"))
    return f(*args, **kwargs)

import torch.optim.adam as _torch_adam

class Adam(torch.optim.Optimizer):  # torch's Adam, its module copied into the student's own: its methods,
    pass                            # the functions they call (adam, _single_tensor_adam, ...)

_g = dict(vars(_torch_adam), Adam=Adam)

def _copy(f, name):
    f = inspect.unwrap(f)
    cells = tuple(types.CellType(Adam) if n == "__class__" else c  # super() finds the student's class
                  for n, c in zip(f.__code__.co_freevars, f.__closure__ or ()))
    g = types.FunctionType(f.__code__, _g, name, f.__defaults__, cells or None)
    g.__kwdefaults__ = f.__kwdefaults__
    return g

for _k, _v in list(_g.items()):
    if isinstance(_v, types.FunctionType) and inspect.unwrap(_v).__module__ == "torch.optim.adam":
        _g[_k] = _copy(_v, _k)
for _k, _v in vars(_torch_adam.Adam).items():
    if isinstance(_v, types.FunctionType):
        setattr(Adam, _k, _copy(_v, _k))

def by_class(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    p = torch.nn.Parameter(param.detach().clone())
    opt = Adam([p], lr=lr, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay, decoupled_weight_decay=True)
    opt.state[p] = {"step": torch.tensor(float(step - 1)), "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    p.grad = grad
    with torch.no_grad():  # what the unwrapped step lost: its decorator
        opt.step()
    param.copy_(p.detach())

# 2. the fused kernels under another holder than torch.* and torch.ops
def sgd_fused(param, grad, buf, *, lr, momentum, weight_decay, dampening, nesterov):
    first, buf = buf is None, torch.zeros_like(param) if buf is None else buf
    torch._C._VariableFunctions._fused_sgd_([param], [grad], [buf], weight_decay=weight_decay, momentum=momentum,
                                            lr=lr, dampening=dampening, nesterov=nesterov, maximize=False,
                                            is_first_step=first)
    return buf

def adamw_fused(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    torch._C._VariableFunctions._fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [],
                                              [torch.tensor(float(step))], lr=lr, beta1=beta1, beta2=beta2,
                                              weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)

def adamw_ops(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    ops = getattr(torch, "ops")  # (cloudpickle cannot ship a function that names torch.ops: a notebook's neither)
    ops.aten._fused_adamw_.default([param], [grad], [exp_avg], [exp_avg_sq], [], [torch.tensor(float(step))],
                                         lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                                         amsgrad=False, maximize=False)

# 3. the references the checks' own modules import, reached through the collector
def _bench(module, name):
    gc.unfreeze()
    return next(d for d in gc.get_objects() if type(d) is dict and d.get("__name__") == module)[name]

def tp_comm_ratio_by_bench(*args, **kwargs):  # Day 7's bench computes its expected ratios with it
    return _bench("dlo.checks.day7_scale", "tp_comm_ratio")(*args, **kwargs)

# honest, and not the reference's way: foreach ops (which torch's own optimizers use too)
def adamw_foreach(param, grad, exp_avg, exp_avg_sq, step, *, lr, beta1, beta2, eps, weight_decay):
    torch._foreach_mul_([param], 1 - lr * weight_decay)
    torch._foreach_lerp_([exp_avg], [grad], 1 - beta1)
    torch._foreach_mul_([exp_avg_sq], beta2)
    torch._foreach_addcmul_([exp_avg_sq], [grad], [grad], 1 - beta2)
    denom = torch._foreach_add(torch._foreach_div(torch._foreach_sqrt([exp_avg_sq]), (1 - beta2 ** step) ** 0.5), eps)
    torch._foreach_addcdiv_([param], [exp_avg], denom, -lr / (1 - beta1 ** step))

def sgd_foreach(param, grad, buf, *, lr, momentum, weight_decay, dampening, nesterov):
    d = torch._foreach_add([grad], [param], alpha=weight_decay)[0]
    if buf is None:
        buf = d.clone()
    else:
        torch._foreach_mul_([buf], momentum)
        torch._foreach_add_([buf], [d], alpha=1 - dampening)
    torch._foreach_add_([param], [d + momentum * buf if nesterov else buf], alpha=-lr)
    return buf
'''


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    """The grader's backend: a runner whose session child runs each check (unconfined here)."""
    with LocalSandbox(tmp_path_factory.mktemp("sandbox")) as sb:
        yield sb


@pytest.fixture(scope="module")
def student():
    return student_cell(STUDENT, "identity_student")


CLONES = ["clone", "wrapped", "by_marshal", "by_source", "by_function_source", "by_reload", "by_gc", "by_class",
          "by_make_function"]


@pytest.mark.parametrize("fn", CLONES)
def test_a_copy_of_the_reference_is_refused_in_the_sandbox(student, sandbox, fn):
    with pytest.raises(ForbiddenCall, match=r"adamw_step: .*(off limits|copy of|did not compile)"):
        sandbox.run(day1.check_adamw_step, getattr(student, fn), trials=2, steps=2)


# by_gc is left out: a notebook's check (feedback) burns what the names lead to, not every clone the process holds
# (the collector's search cost 0.1-0.2 s per check in a long process); in the sandbox, the graded run, it is refused
@pytest.mark.parametrize("fn", ["clone", "wrapped", "by_marshal", "by_function_source", "by_class"])
def test_a_copy_of_the_reference_is_refused_in_a_notebook_s_check(student, fn):
    with pytest.raises(ForbiddenCall, match=r"adamw_step: .*(off limits|copy of)"):
        day1.check_adamw_step(getattr(student, fn), trials=2, steps=2)


@pytest.mark.parametrize(("check", "fn", "op"), [(day1.check_sgd_momentum_step, "sgd_fused", "_fused_sgd_"),
                                                 (day1.check_adamw_step, "adamw_fused", "_fused_adamw_"),
                                                 (day1.check_adamw_step, "adamw_ops", "_fused_adamw_")])
def test_a_fused_kernel_under_another_holder_is_refused(student, sandbox, check, fn, op):
    with pytest.raises(ForbiddenCall, match=f"the torch operator aten::{op} is off limits"):
        sandbox.run(check, getattr(student, fn), trials=2, steps=2)


def test_a_reference_the_checks_modules_import_is_useless_in_the_sandbox(student, sandbox):
    """Day 7's test bench imports the reference `tp_comm_ratio`; the session's child holds the real module (the
    seal hides its name, not the module), where the name scan never looked: what it holds is burned."""
    fsdp_min_tokens = load_solution("day7_tensor_parallel").fsdp_min_tokens
    with pytest.raises(ForbiddenCall, match=r"comm_compute: dlo\.comm_compute\.tp_comm_ratio is off limits"):
        sandbox.run(day7.check_comm_compute, fsdp_min_tokens, student.tp_comm_ratio_by_bench)


@pytest.mark.parametrize(("check", "fn"), [(day1.check_adamw_step, "adamw_foreach"),
                                           (day1.check_sgd_momentum_step, "sgd_foreach")])
def test_honest_code_on_the_same_primitives_keeps_its_marks(student, sandbox, check, fn):
    check(getattr(student, fn), trials=2, steps=2)
    sandbox.run(check, getattr(student, fn), trials=2, steps=2)


def test_everything_comes_back_after_a_notebook_s_check(student):
    """A direct check restores what it blocked: the reference, torch's kernels, making functions."""
    import dlo.optim.reference as ref

    with forbidden(day1.check_adamw_step.forbid, "adamw_step"), pytest.raises(ForbiddenCall):
        ref.adamw_step(torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2), 1, lr=0.1)
    p, m, v = torch.zeros(2), torch.zeros(2), torch.zeros(2)
    ref.adamw_step(p, torch.ones(2), m, v, 1, lr=0.1)
    student.adamw_fused(torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2), 1, lr=0.1, beta1=0.9,
                        beta2=0.999, eps=1e-8, weight_decay=0.0)
    types.FunctionType(student.clone.__code__, {})  # making functions is free again
    assert p.abs().sum() > 0


CHECKS = [getattr(m, n) for m in (getattr(dlo.checks, d) for d in dlo.checks.__all__) for n in dir(m)
          if n.startswith("check_")]


@pytest.mark.parametrize("day", sorted(d.name for d in (REPO / "solutions").iterdir() if d.is_dir()))
def test_the_instructors_solutions_share_no_code_with_a_forbidden_reference(day):
    """A solution that the audit hook would take for a copy (its bytecode, nested code included, equal to a
    reference's) would lose its marks: none of the instructors' does."""
    ns = vars(load_solution(day))
    mine = [v for v in ns.values() if isinstance(v, (types.FunctionType, type))
            and getattr(v, "__module__", "").endswith("_solution")]
    for chk in CHECKS:
        found = plan(chk.forbid, chk.__name__)
        assert [(chk.__name__, v.__name__) for v in mine if identity.copy_in(v, found.codes, found.originals)] == []


def _alone(fn, how: str) -> types.CodeType | None:
    """`fn`'s own source compiled on its own: in a file with or without `from __future__ import annotations`, with
    optimize=2 (docstrings stripped), or indented into a def whose parameters are its globals (free variables)."""
    src, name = textwrap.dedent(inspect.getsource(fn)), fn.__code__.co_name
    if how == "indented into a def":
        params = ", ".join(sorted(set(fn.__code__.co_names) - set(fn.__code__.co_varnames))) or "_"
        outer = compile(f"def _outer({params}):\n" + textwrap.indent(src, "    ") + f"    return {name}\n", "mine",
                        "exec").co_consts[0]
        return next((k for k in outer.co_consts if type(k) is types.CodeType and k.co_name == name), None)
    code = compile(("from __future__ import annotations\n" if how == "annotations as strings" else "") + src, "mine",
                   "exec", optimize=2 if how == "optimize=2" else -1)
    return next((k for k in code.co_consts if type(k) is types.CodeType and k.co_name == name), None)


# compiled alone, its blocks come out in another order (one of 942 forbidden functions, 2026-12-02); its cells in
# another order, its inner function (29 instructions) no longer substantial (SUBSTANTIAL 32, 2026-12-02)
LAID_OUT_OTHERWISE = {"torch.nn.modules.activation.MultiheadAttention.forward",
                      "torch.distributed.tensor.parallel.loss._nll_loss_forward"}


# compiled alone in a file of its own, whatever the file's `__future__` import: every reference. With optimize=2 or
# indented into a def, only some (74 and 31 of 637 are not: torch's asserts stripped, inner closures' cells; the
# Day 1 references are, `test_day_1_s_references_placed_otherwise_are_copies`)
@pytest.mark.parametrize("how", ["annotations as strings", "annotations evaluated"])
def test_a_reference_s_own_source_compiled_alone_is_a_copy(how):
    """A red team read a reference's source (inspect.getsource) and compiled it, unchanged, on its own: 3.11
    compiles `module.f(x)` to LOAD_ATTR where the module is imported in the same file and to LOAD_METHOD
    elsewhere, so the bytecode differed and 13 of 16 points passed (Day 8, 2026-12-02). Every substantial
    forbidden function of every check (not a method using zero-argument super(), which needs its class), so
    compiled, is a copy."""
    missed, seen = [], set()
    for chk in CHECKS:
        found = plan(chk.forbid, chk.__name__)
        for fn, _ in found.burn:
            code = identity.original(fn)
            if hasattr(fn, "__wrapped__") or "__class__" in code.co_freevars or id(code) in seen \
                    or code.co_filename.startswith("<") or bytecode.instructions(code) < bytecode.SUBSTANTIAL \
                    or f"{fn.__module__}.{fn.__qualname__}" in LAID_OUT_OTHERWISE:
                continue
            seen.add(id(code))
            try:
                alone = _alone(fn, how)
            except (OSError, TypeError, SyntaxError):  # no source file, or a source that compiles only in place
                continue
            if alone is None or not any(bytecode.shape(c) in found.codes.shapes for c in bytecode.nested(alone)):
                missed.append(f"{fn.__module__}.{fn.__qualname__}")
    assert len(seen) > 500 and missed == []


def test_the_audit_hook_holds_against_the_student_s_process():
    """For good (a process that ends with the check): the hook reads no global, its code and defaults
    cannot change, nor can the grader's functions'; a copy stays refused."""
    def attempts() -> str:  # in a fork: the hook stays for good in it
        import dlo.optim.reference as ref

        out = []
        code = identity.original(ref.adamw_step.__wrapped__)
        with forbidden(day1.check_adamw_step.forbid, "adamw_step", for_good=True):
            for attempt in (lambda: setattr(identity._audit, "__code__", (lambda *a: None).__code__),
                            lambda: setattr(bytecode.shape, "__defaults__", (None, None)),
                            lambda: types.FunctionType(code, {}),
                            lambda: exec(code, {})):
                try:
                    attempt()
                    out.append("ran")
                except ForbiddenCall:
                    out.append("refused")
        return ",".join(out)

    assert in_a_fork(attempts) == "refused,refused,refused,refused"


class _Namespace:
    """As torch's operator namespaces: an attribute lookup that fails raises RuntimeError."""

    def __getattr__(self, name):
        raise RuntimeError("Expected a torch namespace lookup")


def test_an_object_whose_lookup_raises_is_no_grader_error():
    """The search for copies asked every object it met for `_fn` (a direct check's wrapper): an object whose
    lookup raises RuntimeError (met once through torch.compile's wrapper of a student's FlashAttention) made
    the direct check blame itself ("internal error of the check")."""
    ns = _Namespace()

    def attention(q, k, v, *, causal=False, block_k=32):
        return ns, q

    found = plan(day1.check_adamw_step.forbid, "adamw_step")
    assert identity.copy_in(attention, found.codes, found.originals) is None


def test_a_student_s_named_tuple_is_no_copy_of_a_forbidden_one():
    """Every named tuple's _make, _replace, __repr__ and __getnewargs__ are one code, made in collections' file:
    Day 4's ring list names a module that holds a named tuple, and took every student's for a copy (2026-12-02)."""
    from collections import namedtuple

    from dlo.checks import day4_ring

    Bucket = namedtuple("Bucket", ["start", "stop"])

    def buckets(sizes):
        return [Bucket(0, s)._replace(stop=s) for s in sizes]

    found = plan(day4_ring.check_ring_all_reduce.forbid, "ring_all_reduce")
    assert identity.copy_in(buckets, found.codes, found.originals) is None


def test_no_check_burns_what_a_metaclass_put_in_a_forbidden_class():
    """Day 8's list named torch.ao.quantization.utils.*, whose enums hold Enum.__new__ in their own dict: burned
    with them, it broke every enum made while the check ran (an independent student's checks failed with
    "enum.Enum.__new__ is off limits" where torch._dynamo was first imported during one, 2026-12-02)."""
    import enum

    from dlo.checks import day8

    burned = {f"{fn.__module__}.{fn.__qualname__}" for chk in CHECKS for fn, _ in plan(chk.forbid, chk.__name__).burn}
    assert not {b for b in burned if b.startswith(("enum.", "abc.", "typing.", "builtins."))}
    with forbidden(day8.QUANT, "quantize"):
        assert [m.name for m in enum.Enum("Made", "A B")] == ["A", "B"]  # an enum made while the check runs


@pytest.mark.parametrize("how", ["annotations evaluated", "optimize=2", "indented into a def"])
@pytest.mark.parametrize("name", ["adamw_step", "lamb_step", "sgd_momentum_step"])
def test_day_1_s_references_placed_otherwise_are_copies(name, how):
    """A red team compiled Day 1's references from their unchanged source with optimize=2 (a NOP where the docstring
    was, None moved among the constants) and indented into a def of its own (globals made free variables): 2/2 and
    2/2 (2026-12-02). Constants and names are numbered by first use, free variables read as globals."""
    import dlo.optim.reference as ref

    fn = inspect.unwrap(getattr(ref, name))
    found = plan(day1.check_adamw_step.forbid + day1.check_lamb_step.forbid + day1.check_sgd_momentum_step.forbid,
                 "day1")
    assert any(bytecode.shape(c) in found.codes.shapes for c in bytecode.nested(_alone(fn, how)))
