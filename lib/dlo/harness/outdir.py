"""An output folder that an instructor command owns, and only that.

`dlo grade --out DIR` may write into DIR only when DIR is new, empty, or an earlier output of the same
command: a marker file (`.dlo-grade.json`) lists every file and folder the command made there. Before
a run, anything in DIR that the marker does not list is a reason to refuse (nothing is touched); on
reuse, only the listed files are removed. The marker is rewritten at checkpoints with everything
under DIR (after the check, DIR held nothing else, so everything there was made by this run).

`keep` names top-level entries that belong to someone else with a right to be there (the shard parts
of `dlo grade --shard`, each owned by its own marker): they are neither refused, listed nor touched.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from dlo.errors import BadInput

MARKER = ".dlo-grade.json"


class NotOurs(BadInput):
    """DIR holds something the command did not make (a one-line refusal, exit status 2)."""


def _walk(root: Path, keep=None) -> tuple[list[str], list[str]]:
    files, dirs = [], []
    for base, subdirs, names in os.walk(root, followlinks=False):
        rel = Path(base).relative_to(root)
        if keep is not None and base == str(root):
            subdirs[:] = [d for d in subdirs if not keep(d)]
            names = [n for n in names if not keep(n)]
        for d in subdirs:
            p = Path(base) / d
            (files if p.is_symlink() else dirs).append(str(rel / d))
        files += [str(rel / n) for n in names]
    return sorted(f for f in files if f != MARKER), sorted(dirs)


class OwnedDir:
    """`check()` before anything is written (raises NotOurs), then `claim()`, `record()`, `discard()`."""

    def __init__(self, path: Path, command: str = "dlo grade", keep=None):
        self.path, self.command, self.keep = path, command, keep
        self.created: list[Path] = []  # DIR and the parents this run had to create, outermost first

    def check(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise NotOurs(f"--out {self.path} is a file, not a folder")
        if not self.path.exists():
            return
        files, dirs = _walk(self.path, self.keep)
        if not files and not dirs and not (self.path / MARKER).exists():
            return
        listed = self._listed()
        if listed is None:
            entries = sorted(p.name for p in self.path.iterdir() if not (self.keep and self.keep(p.name)))
            raise NotOurs(f"--out {self.path} is not empty and not an earlier `{self.command}` output (it holds "
                          f"{', '.join(entries[:5])}{', ...' if len(entries) > 5 else ''}): nothing was written; "
                          f"choose a new or empty folder")
        # Inside a folder the marker lists, a file is ours even if unlisted: a run killed outright (SIGKILL,
        # a node lost) wrote results there after its last record(). Such files are never deleted (claim()
        # removes only listed files), so a stranger's file there is kept, not lost.
        def ours(rel: str) -> bool:
            parents = Path(rel).parents
            return rel in listed["files"] or rel in listed["dirs"] or any(str(p) in listed["dirs"] for p in parents)
        strangers = [f for f in files + dirs if not ours(f)]
        if strangers:
            raise NotOurs(f"--out {self.path} holds files that `{self.command}` did not write there: "
                          f"{', '.join(strangers[:5])}{', ...' if len(strangers) > 5 else ''}; nothing was "
                          f"written: move them away or choose another folder")

    def _listed(self) -> dict | None:
        try:
            data = json.loads((self.path / MARKER).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("made_by") != self.command:
            return None
        return {"files": set(data.get("files", [])), "dirs": set(data.get("dirs", []))}

    def claim(self) -> None:
        """Create DIR (or empty an earlier output of ours: only the files the marker lists)."""
        if not self.path.exists():
            self.created = [p for p in reversed(self.path.parents) if not p.exists()] + [self.path]
            self.path.mkdir(parents=True)
        listed = self._listed()
        if listed is not None:
            for f in sorted(listed["files"]):
                p = self.path / f
                if p.is_symlink() or p.is_file():
                    p.unlink()
            for d in sorted(listed["dirs"], key=lambda s: -s.count(os.sep)):
                p = self.path / d
                if p.is_dir() and not p.is_symlink() and not any(p.iterdir()):
                    p.rmdir()
        self.record()

    def owned(self) -> bool:
        """True when DIR holds an earlier output of this command (its marker)."""
        return self._listed() is not None

    def record(self) -> None:
        files, dirs = _walk(self.path, self.keep)
        tmp = self.path / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"made_by": self.command, "files": files, "dirs": dirs}, indent=0))
        os.replace(tmp, self.path / MARKER)

    def discard(self) -> None:
        """After a failed run: remove DIR when this run created it (everything in it is this run's), and
        the parents it created for it when they are empty (no `runs/` left behind)."""
        if not self.created:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in reversed(self.created[:-1]):
            try:
                parent.rmdir()
            except OSError:
                break
