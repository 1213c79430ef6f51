"""What a copy of a code object keeps (`shape`), and the forbidden references' codes a check compares with
(`Codes`): the bytecode side of `dlo.grading.identity`.

A copy is the same instructions, whatever was renamed, moved or stripped, or in which file the same text was
compiled; a code matches by its shape only when it is substantial (`SUBSTANTIAL` instructions: a one-line formula
written twice is the same bytecode, and an honest student may write it so). `shape` and `size` are made with no
builtins and their helpers bound as defaults, so that the audit hook can call them and nothing the student's code
rebinds changes what they compute.
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Iterable

# instructions: a code at least this long matches by bytecode, a shorter one only by identity. 24 refused an honest
# `is_2to4` (31, the reference's own idiom, Day 8's red team, 2026-12-02)
SUBSTANTIAL = 32


def _shape(code, code_type=None, type_=None, len_=None, range_=None, bytes_=None, jumps=frozenset(), skipped=(),
           method=-1, attr=-1, flagged=frozenset(), outer=frozenset(), load_global=-1, load_const=-1,
           named=frozenset(), attributes=frozenset(), extended=-1):
    """What a copy of `code` keeps whatever was renamed, moved or stripped, or where it was compiled: the
    instructions of `code` and of every code among its constants (the functions, comprehensions and lambdas
    it defines), in order, each an opcode and its argument. Names, constants, lines, file and docstring are
    left out, and so is what the same source compiles to differently in another module: 3.11 loads a method
    of an imported module with LOAD_ATTR where the import is in the same file and LOAD_METHOD elsewhere (one
    opcode here), the module itself then with or without LOAD_GLOBAL's push-NULL bit (a global's argument is
    dropped whole, `outer`; 3.12's method bit of LOAD_ATTR too, `flagged`), with other inline caches, so other jump
    distances (jump arguments left out, as are caches, EXTENDED_ARG and PUSH_NULL: a red team ran a
    reference's unchanged source, compiled on its own, for 13 of 16 points on Day 8, 2026-12-02). The same text
    compiled with optimize=2 leaves a NOP where its docstring was, and indented into a def of the student's its
    globals become free variables (LOAD_DEREF, COPY_FREE_VARS): another red team's Day 1 (2026-12-02), so a
    name read from outside the function is one opcode with no argument here, and NOPs and cells are left out.
    The attributes and methods a code reads, sets and imports are kept by name (`attributes`): a copy has the
    same, while an honest answer as short as a reference matched it instruction for instruction through other
    methods (Day 8's red team, 2026-12-02: its own `is_2to4` refused as a copy; that one is below `SUBSTANTIAL`).
    Made with no builtins and its helpers bound (`shape`), so that the audit hook can call it."""
    parts, todo = [], [code]
    while todo:
        c = todo.pop()
        raw, out, consts, names, kept, ext = c.co_code, [], {}, {}, [], 0
        for i in range_(0, len_(raw), 2):
            op, arg = raw[i], raw[i + 1]
            if op == extended:
                ext = (ext | arg) << 8
                continue
            index, ext = ext | arg, 0
            if op in skipped:
                continue
            if op == method:
                op = attr
            if op in attributes:  # 3.12's LOAD_ATTR carries its method bit below the name's index
                index = index >> 1 if op in flagged else index
                name = c.co_names[index] if index < len_(c.co_names) else ""
                if name[:1] == "_" and name[1:2] != "_" and "__" in name[2:]:  # mangled: a copy's class is another
                    name = "__" + name[1:].split("__", 1)[1]
                kept.append(name)
            if op in flagged:
                arg = arg & 254
            if op in outer:  # a global, or a free variable of a def the same text was indented into
                op, arg = load_global, 0
            # constants and attribute names by their order of first use here, not their place in the code's
            # tables: a stripped docstring moves None up among the constants, globals made free variables leave
            # the names
            if op == load_const:
                arg = consts.setdefault(arg, len_(consts)) & 255
            elif op in named:
                arg = names.setdefault(arg, len_(names)) & 255
            out.append(op)
            out.append(0 if op in jumps else arg)
        parts.append(bytes_(out) + b"\xfe\xfe" + "\x00".join(kept).encode())
        for k in c.co_consts:
            if type_(k) is code_type:
                todo.append(k)
    return b"\xff\xff".join(parts)


def _size(code, skipped=(), len_=None):
    """The number of instructions of `code` alone, those `_shape` leaves out not counted: the same for a copy
    compiled elsewhere, and cheap (no loop over the code in Python): the audit hook computes a shape only for a
    code of a forbidden one's size. Bound as `shape` is (`size`)."""
    ops = code.co_code[::2]
    n = len_(ops)
    for op in skipped:
        n -= ops.count(op)
    return n


# inline caches, EXTENDED_ARG, and PUSH_NULL: 3.11 pushes the NULL of a call to an imported module's function with
# LOAD_GLOBAL's low bit or on its own, as the call's form and the file's imports have it; NOP (a docstring stripped
# by optimize=2) and the cells of free variables (the same text indented into a def)
_SKIPPED = tuple(dict.fromkeys(dis.opmap.get(name, 0) for name in ("CACHE", "EXTENDED_ARG", "PUSH_NULL", "NOP",
                                                                    "COPY_FREE_VARS", "MAKE_CELL")))
_OUTER = frozenset(dis.opmap[name] for name in ("LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLASSDEREF") if name in dis.opmap)
_FLAGGED = frozenset((dis.opmap["LOAD_ATTR"],) if sys.version_info >= (3, 12) else ())  # its method bit
# read, set, deleted or imported by name: LOAD_METHOD is read as LOAD_ATTR by then
_ATTRIBUTES = frozenset(dis.opmap[name] for name in ("LOAD_ATTR", "STORE_ATTR", "DELETE_ATTR", "IMPORT_FROM"))
shape = types.FunctionType(_shape.__code__, {"__builtins__": {}}, "shape",
                           (types.CodeType, type, len, range, bytes, frozenset(dis.hasjrel + dis.hasjabs), _SKIPPED,
                            dis.opmap.get("LOAD_METHOD", -1), dis.opmap["LOAD_ATTR"], _FLAGGED, _OUTER,
                            dis.opmap["LOAD_GLOBAL"], dis.opmap["LOAD_CONST"],
                            frozenset(dis.hasname) - {dis.opmap["LOAD_GLOBAL"]}, _ATTRIBUTES,
                            dis.opmap["EXTENDED_ARG"]))
size = types.FunctionType(_size.__code__, {"__builtins__": {}}, "size", (_SKIPPED, len))


def nested(code: types.CodeType) -> list[types.CodeType]:
    """`code` and every code object among its constants (the functions, classes and lambdas it defines)."""
    out, todo = [], [code]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += [k for k in c.co_consts if type(k) is types.CodeType]
    return out


def instructions(code: types.CodeType) -> int:
    """Instructions in `code` and the codes it defines (3.11's inline cache entries, opcode 0, not counted)."""
    return sum(1 for c in nested(code) for op in c.co_code[::2] if op)


class Codes:
    """The code objects of a check's forbidden references: `kept` (every one, nested ones included: held so
    their ids stay theirs), `ids`, the `shapes` of the substantial ones (not the methods a dataclass or a
    named tuple generates from no file: a student's class with the same fields gets the same), and a
    label for each shape (for the message)."""

    def __init__(self, codes: Iterable[tuple[types.CodeType, str]]):
        kept, labels, sizes = {}, {}, set()
        for code, label in codes:
            kept.update((id(c), c) for c in nested(code))
            if code.co_filename.startswith("<"):
                continue
            # the functions it defines count on their own: how the same source compiles a def's annotations
            # depends on the file's `from __future__ import annotations`, not the def's body (not its
            # comprehensions and lambdas: one line, which an honest student writes the same way)
            for c in nested(code):
                if (c is code or not c.co_name.startswith("<")) and instructions(c) >= SUBSTANTIAL:
                    labels.setdefault(shape(c), label)
                    sizes.add(size(c))
        self.kept = tuple(kept.values())
        self.ids = frozenset(kept)
        self.shapes = frozenset(labels)
        self.sizes = frozenset(sizes)
        self.labels = labels


__all__ = ["SUBSTANTIAL", "Codes", "instructions", "nested", "shape", "size"]
