"""Who is connected: workers, trainer ranks, worker host agents and relays, by id and by socket identity.

Part of the coordinator's state (no sockets, no clock: times come from events). A peer is known
from its hello until it leaves, is declared dead or registers again; a message from an identity
the registry does not know is answered with `unknown_peer`.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Iterable, Literal

Role = Literal["worker", "trainer", "host", "relay"]


@dataclass
class WorkerInfo:
    worker_id: int
    identity: bytes
    last_seen: float
    agent: int = 0  # its host agent's id
    pid: int = 0
    busy_s: float = 0.0  # total time it reports busy (heartbeats)
    backlog: int = 0  # piece messages waiting for a rank's socket (heartbeats)
    send_waits: int = 0  # sends that found a rank's socket full (heartbeats)
    busy_share: float = 0.0  # share of the time between its last two heartbeats it was busy
    busy_at: float | None = None  # when busy_s was last reported


@dataclass
class TrainerInfo:
    rank: int
    identity: bytes
    address: str  # its data socket, where workers push its pieces
    last_seen: float
    consumed: int = -1  # last step this rank has fully consumed
    waited_s: float = 0.0  # total time its trainer waited for data (reported with `consumed`)
    via: int | None = None  # the relay it speaks through (its relay_id); None: direct
    incarnation: int = 0  # of its client (a process started again says hello with another)


@dataclass
class RelayInfo:
    relay_id: int
    identity: bytes
    host: str
    address: str  # its data socket, where workers push the pieces of all its ranks
    local: str  # the endpoint its ranks reach it at, on its host
    last_seen: float
    ranks: list[int] = field(default_factory=list)  # alive behind it (its last heartbeat)
    bytes_in: int = 0
    bytes_out: int = 0
    queued: int = 0
    late_steps: int = 0
    incarnation: int = 0  # of its process (one started again says hello with another)


@dataclass
class HostInfo:
    agent_id: int
    identity: bytes
    host: str
    procs: int
    min_procs: int
    max_procs: int
    auto: bool
    last_seen: float
    retiring: set[int] = field(default_factory=set)  # worker ids being emptied before a stop


class Registry:
    def __init__(self) -> None:
        self.workers: dict[int, WorkerInfo] = {}
        self.trainers: dict[int, TrainerInfo] = {}
        self.hosts: dict[int, HostInfo] = {}
        self.relays: dict[int, RelayInfo] = {}
        self.next_relay_id = 0
        self._roles: dict[bytes, tuple[Role, int]] = {}  # socket identity -> (role, id)
        self.next_worker_id = 0
        # how many ranks have consumed up to each step (a few distinct steps): the slowest rank's
        # step without a pass over all ranks (O(ranks^2) per step at a thousand ranks)
        self._at_step: collections.Counter[int] = collections.Counter()
        self._floor: int | None = None
        self._present: tuple[set[int], bool] | None = None  # all_present's answer, until ranks change
        # changes whenever a rank registers or is forgotten: what is derived from who the ranks
        # are and how they are reached (a step's routing) is kept until it changes
        self.ranks_generation = 0

    def slowest(self) -> int:
        """The lowest consumed step over the registered ranks (-1 without any)."""
        if self._floor is None and self._at_step:
            self._floor = min(self._at_step)
        return self._floor if self._floor is not None else -1

    def all_present(self, ranks: set[int]) -> bool:
        """Whether every one of `ranks` is registered (remembered until a rank comes or goes)."""
        if self._present is None or self._present[0] is not ranks:
            self._present = (ranks, ranks <= self.trainers.keys())
        return self._present[1]

    def consumed(self, rows: Iterable[tuple[TrainerInfo, int, float]], last: int) -> int:
        """Ranks' `consumed` reports, (rank, step, seconds waited) each, a step counted up to `last`
        and never back; returns the furthest step of these ranks (-1 without any). One pass for
        all, and the counts of ranks per step changed once per step: a relay's ranks come
        together, a few thousand a step at DP 4,096."""
        furthest, olds, news = -1, [], []
        for trainer, step, waited_s in rows:
            step = min(step, last)
            if step > trainer.consumed:
                olds.append(trainer.consumed)
                news.append(step)
                trainer.consumed = step
            furthest = max(furthest, trainer.consumed)
            if waited_s > trainer.waited_s:
                trainer.waited_s = waited_s
        if len(news) == 1:  # a rank's own message
            self._count(news[0], 1)
            self._count(olds[0], -1)
        elif news:
            for step, n in collections.Counter(news).items():
                self._count(step, n)
            for step, n in collections.Counter(olds).items():
                self._count(step, -n)
        return furthest

    def _count(self, step: int, n: int) -> None:
        left = self._at_step[step] = self._at_step[step] + n
        if left <= 0:
            del self._at_step[step]
            if step == self._floor:
                self._floor = None
        elif self._floor is not None and step < self._floor:
            self._floor = step

    def lookup(self, identity: bytes) -> tuple[Role, int] | None:
        return self._roles.get(identity)

    def __contains__(self, identity: bytes) -> bool:
        return identity in self._roles

    def add_worker(self, identity: bytes, at: float, agent: int, pid: int) -> WorkerInfo:
        wid = self.next_worker_id
        self.next_worker_id += 1
        worker = self.workers[wid] = WorkerInfo(wid, identity, at, agent, pid)
        self._roles[identity] = ("worker", wid)
        return worker

    def worker_by_pid(self, agent: int, pid: int) -> WorkerInfo | None:
        """The registered worker that this host agent started as process pid."""
        return next((w for w in self.workers.values() if w.agent == agent and w.pid == pid), None)

    def add_trainer(self, info: TrainerInfo) -> None:
        """Register a rank; a previous holder of the rank (another identity) is forgotten."""
        old = self.trainers.get(info.rank)
        if old is not None and old.identity != info.identity:
            self._roles.pop(old.identity, None)
        if old is not None:
            self._count(old.consumed, -1)
        self.trainers[info.rank] = info
        self._count(info.consumed, 1)
        self._roles[info.identity] = ("trainer", info.rank)
        self._present = None
        self.ranks_generation += 1

    def add_host(self, info: HostInfo) -> None:
        """Register a host agent; an earlier registration of the same agent is replaced."""
        old = self.hosts.pop(info.agent_id, None)
        if old is not None:
            self._roles.pop(old.identity, None)
        self.hosts[info.agent_id] = info
        self._roles[info.identity] = ("host", info.agent_id)

    def add_relay(self, identity: bytes, host: str, address: str, local: str, at: float) -> RelayInfo:
        relay = self.relays[self.next_relay_id] = RelayInfo(self.next_relay_id, identity, host, address, local, at)
        self.next_relay_id += 1
        self._roles[identity] = ("relay", relay.relay_id)
        return relay

    def relay_at(self, identity: bytes) -> RelayInfo | None:
        """The registered relay with this socket identity."""
        entry = self._roles.get(identity)
        return self.relays.get(entry[1]) if entry is not None and entry[0] == "relay" else None

    def remove(self, identity: bytes) -> tuple[Role, WorkerInfo | TrainerInfo | HostInfo | RelayInfo | None] | None:
        """Forget a peer: (role, its record), or None for an identity nobody holds."""
        entry = self._roles.pop(identity, None)
        if entry is None:
            return None
        role, pid = entry
        table = {"worker": self.workers, "trainer": self.trainers, "host": self.hosts, "relay": self.relays}[role]
        gone = table.pop(pid, None)
        if role == "trainer":
            self._present = None
            self.ranks_generation += 1
            if gone is not None:
                self._count(gone.consumed, -1)
        return role, gone

    def forget_workers(self) -> list[WorkerInfo]:
        """Forget every worker at once (the plan was rewound); returns them."""
        gone = list(self.workers.values())
        for w in gone:
            self._roles.pop(w.identity, None)
        self.workers.clear()
        return gone

    def silent(self, now: float, deadline_s: float,
               host_deadline_s: float | None = None) -> list[tuple[Role,
                                                                   WorkerInfo | TrainerInfo | HostInfo | RelayInfo]]:
        """Peers not heard from for longer than the deadline (host agents: their own deadline)."""
        host_deadline_s = deadline_s if host_deadline_s is None else host_deadline_s
        out: list = [("worker", w) for w in self.workers.values() if now - w.last_seen > deadline_s]
        out += [("trainer", t) for t in self.trainers.values() if now - t.last_seen > deadline_s]
        out += [("host", h) for h in self.hosts.values() if now - h.last_seen > host_deadline_s]
        out += [("relay", r) for r in self.relays.values() if now - r.last_seen > deadline_s]
        return out
