"""lib/dlo/grading/README.md names every module of the package, on the side of the trust boundary the
seal puts it: its first table is `seal.OPEN` (the student's side), its second every other module."""

import re
from pathlib import Path

import dlo.grading
from dlo.grading.seal import OPEN


def _named(part: str) -> set[str]:
    return set(re.findall(r"^\| `(\w+)`", part, re.M))


def test_the_readme_names_each_module_on_its_side():
    folder = Path(dlo.grading.__file__).parent
    student, trusted = (folder / "README.md").read_text().split("The trusted side")
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert _named(student) == {m.removeprefix("dlo.grading.") for m in OPEN}
    assert _named(trusted) == modules - _named(student)
