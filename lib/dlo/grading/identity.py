"""Forbidden references blocked by what they are, not by the names they are reached through.

`dlo.grading.forbid` swaps the names of a check's forbidden references for blockers; a name is only one
way in. A student can reach the same code through the garbage collector, a frame, `__wrapped__`, a class's
methods, or rebuild it: `types.FunctionType(ref.__code__, ...)`, a clone pickled by value into the
sandbox, `marshal`, `exec` of the reference's source as it is, `importlib.reload` of its module. Here the
code itself is blocked, for as long as the check runs:

- *burned*: every function object that implements a forbidden reference (the reference, what it wraps,
  a class's own methods, its private helpers) gets a code object that raises `ForbiddenCall`, whoever
  holds the function (`burn`); its original code is kept only by the audit hook below;
- *refused*: an audit hook (PEP 578: it cannot be removed) refuses to make a function from, `exec`, or
  assign as `__code__` any code object that is a forbidden one or contains one: the same object, or the
  same bytecode, its own and that of the code it defines (`shape`), when it is substantial (`SUBSTANTIAL`
  instructions: a one-line formula written twice is the same bytecode, and an honest student may write
  it so). Renaming variables, moving lines, stripping the docstring or pickling change no bytecode, and
  `shape` leaves out what compiling the same text in another file changes (3.11's LOAD_METHOD for a method
  of a module imported elsewhere; a def's annotations under `from __future__ import annotations`: the
  functions a reference defines count on their own). It also refuses code that makes functions from code
  objects it did not compile (hand-edited bytecode: `_made_by_hand`), whose functions it would never see.

Where the student's code runs for the rest of a process (the sandboxed runner's session child, the
ranks of a launch) the hook is armed `for_good`: its state lives in its own default arguments
(immutable tuples and frozensets), it reads no global name, and it refuses any change to its own code or
defaults, or to those of the grader's functions (`protected`). Elsewhere (a notebook's direct check, the
tests' reused ranks) one hook per process follows a stack of active checks that `restore` pops: feedback,
not grading; there a clone the student made before the check and hid outside the objects the check receives
(found at run time through the collector) is not burned. What is not covered: the reference's source
with its bytecode changed (a statement added to each function, then compiled: a red team's 11/11 on Day 11,
2026-12-01; the similarity report flags every cell that runs text it cannot decode as obfuscated), code
compiled by another compiler from the reference's source file (TorchScript, Triton), and native code (ctypes)
rewriting the interpreter's memory.
"""

from __future__ import annotations

import dis
import sys
import types
import warnings
from collections.abc import Iterable

from dlo.grading.bytecode import Codes, nested, shape, size

WATCHED = frozenset(("function.__new__", "exec", "object.__setattr__"))
_GENERATED = ("<string>",)  # the file of the methods a dataclass generates for the class itself
FUNCTION_STATE = ("__code__", "__defaults__", "__kwdefaults__")


def kernel_function(obj) -> types.FunctionType | None:
    """The Python function behind a Triton kernel (`@triton.jit`, and an autotuner or heuristics around one),
    else None: Triton's interpreter runs that function, so a kernel is implemented by it (a red team launched
    Day 8's quantization kernel directly in the interpreter, its launcher forbidden, 2026-12-02)."""
    for _ in range(4):  # an autotuner's `fn` is the kernel, whose `fn` is the function
        if not type(obj).__module__.startswith("triton."):
            return None
        obj = getattr(obj, "fn", None)
        if isinstance(obj, types.FunctionType):
            return obj
    return None


def implementations(obj) -> list[types.FunctionType]:
    """The plain functions that implement `obj`: a function and what it wraps (`__wrapped__`, through
    decorators), a class's own methods (static, class and property functions included) and what they
    wrap, a Triton kernel's function (`kernel_function`). Inherited methods are the base class's, never the
    forbidden class's."""
    obj = kernel_function(obj) or obj
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        return [f for part in (obj.fget, obj.fset, obj.fdel) for f in implementations(part)]
    if isinstance(obj, type):  # its own functions (a class attribute that is a class is not its code): those its
        # body or its module made, not another module's that a metaclass put in its dict (an Enum's has Enum.__new__:
        # burning it broke every enum made while a check ran, 2026-12-02)
        # nor what a factory of another file made for it (a named tuple's _make, _replace, __repr__: one code for
        # every named tuple, a student's too: a Day 4 list naming a module with one refused them all, 2026-12-02)
        own, home = obj.__qualname__ + ".", getattr(sys.modules.get(obj.__module__), "__file__", None)
        return [f for v in list(vars(obj).values()) if isinstance(v, (types.FunctionType, staticmethod, classmethod,
                                                                      property)) for f in implementations(v)
                if (f.__qualname__.startswith(own) or f.__module__ == obj.__module__ or "<locals>" in f.__qualname__)
                and (home is None or original(f).co_filename in (home, *_GENERATED))]
    out, seen = [], set()
    while isinstance(obj, types.FunctionType) and id(obj) not in seen:
        seen.add(id(obj))
        out.append(obj)
        obj = getattr(obj, "__wrapped__", None)
    return out


# ----------------------------------------------------------------------------- burning

_TEMPLATES: dict[int, types.CodeType] = {}
_PLACEHOLDER = "dlo: the blocker goes here"


def _template(nfree: int) -> types.CodeType:
    """`def blocked(*args, **kwargs): return <raiser>(*args, **kwargs)` with `nfree` free variables (a
    function's new code must take its closure's cells)."""
    if nfree not in _TEMPLATES:
        names = [f"_f{i}" for i in range(nfree)]
        src = ("def outer():\n" + (f"    {' = '.join(names)} = None\n" if names else "")
               + "    def blocked(*args, **kwargs):\n" + (f"        ({', '.join(names)},)\n" if names else "")
               + f"        return {_PLACEHOLDER!r}(*args, **kwargs)\n    return blocked\n")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "'str' object is not callable": it is replaced below
            outer = compile(src, __file__, "exec").co_consts[0]
        _TEMPLATES[nfree] = next(c for c in outer.co_consts if type(c) is types.CodeType)
    return _TEMPLATES[nfree]


def blocker_code(fn: types.FunctionType, raiser) -> types.CodeType:
    """A code for `fn` whose call calls `raiser` (which raises ForbiddenCall) with the arguments."""
    t = _template(len(fn.__code__.co_freevars))
    return t.replace(co_consts=tuple(raiser if k == _PLACEHOLDER else k for k in t.co_consts),
                     co_name=fn.__code__.co_name, co_qualname=getattr(fn, "__qualname__", fn.__code__.co_name))


_ORIGINAL: dict[int, types.CodeType] = {}  # id(function) -> its own code, while it is burned


def original(fn: types.FunctionType) -> types.CodeType:
    """`fn`'s own code, burned or not."""
    return _ORIGINAL.get(id(fn), fn.__code__)


def burn(pairs: Iterable[tuple[types.FunctionType, object]]) -> list[tuple[types.FunctionType, types.CodeType]]:
    """Give each function the code that calls its raiser; what `disarm` needs to undo it."""
    saved, done = [], set()
    for fn, raiser in pairs:
        if id(fn) in done:
            continue
        done.add(id(fn))
        _ORIGINAL.setdefault(id(fn), fn.__code__)
        saved.append((fn, fn.__code__))
        fn.__code__ = blocker_code(fn, raiser)
    return saved


# ----------------------------------------------------------------------------- the audit hook

def _made_by_hand(code, load_const, extended_arg, make_function, code_type, type_, len_) -> bool:
    """Whether `code` makes a function from a code object that is not its own constant: CPython's compiler
    puts a LOAD_CONST of the code right before every MAKE_FUNCTION (all 359,951 of them in the standard
    library's, torch's and dlo's 15,906 files, 3.11), so only hand-edited bytecode does otherwise. Such code
    turns any code object on the stack (a forbidden module's, compiled from its file; an original kept by the
    grader) into a function with no audit event: a red team's Day 9 (2026-12-02), 11/11. Bound as the hook is."""
    raw = code.co_code
    i = raw.find(make_function)
    while i >= 0:
        if i % 2 == 0:  # an opcode, not an argument byte
            if i < 2 or raw[i - 2] != load_const:
                return True
            arg, j, shift = raw[i - 1], i - 4, 8
            while j >= 0 and raw[j] == extended_arg:
                arg, j, shift = arg | raw[j + 1] << shift, j - 2, shift + 8
            if arg >= len_(code.co_consts) or type_(code.co_consts[arg]) is not code_type:
                return True
        i = raw.find(make_function, i + 1)
    return False


def _audit(event, args, watched, ids, shapes, labels, protected, error, prefix, code_type, type_, id_, getattr_,
           len_, shape_, kept, library_, sizes, size_, by_hand, containers):
    """The hook's body. Every name it uses is a parameter bound to a default (`arm_for_good`): no global or
    builtin lookup that the student's code could rebind. `kept` holds the forbidden originals alive, so
    that their ids stay theirs. A library module imported while the check runs (torch imports
    `torch._dynamo` at a first optimizer) may hold a generic idiom with a forbidden reference's bytecode
    (torch's `no_sync`: save a flag, set it, yield, restore): its code is not the student's (`library_`).
    Code that makes functions from code objects it did not compile (`by_hand`) is refused whatever they are:
    the functions it would make are never seen here. So is running a module of torch's test suite."""
    if event not in watched:
        return
    if event == "object.__setattr__":
        if len_(args) != 3 or args[1] not in ("__code__", "__defaults__", "__kwdefaults__"):
            return
        if id_(getattr_(args[0], "__code__", None)) in protected:
            raise error(f"{prefix}the grader's functions cannot be changed while this check runs")
        if args[1] != "__code__":
            return
        code = args[2]
    else:
        code = args[0] if len_(args) else None
    if event == "exec" and type_(code) is code_type and type_(code.co_filename) is type_("") \
            and "/torch/testing/_internal/" in code.co_filename and "/_internal/optests/" not in code.co_filename \
            and not code.co_filename.endswith(("/_internal/__init__.py", "/_internal/common_dtype.py",
                                               "/_internal/composite_compliance.py", "/_internal/logging_tensor.py",
                                               "/_internal/common_xpu.py", "/_internal/distributed/__init__.py",
                                               "/_internal/distributed/fake_pg.py")):
        # a module of torch's own test suite run (imported by any route): its references of the exercises' work
        # (a red team's fake quantizer called common_quantized's, expecttest stubbed, 2026-12-02). Not the modules
        # torch itself imports at run time (torch.distributed.tensor.debug imports composite_compliance: refusing it
        # failed a Day 7 test's import of CommDebugMode; fsdp and dlo.plan the fake process group; utils.checkpoint
        # logging_tensor; _refs common_dtype; torch.library optests)
        raise error(f"{prefix}torch's test suite ({code.co_filename.split('/torch/testing/')[-1]}) holds reference "
                    f"implementations: off limits while this check runs; the exercise asks for your own")
    todo = [code] if type_(code) is code_type else []
    library = None  # decided once, at the first match: is `code` a library module's, read from its file?
    while todo:
        c = todo.pop()
        if id_(c) in ids:
            raise error(f"{prefix}this is a forbidden reference's own code, off limits while this check runs: "
                        f"the exercise asks for your own implementation")
        key = shape_(c) if size_(c) in sizes else None  # a shape is a loop in Python: only at a forbidden size
        if key in shapes:
            if library is None:
                library = event == "exec" and library_(code)
            if not library:
                raise error(f"{prefix}this code is a copy of {labels.get(key, 'a forbidden reference')}, off "
                            f"limits while this check runs: the exercise asks for your own implementation")
        if by_hand(c):
            raise error(f"{prefix}this code makes a function from a code object it did not compile (hand-edited "
                        f"bytecode), refused while this check runs: write the exercise in Python")
        for k in c.co_consts:
            if type_(k) is code_type:
                todo.append(k)
            elif type_(k) in containers:  # the compiler never puts a code there; hand-made code may
                todo += [x for x in k if type_(x) is code_type]


def _library_module(code, roots, own_files, shape_, open_, compile_, str_, type_, error_) -> bool:
    """Whether `code` is the module code of a library file, as that file compiles: under `roots` (the
    interpreter's prefixes and dlo's package: read-only where the grader runs student code), not the file
    of a forbidden reference (`own_files`: an `importlib.reload` of it stays refused), and with the
    bytecode its source compiles to (a copy compiled under a library file's name is not). Bound with its
    helpers as defaults (`library_module`), as the hook itself."""
    filename = code.co_filename
    if code.co_name != "<module>" or type_(filename) is not str_ or not filename.startswith(roots) \
            or filename in own_files:
        return False
    try:
        with open_(filename, "rb") as f:
            return shape_(compile_(f.read(), filename, "exec", 0, True)) == shape_(code)
    except error_:
        return False


def library_module(codes: Codes):
    """`_library_module` bound for this check's forbidden codes (its state in its defaults: no global)."""
    import os

    import dlo

    roots = tuple(dict.fromkeys(os.path.join(os.path.realpath(p), "") for p in
                                (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(dlo.__file__))))
    own = frozenset(c.co_filename for c in codes.kept)
    return types.FunctionType(_library_module.__code__, {"__builtins__": {}}, "library_module",
                              (roots, own, shape, open, compile, str, type, Exception))


by_hand = types.FunctionType(_made_by_hand.__code__, {"__builtins__": {}}, "by_hand",
                             (dis.opmap["LOAD_CONST"], dis.opmap["EXTENDED_ARG"], dis.opmap["MAKE_FUNCTION"],
                              types.CodeType, type, len))


def _state(codes: Codes, protected: frozenset, error, exercise: str) -> tuple:
    return (WATCHED, codes.ids, codes.shapes, dict(codes.labels), protected, error, f"{exercise}: ",
            types.CodeType, type, id, getattr, len, shape, codes.kept, library_module(codes), codes.sizes, size,
            by_hand, (tuple, frozenset))


def arm_for_good(codes: Codes, protected: frozenset, error, exercise: str) -> None:
    """An audit hook for the rest of this process, whose state is its own defaults (a function with no
    builtins: it could not look one up): the originals it keeps can be reached, never run again; its own
    code and defaults, and the `protected` functions', cannot be changed."""
    hook = types.FunctionType(_audit.__code__, {"__builtins__": {}}, "dlo_forbidden_code",
                              _state(codes, protected | {id(_audit.__code__), id(_library_module.__code__),
                                                         id(_made_by_hand.__code__)}, error, exercise))
    sys.addaudithook(hook)


_ACTIVE: list[tuple] = []  # reversible: the active checks' states, innermost last
_PAUSED: list[bool] = [False]
_INSTALLED: list[bool] = [False]


def _follow(event, args):
    if _ACTIVE and not _PAUSED[0]:
        _audit(event, args, *_ACTIVE[-1])


def arm(codes: Codes, protected: frozenset, error, exercise: str) -> tuple:
    """The reversible hook follows this check until `disarm`; one hook per process, installed once."""
    if not _INSTALLED[0]:
        sys.addaudithook(_follow)
        _INSTALLED[0] = True
    state = _state(codes, protected, error, exercise)
    _ACTIVE.append(state)
    return state


def disarm(state: tuple, saved: list[tuple[types.FunctionType, types.CodeType]]) -> None:
    """Undo `arm` and `burn`: the originals given back (the hook paused meanwhile)."""
    _PAUSED[0] = True
    try:
        for fn, code in reversed(saved):
            fn.__code__ = code
            if _ORIGINAL.get(id(fn)) is code:
                del _ORIGINAL[id(fn)]
    finally:
        _PAUSED[0] = False
        if state in _ACTIVE:
            _ACTIVE.remove(state)


def copy_in(obj, codes: Codes, originals: frozenset = frozenset(), limit: int = 5000) -> str | None:
    """The label of a forbidden reference whose code `obj` carries (a copy made before the check, as a
    notebook's direct check meets it), else None: through functions (their code, closure, defaults,
    `__wrapped__` and the globals their code names), classes' own attributes and containers; the burned
    originals themselves (`originals`: ids) are no copy. Where the grader runs the student's code (the
    sandbox, the ranks) its objects are made under the audit hook, which refuses a copy; this finds the
    ones a notebook made earlier."""
    todo, seen = [obj], set(originals)
    while todo and len(seen) < limit:
        o = todo.pop()
        if id(o) in seen or isinstance(o, (types.ModuleType, str, bytes, int, float)):
            continue
        seen.add(id(o))
        if isinstance(o, types.FunctionType):
            for c in nested(original(o)):
                if id(c) in codes.ids or shape(c) in codes.shapes:
                    return codes.labels.get(shape(c), f"{o.__module__}.{o.__qualname__}")
            names = {n for c in nested(o.__code__) for n in c.co_names}
            todo += [o.__globals__[n] for n in names if n in o.__globals__]
            for cell in o.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
            todo += [*(o.__defaults__ or ()), *(o.__kwdefaults__ or {}).values(), getattr(o, "__wrapped__", None)]
        elif isinstance(o, type):
            todo += [v for v in vars(o).values() if isinstance(v, (types.FunctionType, staticmethod, classmethod,
                                                                  property, type))]
        elif isinstance(o, (staticmethod, classmethod)):
            todo.append(o.__func__)
        elif isinstance(o, property):
            todo += [o.fget, o.fset, o.fdel]
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo += list(o)
        elif isinstance(o, dict):
            todo += list(o.values())
        else:  # a direct check's Guarded student callable (torch.compile's wrapper holds its function so too)
            todo.append(_attribute(o, "_fn"))
    return None


def _attribute(obj, name: str):
    """`obj.name`, or None: an object whose `__getattr__` raises something else than AttributeError (torch's
    operator namespaces raise RuntimeError) is no student callable."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001
        return None


def protected_codes(prefixes: tuple[str, ...]) -> frozenset:
    """The ids of the code objects of every function and method of the modules under `prefixes` (the
    grader's): their code and defaults are what the checks and the meters run on."""
    out = set()
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(prefixes):
            continue
        for v in list(vars(module).values()):
            if getattr(v, "__module__", None) == name:  # and the lambdas they make (hooks), nested codes
                out.update(id(c) for f in implementations(v) for c in nested(f.__code__))
    return frozenset(out)
