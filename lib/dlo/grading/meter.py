"""The bytes each rank sends, counted where the student's code cannot change the count.

A check's worker counts the collectives of the student's engine on the rank (`dlo.measure.CommCounter`),
in the process the engine runs in: a student could patch the counter there. The kernel counts the same
traffic too, per TCP socket (TCP_INFO's bytes sent), and those counters are read here from outside the
rank. Before any student code runs on it, each rank hands the launching process (which runs none: the
sandboxed runner's session child launching the ranks, a notebook's kernel, a test) a copy of every TCP
socket it has open (the process group's connections and the rendezvous store's), over a Unix socket
(`hand_over`); the launcher reads each one's counter then and after the launch (`SocketMeter`). A
check compares what the worker reports with what the sockets sent (`dlo.measure.comm.wire_agrees`).

Each rank hands over once before its student code runs, and once more at the end (the sockets it opened
since: a process group the engine made); any other hand-over (a second one claiming a rank, one from
another process) marks the measurement as tampered with. What the meter guarantees is the total: the
bytes a rank's code sent over its connections, however it reached them, whatever the counter on the
rank says. Traffic over a channel the student's code opens itself outside TCP (a file, a pipe) is not
counted: it is not the process group the exercise uses.

The same hand-overs tell the launcher each rank's process (`SO_PEERCRED`), whose memory it reads from /proc
(`dlo.measure.process`) for a worker that asks it (`counted_prelude`, `dlo.grading.ranks`): at the start,
at one mark the rank sends once its trusted prelude has run (before any student object exists), then
every few milliseconds until the launch ends (the high water mark only rises: no hand-over the student's
code sends late, early or never makes it lower). `SocketMeter.memory` gives the counts.
"""

from __future__ import annotations

import contextlib
import os
import select
import shutil
import socket
import struct
import tempfile
import threading

from dlo.measure.comm import tcp_bytes_sent
from dlo.measure.process import Snapshot, snapshot

ACK = b"k"
START, END, MARK = 0, 1, 2  # the kinds of hand-over
POLL_S = 0.005  # how often the launcher reads a marked rank's high water mark


def _tcp_sockets() -> list[int]:
    """This process's connected TCP sockets (listening ones left out), as descriptors."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM \
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                out.append(fd)
    return out


def hand_over(path: str, rank: int, kind: int = START) -> None:
    """On a rank, before any student code: a copy of each of its TCP sockets to the launcher's meter. Again
    at the end (`END`): the sockets opened since (a process group the engine made) count from their
    first byte. `MARK`, once, between the two: the rank's trusted prelude is done (its memory is read)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        socket.send_fds(s, [struct.pack("!iB", rank, kind)], _tcp_sockets() if kind != MARK else [])
        if s.recv(1) != ACK:
            raise RuntimeError("the grader's byte meter did not take this rank's sockets")


class SocketMeter:
    """The launcher's end: takes each rank's sockets and reads their counters (`sent`)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.folder = tempfile.mkdtemp(prefix="dlo-meter-")
        self.path = os.path.join(self.folder, "meter")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(world_size + 4)
        self.ranks: dict[int, tuple[list[socket.socket], int]] = {}
        self.pids: dict[int, int] = {}  # rank -> the process that handed its sockets over
        self.counts: dict[int, dict[str, Snapshot | None]] = {}  # rank -> its memory at start, mark and end
        self.peaks: dict[int, int] = {}  # rank -> the highest VmHWM read since its mark
        self.tampered: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dlo-socket-meter")
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.listener], [], [], POLL_S if self.peaks else 0.05)
            self._poll()
            if ready:
                with contextlib.suppress(OSError):
                    conn, _ = self.listener.accept()
                    with conn:
                        self._take(conn)

    def _poll(self) -> None:
        for rank, peak in self.peaks.items():
            now = snapshot(self.pids[rank])
            if now is not None and now.hwm > peak:
                self.peaks[rank] = now.hwm

    def _take(self, conn: socket.socket) -> None:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        msg, fds, _, _ = socket.recv_fds(conn, 5, 256)
        socks = [socket.socket(fileno=fd) for fd in fds]
        rank, kind = struct.unpack("!iB", msg) if len(msg) == 5 else (-1, -1)
        ours = self.pids.get(rank) == pid and "end" not in self.counts[rank]
        if kind == END and ours:  # the same rank, at its end: the sockets it opened since
            self.counts[rank]["end"] = snapshot(pid)
            held = {os.fstat(s.fileno()).st_ino for s in self.ranks[rank][0]}
            new = [s for s in socks if os.fstat(s.fileno()).st_ino not in held]
            for s in socks:
                if s not in new:
                    s.close()
            self.ranks[rank][0].extend(new)  # counted from their first byte: their baseline is 0
        elif kind == MARK and ours and "mark" not in self.counts[rank]:
            self.counts[rank]["mark"] = snapshot(pid)  # the prelude's peak, before the reset
            after = snapshot(pid, reset=True)  # where this process may: the peak from here on is exact
            self.counts[rank]["reset"] = after
            self.peaks[rank] = after.hwm if after is not None else 0
        elif kind != START or not 0 <= rank < self.world_size or rank in self.ranks or pid in self.pids.values():
            self.tampered = f"a second hand-over for rank {rank} (process {pid})"
            for s in socks:
                s.close()
            return
        else:
            self.pids[rank] = pid
            self.counts[rank] = {"start": snapshot(pid)}
            self.ranks[rank] = (socks, sum(tcp_bytes_sent(s) for s in socks))
        conn.sendall(ACK)

    def memory(self) -> list[dict[str, int]] | None:
        """Each marked rank's memory as the kernel counted it, read from here (bytes; after `close`): `start_rss`
        at its first hand-over, `prelude_peak` (VmHWM at its mark: what the trusted prelude reached),
        `mark_rss` (after the prelude let go of it), `peak` (the highest VmHWM read after the mark, at the
        polls and the end hand-over), `ended` (1 if the end hand-over came), `below` (processes below the
        rank at its end) and `child_ticks` (the CPU time of children it waited for since the mark). None where
        no rank marked, or a rank's count could not be read."""
        if not self.peaks:
            return None
        out = []
        for rank in range(self.world_size):
            got = self.counts.get(rank, {})
            start, mark, reset, end = (got.get(k) for k in ("start", "mark", "reset", "end"))
            if start is None or mark is None or reset is None:
                return None
            peak = max(self.peaks[rank], end.hwm if end is not None else 0)
            out.append({"start_rss": start.rss, "prelude_peak": mark.hwm, "mark_rss": reset.rss, "peak": peak,
                        "ended": int(end is not None), "below": end.below if end is not None else 0,
                        "child_ticks": end.child_ticks - reset.child_ticks if end is not None else 0})
        return out

    def close(self) -> list[int] | None:
        """Bytes each rank's sockets sent since it handed them over (None: a rank never did, or the hand-over
        was tampered with); the meter's sockets and folder are gone after."""
        self.stop.set()
        self.thread.join()
        self.listener.close()
        shutil.rmtree(self.folder, ignore_errors=True)
        try:
            if self.tampered or len(self.ranks) != self.world_size:
                return None
            return [sum(tcp_bytes_sent(s) for s in self.ranks[r][0]) - self.ranks[r][1]
                    for r in range(self.world_size)]
        finally:
            for socks, _ in self.ranks.values():
                for s in socks:
                    s.close()
