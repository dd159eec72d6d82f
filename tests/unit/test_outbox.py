"""The worker's outbox with real ZeroMQ sockets on loopback: a send to a rank whose socket is full
(here: not there, with a high-water mark of 1 message) never blocks; what waits goes out in
order once the rank reads; a released rank's backlog is dropped."""

import time

import zmq

from msd.testing.ports import free_address
from msd_common.sockets import make_socket
from msd_common.outbox import RankOutbox


def test_sends_never_block_and_the_backlog_goes_out_in_order_once_the_rank_is_there():
    ctx = zmq.Context()
    polled: dict = {}
    outbox = RankOutbox(lambda a: _connected(ctx, a), lambda sock, on: polled.__setitem__(sock, on))
    address = free_address()  # nobody listens there yet
    started = time.monotonic()
    for i in range(5):
        outbox.send(address, [str(i).encode()], copy=True)
    assert time.monotonic() - started < 0.5, "a send waited for the rank"
    assert outbox.backlog() >= 3 and outbox.waits == 1  # the socket's own queue holds one or two
    [sock] = [s for s, on in polled.items() if on]  # the loop is asked to poll it for POLLOUT
    rank = make_socket(ctx, zmq.PULL)
    rank.bind(address)
    deadline = time.monotonic() + 5
    while outbox.backlog() and time.monotonic() < deadline:
        if sock.poll(100, zmq.POLLOUT):
            outbox.flush(sock)
    assert outbox.backlog() == 0 and polled[sock] is False
    got = [rank.recv_multipart()[0] for _ in range(5)]
    assert got == [b"0", b"1", b"2", b"3", b"4"]
    outbox.close()
    rank.close(linger=0)
    ctx.term()


def test_a_released_rank_drops_what_waits_for_it():
    ctx = zmq.Context()
    outbox = RankOutbox(lambda a: _connected(ctx, a), lambda sock, on: None)
    address = free_address()
    outbox.send(address, [b"x"], copy=True)
    outbox.send(address, [b"y"], copy=True)
    outbox.send(address, [b"z"], copy=True)
    assert outbox.release(address) >= 1
    assert outbox.backlog() == 0 and address not in outbox.sockets
    outbox.close()
    ctx.term()


def _connected(ctx, address: str) -> zmq.Socket:
    sock = make_socket(ctx, zmq.PUSH, hwm=1)
    sock.connect(address)
    return sock
