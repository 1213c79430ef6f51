"""What a student wrote for each exercise, wherever it is in the notebook: the similarity report's input.

An exercise cell can be a decoy: `adamw_step = _impl`, with `_impl` in a cell the student added, or an
`exec(zlib.decompress(base64.b64decode(...)))` anywhere. So every code cell the student can edit counts
(not a locked one, not one identical to a released cell, which is the instructors' code), split into its
top-level statements (`Part`): what each defines and which names it uses. An exercise's code is the
closure of the names its released stub defines (`adamw_step`): every part that defines one of them, then
every part defining a name those use, and so on, in notebook order, with the exercise cell itself.

Code run from text (`exec`, `eval`, `compile`) is decoded statically (`dlo.harness.decode`): the
decoded text then counts as code of the student's, its parts marked "obfuscated". Nothing of the
student's is ever run. What cannot be decoded is marked too, and so is code made from a code object
(`types.FunctionType(ref.__code__, ...)`, `__wrapped__`, marshal, pickle): the dotted name whose code
object is taken (`clones`), resolved through the notebook's imports, names the reference it clones.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from dlo.harness import bytecode
from dlo.harness.decode import dotted, literal
from dlo.harness.results import read_json

MAX_DEPTH = 5  # exec inside decoded text inside decoded text ...
MAX_DECODED = 16 << 20  # characters decoded for one submission, all its texts together: then no more decoding
RUNS_TEXT = {"exec", "eval", "compile", "builtins.exec", "builtins.eval", "builtins.compile"}
LOADS_CODE = {"marshal.loads", "pickle.loads", "cloudpickle.loads", "dill.loads", "types.FunctionType",
              "types.CodeType", "types.LambdaType", "FunctionType", "CodeType"}
CODE_ATTRS = {"__code__", "__wrapped__", "__func__"}
IDENTIFIER = re.compile(r"[A-Za-z_]\w{0,60}")


@dataclass
class Part:
    """One top-level statement of a student's code (or of text it decoded)."""

    cell: int
    source: str
    defines: set = field(default_factory=set)
    uses: set = field(default_factory=set)
    strings: set = field(default_factory=set)  # identifier-like string constants: setattr(m, "adamw_step", f)
    obfuscated: list = field(default_factory=list)  # why: "exec of base64 + zlib text (decoded)", ...
    clones: list = field(default_factory=list)  # dotted names whose code object the statement takes


# ----------------------------------------------------------------------------- a program

def _names(targets) -> set:
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _defines(stmt) -> set:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in stmt.names}
    if isinstance(stmt, ast.Assign):
        out = _names(stmt.targets)
        for t in stmt.targets:  # globals()["name"] = ...
            if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and isinstance(t.slice.value, str):
                out.add(t.slice.value)
        return out
    if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
        return _names([stmt.target])
    if isinstance(stmt, (ast.For, ast.AsyncFor, ast.With, ast.AsyncWith)):
        return _names([stmt.target] if hasattr(stmt, "target") else [i.optional_vars for i in stmt.items
                                                                      if i.optional_vars is not None])
    return set()


def _uses(stmt) -> tuple[set, set]:
    """(names the statement reads, identifier-like strings in it: a name set by setattr or globals())."""
    used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    strings = {n.value for n in ast.walk(stmt) if isinstance(n, ast.Constant) and isinstance(n.value, str)
               and IDENTIFIER.fullmatch(n.value)}
    return used | strings, strings


def _segment(lines: list[str], stmt) -> str:
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
    return "".join(lines[first - 1:stmt.end_lineno])


class Program:
    """A student's notebook as parts, with the imports and literal names the decoder reads."""

    def __init__(self):
        self.parts: list[Part] = []
        self.aliases: dict[str, str] = {}
        self.env: dict[str, str | bytes] = {}
        self._decoded: set[ast.AST] = set()  # the nodes of a decoded exec's argument (compile(...)): decoded once
        self._budget = MAX_DECODED

    @classmethod
    def of(cls, cells: list[tuple[int, str]]) -> Program:
        """`cells`: (index, source) of the code cells that count, in order."""
        program = cls()
        for index, source in cells:
            program.add(index, source, [])
        return program

    def add(self, cell: int, source: str, why: list[str], depth: int = 0) -> None:
        """The parts of `source` (a cell, or text decoded from one: `why` says how it was hidden)."""
        source = "\n".join("pass" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines())
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            words = set(re.findall(r"[A-Za-z_]\w*", source))
            self.parts.append(Part(cell, source, set(), words, set(), list(why)))
            return
        lines = source.splitlines(keepends=True)
        for stmt in tree.body:
            self._bind(stmt)
            part = Part(cell, _segment(lines, stmt), _defines(stmt), *_uses(stmt), list(why))
            self.parts.append(part)
            self._scan(stmt, part, depth)

    def _bind(self, stmt) -> None:
        """Imports (aliases of dotted names) and names bound to literals or to dotted names."""
        if isinstance(stmt, ast.Import):
            for a in stmt.names:
                self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(stmt, ast.ImportFrom) and stmt.module and not stmt.level:
            for a in stmt.names:
                self.aliases[a.asname or a.name] = f"{stmt.module}.{a.name}"
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            name, value = stmt.targets[0].id, stmt.value
            decoded = literal(value, self.env, self.aliases, []) if self._budget > 0 else None
            if decoded is not None:
                self._budget -= len(decoded)
                self.env[name] = decoded
            elif (target := dotted(value, self.aliases)) and "." in target:
                self.aliases[name] = target

    def _scan(self, stmt, part: Part, depth: int) -> None:
        """Code run from text or made from a code object, anywhere in the statement."""
        for node in ast.walk(stmt):
            if isinstance(node, ast.Attribute) and node.attr in CODE_ATTRS:
                target = dotted(node.value, self.aliases)
                part.clones.append(target or "?")
                part.obfuscated.append(f"takes a code object ({node.attr} of {target or 'an expression'})")
            if not isinstance(node, ast.Call):
                continue
            name = dotted(node.func, self.aliases)
            if name in LOADS_CODE:
                part.obfuscated.append(f"makes code with {name}")
            elif name in RUNS_TEXT and node.args and node not in self._decoded:
                self._decoded |= set(ast.walk(node.args[0]))
                how: list[str] = []
                text = literal(node.args[0], self.env, self.aliases, how) if self._budget > 0 else None
                steps = " + ".join(dict.fromkeys(how)) or "plain"
                if isinstance(text, bytes):
                    text = text.decode("utf-8", "replace")
                self._budget -= len(text or "")
                if text is None or depth >= MAX_DEPTH or self._budget < 0:
                    part.obfuscated.append(f"{name.split('.')[-1]} of text that could not be decoded")
                else:
                    why = f"{name.split('.')[-1]} of {steps} text (decoded)"
                    part.obfuscated.append(why)
                    self.add(part.cell, text, [*part.obfuscated], depth + 1)

    def exercise(self, names: set[str], cell: int | None) -> list[Part]:
        """The parts an exercise uses: its cell's, those defining its names, then the names those use."""
        defined = {n for p in self.parts for n in p.defines}
        chosen = {i for i, p in enumerate(self.parts) if p.cell == cell}
        needed = set(names) | {n for i in chosen for n in self.parts[i].uses if n in defined}
        while True:
            more = {i for i, p in enumerate(self.parts) if i not in chosen and (p.defines & needed or
                    p.strings & set(names))}
            if not more:
                return [p for i, p in enumerate(self.parts) if i in chosen]
            chosen |= more
            needed |= {n for i in more for n in self.parts[i].uses if n in defined}


def defined_names(source: str) -> set[str]:
    """The names a released stub defines (`def adamw_step`: the name its test cells read)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    return {n for stmt in tree.body for n in _defines(stmt) if not isinstance(stmt, (ast.Import, ast.ImportFrom))}


# ----------------------------------------------------------------------------- a submission

def notebook_cells(path: Path) -> list[dict]:
    """A notebook's cells as dicts, [] when it cannot be read (the student's file: anything may be in it)."""
    try:
        cells = json.loads(path.read_text())["cells"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [c for c in cells if isinstance(c, dict)] if isinstance(cells, list) else []


def nbgrader_meta(cell: dict) -> dict:
    """A cell's nbgrader metadata, {} when it has none or it is not a dict."""
    meta = cell.get("metadata", {})
    meta = meta.get("nbgrader", {}) if isinstance(meta, dict) else {}
    return meta if isinstance(meta, dict) else {}


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else str(src)


class Submission:
    """One submission of a day: its program and the code objects its checks received."""

    def __init__(self, path: Path, release_code: set[str]):
        self.cells = notebook_cells(path)
        counted = [(i, cell_source(c)) for i, c in enumerate(self.cells) if c.get("cell_type") == "code"
                   and not nbgrader_meta(c).get("locked") and cell_source(c) not in release_code]
        self.program = Program.of(counted)
        student, day = path.parent.parent.name, path.parent.name
        found = read_json(path.parents[3] / "autograded" / student / day / bytecode.FILE) or {}
        self.captured = {k: v for k, v in found.items() if isinstance(v, dict)}
        self.attributed: set[int] = set()  # ids of the parts some exercise uses

    def exercise(self, gid: str, names: set[str]) -> tuple[str, list[str], set[str], dict, set[str]]:
        """(code text, why it is obfuscated, names it clones, {digest: size} of its code objects, dlo refs)."""
        index = next((i for i, c in enumerate(self.cells) if nbgrader_meta(c).get("grade_id") == gid), None)
        parts = self.program.exercise(names, index)
        self.attributed |= {id(p) for p in parts}
        digests, refs = {}, set()
        for name in names:
            entry = self.captured.get(name, {})
            digests.update({d: s for d, s in (entry.get("digests") or {}).items() if isinstance(s, int)
                            and s >= bytecode.MIN_SIZE})
            refs |= {r for r in entry.get("refs") or () if isinstance(r, str)}
        return ("\n".join(p.source for p in parts), sorted({w for p in parts for w in p.obfuscated}),
                {c for p in parts for c in p.clones}, digests, refs)
