"""The delivery book: one record per `deliver` sent to a worker, from sending until it is done.

A delivery asks one worker to send some pieces of one step to their ranks. Its states:

- SENT: the worker was asked and has not acknowledged yet;
- ACKED: the worker acknowledged, meaning its sockets queued the pieces, not that they arrived
  (a worker killed right after its ack loses what was still queued), so the record is kept
  until every one of its ranks has consumed the step;
- ORPHANED: its worker died while it was SENT or ACKED; it waits to be sent again, from
  copies that live workers hold (in step order: see `orphans`);
- DONE: its ranks consumed the step, or it was sent again as new deliveries, or the plan was
  rewound. A done delivery leaves the book.

Part of the coordinator's state: no sockets, no clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


class DeliveryState(enum.Enum):
    SENT = "sent"
    ACKED = "acknowledged"
    ORPHANED = "orphaned"


@dataclass
class Delivery:
    delivery_id: int
    worker_id: int
    step: int
    items: np.ndarray  # protocol.DELIVER_ITEM rows, as sent
    positions: np.ndarray  # [source, stream position] of each item's record
    release: np.ndarray  # [source, position] of prepared copies this delivery uses up
    ranks: list[int] = field(default_factory=list)  # the ranks it sends to
    state: DeliveryState = DeliveryState.SENT
    # the registry's ranks_generation when it was opened, if all its ranks were registered then:
    # while no rank has come or gone since, each of them has consumed at least the slowest step
    registered: int | None = None

    def needs(self) -> set[tuple[int, int]]:
        """The (source, position) of every prepared copy it reads or releases."""
        return {tuple(p) for p in self.positions.tolist()} | {tuple(p) for p in self.release.tolist()}


class DeliveryBook:
    def __init__(self) -> None:
        self._live: dict[int, Delivery] = {}  # every delivery not done, by id
        self._by_worker: dict[int, set[int]] = {}  # SENT and ACKED ones, by worker
        self.orphaned = 0  # how many are ORPHANED
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._live)

    def open(self, worker_id: int, step: int, items: np.ndarray, positions: np.ndarray,
             release: np.ndarray, ranks: list[int], registered: int | None = None) -> Delivery:
        """A delivery about to be sent to `worker_id` (SENT); registered: see Delivery."""
        d = Delivery(self._next_id, worker_id, step, items, positions, release, ranks, registered=registered)
        self._next_id += 1
        self._live[d.delivery_id] = d
        self._by_worker.setdefault(worker_id, set()).add(d.delivery_id)
        return d

    def acknowledge(self, delivery_id: int, worker_id: int) -> Delivery | None:
        """SENT -> ACKED, when the ack comes from the delivery's worker; None otherwise (an
        unknown, repeated or stale ack)."""
        d = self._live.get(delivery_id)
        if d is None or d.worker_id != worker_id or d.state is not DeliveryState.SENT:
            return None
        d.state = DeliveryState.ACKED
        return d

    def orphan(self, worker_id: int) -> tuple[list[Delivery], list[Delivery]]:
        """The worker is gone: its SENT and ACKED deliveries become ORPHANED. Returns (those that
        were SENT, those that were ACKED), each in id order."""
        sent, acked = [], []
        for did in sorted(self._by_worker.pop(worker_id, ())):
            d = self._live[did]
            (acked if d.state is DeliveryState.ACKED else sent).append(d)
            d.state = DeliveryState.ORPHANED
        self.orphaned += len(sent) + len(acked)
        return sent, acked

    def orphans(self) -> list[Delivery]:
        """ORPHANED deliveries in step order (then id): the order they must be sent again in."""
        return sorted((d for d in self._live.values() if d.state is DeliveryState.ORPHANED),
                      key=lambda d: (d.step, d.delivery_id))

    def replaced(self, d: Delivery) -> None:
        """ORPHANED -> DONE: it was sent again (as new deliveries)."""
        assert d.state is DeliveryState.ORPHANED
        del self._live[d.delivery_id]
        self.orphaned -= 1

    def finish_consumed(self, consumed: Callable[[int], int], slowest: int | None = None,
                        generation: int | None = None) -> int:
        """ACKED -> DONE for every delivery whose ranks have all consumed its step;
        consumed(rank) is the last step that rank consumed (-1 for a rank not registered);
        slowest, if given, the lowest of those over the registered ranks: a delivery of a later
        step is skipped without asking each of its ranks (called once per burst of messages, the
        per-rank check made a step O(ranks^2)), and one of an earlier step opened at the
        registry's ranks `generation` with all its ranks registered is done without asking them
        either. Returns how many were done."""
        def finished(d: Delivery) -> bool:
            if slowest is None:
                return all(consumed(r) >= d.step for r in d.ranks)
            if d.step > slowest:
                return False
            return (generation is not None and d.registered == generation) or all(consumed(r) >= d.step
                                                                                  for r in d.ranks)

        done = [d for d in self._live.values() if d.state is DeliveryState.ACKED and finished(d)]
        for d in done:
            del self._live[d.delivery_id]
            mine = self._by_worker.get(d.worker_id)
            if mine is not None:
                mine.discard(d.delivery_id)
                if not mine:
                    del self._by_worker[d.worker_id]
        return len(done)

    def holds(self, worker_id: int) -> bool:
        """Whether the worker has a delivery that is not done (SENT or ACKED)."""
        return bool(self._by_worker.get(worker_id))

    def floors(self, n_sources: int) -> list[int | None]:
        """Per source, the lowest stream position a live delivery refers to (None: none)."""
        out: list[int | None] = [None] * n_sources
        for d in self._live.values():
            for rows in (d.positions, d.release):
                if not len(rows):
                    continue
                for s in np.unique(rows[:, 0]).tolist():
                    low = int(rows[rows[:, 0] == s, 1].min())
                    out[s] = low if out[s] is None else min(out[s], low)
        return out

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in DeliveryState}
        for d in self._live.values():
            out[d.state.value] += 1
        return out

    def clear(self) -> None:
        """Every delivery is done (the plan was rewound: its steps come again)."""
        self._live.clear()
        self._by_worker.clear()
        self.orphaned = 0
