"""Reading what a student made without following it: regular files only, each resolved inside its folder.

A submission folder and the sandbox's scratch folders (the capture folder the student's kernel writes
into) hold whatever the student put there: a symlink to the instructors' notebook, a fifo that blocks
the reader forever, a device, a socket, or a folder swapped for a link between two reads. The grader
reads them only through this module:

- every component is opened relative to its folder (`dir_fd`) with O_NOFOLLOW, so a link anywhere on
  the way (the file itself or a folder above it) is refused, never resolved;
- a file is opened non-blocking and kept only if fstat of the opened descriptor says it is a regular
  file (a fifo, device or socket is refused without ever being read: the check is on what was opened,
  not on an earlier stat that a swap could outdate);
- `copy_tree` copies regular files and real folders, and names what it skipped ("data.txt (a
  symlink)") for the student's feedback.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CHUNK = 1 << 20
# What a day folder may hold that is no part of the notebook: never copied, hashed or graded.
NOT_SUBMITTED = ("runs", ".ipynb_checkpoints", "__pycache__")  # TensorBoard logs, checkpoints, caches


class NotRegular(OSError):
    """A path that is not a regular file (or folder) where one was expected: `what` says what it is."""

    def __init__(self, name: str, what: str):
        super().__init__(f"{name} is {what}: only regular files are read")
        self.name, self.what = name, what


def kind(mode: int) -> str:
    """What a stat mode is, in the words the feedback uses."""
    for test, what in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symlink"),
                       (stat.S_ISFIFO, "a fifo"), (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"),
                       (stat.S_ISBLK, "a device")):
        if test(mode):
            return what
    return "not a regular file"


def _why(name: str, dir_fd: int | None, err: OSError) -> NotRegular | OSError:
    """The refusal for an open that failed: ELOOP/ENOTDIR on a link say what the entry really is."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return err
    what = kind(st.st_mode)
    return NotRegular(name, what) if what not in ("a regular file", "a folder") else err


def open_dir(path: str | Path, dir_fd: int | None = None) -> int:
    """A descriptor of folder `path` (relative to `dir_fd` when given), refusing a link."""
    try:
        return os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        raise _why(str(path), dir_fd, err) from None


def open_file(name: str, dir_fd: int | None = None) -> int:
    """A descriptor of the regular file `name` (relative to `dir_fd`), refusing links and special files."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        raise _why(name, dir_fd, err) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise NotRegular(name, kind(st.st_mode))
    os.set_blocking(fd, True)
    return fd


@contextlib.contextmanager
def opened_dir(base: str | Path, parts: Iterable[str] = ()) -> Iterator[int]:
    """`base` (the grader's own folder: opened as given), then each of `parts` inside it without
    following links; the last folder's descriptor."""
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts:
            _check_part(part)
            inner = open_dir(part, fd)
            os.close(fd)
            fd = inner
        yield fd
    finally:
        os.close(fd)


def _check_part(part: str) -> None:
    if not part or part in (".", "..") or "/" in part:
        raise ValueError(f"{part!r} is not a name inside a folder")


def open_log(path: str | Path) -> int:
    """A log of the grader's, opened once for appending and reading: created if missing, refused when
    the name is a link or a special file."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        raise _why(str(path), None, err) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        what = kind(os.fstat(fd).st_mode)
        os.close(fd)
        raise NotRegular(str(path), what)
    os.set_blocking(fd, True)
    return fd


def read_file(base: str | Path, *parts: str, limit: int | None = None) -> bytes:
    """The bytes of base/parts[0]/.../parts[-1], a regular file reached without following any link
    below `base`; NotRegular or OSError otherwise; ValueError when it is larger than `limit`."""
    *folders, name = parts
    _check_part(name)
    with opened_dir(base, folders) as d:
        fd = open_file(name, d)
        try:
            size = os.fstat(fd).st_size
            if limit is not None and size > limit:
                raise ValueError(f"{name} is {size} bytes, more than the {limit} the grader reads")
            chunks = []
            while chunk := os.read(fd, CHUNK):
                chunks.append(chunk)
                if limit is not None and sum(map(len, chunks)) > limit:
                    raise ValueError(f"{name} grew past the {limit} bytes the grader reads")
            return b"".join(chunks)
        finally:
            os.close(fd)


def is_regular(base: str | Path, *parts: str) -> bool:
    """True when base/parts... is a regular file reached without following a link below `base`."""
    try:
        *folders, name = parts
        with opened_dir(base, folders) as d:
            return stat.S_ISREG(os.stat(name, dir_fd=d, follow_symlinks=False).st_mode)
    except (OSError, ValueError):
        return False


def walk(src: str | Path, ignore: Iterable[str] = ()) -> Iterator[tuple[str, int | None, str | None]]:
    """Every entry under folder `src` (NotRegular when `src` itself is a link; the folders above it
    are the grader's, followed), depth first, sorted: (relative path, descriptor, None) for a regular
    file, (relative path + "/", None, None) for a folder, which is descended into without following
    links, (relative path, None, what it is) for anything else. A descriptor is valid until the next
    item. Names in `ignore` are left out entirely."""
    skip, src = set(ignore), Path(src)
    with opened_dir(src.parent, [src.name]) as top:
        yield from _walk(top, "", skip)


def _walk(dir_fd: int, prefix: str, skip: set) -> Iterator[tuple[str, int | None, str | None]]:
    for name in sorted(os.listdir(dir_fd)):
        if name in skip:
            continue
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except OSError:
            continue  # gone meanwhile
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = open_dir(name, dir_fd)
            except OSError as err:  # swapped for a link since the stat
                yield rel, None, getattr(err, "what", "unreadable")
                continue
            try:
                yield rel + "/", None, None
                yield from _walk(sub, rel + "/", skip)
            finally:
                os.close(sub)
            continue
        try:
            fd = open_file(name, dir_fd)
        except NotRegular as err:
            yield rel, None, err.what
            continue
        except OSError:
            yield rel, None, "unreadable"
            continue
        try:
            yield rel, fd, None
        finally:
            os.close(fd)


def copy_tree(src: str | Path, dest: str | Path, ignore: Iterable[str] = ()) -> list[str]:
    """Copy the regular files and folders under `src` into `dest` (created; the grader's own folder),
    never following a link or opening a special file; what was skipped, as "data.txt (a symlink)"."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    skipped = []
    for rel, fd, why in walk(src, ignore):
        if why is not None:
            skipped.append(f"{rel} ({why})")
        elif fd is None:
            (dest / rel).mkdir(exist_ok=True)
        else:
            with open(dest / rel, "wb") as out:
                while chunk := os.read(fd, CHUNK):
                    out.write(chunk)
    return skipped
