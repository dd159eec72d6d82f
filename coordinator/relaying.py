"""The shell's side of relays: their ranks' messages in, the coordinator's messages to them out.

A relay (`msd relay`, relay/process.py) speaks for the ranks of its host on one
connection. Up, its `relay_up` carries its ranks' messages; each is checked as if the rank had
sent it and becomes the same event, from an identity of its own (`relay identity / rank`), so the
state treats a relayed rank as any other (it knows it by `TrainerInfo.via`). Down, what the state
sends to such an identity is gathered per relay into one `relay_down` per pass of the event loop,
so the coordinator sends a message per host, not per rank.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError

from .events import PeerEvent, RelayReport, from_message

log = logging.getLogger("msd.coordinator")


def relayed_identity(relay: bytes, rank: int) -> bytes:
    """The identity a rank behind `relay` has at the coordinator (longer than any ZMQ identity)."""
    return relay + b"/" + rank.to_bytes(4, "big")


class RelayEnvelopes:
    def __init__(self) -> None:
        # relayed identity -> (relay identity, rank); kept for the job (a few per rank and relay incarnation)
        self._relay_of: dict[bytes, tuple[bytes, int]] = {}
        self._out: dict[bytes, list] = {}  # relay identity -> (rank, header, arrays) waiting

    def unpack(self, relay: bytes, at: float, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[PeerEvent]:
        """The events of a `relay_up`: each message checked as the rank's own would be, then its
        ranks' `consumed` as one event."""
        out: list[PeerEvent] = []
        for inner in header["messages"]:
            try:
                P.validate(inner, P.TRAINER_UP, 0)
            except ProtocolError as e:
                log.warning("dropped a message relayed by %s: %s", relay.hex(), e)
                continue
            peer = relayed_identity(relay, inner["rank"])
            self._relay_of[peer] = (relay, inner["rank"])
            out.append(from_message(peer, at, inner, {}, via=relay))
        out.append(RelayReport(peer=relay, at=at, **{name: header[name] for name in P.RelayUp.KIND.fields
                                                     if name != "messages"}, **arrays))
        return out

    def relayed(self, peer: bytes) -> bool:
        return peer in self._relay_of

    def waiting_for(self, relay: bytes) -> bool:
        """Whether messages to this relay's ranks wait to go out (before anything to the relay itself)."""
        return relay in self._out

    def add(self, peer: bytes, message: P.Message) -> None:
        relay, rank = self._relay_of[peer]
        self._out.setdefault(relay, []).append((rank, message))

    def take(self, relay: bytes | None = None) -> list[tuple[bytes, list]]:
        """(relay identity, frames of its relay_down) for every relay with messages waiting (or one)."""
        relays = [relay] if relay is not None else list(self._out)
        return [(r, wire.encode(relay_down(self._out.pop(r)))) for r in relays]


def relay_down(parts: list[tuple[int, P.Message]]) -> P.RelayDown:
    """A `relay_down` carrying messages (rank, message) to a relay's ranks; the arrays as
    wire.encode would send them (the spec's dtype, C order)."""
    entries, frames = [], []
    for rank, message in parts:
        sizes = []
        header = message.header()
        for spec, a in zip(message.KIND.arrays, message.frames()):
            a = np.ascontiguousarray(a, dtype=spec.dtype or header["dtype"])
            sizes.append(a.nbytes)
            frames.append(memoryview(a).cast("B") if a.size else b"")
        entries.append([rank, header, sizes])
    blob = np.frombuffer(b"".join(frames), dtype=np.uint8) if frames else np.zeros(0, np.uint8)
    return P.RelayDown(parts=entries, blob=blob)
