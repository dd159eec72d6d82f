"""Relay admission and counters: which relay a hello registers (and which earlier relays it
replaces), the welcome it gets, and what its heartbeats and `relay_up` reports say of it and its
ranks. It returns what to send and whom to forget; the state does the rest (forgetting a relay
forgets its ranks).
"""

from __future__ import annotations

import logging

import numpy as np

from msd_common import protocol as P
from msd_common.protocol import RELAY_LOSS
from msd_common.topology import Topology

from .events import RelayHeartbeat, RelayHello, RelayReport
from .instructions import Send
from .registry import RelayInfo, Registry, TrainerInfo
from .welcome import version_refusal

log = logging.getLogger("msd.coordinator")


class RelayBook:
    def __init__(self, registry: Registry, topology: Topology, heartbeat_s: float) -> None:
        self.registry = registry
        self.topology = topology
        self.heartbeat_s = heartbeat_s

    def _welcome(self, relay: RelayInfo) -> Send:
        return Send(relay.identity, P.RelayWelcome(relay_id=relay.relay_id, heartbeat_s=self.heartbeat_s,
                                           topology=self.topology._asdict()))

    def answer(self, ev: RelayHello) -> list[Send] | None:
        """A refusal, or the welcome of a relay we know saying hello again before our welcome
        reached it (its ranks stay); None: a relay to admit."""
        refusal = version_refusal(ev.version, f"relay on {ev.host}")
        if refusal is not None:
            return [Send(ev.peer, refusal)]
        known = self.registry.relay_at(ev.peer)
        if known is not None and (known.incarnation, known.address) == (ev.incarnation, ev.data_address):
            known.last_seen = ev.at
            return [self._welcome(known)]
        return None

    def replaced(self, ev: RelayHello) -> list[tuple[bytes, str]]:
        """The peers to forget before admitting this relay: its own earlier registration, and an
        earlier relay of its host (started again: its ranks come back through the new one)."""
        out = [(ev.peer, "re-registered")] if ev.peer in self.registry else []
        return out + [(r.identity, "replaced by a new relay on its host") for r in self.registry.relays.values()
                      if (r.host, r.local) == (ev.host, ev.local) and r.identity != ev.peer]

    def admit(self, ev: RelayHello) -> list[Send]:
        relay = self.registry.add_relay(ev.peer, ev.host, ev.data_address, ev.local, ev.at)
        relay.incarnation = ev.incarnation
        log.info("relay %d registered on %s, data address %s", relay.relay_id, ev.host, ev.data_address)
        return [self._welcome(relay)]

    def counters(self, ev: RelayHeartbeat, relay: RelayInfo) -> None:
        """A relay's heartbeat (or report) counts for it and for each rank behind it that it still hears."""
        relay.ranks = [int(r) for r in ev.ranks]
        relay.bytes_in, relay.bytes_out, relay.queued, relay.late_steps = (ev.bytes_in, ev.bytes_out, ev.queued,
                                                                            ev.late_steps)
        trainers = self.registry.trainers
        for r in relay.ranks:
            t = trainers.get(r)
            if t is not None and t.via == relay.relay_id:
                t.last_seen = ev.at

    def losses(self, ev: RelayReport, relay: RelayInfo) -> tuple[np.ndarray, np.ndarray] | None:
        """The training losses of a relay_up (mixture.adapt), the rows of the ranks registered
        through this relay only: its RELAY_LOSS table and summed losses (None without rows). A
        table, not a row each: behind relays the coordinator gets a rank's losses every step."""
        table, sums = ev.losses, ev.loss_sums
        if table is None or not len(table):
            return None
        trainers = self.registry.trainers
        present = set(table[:, RELAY_LOSS.rank].tolist())  # (a set of a few ranks: cheaper than np.unique)
        mine = {r for r in present if (t := trainers.get(r)) is not None and t.via == relay.relay_id}
        if mine != present:
            keep = np.isin(table[:, RELAY_LOSS.rank], list(mine))
            table, sums = table[keep], sums[keep]
        return (table, sums) if len(table) else None

    def consumed(self, ev: RelayReport, relay: RelayInfo) -> list[tuple[TrainerInfo, int, float]]:
        """The `consumed` of a relay_up, each as its rank's own message would be (for the ranks
        registered through this relay only): (rank, step, seconds waited)."""
        self.counters(ev, relay)
        trainers = self.registry.trainers
        rows = ev.consumed
        out = []
        for rank, step, waited in zip(rows[:, 0].tolist(), rows[:, 1].tolist(), ev.waited_s.tolist()):
            t = trainers.get(rank)
            if t is not None and t.via == relay.relay_id:
                out.append((t, step, waited))
        return out
