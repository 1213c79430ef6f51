"""nbgrader's own tools on `dlo grade`'s output, and nbgrader's exchange round trip with real Unix users.

After `dlo grade`, OUT/course is an nbgrader course root that the formgrader (NbGraderAPI, what its
pages show), `nbgrader export` and `nbgrader release_feedback` work in (issues 19 and 26). The round
trip runs as an instructor and two students, each a Unix user made for the test: release, fetch,
submit, collect, `dlo grade`, release and fetch of the feedback.
"""

from __future__ import annotations

import csv
import io
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from dlo.grading import files
from dlo.harness import exchange
from dlo.harness.setup import setup
from tests.harness.conftest import (
    ADAMW,
    DAY,
    POINTS,
    REPO,
    dlo,
    edit_cells,
    grade_id,
    read_csv,
    toy_days,
    unreachable_by_others,
)

TOTAL = sum(POINTS.values())
ADD = "def add(a, b):\n    return a + b"
NORM = "def norm(x, y):\n    return (x * x + y * y) ** 0.5"
ADAMW_OWN = ADAMW.replace("    ### BEGIN SOLUTION\n", "").replace("\n    ### END SOLUTION", "")

# What the formgrader's pages show, computed as its server extension does (NbGrader's config: the
# Jupyter config path, then the course root's nbgrader_config.py), every nbgrader log line on stderr.
FORMGRADER = textwrap.dedent('''
    import json, logging, os, sys
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
    from nbgrader.apps import NbGraderAPI
    from nbgrader.apps.baseapp import NbGrader
    from nbgrader.coursedir import CourseDirectory
    app = NbGrader()
    app.load_config_file()
    app.config.CourseDirectory.root = os.getcwd()
    api = NbGraderAPI(CourseDirectory(config=app.config), config=app.config)
    json.dump({"assignment": api.get_assignment(sys.argv[1]), "submissions": api.get_submissions(sys.argv[1]),
               "students": api.get_students(), "functional": bool(api.exchange_is_functional)}, sys.stdout, default=str)
''')


def formgrader_view(course: Path, day: str, env: dict) -> tuple[dict, str]:
    """(what the formgrader shows of `day` in course root `course`, nbgrader's log)."""
    proc = subprocess.run([sys.executable, "-c", FORMGRADER, day], cwd=course, capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def jupyter_config(folder: Path, text: str = "") -> dict:
    """The environment for a Jupyter config folder of our own holding `text` as nbgrader_config.py (first
    on the config path, so it has the last word over this environment's settings)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "nbgrader_config.py").write_text("c = get_config()\n" + text)
    return {"JUPYTER_CONFIG_DIR": str(folder)}


# ----------------------------------------------------------------------------- the pieces

def test_copy_regular_files_skips_links_and_special_files(tmp_path):
    src, dest, secret = tmp_path / "sub", tmp_path / "dest", tmp_path / "secret"
    (src / "data").mkdir(parents=True)
    (src / "runs" / "tb").mkdir(parents=True)
    secret.mkdir()
    (secret / "answers.txt").write_text("hidden")
    (src / f"{DAY}.ipynb").write_text("{}")
    (src / "data" / "x.csv").write_text("1,2")
    (src / "runs" / "tb" / "events").write_text("log")
    (src / "link.txt").symlink_to(secret / "answers.txt")
    (src / "linkdir").symlink_to(secret)
    (src / "data" / "dangling").symlink_to(tmp_path / "nothing")
    os.mkfifo(src / "pipe")  # opening it for reading would block forever
    skipped = files.copy_tree(src, dest, ignore=files.NOT_SUBMITTED)  # what publish() copies with
    assert sorted(skipped) == ["data/dangling (a symlink)", "link.txt (a symlink)", "linkdir (a symlink)",
                               "pipe (a fifo)"]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["data", "data/x.csv", f"{DAY}.ipynb"]
    assert not any(p.is_symlink() for p in dest.rglob("*"))


def test_class_exchange_comes_from_the_settings_and_must_exist(tmp_path, monkeypatch):
    ex = tmp_path / "exchange"
    monkeypatch.setenv("JUPYTER_CONFIG_DIR", str(tmp_path / "cfg"))
    jupyter_config(tmp_path / "cfg", f"c.CourseDirectory.course_id = 'dlo-test'\nc.Exchange.root = {str(ex)!r}\n")
    assert exchange.class_exchange() is None  # the folder is missing: nbgrader would log a CRITICAL
    ex.mkdir()
    assert exchange.class_exchange() == ("dlo-test", str(ex))
    jupyter_config(tmp_path / "cfg", f"c.CourseDirectory.course_id = ''\nc.Exchange.root = {str(ex)!r}\n")
    assert exchange.class_exchange() is None  # no course id: release and collect cannot work
    from traitlets.config import Config

    on, off = Config(), Config()
    exec(compile(exchange.config_block(("dlo-test", str(ex))), "on", "exec"), {"c": on})
    exec(compile(exchange.config_block(None), "off", "exec"), {"c": off})
    assert on.CourseDirectory.course_id == "dlo-test" and on.Exchange.root == str(ex)
    assert off.CourseDirectory.course_id == "" and off.ExchangeFactory.list == "dlo.harness.exchange.NoExchange"


def test_setup_writes_the_course_id(tmp_path):
    from dlo.harness import setup as S

    S.setup("instructor", cfg_dir=tmp_path / "cfg", exchange=tmp_path / "ex", course_id="dlo-2026")
    assert "c.CourseDirectory.course_id = 'dlo-2026'" in (tmp_path / "cfg" / "nbgrader_config.py").read_text()
    with pytest.raises(SystemExit, match="course-id"):
        S.setup("instructor", cfg_dir=tmp_path / "cfg2", course_id="a/b")
    assert not (tmp_path / "cfg2").exists()


def modes(root: Path, course_id: str) -> dict[str, str]:
    return {sub: oct(stat.S_IMODE((root / course_id / sub).stat().st_mode)) for sub in exchange.COURSE_MODES}


def test_prepare_makes_nbgraders_folders_and_fixes_only_its_own(tmp_path):
    ex = tmp_path / "ex"
    lines = exchange.prepare(ex, "dlo-test")
    assert [line.split()[0] for line in lines] == ["created"] * 5, lines
    assert stat.S_IMODE(ex.stat().st_mode) == 0o1777
    assert modes(ex, "dlo-test") == {".": "0o755", "outbound": "0o755", "inbound": "0o3733", "feedback": "0o711"}
    assert [line.split()[0] for line in exchange.prepare(ex, "dlo-test")] == ["exists"] * 5  # again: nothing

    # inbound as an older dlo left it (nbgrader's release made it: 2733, no sticky bit, no marker): a warning
    (ex / "dlo-test" / "inbound" / exchange.CREATED).unlink()
    os.chmod(ex / "dlo-test" / "inbound", 0o2733)
    os.chmod(ex / "dlo-test" / "outbound", 0o777)  # dlo's (marked): fixed
    lines = exchange.prepare(ex, "dlo-test")
    assert sum(line.startswith("warning:") for line in lines) == 1 and "chmod 3733" in lines[3], lines
    assert modes(ex, "dlo-test")["inbound"] == "0o2733"  # never changed: dlo did not make it
    assert lines[2].startswith("fixed") and modes(ex, "dlo-test")["outbound"] == "0o755"

    # a marker is trusted only from the folder's owner, who must be this user
    (ex / "dlo-test" / "inbound" / exchange.CREATED).touch()
    assert exchange.created_by_dlo(ex / "dlo-test" / "inbound")
    if os.geteuid() == 0:
        os.chown(ex / "dlo-test" / "inbound" / exchange.CREATED, 65534, 65534)
        assert not exchange.created_by_dlo(ex / "dlo-test" / "inbound")


def test_setup_makes_the_course_folders_only_for_an_instructor_not_root(tmp_path, capsys, monkeypatch):
    from dlo.harness import setup as S

    S.setup("student", cfg_dir=tmp_path / "s", exchange=tmp_path / "ex", course_id="dlo-2026")
    assert stat.S_IMODE((tmp_path / "ex").stat().st_mode) == 0o1777 and not (tmp_path / "ex" / "dlo-2026").exists()
    config = (tmp_path / "s" / "nbgrader_config.py").read_text()
    assert 'c.ExchangeFactory.submit = "dlo.harness.exchange.Submit"' in config
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    S.setup("instructor", cfg_dir=tmp_path / "i", exchange=tmp_path / "ex", course_id="dlo-2026")
    assert not (tmp_path / "ex" / "dlo-2026").exists() and "as the instructor" in capsys.readouterr().out


# ----------------------------------------------------------------------------- nbgrader's tools on OUT/course

def _submit(toy_root: Path, submitted: Path, student: str, answers: dict[str, str]) -> Path:
    """A student's notebook: the release with `answers` ({grade_id: source}) in place of the stubs."""
    def edit(cell):
        if grade_id(cell) in answers:
            cell["source"] = answers[grade_id(cell)]
    return edit_cells(toy_root / "course" / DAY / f"{DAY}.ipynb", submitted / student / DAY / f"{DAY}.ipynb", edit)


@pytest.fixture(scope="module")
def graded_class(toy_template, tmp_path_factory):
    """The toy course graded for four students: (course root, submitted dir, out dir, dlo grade's stdout)."""
    base = tmp_path_factory.mktemp("graded")
    submitted, out = base / "submitted", base / "out"
    _submit(toy_template, submitted, "ann", {"add": ADD, "norm": NORM, "adamw": ADAMW_OWN})
    _submit(toy_template, submitted, "bob", {})
    cat = _submit(toy_template, submitted, "cat", {"add": ADD}).parent
    (cat / "notes.txt").write_text("my notes")
    (cat / "answers.ipynb").symlink_to(toy_template / "solutions" / DAY / f"{DAY}.ipynb")  # never copied
    (cat / "runs" / "tb").mkdir(parents=True)
    (cat / "runs" / "tb" / "events").write_text("log")
    (submitted / "ghost" / DAY).mkdir(parents=True)  # no notebook: no submission
    env = jupyter_config(base / "jupyter")  # no exchange set up for this class
    proc = dlo("grade", str(submitted), "--out", str(out), "--cell-timeout", "30", root=toy_template, env=env,
               timeout=900, cwd=base)
    return toy_template, submitted, out, proc.stdout, env


@pytest.mark.slow
def test_formgrader_and_export_see_every_submission(graded_class):
    _, submitted, out, _, env = graded_class
    course = out / "course"
    scores = {r["student"]: float(r["score"]) for r in read_csv(out / "scores.csv")}
    assert scores == {"ann": TOTAL, "bob": 0, "cat": POINTS["add_test"], "ghost": 0}

    view, log = formgrader_view(course, DAY, env)
    assert view["assignment"]["num_submissions"] == 3, view["assignment"]  # ghost submitted nothing
    assert view["assignment"]["max_score"] == TOTAL
    assert {s["student"]: (s["score"], s["autograded"], s["submitted"]) for s in view["submissions"]} == {
        "ann": (TOTAL, True, True), "bob": (0, True, True), "cat": (POINTS["add_test"], True, True)}
    assert {s["id"]: s["score"] for s in view["students"]} == scores  # the students page: ghost too
    assert "CRITICAL" not in log and "Unwritable" not in log, log
    assert not view["functional"]  # no class exchange: off, not broken

    # the submissions as graded: the notebook and the student's own files, never a link or runs/
    for student in ("ann", "bob", "cat"):
        assert (course / "submitted" / student / DAY / f"{DAY}.ipynb").read_bytes() == \
            (submitted / student / DAY / f"{DAY}.ipynb").read_bytes()
    assert sorted(p.name for p in (course / "submitted" / "cat" / DAY).iterdir()) == ["notes.txt", f"{DAY}.ipynb"]
    assert not (course / "submitted" / "ghost").exists()

    proc = subprocess.run([str(Path(sys.executable).parent / "nbgrader"), "export", "--to", str(out / "export.csv")],
                          cwd=course, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = list(csv.DictReader(io.StringIO((out / "export.csv").read_text())))
    assert {r["student_id"]: float(r["score"]) for r in rows if r["assignment"] == DAY} == scores
    assert {float(r["max_score"]) for r in rows} == {TOTAL}


# ----------------------------------------------------------------------------- the exchange, with Unix users

def _root_binds() -> list[str]:
    """The folders of root's home (0700) that this Python and this checkout live in: bound back into
    the users' view of /root (a tmpfs) so that they can run them."""
    needed = [Path(os.path.realpath(sys.executable)), Path(sys.prefix), Path(sys.base_prefix), REPO]
    return sorted({str(Path("/root", p.relative_to("/root").parts[0])) for p in needed
                   if p.is_relative_to("/root") and p != Path("/root")})


class Users:
    """Unix users made for one test (`useradd`), removed afterwards with their homes (`userdel -r`).
    `run` runs a command as one of them in a private mount namespace (`unshare -m`) whose /root is an
    empty tmpfs (mode 0755) with `_root_binds` bound back in: the host's /root is not changed."""

    def __init__(self, base: Path):
        self.base, self.made = base, []
        self.stash = base / ".mounts"  # where the namespace parks root's folders before covering /root
        self.stash.mkdir(mode=0o700)

    def add(self, name: str) -> str:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
        self.made.append(name)
        os.chmod(pwd.getpwnam(name).pw_dir, 0o700)  # a student's home is their own
        return name

    def home(self, name: str) -> Path:
        return Path(pwd.getpwnam(name).pw_dir)

    def run(self, name: str, *cmd: str, cwd: Path, env: dict | None = None, check: bool = True,
            timeout: float = 300) -> subprocess.CompletedProcess:
        pw = pwd.getpwnam(name)
        binds = _root_binds()
        script = ["set -e"]
        script += [f"mkdir -p {self.stash}/{i} && mount --bind {b} {self.stash}/{i}" for i, b in enumerate(binds)]
        script += ["mount -t tmpfs -o mode=0755 tmpfs /root"] if binds else []
        script += [f"mkdir -p {b} && mount --bind {self.stash}/{i} {b}" for i, b in enumerate(binds)]
        script += [f'cd "{cwd}"', f"exec setpriv --reuid={pw.pw_uid} --regid={pw.pw_gid} --init-groups -- \"$@\""]
        user_env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": pw.pw_dir,
                    "USER": name, "LOGNAME": name, "LANG": "C.UTF-8", "DLO_PROFILE": "tiny", **(env or {})}
        proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script),
                               "sh", *cmd], env=user_env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{name}: {' '.join(cmd)} -> rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    def remove(self) -> None:
        for name in self.made:
            subprocess.run(["userdel", "--remove", name], capture_output=True)


def _can_switch_users() -> str | None:
    """Why this machine cannot run the round trip as several Unix users, or None."""
    if os.geteuid() != 0:
        return "needs root (useradd, setpriv, unshare -m): CI runs the suite as root"
    missing = [c for c in ("useradd", "userdel", "setpriv", "unshare", "mount") if shutil.which(c) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        return "unshare --mount is refused here (a container without CAP_SYS_ADMIN?)"
    return None


PEEK = textwrap.dedent('''
    import os, shutil, sys
    inbound, home, sub, day = sys.argv[1:5]
    def attempt(act):
        try:
            act()
            return "done"
        except PermissionError:
            return "refused"
    for act in (lambda: os.listdir(inbound), lambda: os.listdir(home), lambda: os.listdir(sub),
                lambda: open(os.path.join(sub, day + ".ipynb")).read(), lambda: os.rename(sub, sub + "x"),
                lambda: os.unlink(os.path.join(sub, "timestamp.txt")), lambda: shutil.rmtree(sub),
                lambda: open(os.path.join(sub, "timestamp.txt"), "a").write("1")):
        print(attempt(act))
''')


def _nbgrader(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "nbgrader"), *args]


SOLVE = textwrap.dedent('''
    import json, sys
    path, answers = sys.argv[1], json.loads(sys.argv[2])
    nb = json.load(open(path))
    for cell in nb["cells"]:
        gid = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
        if gid in answers:
            cell["source"] = answers[gid]
    json.dump(nb, open(path, "w"))
''')


@pytest.mark.skipif(unreachable_by_others(REPO) is not None,
                    reason=f"another user must reach the checkout: {unreachable_by_others(REPO)}")
@pytest.mark.slow
@pytest.mark.trust  # Unix users, minutes: its own CI step (pytest -m trust)
def test_exchange_round_trip_with_unix_users(toy_template):
    why = _can_switch_users()
    if why:
        pytest.skip(why)
    tag = f"{os.getpid() % 100000}"
    base = Path(tempfile.mkdtemp(prefix="dlo-exchange-"))  # not under pytest's 0700 temp folder: users reach it
    users = Users(base)
    try:
        _round_trip(toy_template, base, users, tag)
    finally:
        users.remove()
        shutil.rmtree(base, ignore_errors=True)


def _round_trip(toy_template: Path, base: Path, users: Users, tag: str) -> None:
    os.chmod(base, 0o755)
    course_id = "dlo-toy"
    inst, ann, bob = (users.add(f"dlo{role}{tag}") for role in ("inst", "ann", "bob"))
    ex = base / "exchange"
    ex.mkdir(mode=0o1777)
    ex.chmod(0o1777)  # as nbgrader's documentation says: everyone writes, nobody removes another's files
    desk = base / "instructor"  # the instructor's: the checkout (solutions/, course/, nbgrader_config.py), gradings
    course = desk / "course"
    shutil.copytree(toy_template, course)
    shutil.copyfile(REPO / "nbgrader_config.py", course / "nbgrader_config.py")
    subprocess.run(["chown", "-R", f"{inst}:{inst}", str(desk)], check=True)

    # The Jupyter settings `dlo setup` writes (the exchange, the course id): the instructor's, the students'.
    # The instructor's setup makes the course's folders (nbgrader's release wants them the instructor's own).
    settings = {}
    for role, who in (("instructor", [inst]), ("student", [ann, bob])):
        cfg = base / "jupyter" / role
        if role == "instructor":
            cfg.mkdir(parents=True)
            shutil.chown(cfg, inst, inst)
            users.run(inst, sys.executable, "-m", "dlo.cli", "setup", role, "--config-dir", str(cfg), "--exchange",
                      str(ex), "--course-id", course_id, cwd=base)
        else:
            assert setup(role, cfg_dir=cfg, exchange=ex, course_id=course_id) == 0
        settings.update({user: {"JUPYTER_CONFIG_PATH": str(cfg)} for user in who})  # read-only, as an environment's
    assert modes(ex, course_id) == {".": "0o755", "outbound": "0o755", "inbound": "0o3733", "feedback": "0o711"}

    # The instructor releases the day; each student fetches it, answers, submits.
    users.run(inst, *_nbgrader("release_assignment", DAY), cwd=course, env=settings[inst])
    answers = {ann: {"add": ADD, "norm": NORM, "adamw": ADAMW_OWN}, bob: {"add": ADD}}
    for student in (ann, bob):
        home = users.home(student)
        users.run(student, *_nbgrader("fetch_assignment", DAY), cwd=home, env=settings[student])
        users.run(student, sys.executable, "-c", SOLVE, str(home / DAY / f"{DAY}.ipynb"),
                  json.dumps(answers[student]), cwd=home)
        users.run(student, *_nbgrader("submit", DAY), cwd=home, env=settings[student])

    # A student cannot see another's submission: the inbound folder cannot be listed and its entries are
    # named with a random part; the submitting student's own cache is in a home no one else reads. Even
    # with its name, bob can neither read, list, empty, rename nor remove ann's submission (sticky inbound,
    # the submission the instructor's group's only: `exchange.Submit`).
    inbound = ex / course_id / "inbound"
    (mine,) = inbound.glob(f"{ann}+{DAY}+*")  # it is there (root sees it)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o770 and mine.stat().st_gid == inbound.stat().st_gid
    seen = users.run(bob, sys.executable, "-c", PEEK, str(inbound), str(users.home(ann)), str(mine), DAY,
                     cwd=base).stdout.split()
    assert seen == ["refused"] * 8, seen
    assert sorted(p.name for p in mine.iterdir()) == sorted([f"{DAY}.ipynb", "submission_secret.txt", "timestamp.txt"])

    # The instructor collects into the course's submitted/, the layout `dlo grade` reads, and grades.
    users.run(inst, *_nbgrader("collect", DAY), cwd=course, env=settings[inst])
    for student in (ann, bob):
        collected = course / "submitted" / student / DAY
        assert (collected / f"{DAY}.ipynb").read_bytes() == \
            (users.home(student) / DAY / f"{DAY}.ipynb").read_bytes()  # nothing lost on the way
        assert (collected / "timestamp.txt").is_file()
    out = desk / "grading"
    graded = users.run(inst, sys.executable, "-m", "dlo.cli", "--root", str(course), "grade",
                       str(course / "submitted"), "--out", str(out), "--cell-timeout", "30", cwd=course,
                       env={**settings[inst], **toy_days(course)}, timeout=900)
    scores = {r["student"]: float(r["score"]) for r in read_csv(out / "scores.csv")}
    assert scores == {ann: TOTAL, bob: POINTS["add_test"]}, graded.stdout + graded.stderr

    # The formgrader on the graded course root: the class's exchange, both submissions with their scores.
    view, log = formgrader_view(out / "course", DAY, settings[inst])
    assert view["functional"] and view["assignment"]["status"] == "released", view["assignment"]
    assert view["assignment"]["num_submissions"] == 2
    assert {s["student"]: (s["score"], s["autograded"]) for s in view["submissions"]} == {
        ann: (TOTAL, True), bob: (POINTS["add_test"], True)}
    assert "CRITICAL" not in log, log

    # Feedback: released from the graded course root, each student fetches their own.
    users.run(inst, *_nbgrader("release_feedback", DAY), cwd=out / "course", env=settings[inst])
    for student in (ann, bob):
        users.run(student, *_nbgrader("fetch_feedback", DAY), cwd=users.home(student), env=settings[student])
        fetched = list((users.home(student) / DAY / "feedback").glob(f"*/{DAY}.html"))
        assert len(fetched) == 1, fetched
        assert fetched[0].read_bytes() == (out / "feedback" / student / f"{DAY}.html").read_bytes()
        assert "add(-1, 1)" not in fetched[0].read_text()  # the hidden tests stay hidden
    assert modes(ex, course_id) == {".": "0o755", "outbound": "0o755", "inbound": "0o3733", "feedback": "0o711"}


@pytest.mark.slow
def test_similarity_report_beside_the_scores(graded_class):
    _, _, out, stdout, _ = graded_class
    assert f"similarity: {out / 'similarity.html'}" in stdout
    rows = read_csv(out / "similarity.csv")
    # ann's AdamW is the instructors' solution; bob's cells are the untouched stubs, cat's `add` one line
    assert {(r["student"], r["other"], r["cell"]) for r in rows} >= {("ann", "solutions", "adamw")}
    assert not any(r["student"] in ("bob", "ghost") or r["other"] in ("bob", "ghost") for r in rows), rows
    assert "ann" in (out / "similarity.html").read_text()
