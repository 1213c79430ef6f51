"""No import cycle among lib/dlo's modules, counting every import statement, those inside functions too: a lazy
import only hides a cycle until the day the order of imports changes. Each seam has one direction: the kernels
below `dlo.bench` (the roofline is `dlo.hardware`'s), the launcher above the rank side (`dlo.distributed.current`),
the harness's set-up above the exchange, `dlo.attention` (the references) below its kernel."""

from __future__ import annotations

import ast
from pathlib import Path

LIB = Path(__file__).resolve().parents[1] / "lib"


def modules(root: Path = LIB / "dlo") -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (`from a import b` counts a.b when that is a
    module, else a); a package's own submodules importing it are not an edge of this kind."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_sees_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a  # lazy, still a cycle\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    known = modules(pkg)
    assert cycles({m: imports(m, p, known) for m, p in known.items()}) == [["pkg.a", "pkg.b"]]


def test_lib_dlo_has_no_import_cycle():
    known = modules()
    assert len(known) > 100  # the whole library was read
    assert cycles({m: imports(m, p, known) for m, p in known.items()}) == []


def test_a_notebooks_imports_leave_out_dtensor():
    """Every day's first cell imports `dlo.checks` (every day's checks, the Llama among them): DTensor's
    module (torch.distributed.tensor, 0.9 CPU s on this machine's cores) is imported only by the days and
    checks that use it, not by each of the 22 kernels of `make run` (`dlo.models.llama._is_dtensor`)."""
    import subprocess
    import sys

    code = "import sys, dlo.checks, dlo.models.llama; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr[-800:]
