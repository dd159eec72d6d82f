"""CURVE encryption and authentication of every connection (ZeroMQ's CurveZMQ, via pyzmq).

`msd keys generate DIR` writes one key pair per role - `coordinator`, `worker`, `trainer` - as
ZeroMQ certificate files (`ROLE.key` public, `ROLE.key_secret` secret) and copies the worker
and trainer public keys into `DIR/authorized/`. Servers (the coordinator's ROUTER, each
trainer's data PULL) accept only clients whose public key is in `authorized/`; clients
(workers, trainers) know the server's public key. A process outside the job, or one given
another key set, completes no handshake: it cannot register, send or receive anything.

Key directories hold secrets: give each host only the secret key of its role.
"""

from __future__ import annotations

import os
import shutil
from typing import NamedTuple

import zmq
import zmq.auth

ROLES = ("coordinator", "worker", "trainer")
AUTHORIZED = "authorized"


class KeyPair(NamedTuple):
    public: bytes
    secret: bytes


def generate(directory: str) -> list[str]:
    """Create the key pairs of every role and the authorized list; returns the files written.
    Refuses to overwrite existing keys."""
    os.makedirs(directory, exist_ok=True)
    for role in ROLES:
        if os.path.exists(os.path.join(directory, f"{role}.key_secret")):
            raise FileExistsError(f"{directory}: keys exist already (remove them to make new ones)")
    written = []
    authorized = os.path.join(directory, AUTHORIZED)
    os.makedirs(authorized, exist_ok=True)
    for role in ROLES:
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
