"""`dlo setup student|instructor`: one JupyterLab per role, configured in the environment.

nbgrader installs five JupyterLab plugins and four server extensions, all enabled. A student needs
the assignment list and Validate; the "Create Assignment" sidebar, the Formgrader and the course list
are the instructor's. `dlo setup ROLE` writes, into one Jupyter config folder (default: this
environment's `<sys.prefix>/etc/jupyter`, the level `jupyter ... --sys-prefix` writes; never the home
folder unless `--user` is given):

- `labconfig/page_config.json`: `disabledExtensions` for the lab plugins, as `jupyter labextension
  disable/enable --level=sys_prefix` writes it;
- `jupyter_server_config.d/<extension>.json`: the server extensions, as `jupyter server extension
  disable/enable --sys-prefix` writes them;
- `nbgrader_config.py`: the cell timeout, the exchange folder, dlo's submit (`exchange.Submit`: the
  submission closed to other students) and (`--course-id`) the course's name in it, which
  release_assignment, fetch_assignment, submit, collect and the feedback need. nbgrader reads the
  nbgrader_config.py of every Jupyter config folder, then the one of its working directory; so the
  course's timeout (nbgrader's default is 30 s) holds wherever a student opens a day folder, a
  copy outside the checkout included. Only role-neutral settings go here. `dlo release` and `dlo
  grade` run nbgrader in course roots of their own, with those roots' settings only; `dlo grade`
  copies the course id and exchange into its output's course root (`exchange`), so that
  `nbgrader release_feedback` works there.

The exchange's folders are made as `exchange.prepare` says (the course's by an instructor's setup).
Running it again changes nothing; switching role rewrites the same keys. JSON files are updated key by
key (other settings in them are kept); nothing is deleted; an nbgrader_config.py that `dlo setup` did
not write is left alone (one-line error saying what to add to it, before anything is written).
The instructor's course root is the checkout: its nbgrader_config.py (source: solutions/, release:
course/) is read when JupyterLab is started there.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

from dlo.errors import BadInput

NBGRADER_LAB = "@jupyter/nbgrader:"
# True: enabled for that role. The menu and validate plugins stay on for both.
LAB_PLUGINS = {
    "student": {"assignment-list": True, "validate-assignment": True, "course-list": False,
                "create-assignment": False, "formgrader": False},
    "instructor": {"assignment-list": True, "validate-assignment": True, "course-list": True,
                   "create-assignment": True, "formgrader": True},
}
SERVER_EXTENSIONS = {
    "student": {"assignment_list": True, "validate_assignment": True, "course_list": False, "formgrader": False},
    "instructor": {"assignment_list": True, "validate_assignment": True, "course_list": True, "formgrader": True},
}
MARKER = "# Written by `dlo setup`"
TERMINAL = ["/bin/bash", "-i"]  # not -l: see planned_files
CELL_TIMEOUT = 1800  # seconds: cells of the full profile run for minutes (nbgrader's default: 30)


def nbgrader_config_text(role: str, cell_timeout: int, exchange: Path, course_id: str | None = None) -> str:
    course = ("# The course's name in the exchange (release_assignment, fetch_assignment, submit, collect, feedback).\n"
              f"c.CourseDirectory.course_id = {course_id!r}\n" if course_id else
              "# No course id (`dlo setup --course-id ID`): nbgrader's release, fetch, submit and collect need one.\n")
    return f'''{MARKER} ({role}); `dlo setup` rewrites this file, edit the command's options instead.
c = get_config()  # noqa: F821 (provided by traitlets)
# Validate runs what `dlo grade` runs: the cells up to the last graded one (the experiments after it are the
# notebook's own run: Run All, or dlo run DAY), each with the course's timeout (nbgrader's default is 30 s).
import dlo.harness.validate  # noqa: E402
dlo.harness.validate.install()
c.Execute.timeout = {int(cell_timeout)}
# Its kernel on Unix sockets in a private folder, not on TCP ports of localhost that anyone on the node can reach.
c.Execute.kernel_manager_class = "dlo.harness.kernels.IPCKernelManager"
# The folder assignments are released to and collected from (nbgrader's default one usually does not exist).
c.Exchange.root = {str(exchange)!r}
# nbgrader's submit, then the submission readable by the instructor's group only (nbgrader leaves it 0777).
c.ExchangeFactory.submit = "dlo.harness.exchange.Submit"
''' + course


def config_dir(user: bool = False, explicit: str | Path | None = None) -> Path:
    """Where the settings go: an explicit folder, the user's Jupyter config folder, or this environment's."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    if user:
        from jupyter_core.paths import jupyter_config_dir
        return Path(jupyter_config_dir()).resolve()
    return Path(sys.prefix, "etc", "jupyter").resolve()


def default_exchange(cfg: Path, user: bool = False, explicit: bool = False) -> Path:
    """nbgrader's exchange beside the settings: <sys.prefix>/share/nbgrader/exchange for the environment,
    the user's Jupyter data folder with --user, <config dir>/exchange for an explicit config folder."""
    if explicit:
        return cfg / "exchange"
    if user:
        from jupyter_core.paths import jupyter_data_dir
        return Path(jupyter_data_dir(), "nbgrader", "exchange").resolve()
    return Path(sys.prefix, "share", "nbgrader", "exchange").resolve()


def planned_files(role: str, cfg: Path, cell_timeout: int, exchange: Path,
                  course_id: str | None = None) -> dict[Path, dict | str]:
    """{path: JSON keys to merge in, or the whole text of nbgrader_config.py}."""
    files: dict[Path, dict | str] = {}
    disabled = {NBGRADER_LAB + name: not on for name, on in LAB_PLUGINS[role].items()}
    files[cfg / "labconfig" / "page_config.json"] = {"disabledExtensions": disabled}
    for name, on in SERVER_EXTENSIONS[role].items():
        module = f"nbgrader.server_extensions.{name}"
        files[cfg / "jupyter_server_config.d" / f"{module}.json"] = {"ServerApp": {"jpserver_extensions": {module: on}}}
    # JupyterLab's terminal: an interactive shell that keeps the server's environment (the course's PATH:
    # jupyter, nbgrader, dlo). terminado's default is a login shell, whose /etc/profile resets PATH: on a hub
    # every terminal command of the README then failed (issue 38).
    files[cfg / "jupyter_server_config.d" / "dlo-terminal.json"] = {
        "ServerApp": {"terminado_settings": {"shell_command": TERMINAL}}}
    files[cfg / "nbgrader_config.py"] = nbgrader_config_text(role, cell_timeout, exchange, course_id)
    return files


def problems(files: dict[Path, dict | str]) -> list[str]:
    """Why writing would damage something: a foreign nbgrader_config.py, a JSON file that is not JSON."""
    out = []
    for path, content in files.items():
        if not path.exists():
            continue
        if isinstance(content, str):
            if not path.read_text().startswith(MARKER):
                out.append(f"{path} exists and was not written by `dlo setup`; it is left alone: add to it\n"
                           + "\n".join("    " + line for line in content.splitlines()[1:]))
        else:
            try:
                if not isinstance(json.loads(path.read_text() or "{}"), dict):
                    raise ValueError
            except ValueError:
                out.append(f"{path} is not a JSON object; fix or move it, then run `dlo setup` again")
    return out


def merge(into: dict, update: dict) -> dict:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            merge(into[key], value)
        else:
            into[key] = value
    return into


def write(path: Path, content: dict | str) -> str:
    """Write one planned file; returns "created", "updated" or "unchanged"."""
    old = path.read_text() if path.exists() else None
    if isinstance(content, str):
        new = content
    else:
        new = json.dumps(merge(json.loads(old or "{}"), content), indent=2, sort_keys=True) + "\n"
    if new == old:
        return "unchanged"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".dlo-tmp")
    tmp.write_text(new)
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return "created" if old is None else "updated"


def setup(role: str, *, user: bool = False, cfg_dir: str | Path | None = None, exchange: str | Path | None = None,
          cell_timeout: int = CELL_TIMEOUT, root: Path | None = None, course_id: str | None = None) -> int:
    if role not in LAB_PLUGINS:
        raise BadInput(f"unknown role {role!r}; choose student or instructor")
    if cell_timeout <= 0:
        raise BadInput(f"--cell-timeout must be > 0 seconds, got {cell_timeout}")
    if course_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", course_id):
        raise BadInput(f"--course-id {course_id!r}: letters, digits, '.', '_' and '-' only "
                       f"(it names a folder of the exchange)")
    cfg = config_dir(user, cfg_dir)
    ex = Path(exchange).expanduser().resolve() if exchange else default_exchange(cfg, user, bool(cfg_dir))
    if ex.exists() and not ex.is_dir():
        raise BadInput(f"exchange {ex} exists and is not a folder")
    files = planned_files(role, cfg, cell_timeout, ex, course_id)
    found = problems(files)
    if found:
        for p in found:
            print(f"dlo setup: {p}", file=sys.stderr)
        print("dlo setup: nothing was written", file=sys.stderr)
        return 2
    where = "your home folder (--user)" if user and not cfg_dir else "this environment" if not cfg_dir else "it"
    print(f"dlo setup {role}: Jupyter settings in {cfg} ({where})")
    for path, content in files.items():
        print(f"  {write(path, content):9s} {path.relative_to(cfg)}")
    prepare_exchange(role, ex, course_id)
    print(next_steps(role, root))
    if cfg_dir:  # a folder Jupyter does not read by itself
        print(f"note: Jupyter reads {cfg} only when told: start JupyterLab with JUPYTER_CONFIG_DIR={cfg} "
              f"(e.g. `export JUPYTER_CONFIG_DIR={cfg}` in your shell's profile)")
    if user and not cfg_dir:
        from jupyter_core.paths import prefer_environment_over_user
        if prefer_environment_over_user():
            print("note: Jupyter reads this environment's settings before your home's; start JupyterLab with "
                  "JUPYTER_PREFER_ENV_PATH=0 so that these come first")
    return 0


def prepare_exchange(role: str, ex: Path, course_id: str | None) -> None:
    """The exchange's folders (`exchange.prepare`): the course's only for an instructor who is not root,
    as nbgrader's release refuses course folders its user does not own."""
    from dlo.harness import exchange

    own = role == "instructor" and course_id and os.geteuid() != 0
    for line in exchange.prepare(ex, course_id if own else None):
        if line.startswith("warning:"):
            print(f"dlo setup: {line}", file=sys.stderr)
        else:
            print(f"  {line}")
    if role == "instructor" and course_id and not own:
        print(f"note: run `dlo setup instructor` as the instructor to make the course's folders in {ex} "
              f"(nbgrader's release refuses folders its user does not own)")


def next_steps(role: str, root: Path | None) -> str:
    if role == "student":
        return ("Start JupyterLab in the folder of a day (a copy anywhere is fine): `jupyter lab`, then "
                "Validate in the notebook's toolbar runs it with the course's cell timeout.")
    course = root or Path(".")
    return (f"Start JupyterLab in the course root, {course} (its nbgrader_config.py: source solutions/, "
            f"release course/): `cd {course} && jupyter lab`; the Formgrader is under the Nbgrader menu.")


def kernel_metadata() -> dict:
    """The notebook metadata JupyterLab writes when this environment's Python kernel starts: the
    python3 kernelspec of ipykernel and the `language_info` of its kernel_info reply."""
    from ipykernel.ipkernel import IPythonKernel

    language_info = {**IPythonKernel.language_info, "version": sys.version.split()[0]}
    return {"kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"},
            "language_info": language_info}


def normalise_metadata(nb) -> bool:
    """Give a notebook the kernel metadata JupyterLab would write on open, so opening it does not mark
    it modified (JupyterLab compares and rewrites both keys when the kernel is ready; "Python 3" and a
    bare {"name": "python"} differ). The version in language_info is this interpreter's (3.11.x in the
    course environment): a student on another Python still sees the mark. True when something changed."""
    want = kernel_metadata()
    changed = any(nb.metadata.get(k) != v for k, v in want.items())
    nb.metadata.update(want)
    return changed


def comparable_metadata(metadata: dict) -> dict:
    """Notebook metadata without what depends on the releasing interpreter (language_info.version), for
    `dlo check`'s comparison of committed and regenerated notebooks across Python patch versions."""
    info = {k: v for k, v in metadata.get("language_info", {}).items() if k != "version"}
    return {**metadata, "language_info": info}
