"""CURVE encryption and authentication of every connection (ZeroMQ's CurveZMQ, via pyzmq).

`msd keys generate DIR` writes one key pair per role - `coordinator`, `worker`, `trainer`,
`operator` - as ZeroMQ certificate files (`ROLE.key` public, `ROLE.key_secret` secret) and copies
the worker, trainer and operator public keys into `DIR/authorized/`. The operator's key is the
one for tools (`msd mix`, `msd status`): the coordinator takes requests that change the plan only
from a key whose authorised file is named `operator*.key`; any authorised key may read status. Servers (the
coordinator's ROUTER, each
trainer's data PULL) accept only clients whose public key is in `authorized/`; clients
(workers, trainers) know the server's public key. A process outside the job, or one given
another key set, completes no handshake: it cannot register, send or receive anything.

Key directories hold secrets: give each host only the secret key of its role.
"""

from __future__ import annotations

import os
import shutil
import logging
from typing import Any, NamedTuple

import zmq
import zmq.auth

ROLES = ("coordinator", "worker", "trainer", "operator")
TOOL_ROLES = ("operator", "trainer", "worker")  # the key a tool uses, first found
AUTHORIZED = "authorized"


class KeyPair(NamedTuple):
    public: bytes
    secret: bytes


def generate(directory: str) -> list[str]:
    """Create the key pairs of every role and the authorized list; returns the files written.
    Existing keys are kept: a key set made before operator keys existed gets its operator pair
    added; one that has every role is refused."""
    os.makedirs(directory, exist_ok=True)
    missing = [role for role in ROLES if not os.path.exists(os.path.join(directory, f"{role}.key_secret"))]
    if not missing:
        raise FileExistsError(f"{directory}: keys exist already (remove them to make new ones)")
    written = []
    authorized = os.path.join(directory, AUTHORIZED)
    os.makedirs(authorized, exist_ok=True)
    for role in missing:
        public, secret = zmq.auth.create_certificates(directory, role)
        os.chmod(secret, 0o600)
        written += [public, secret]
        if role != "coordinator":
            shutil.copy(public, os.path.join(authorized, f"{role}.key"))
            written.append(os.path.join(authorized, f"{role}.key"))
    return written


def load(directory: str, role: str) -> KeyPair:
    """The role's key pair (the secret file holds both keys)."""
    public, secret = zmq.auth.load_certificate(os.path.join(directory, f"{role}.key_secret"))
    if secret is None:
        raise ValueError(f"{directory}/{role}.key_secret holds no secret key")
    return KeyPair(public, secret)


def public_key(directory: str, role: str) -> bytes:
    return zmq.auth.load_certificate(os.path.join(directory, f"{role}.key"))[0]


def tool_keys(directory: str) -> tuple[KeyPair, bytes]:
    """The key pair a tool speaks with (the operator's if the directory holds it, else a trainer's
    or a worker's: those may read status only) and the coordinator's public key."""
    for role in TOOL_ROLES:
        if os.path.exists(os.path.join(directory, f"{role}.key_secret")):
            return load(directory, role), public_key(directory, "coordinator")
    raise FileNotFoundError(f"{directory}: no operator.key_secret (nor a trainer's or worker's); "
                            "`msd keys generate` makes the operator pair")


def operator_ids(directory: str) -> frozenset[str]:
    """The ZAP user ids (z85 public keys, as certificate files hold them) of the operator keys
    authorised in `directory`."""
    folder = os.path.join(directory, AUTHORIZED)
    ids = set()
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
        if name.startswith("operator") and name.endswith(".key"):
            ids.add(zmq.auth.load_certificate(os.path.join(folder, name))[0].decode("ascii"))
    return frozenset(ids)


def as_server(sock: zmq.Socket, keys: KeyPair) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def as_client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> None:
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public


def start_authenticator(ctx: zmq.Context, directory: str):
    """A ZAP handler in this process that admits the public keys of `directory/authorized/`."""
    from zmq.auth.thread import ThreadAuthenticator

    # a plain context sharing the same libzmq context (ZAP is per libzmq context), so that this
    # also works for an asyncio context
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve(domain="*", location=os.path.join(directory, AUTHORIZED))
    return auth


_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the coordinator refused this process's key (it is not among the job's authorised "
                                     "keys)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "the two sides disagree on security (one uses CURVE, the other does not)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the security handshake failed (a plain peer meeting a CURVE one, or keys "
                                          "of another job)",
}
_CLOSED_IN_HANDSHAKE = ("the coordinator closed the connection during the security handshake (a plain peer meeting a "
                        "CURVE one, or keys of another job)")
REFUSED_AFTER = 3  # consecutive failed handshakes: one may be a connection cut mid-handshake, three are a refusal
# The peer's own answer, never a cut connection, and libzmq does not connect again after it (a
# protocol error ends the session): one is a refusal. Counted as one of three, a plain client
# that saw the mismatch itself (before the coordinator closed) stopped at two and waited forever.
_REFUSALS = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)


class HandshakeWatch:
    """Watches a connecting socket's handshakes (a ZeroMQ monitor). A peer that refuses ours
    (CURVE keys missing or of another job) is silent otherwise: without this, a misconfigured
    worker or trainer would wait for data that never comes."""

    def __init__(self, sock: zmq.Socket) -> None:
        events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                  | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                  | zmq.EVENT_DISCONNECTED)
        self.socket = sock.get_monitor_socket(events=events)
        self._sock = sock
        self.failures = 0
        self.last_failure = ""
        self._handshook = False  # the current connection completed its handshake
        self._broken = False  # a connection that had completed its handshake closed since broke() was asked

    def refused(self) -> str | None:
        """Read the pending events; the reason if the peer has refused us REFUSED_AFTER times in a row."""
        from zmq.utils.monitor import recv_monitor_message

        while self.socket.poll(0):
            event = recv_monitor_message(self.socket)["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failures, self._handshook = 0, True
            elif event in _FAILED:
                self.failures += REFUSED_AFTER if event in _REFUSALS else 1
                self.last_failure = _FAILED[event]
            elif event == zmq.EVENT_DISCONNECTED:
                # Which side notices a mismatch first depends on timing: often the peer just
                # closes the connection before ours reports a failed handshake.
                if not self._handshook:
                    self.failures += 1
                    self.last_failure = self.last_failure or _CLOSED_IN_HANDSHAKE
                else:
                    self._broken = True
                self._handshook = False
        return self.last_failure if self.failures >= REFUSED_AFTER else None

    def broke(self) -> bool:
        """Whether a connection that was up has closed since the last call (after refused() read the
        events). ZeroMQ reconnects by itself, but what was on its way in either direction is lost:
        the peer says hello again (session.LOST_MESSAGES), and the coordinator re-sends what it had
        in flight."""
        broken, self._broken = self._broken, False
        return broken

    def close(self) -> None:
        self._sock.disable_monitor()
        self.socket.close(linger=0)


def operator_refusal(operators: set | None, header: dict[str, Any], frame: Any) -> Any:
    """The answer to a control request (msd mix) from a key that is not an operator's, in a CURVE
    job (operators: the ZAP user ids of the operator keys; None: not a CURVE job); None: served."""
    from . import protocol as P

    if operators is None or header["type"] not in P.CONTROL_REQUESTS:
        return None
    user = frame.get("User-Id")
    if user in operators:
        return None
    logging.getLogger("msd.coordinator").warning("refused %s from a key that is not an operator's (%s...)",
                                                 header["type"], user[:8])
    return P.MixReply(ok=0, at_step=int(header.get("at_step", 0)),
                      reason="changes to the plan are taken only from an operator key (msd keys generate makes one; "
                             "pass --keys)")
