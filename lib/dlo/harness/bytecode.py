"""Code objects compared by what they run: the similarity report's evidence that no source shows.

A function made from a reference's code object (`types.FunctionType(ref.__code__, ...)`), or code that
was decompressed and exec'd, has no source in the notebook worth comparing; what the grader ran does.
When a test cell runs, the student's kernel pickles the objects the cell names (cloudpickle, by value:
`dlo.grading.testcells.capture_code`) into the submission's capture folder, for the sandboxed runner. The
grading child (`nbgrader_cli`), once nbgrader is done and before that folder is deleted, reads those
pickles here *without unpickling them*: `pickletools` lists their opcodes and a symbolic stack rebuilds
only the calls cloudpickle recorded, so every code object's fields (bytecode, constants, global and
attribute names) are read as data, and no student object is ever made. Each code object becomes a digest
of what it runs - bytecode, constants (nested code by its digest; a docstring by its place only),
global and attribute names, argument counts, flags - leaving out what a copy changes for free: local
names, file name, line numbers. A clone of a reference is the reference's own code: the same digest
as `of_function(reference)`, computed from the library in the grading process.
"""

from __future__ import annotations

import hashlib
import pickletools
import types

# The positions of CodeType's arguments as cloudpickle writes them (Python 3.11 to 3.13).
ARGS = 18
CODE, CONSTS, NAMES, EXCEPTIONS = 6, 7, 8, 15
MAX_PICKLE = 32 << 20  # bytes of one pickle read; a larger one (data, not code) is not looked into
MAX_READ = 128 << 20  # bytes of pickles read for one submission, all its capture folders together
MAX_OPS = 2_000_000
MIN_SIZE = 64  # bytes of bytecode: a smaller code object (`return a + b`) is the same in every answer
FILE = ".dlo-bytecode.json"  # beside an autograded notebook: {captured name: {"digests": ..., "refs": ...}}


class _Global(tuple):
    """A global a pickle names: (module, name)."""


class _Call:
    """A call a pickle records (REDUCE, NEWOBJ): never made, only kept."""

    __slots__ = ("func", "args")

    def __init__(self, func, args):
        self.func, self.args = func, args if isinstance(args, tuple) else ()


def _is_code_type(func) -> bool:
    """True for what rebuilds a code object: cloudpickle's `_builtin_type("CodeType")`, or types.CodeType."""
    if isinstance(func, _Global):
        return tuple(func) in {("types", "CodeType"), ("builtins", "code")}
    return isinstance(func, _Call) and isinstance(func.func, _Global) and func.func[1] == "_builtin_type" \
        and func.args == ("CodeType",)


_SIMPLE = {"BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING", "SHORT_BINSTRING",
           "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "BININT", "BININT1", "BININT2", "LONG1", "LONG4",
           "INT", "LONG", "BINFLOAT", "FLOAT"}


def _calls(blob: bytes) -> list[_Call]:
    """Every call a pickle records, in order, rebuilt symbolically; ValueError for what is not understood."""
    stack, marks, memo, calls = [], [], {}, []

    def popmark():
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    for n, (op, arg, _) in enumerate(pickletools.genops(blob)):
        name = op.name
        if n > MAX_OPS:
            raise ValueError("too long")
        if name in ("PROTO", "FRAME", "STOP"):
            continue
        if name in _SIMPLE:
            stack.append(arg)
        elif name == "MARK":
            marks.append(len(stack))
        elif name in ("NONE", "NEWTRUE", "NEWFALSE"):
            stack.append({"NONE": None, "NEWTRUE": True, "NEWFALSE": False}[name])
        elif name in ("EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET"):
            stack.append(() if name == "EMPTY_TUPLE" else [])
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            k = int(name[-1])
            stack[-k:] = [tuple(stack[-k:])]
        elif name in ("TUPLE", "FROZENSET", "LIST", "DICT"):
            stack.append(tuple(popmark()) if name != "LIST" else popmark())
        elif name in ("APPEND", "SETITEM"):
            items = [stack.pop() for _ in range(1 if name == "APPEND" else 2)][::-1]
            if isinstance(stack[-1], list):
                stack[-1].extend(items)
        elif name in ("APPENDS", "SETITEMS", "ADDITEMS"):
            items = popmark()
            if isinstance(stack[-1], list):
                stack[-1].extend(items)
        elif name == "STACK_GLOBAL":
            attr, module = stack.pop(), stack.pop()
            stack.append(_Global((str(module), str(attr))))
        elif name in ("GLOBAL", "INST"):
            stack.append(_Global(tuple(str(arg).split(" ", 1))))
        elif name in ("REDUCE", "NEWOBJ", "NEWOBJ_EX"):
            if name == "NEWOBJ_EX":
                stack.pop()
            args, func = stack.pop(), stack.pop()
            calls.append(_Call(func, args))
            stack.append(calls[-1])
        elif name == "BUILD":
            stack.pop()  # an object's state: functions' globals and names, nothing that runs
        elif name == "MEMOIZE":
            memo[len(memo)] = stack[-1]
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[arg] = stack[-1]
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo[arg])
        elif name == "POP":
            marks.pop() if marks and marks[-1] == len(stack) else stack.pop()
        elif name == "POP_MARK":
            popmark()
        elif name == "DUP":
            stack.append(stack[-1])
        else:
            raise ValueError(f"opcode {name}")
    return calls


def _code_args(call: _Call):
    """The CodeType arguments `call` rebuilds a code object from (dlo.pickling wraps cloudpickle's), or None."""
    if _is_code_type(call.func) and len(call.args) == ARGS:
        return call.args
    if isinstance(call.func, _Global) and call.func[1] == "_code_with_filename" and len(call.args) == 3 \
            and _is_code_type(call.args[0]) and isinstance(call.args[1], tuple) and len(call.args[1]) == ARGS:
        return call.args[1]
    return None


def _const(value, seen):
    if isinstance(value, types.CodeType):
        return ("code", _digest(_real_args(value), seen)[0])
    if isinstance(value, _Call):
        args = _code_args(value)
        return ("code", _digest(args, seen)[0]) if args else ("?",)
    if isinstance(value, (tuple, list)):
        return tuple(_const(v, seen) for v in value)
    if value is None or isinstance(value, (str, bytes, int, float, complex, bool)):
        return (type(value).__name__, value)
    return ("?",)


def _digest(args, seen: dict) -> tuple[str, int]:
    """(digest, bytecode length) of one code object's arguments; nested code objects into `seen` too."""
    key = id(args)
    if key in seen:
        return seen[key][0]
    consts = list(args[CONSTS]) if isinstance(args[CONSTS], (tuple, list)) else []
    if consts and isinstance(consts[0], str):
        consts[0] = None  # a docstring (or a first string constant): its place counts, not its words
    flags = args[5] & 0x3FF if isinstance(args[5], int) else None  # no __future__ flags: they change no bytecode
    body = repr((args[:3], flags, args[CODE], tuple(_const(c, seen) for c in consts), args[NAMES],
                 args[EXCEPTIONS]))
    code = args[CODE] if isinstance(args[CODE], bytes) else b""
    digest = hashlib.blake2b(body.encode(), digest_size=12).hexdigest()
    seen[key] = (digest, len(code)), args  # args kept alive: no other tuple gets its id while `seen` lives
    return seen[key][0]


def _real_args(code: types.CodeType) -> tuple:
    import cloudpickle

    return cloudpickle.Pickler.dispatch_table[types.CodeType](code)[1]


def of_function(obj) -> dict[str, int]:
    """{digest: bytecode length} of a function's code and the code nested in it; a class's methods'."""
    import inspect

    targets = [obj] if not isinstance(obj, type) else [v for _, v in sorted(vars(obj).items())]
    out, seen = {}, {}
    for target in targets:
        target = getattr(target, "__func__", target)  # staticmethod, classmethod
        code = getattr(inspect.unwrap(target), "__code__", None) if callable(target) else None
        if isinstance(code, types.CodeType):
            _collect(_real_args(code), seen, out)
    return out


def _collect(args, seen: dict, out: dict) -> None:
    digest, size = _digest(args, seen)
    out[digest] = size
    for c in args[CONSTS] if isinstance(args[CONSTS], (tuple, list)) else ():
        nested = _real_args(c) if isinstance(c, types.CodeType) else _code_args(c) if isinstance(c, _Call) else None
        if nested:
            _collect(nested, seen, out)


def of_pickle(blob: bytes) -> dict:
    """{"digests": {digest: bytecode length}, "refs": [dlo names the pickle refers to]} of one pickle,
    read without unpickling it; empty when it cannot be read."""
    try:
        return _of_pickle(blob) if len(blob) <= MAX_PICKLE else {"digests": {}, "refs": []}
    except Exception:  # noqa: BLE001 - a pickle this reader does not follow (or nests too deep): no evidence
        return {"digests": {}, "refs": []}


def _of_pickle(blob: bytes) -> dict:
    calls = _calls(blob)
    out, seen, refs = {}, {}, set()
    for call in calls:
        args = _code_args(call)
        if args:
            out.setdefault(*_digest(args, seen))
        if isinstance(call.func, _Global) and call.func[1] == "subimport" and call.args:
            refs.add(str(call.args[0]))
    for value in [c.func for c in calls] + [a for c in calls for a in c.args]:
        if isinstance(value, _Global) and value[0].startswith("dlo."):
            refs.add(".".join(value))
    refs = {r for r in refs if r.startswith("dlo.") and not r.startswith("dlo.pickling")}
    return {"digests": out, "refs": sorted(refs)}
