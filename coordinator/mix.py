"""`msd mix`: ask a running coordinator to use new mixture weights from a later step on."""

from __future__ import annotations

import zmq

from trainer_client import protocol as P
from trainer_client import wire
from trainer_client.errors import ProtocolError
from trainer_client.sockets import make_socket


def parse_weights(items: tuple[str, ...]) -> dict[str, float]:
    """["web=0.5", "code=0.5"] -> {"web": 0.5, "code": 0.5}; ValueError naming the bad item."""
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: expected SOURCE=WEIGHT")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return weights


def request_mix(address: str, at_step: int, weights: dict[str, float], timeout_s: float = 10.0) -> tuple[bool, str]:
    """Send the change and wait for the coordinator's answer: (accepted, reason if not).
    address: one, or a primary and its standbys (comma-separated): the one that serves answers
    (a standby that does not serve has no socket bound, so each is given its share of the time)."""
    from trainer_client.session import split_addresses

    addresses = split_addresses(address)
    silent = []
    for one in addresses:
        answer = _ask(one, at_step, weights, timeout_s / len(addresses))
        if answer is not None:
            return answer
        silent.append(one)
    return False, f"no answer from {', '.join(silent)} within {timeout_s:.0f}s"


def _ask(address: str, at_step: int, weights: dict[str, float], timeout_s: float) -> tuple[bool, str] | None:
    ctx = zmq.Context()
    sock = make_socket(ctx, zmq.DEALER)
    try:
        sock.connect(address)
        sock.send_multipart(wire.encode(P.make(P.MIX_REQUEST, at_step=at_step, weights=weights)))
        if not sock.poll(int(timeout_s * 1000)):
            return None
        try:
            reply, _ = wire.decode(sock.recv_multipart(), P.TOOL_INBOX)
        except ProtocolError as e:
            return False, f"bad answer from {address}: {e}"
        return bool(reply["ok"]), reply["reason"]
    finally:
        sock.close(linger=0)
        ctx.term()
