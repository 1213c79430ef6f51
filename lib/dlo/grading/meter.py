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

ACK = b"k"


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


def hand_over(path: str, rank: int, end: bool = False) -> None:
    """On a rank, before any student code: a copy of each of its TCP sockets to the launcher's meter. Again
    at the end (`end`): the sockets opened since (a process group the engine made) count from their
    first byte."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        socket.send_fds(s, [struct.pack("!i?", rank, end)], _tcp_sockets())
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
        self.tampered: str | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True, name="dlo-socket-meter")
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            ready, _, _ = select.select([self.listener], [], [], 0.05)
            if ready:
                with contextlib.suppress(OSError):
                    conn, _ = self.listener.accept()
                    with conn:
                        self._take(conn)

    def _take(self, conn: socket.socket) -> None:
        pid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        msg, fds, _, _ = socket.recv_fds(conn, 5, 256)
        socks = [socket.socket(fileno=fd) for fd in fds]
        rank, end = struct.unpack("!i?", msg) if len(msg) == 5 else (-1, False)
        if end and self.pids.get(rank) == pid:  # the same rank, at its end: the sockets it opened since
            held = {os.fstat(s.fileno()).st_ino for s in self.ranks[rank][0]}
            new = [s for s in socks if os.fstat(s.fileno()).st_ino not in held]
            for s in socks:
                if s not in new:
                    s.close()
            self.ranks[rank][0].extend(new)  # counted from their first byte: their baseline is 0
        elif end or not 0 <= rank < self.world_size or rank in self.ranks or pid in self.pids.values():
            self.tampered = f"a second hand-over for rank {rank} (process {pid})"
            for s in socks:
                s.close()
            return
        else:
            self.pids[rank] = pid
            self.ranks[rank] = (socks, sum(tcp_bytes_sent(s) for s in socks))
        conn.sendall(ACK)

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
