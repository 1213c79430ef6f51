"""The socket meter (`dlo.grading.meter`): the bytes a rank's TCP sockets send, read by the launcher.

Without ranks: this process plays a rank (a TCP connection to itself), hands its sockets over, sends,
and the meter's count follows the kernel's; a second hand-over claiming the rank is tampering.
"""

from __future__ import annotations

import socket

import pytest

from dlo.grading.meter import SocketMeter, hand_over

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
