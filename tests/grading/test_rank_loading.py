"""Where the grader unpickles a student's objects for an on-ranks check (issue 26): only in processes that
can reach no other rank's part of the case.

Unpickling a student's object runs the student's code (`__reduce__`, a class body, a cell's module-level
code). A hostile answer to Day 4's ring all-reduce carries such an object: wherever it is unpickled, it
searches for every rank's part - the objects the garbage collector tracks, the locals of every thread's
frames, its own memory read raw (freed remnants included), under the grader's jail also its ancestors'
memory (the jail's processes are one user), and the grader's channel (an inherited socket, or one taken
from an ancestor with pidfd_getfd: it answers the request in flight and reads the next) - and leaves a
record of what it found. It is unpickled in the runner's stub probe (a grandchild of the session's child)
and on each rank, after the rank has taken its own part and sealed the grader's modules
(`dlo.grading.ranks.run_on_rank`). None of them may reach a part but its own. On the previous code the
probe held the session's socket and read both parts from the ranks' request; and a rank read both from
the memory of the session's child and of the runner.
"""

from __future__ import annotations

import json
import os
import pickle
import platform

import pytest
import torch

from dlo.checks import day4
from dlo.grading import trusted
from dlo.grading.jail import make_spec, probe
from dlo.grading.trusted import LocalSandbox

PIDFD_GETFD = 438  # the syscall's number on every architecture
PROCESS_VM_READV = {"x86_64": 310, "aarch64": 270}.get(platform.machine())  # the syscall's number
pytestmark = [pytest.mark.slow,  # a sandboxed runner and a launch of two ranks: ~8 CPU s
              pytest.mark.trust,  # its own CI step, pytest -m trust
              pytest.mark.skipif(PROCESS_VM_READV is None, reason=f"process_vm_readv's number on {platform.machine()}")]


def _tensors(obj, depth: int = 0):
    """The tensors in a part of the case (through lists, tuples and dicts)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 8 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _fingerprint(t) -> str:
    import hashlib

    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def _write_oracle(path: str, per_rank: list) -> None:
    """What the search looks for, per rank: each tensor's fingerprint (found among objects), and the raw
    bytes of each tensor of 4 elements or more in two halves (found in memory: the halves are kept apart,
    so that the search never finds its own needle)."""
    oracle = []
    for part in per_rank:
        tensors = list(_tensors(part))
        raw = [t.detach().contiguous().numpy().tobytes() for t in tensors if t.numel() >= 4]
        oracle.append({"fingerprints": [_fingerprint(t) for t in tensors],
                       "halves": [(b[:len(b) // 2], b[len(b) // 2:]) for b in raw]})
    with open(path, "wb") as f:
        pickle.dump(oracle, f)


def _objects_found(oracle) -> list[int]:
    """The ranks whose part is among this process's objects: those the gc tracks, and every thread's
    frames' locals (a few levels into lists, tuples and dicts)."""
    import gc
    import sys

    seen, found = set(), set()
    wanted = {fp: r for r, part in enumerate(oracle) for fp in part["fingerprints"]}

    def walk(obj, depth, tuples):
        if id(obj) in seen or depth > 6:
            return
        seen.add(id(obj))
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            if obj.layout == torch.strided and obj.device.type == "cpu" and obj.numel() < 1 << 20:
                found.add(wanted.get(_fingerprint(obj)))
        elif type(obj) is list or (tuples and type(obj) is tuple):
            for x in obj:
                walk(x, depth + 1, True)
        elif type(obj) is dict:
            for x in list(obj.values()):
                walk(x, depth + 1, True)

    gc.unfreeze()  # a rank freezes what it inherited (dlo.distributed._worker): out of get_objects' sight till then
    for obj in gc.get_objects():  # a tuple there may be one the unpickler is still filling: not read
        walk(obj, 0, False)
    for frame in sys._current_frames().values():
        while frame is not None:
            for value in list(frame.f_locals.values()):
                walk(value, 0, True)
            frame = frame.f_back
    return sorted(found - {None})


def _memory_found(oracle, pid: int | None = None) -> list[int] | None:
    """The ranks whose part's bytes are in the writable private memory of process `pid` (this one by
    default), read raw (process_vm_readv, as a debugger reads); None where it cannot be read."""
    import ctypes

    pid = os.getpid() if pid is None else pid
    try:
        with open(f"/proc/{pid}/maps") as f:
            regions = [line.split() for line in f]
    except OSError:
        return None
    libc, chunk, found, read_any = ctypes.CDLL(None, use_errno=True), 8 << 20, set(), False
    word = ctypes.c_long  # syscall() is variadic: every argument a full register
    buf = ctypes.create_string_buffer(chunk + 4096)
    for fields in regions:
        name = fields[5] if len(fields) > 5 else ""
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if not fields[1].startswith("rw") or not (name in ("", "[heap]", "[stack]") or name.startswith("[anon")) \
                or end - start > 1 << 30:
            continue
        for at in range(start, end, chunk):
            n = min(chunk + 4096, end - at)
            local, remote = (ctypes.c_void_p * 2)(ctypes.addressof(buf), n), (ctypes.c_void_p * 2)(at, n)
            got = libc.syscall(word(PROCESS_VM_READV), word(pid), local, word(1), remote, word(1), word(0))
            if got <= 0:
                break
            read_any, data = True, buf.raw[:got]
            for r, part in enumerate(oracle):
                for a, b in part["halves"]:
                    i = data.find(a)
                    while i >= 0 and r not in found:
                        if data[i + len(a):i + len(a) + len(b)] == b:
                            found.add(r)
                        i = data.find(a, i + 1)
    return sorted(found) if read_any else None


def _ancestors() -> list[int]:
    """This process's parent, grandparent, ... up to (not including) the PID namespace's first process."""
    pids, pid = [], os.getppid()
    while pid > 1:
        pids.append(pid)
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
    return pids


def _sockets(take: bool) -> list[int]:
    """The sockets this process holds: those it inherited, and (`take`) those it can take from its
    ancestors (pidfd_getfd, as a debugger may: unconfined as root, it always can)."""
    import ctypes
    import stat

    libc, fds = ctypes.CDLL(None, use_errno=True), []
    for pid in _ancestors() if take else ():
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue
        taken = (libc.syscall(*map(ctypes.c_long, (PIDFD_GETFD, pidfd, n, 0))) for n in range(64))
        fds += [fd for fd in taken if fd >= 0]
        os.close(pidfd)
    fds += [int(n) for n in os.listdir("/proc/self/fd")]
    return [fd for fd in fds if _is(fd, stat.S_ISSOCK)]


def _is(fd, kind) -> bool:
    try:
        return kind(os.fstat(fd).st_mode)
    except OSError:
        return False


def _channel_found(oracle, take: bool) -> list[int]:
    """The ranks whose part comes through a channel of the grader's that this process holds: it answers
    the request in flight as the runner's session would ("not the stub"), and reads the next one."""
    import select

    from dlo.grading import wire

    sockets = _sockets(take)
    if not sockets:
        return []
    wire.write_frame(sockets[0], wire.encode({"kind": "result", "value": None, "after": None}))
    ready, _, _ = select.select(sockets, [], [], 20)
    if not ready:
        return []
    frame = wire.read_frame(ready[0])
    return sorted(r for r, part in enumerate(oracle) if any(a + b in frame for a, b in part["halves"]))


def _search(oracle_path: str, out: str, jailed: bool) -> str:
    """Run where the student's object is unpickled: what this process can reach of the case, recorded."""
    import sys

    with open(oracle_path, "rb") as f:
        oracle = pickle.load(f)
    where, frame = [], sys._getframe(1)
    while frame is not None:
        where.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        frame = frame.f_back
    rank = os.environ.get("RANK")
    record = {"pid": os.getpid(), "rank": rank, "where": where[:8], "objects": _objects_found(oracle),
              "memory": _memory_found(oracle),
              "ancestors": {pid: _memory_found(oracle, pid) for pid in _ancestors()} if jailed else {},
              # on a rank the sockets are the process group's: the channel is the runner's side's
              "channel": _channel_found(oracle, jailed) if rank is None else []}
    with open(os.path.join(out, f"loaded-{os.getpid()}.json"), "w") as f:
        json.dump(record, f)
    return out


class _Searcher:
    """Unpickled, it runs `_search` (pickle's __reduce__): the student's code at load time."""

    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return (_search, self.args)


def ring_that_searches(*args):
    """A ring all-reduce whose global is the searcher: loading the function loads it."""
    searcher = _Searcher(*args)

    def ring_all_reduce(tensor):
        assert searcher is not None
        raise RuntimeError("this answer only searches")
    return ring_all_reduce


def test_the_students_objects_are_loaded_where_no_other_ranks_part_is(tmp_path, monkeypatch):
    """Under the grader's own jail where bubblewrap runs (there the search also reads its ancestors'
    memory and takes their descriptors, as the jail's one user may), else unconfined."""
    jailed = probe() == "bwrap"
    spec = make_spec("bwrap" if jailed else "none (test)", tmp_path / "work", hidden=[])
    spec.make_dirs()
    oracle, out = spec.captured_dir / "oracle.pkl", spec.runner_dir  # readable, writable in the jail
    sent = trusted.Session.on_ranks

    def on_ranks(self, worker, world_size, args, kwargs, timeout, backend, per_rank=None):
        _write_oracle(str(oracle), per_rank)  # before any of it reaches the sandbox
        return sent(self, worker, world_size, args, kwargs, timeout, backend, per_rank=per_rank)

    monkeypatch.setattr(trusted.Session, "on_ranks", on_ranks)
    with LocalSandbox(spec.capture_dir, prefix=spec.runner_prefix(), log=spec.runner_log,
                      captures=spec.captured_dir) as sandbox, \
            pytest.raises(Exception) as failed:  # noqa: PT011 - an answer that reads the request breaks the channel
        sandbox.run(day4.check_ring_all_reduce, ring_that_searches(str(oracle), str(out), jailed))
    records = [json.loads(p.read_text()) for p in sorted(out.glob("loaded-*.json"))]
    for rec in records:  # where it was loaded, it reached no part but that process's own
        own = set() if rec["rank"] is None else {int(rec["rank"])}
        reached = {*rec["objects"], *(rec["memory"] or ()), *rec["channel"]}
        reached |= {r for found in rec["ancestors"].values() for r in found or ()}
        assert reached <= own, rec
    on_ranks = {int(rec["rank"]): rec for rec in records if rec["rank"] is not None}
    assert sorted(on_ranks) == [0, 1], records  # the search ran on each rank, and there it finds its own
    assert all(rec["objects"] == rec["memory"] == [r] for r, rec in on_ranks.items()), records
    assert "this answer only searches" in str(failed.value)
