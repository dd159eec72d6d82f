"""How tools (`msd mix`, `msd status`) ask a running coordinator: one request and its answer over a
DEALER socket, with CURVE keys on a secured job, trying a primary and its standbys in turn."""

from __future__ import annotations

from typing import Any

import zmq

from msd_common import protocol as P
from msd_common import security, wire
from msd_common.errors import ProtocolError
from msd_common.sockets import make_socket


class NoAnswer(Exception):
    """No coordinator at the address(es) answered in time (the message names them and why)."""


def ask(address: str, request: P.Message | dict[str, Any], timeout_s: float = 10.0,
        keys_dir: str | None = None) -> P.Message:
    """Send one request (a raw header only where a test sends one unchecked) and return the
    answer. address: one, or a primary and its
    standbys (comma-separated): the one that serves answers (a standby that does not serve has no
    socket bound, so each is given its share of the time). keys_dir: the job's key directory
    (`msd keys generate`), for a job with security.curve."""
    from msd_common.session import split_addresses

    keys = security.tool_keys(keys_dir) if keys_dir else None
    addresses = split_addresses(address)
    silent = []
    for one in addresses:
        answer = _ask_one(one, request, timeout_s / len(addresses), keys)
        if answer is not None:
            return answer
        silent.append(one)
    hint = "" if keys_dir else " (a job with security.curve needs --keys)"
    raise NoAnswer(f"no answer from {', '.join(silent)} within {timeout_s:.0f}s{hint}")


def _ask_one(address: str, request: P.Message | dict[str, Any], timeout_s: float,
             keys: tuple[security.KeyPair, bytes] | None) -> P.Message | None:
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER)
    try:
        if keys is not None:
            security.as_client(sock, *keys)
        sock.connect(address)
        sock.send_multipart(wire.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        try:
            reply = wire.receive(sock.recv_multipart(), P.TOOL_INBOX)
        except ProtocolError as e:
            raise NoAnswer(f"bad answer from {address}: {e}") from None
        return reply
    finally:
        sock.close(linger=0)
        ctx.term()
