"""`student_cell(source, name)`: a student's notebook cell as the grader meets it, run in a module of its own that
nothing can import (`name`), so that what it defines travels to the sandbox and the ranks by value, as a notebook's
does; `given` are names the cell finds already defined (an earlier cell's)."""

import types


def student_cell(source: str, name: str, /, **given) -> types.SimpleNamespace:
    ns = {"__name__": name, **given}
    exec(compile(source, "student cell", "exec"), ns)  # noqa: S102 - the tests' own cells
    return types.SimpleNamespace(**ns)
