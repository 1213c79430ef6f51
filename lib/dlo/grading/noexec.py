"""No new program once the student's code may run: a seccomp filter that makes execve and execveat fail.

Every defence of `dlo.grading.forbid` lives in one interpreter: names blocked, code burned, an audit hook, the
seal. A fresh interpreter started from the student's code has none of them and imports dlo's references as any
program would: a red team ran them with `subprocess.run([sys.executable, "-c", ...])`, `os.posix_spawn`,
`os.fork` + `os.execv` and a spawn-context multiprocessing pool, 12 points of 15 on Day 10 (2026-12-02). No
audit event covers every way there (`_posixsubprocess.fork_exec` raises none), so the kernel refuses: a filter
(Linux seccomp, `SECCOMP_FILTER_FLAG_TSYNC`: every thread of the process, and every process it forks) returns
EPERM for execve and execveat. Forking stays free: a fork keeps every defence of its parent.

Where the grader arms it (`forbid.forbidden(..., for_good=True)`: the sandboxed runner's session child and a
launch's ranks) nothing trusted starts a program afterwards: the ranks come from a fork server started before
any student code. What a student's code may have started a program for no longer works there: `torch.compile`
(its C++ and Triton compilers are programs) falls back to running the function as written
(`torch._dynamo.config.suppress_errors`), as a compiled exercise function already travels uncompiled
(`dlo.pickling`).

Only x86-64 and AArch64 are known (any other architecture's system calls, x32's included, are refused too); where
the filter cannot be installed (not Linux, seccomp unavailable), `deny_exec` says so and the caller decides.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys
import types

# per machine: (AUDIT_ARCH_*, execve, execveat, the seccomp system call)
ARCHES = {"x86_64": (0xC000003E, 59, 322, 317), "aarch64": (0xC00000B7, 221, 281, 277)}
X32 = 0x40000000  # x86-64's x32 ABI: the same calls under these numbers
PR_SET_NO_NEW_PRIVS, SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC = 38, 1, 1
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
LD_ABS_W, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06  # BPF: load word, jump if ==, jump if >=, return


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def program(arch: str) -> bytes:
    """The classic-BPF filter for `arch` (struct sock_filter: u16 code, u8 jt, u8 jf, u32 k, each)."""
    audit_arch, execve, execveat, _ = ARCHES[arch]
    deny = RET_ERRNO | errno.EPERM
    steps = [(LD_ABS_W, 0, 0, 4),  # seccomp_data.arch
             (JEQ_K, 1, 0, audit_arch), (RET_K, 0, 0, deny),  # another architecture's calls: refused
             (LD_ABS_W, 0, 0, 0),  # seccomp_data.nr
             (JGE_K, 3, 0, X32) if arch == "x86_64" else (JEQ_K, 3, 0, 0xFFFFFFFF),
             (JEQ_K, 2, 0, execve), (JEQ_K, 1, 0, execveat),
             (RET_K, 0, 0, RET_ALLOW), (RET_K, 0, 0, deny)]
    return b"".join(struct.pack("=HBBI", *step) for step in steps)


EVENTS = frozenset(("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "os.startfile"))
MESSAGE = ("starting a program is off limits while a check runs: a fresh interpreter would run without the check's "
           "rules; compute the answer in the function itself")


def _refuse(event, args, events=EVENTS, error=PermissionError, message=MESSAGE):
    """The audit hook that names the rule where Python announces a new program (the filter refuses the rest with
    a bare EPERM). Its state is its defaults (no global lookup); PermissionError is an OSError, which the
    library code that probes for programs (ctypes.util.find_library) already expects."""
    if event in events:
        raise error(message)


def deny_exec() -> str | None:
    """Install the filter in this process; None once installed, else why it could not be (one line)."""
    arch = platform.machine()
    if platform.system() != "Linux" or arch not in ARCHES:
        return f"no seccomp filter on {platform.system()} {arch}: a program the student's code starts is not refused"
    code = program(arch)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = _Program(len(code) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(
            ARCHES[arch][3], SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(prog)) != 0:
        return f"no seccomp filter ({errno.errorcode.get(ctypes.get_errno(), '?')}): a program the student's code " \
               f"starts is not refused"
    sys.addaudithook(types.FunctionType(_refuse.__code__, {"__builtins__": {}}, "dlo_no_new_program",
                                        _refuse.__defaults__))
    _compile_as_written()
    return None


def _compile_as_written() -> None:
    """torch.compile's compilers are programs: where they cannot start, the function runs as written."""
    os.environ["TORCHDYNAMO_SUPPRESS_ERRORS"] = "1"  # read when torch._dynamo is first imported
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # imported already: its config read the environment then
        dynamo.config.suppress_errors = True


__all__ = ["EVENTS", "MESSAGE", "deny_exec", "program"]
