"""Packaging stays consistent: one dependency list in two files, README commands wired to CI."""

from __future__ import annotations

import re
import tomllib

from tests.harness.conftest import REPO


def test_environment_yml_lists_the_same_packages_as_pyproject():
    deps = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])
    pip_section = (REPO / "environment.yml").read_text().split("- pip:", 1)[1]
    conda = {s for s in re.findall(r"^\s+- (\S+)\s*$", pip_section, flags=re.M) if not s.startswith("-")}
    assert deps == conda, f"only in pyproject: {deps - conda}; only in environment.yml: {conda - deps}"


def test_no_torchvision_anywhere():
    for f in ("pyproject.toml", "environment.yml"):
        assert "torchvision" not in (REPO / f).read_text()


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    assert "make test" in readme and "make run" in readme
    assert "make test" in (REPO / ".ci" / "run").read_text()
