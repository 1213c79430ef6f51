"""dlo.pickling: a function shipped by value raises on the other side with the student's file (or
notebook cell) and source line in its traceback, whatever cloudpickle does with code objects' file
names (3.1.3 calls them all "<dynamic-code>")."""

import subprocess
import sys
import textwrap

import cloudpickle

from dlo.pickling import dumps

# Loads a payload in a fresh interpreter (which has none of the sender's files or cells in
# linecache), calls it and prints the traceback.
LOAD_AND_CALL = textwrap.dedent("""
    import sys, traceback, cloudpickle
    fn = cloudpickle.loads(open(sys.argv[1], "rb").read())
    try:
        fn(1)
    except Exception:
        traceback.print_exc()
""")


def _call_elsewhere(blob: bytes, tmp_path) -> str:
    payload = tmp_path / "payload.pkl"
    payload.write_bytes(blob)
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_CALL, str(payload)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    return proc.stderr


def test_function_from_a_module_file_keeps_its_file_and_line(tmp_path):
    src = tmp_path / "student_mod.py"
    src.write_text("def step(x):\n    y = x * 2\n    raise ValueError('module boom')  # line 3\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import student_mod

        cloudpickle.register_pickle_by_value(student_mod)  # as dlo does for a student's own module
        try:
            blob = dumps(student_mod.step)
        finally:
            cloudpickle.unregister_pickle_by_value(student_mod)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("student_mod", None)
    src.unlink()  # the other side cannot read the file: the lines must travel
    err = _call_elsewhere(blob, tmp_path)
    assert f'File "{src}", line 3, in step' in err, err
    assert "raise ValueError('module boom')  # line 3" in err
    assert "<dynamic-code>" not in err


def test_function_from_a_script_keeps_its_file_and_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import sys
        from dlo.pickling import dumps

        def step(x):
            raise KeyError('script boom')

        open(sys.argv[1], "wb").write(dumps(step))
    """))
    subprocess.run([sys.executable, str(script), str(tmp_path / "blob")], check=True, timeout=120)
    err = _call_elsewhere((tmp_path / "blob").read_bytes(), tmp_path)
    assert f'File "{script}", line 6, in step' in err, err
    assert "raise KeyError('script boom')" in err


def test_function_from_a_notebook_cell_names_the_cell(tmp_path):
    # A real IPython shell: its cells' "files" exist only in its memory, and it labels them In[n].
    script = textwrap.dedent("""
        import sys
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_cell("x = 1", store_history=True)
        shell.run_cell("def step(x):\\n    y = x + 1\\n    raise ValueError('cell boom')", store_history=True)
        from dlo.pickling import dumps
        open(sys.argv[1], "wb").write(dumps(shell.user_ns["step"]))
    """)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "blob")], check=True, timeout=120,
                   capture_output=True)
    err = _call_elsewhere((tmp_path / "blob").read_bytes(), tmp_path)
    assert 'File "Cell In[2]", line 3, in step' in err, err
    assert "raise ValueError('cell boom')" in err


CELL_1 = """\
import torch.distributed as dist
from dlo.distributed import launch

def body():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return 0
"""
CELL_2 = """\
try:
    launch(body, 2, timeout=120)
except Exception as exc:
    print("ERROR:", exc)
"""


def test_a_rank_raising_in_a_notebook_cell_shows_the_cell_line(tmp_path):
    # launch() from a notebook: the RankError the student reads names the cell and the line.
    script = "\n".join([
        "from IPython.core.interactiveshell import InteractiveShell",
        "shell = InteractiveShell.instance()",
        f"shell.run_cell({CELL_1!r}, store_history=True)",
        f"shell.run_cell({CELL_2!r}, store_history=True)",
    ])
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    out = proc.stdout
    assert "ERROR:" in out, proc.stdout + proc.stderr
    assert 'File "Cell In[1]", line 6, in body' in out, out
    assert 'raise ValueError("boom on rank 1")' in out
    assert "<dynamic-code>" not in out


def test_nested_functions_and_lambdas_keep_their_file(tmp_path):
    def outer():
        inner = lambda v: 1 / v  # noqa: E731 - a nested code object in outer's constants
        return inner(0)

    err = _call_elsewhere(dumps(lambda _x: outer()), tmp_path)
    assert f'File "{__file__}"' in err and "inner = lambda v: 1 / v" in err, err


def test_a_compiled_function_or_module_travels_as_what_it_wraps():
    """torch.compile's wrappers hold compiler state no pickle takes ("cannot pickle 'ConfigModuleInstance'"): a
    student's compiled exercise function could not be sent to the grader. What it wraps travels instead."""
    import torch

    def double(x):
        return x * 2

    back = cloudpickle.loads(dumps([torch.compile(double), torch.compile(torch.nn.Linear(2, 3))]))
    assert back[0].__name__ == "double" and torch.equal(back[0](torch.ones(2)), torch.full((2,), 2.0))
    assert type(back[1]) is torch.nn.Linear
