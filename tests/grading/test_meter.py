"""The socket meter (`dlo.grading.meter`): the bytes a rank's TCP sockets send, read by the launcher.

Without ranks: this process plays a rank (a TCP connection to itself), hands its sockets over, sends,
and the meter's count follows the kernel's; a second hand-over claiming the rank is tampering.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import pytest

from dlo.grading.meter import END, MARK, POLL_S, SocketMeter, hand_over

pytestmark = pytest.mark.trust  # a hostile class's evidence: its own CI step, pytest -m trust


@pytest.fixture
def connection():
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    peer, _ = server.accept()
    server.close()
    yield client, peer
    client.close()
    peer.close()


def test_the_meter_counts_what_the_sockets_send_after_the_hand_over(connection):
    client, peer = connection
    client.sendall(b"x" * 1000)  # before the hand-over: not counted
    peer.recv(4096)
    meter = SocketMeter(1)
    hand_over(meter.path, 0)
    client.sendall(b"y" * 5000)
    got = 0
    while got < 5000:
        got += len(peer.recv(65536))
    assert meter.close() == [5000]  # both ends are this process's: the client sent 5000, the peer nothing


def test_a_second_hand_over_is_tampering(connection):
    meter = SocketMeter(2)
    hand_over(meter.path, 0)
    with pytest.raises(RuntimeError, match="did not take"):
        hand_over(meter.path, 1)  # the same process claiming another rank
    assert meter.close() is None and "second hand-over" in meter.tampered


def _hold(mib: int) -> bytearray:
    block = bytearray(mib * 2 ** 20)
    block[::4096] = b"\1" * len(block[::4096])  # every page touched: resident
    return block


def test_a_mark_starts_the_memory_count_and_the_polls_see_the_peak():
    """This process plays a rank: its prelude's peak, then what it holds after the mark; the polls read the
    peak of a block made and freed after an early end hand-over (what a rank's code sending its own end, and
    keeping the worker's from reaching the meter, would do)."""
    meter = SocketMeter(1)
    hand_over(meter.path, 0)
    prelude = _hold(48)
    del prelude
    hand_over(meter.path, 0, MARK)
    hand_over(meter.path, 0, END)
    late = _hold(96)
    time.sleep(20 * POLL_S)  # long enough for a few polls
    del late
    meter.close()
    (m,) = meter.memory()
    assert m["ended"] == 1  # (`below`: this test's process may hold others' children, a fork server)
    assert m["prelude_peak"] - m["start_rss"] >= 40 * 2 ** 20
    assert m["peak"] - m["mark_rss"] >= 90 * 2 ** 20


def test_a_second_mark_or_end_is_tampering():
    for kinds in ((MARK, MARK), (END, END)):
        meter = SocketMeter(1)
        hand_over(meter.path, 0)
        hand_over(meter.path, 0, kinds[0])
        with pytest.raises(RuntimeError, match="did not take"):
            hand_over(meter.path, 0, kinds[1])
        assert meter.close() is None and "second hand-over" in meter.tampered


def test_no_memory_without_a_mark():
    meter = SocketMeter(1)
    hand_over(meter.path, 0)
    meter.close()
    assert meter.memory() is None


def test_a_process_started_after_the_mark_shows_at_the_end():
    meter = SocketMeter(1)
    hand_over(meter.path, 0)
    hand_over(meter.path, 0, MARK)
    child = subprocess.Popen(["sleep", "30"])  # alive at the end hand-over: the rank's memory is not all its work
    try:
        hand_over(meter.path, 0, END)
    finally:
        child.kill()
        child.wait()
    meter.close()
    assert meter.memory()[0]["below"] >= 1


def test_a_prelude_that_fails_is_the_grader_s_error():
    """The course's reference failing in a counted prelude (here: a case without its parts) is the grader's fault,
    and the student reads so, as for a worker's own exception."""
    import torch.distributed as dist

    from dlo.checks.day5_count import count_worker
    from dlo.grading.frames import GraderError
    from dlo.grading.ranks import rank_payload, run_on_rank, write_shards

    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    meter, shards = SocketMeter(1), write_shards([{}], 1)
    try:
        with pytest.raises(GraderError, match="internal error of the check"):
            run_on_rank(count_worker, (), "zero2", "", rank_payload((None,), {}), shards, meter.path)
    finally:
        meter.close()
        dist.destroy_process_group()
        shutil.rmtree(shards, ignore_errors=True)
