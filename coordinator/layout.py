"""A planned step as messages: its step headers (one per rank served directly, one `relay_step` per
relay for its ranks), and its deliveries (one `deliver` per worker holding any of its pieces).
It returns the messages (`Send` instructions); the state sends them, in order.

Every piece goes once to each global rank that receives its DP rank's part of the plan, and once
per relay for all its ranks of one DP rank (the relay passes it on to each). A header's plan
summary is O(1): this rank's costs and the step's balance, never every rank's (that would make
each step O(DP^2) to encode).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from msd_common import protocol as P
from msd_common.doc_keys import doc_key
from msd_common.protocol import DELIVER_ITEM
from msd_common.topology import Topology

from .deliveries import DeliveryBook
from .instructions import Send
from .plan import LENGTH, OFFSET, POSITION, RECORD, SOURCE, StepPlan
from .positions import NOBODY, PositionTables
from .registry import Registry


def rows_of(edges: np.ndarray, dps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The plan's piece rows of each DP rank in `dps`, one after another (edges: where each DP rank's
    rows start), and each row's index within its DP rank's recipe."""
    starts = edges[dps]
    sizes = edges[dps + 1] - starts
    within = np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    return within + np.repeat(starts, sizes), within


@dataclass(frozen=True)
class RelayGroup:
    """A relay's ranks, as its relay_step names them: the DP ranks it gets recipes of, and each rank
    with the index of its DP rank among those."""

    via: int  # the relay's id
    dps: list[int]
    at: np.ndarray  # dps as an index array
    ranks: list[list[int]]  # [rank, index into dps]
    contiguous: bool  # consecutive DP ranks (a host's usually are): the plan's rows as one slice

    @staticmethod
    def of(via: int, members: list[tuple[int, int]]) -> "RelayGroup":
        dps = sorted({d for _, d in members})
        index = {d: i for i, d in enumerate(dps)}
        return RelayGroup(via, dps, np.asarray(dps, dtype=np.int64), [[r, index[d]] for r, d in members],
                          dps[-1] - dps[0] + 1 == len(dps))


@dataclass(frozen=True)
class Routes:
    """How a step reaches the registered ranks: a step_header to each direct rank (rank, DP rank,
    identity), a relay_step to each relay, and pieces to the delivery ranks (with their DP ranks)."""

    direct: list[tuple[int, int, bytes]]
    relayed: list[RelayGroup]
    delivery_ranks: np.ndarray  # uint64
    delivery_dps: np.ndarray  # int64


class StepLayout:
    def __init__(self, topology: Topology, registry: Registry, tables: PositionTables, deliveries: DeliveryBook,
                 num_records: list[int]) -> None:
        self.topology = topology
        self.dp = topology.dp
        self.receivers = set(topology.receivers())  # global ranks that get data
        self.registry = registry
        self.tables = tables
        self.deliveries = deliveries
        self.num_records = num_records
        self._dp_of: dict[int, int] = {}  # global rank -> its data-parallel rank (coords, computed once)
        self._routing: tuple[int, Routes] | None = None  # (registry.ranks_generation, the routes then)
        # (registry.ranks_generation, registered ranks sorted, the index of each one's data address, addresses)
        self._addressing: tuple[int, np.ndarray, np.ndarray, list[str]] | None = None

    def dp_rank(self, rank: int) -> int:
        """A global rank's data-parallel rank (its coordinates, computed once)."""
        d = self._dp_of.get(rank)
        if d is None:
            d = self._dp_of[rank] = self.topology.coords(rank).dp
        return d

    def step(self, plan: StepPlan, balance: tuple[float, float]) -> list[Send]:
        """Every message of a planned step: headers first, then its deliveries."""
        t = plan.pieces
        refs = np.column_stack([doc_key(t[:, SOURCE], t[:, RECORD]), t[:, OFFSET].astype(np.uint64),
                                t[:, LENGTH].astype(np.uint64)])  # protocol.RECIPE_PIECE rows
        bounds = np.searchsorted(plan.rank, np.arange(self.dp + 1)).tolist()
        counts = np.zeros((self.dp, plan.rows_per_rank), dtype=np.int64)  # pieces per sequence of each rank
        np.add.at(counts, (plan.rank, plan.row), 1)
        routes = self._routes()
        # as Python floats: indexing a numpy array gives a numpy scalar per rank, slower to pack too
        rank_costs = np.asarray(plan.rank_costs, dtype=np.float64).tolist()
        naive_costs = np.asarray(plan.naive_rank_costs, dtype=np.float64).tolist()
        edges = np.asarray(bounds, dtype=np.int64)
        out: list[Send] = [Send(identity, P.step_header(plan.step, rank, plan.row_capacity, *balance, rank_costs[d],
                                                        naive_costs[d], refs[bounds[d]:bounds[d + 1]], counts[d]))
                           for rank, d, identity in routes.direct]
        costs = (np.asarray(rank_costs, dtype=np.float64), np.asarray(naive_costs, dtype=np.float64))
        relays = self.registry.relays
        out += [self._relay_step(relays[group.via].identity, group, plan, refs, counts, edges, costs, balance)
                for group in routes.relayed]
        piece, within = rows_of(edges, routes.delivery_dps)
        sizes = edges[routes.delivery_dps + 1] - edges[routes.delivery_dps]
        items = np.column_stack([np.repeat(routes.delivery_ranks, sizes), within.astype(np.uint64),
                                 refs[piece]])  # DELIVER_ITEM rows
        return out + self.deliver(plan.step, items, t[piece][:, [SOURCE, POSITION]], plan.finished)

    def _routes(self) -> "Routes":
        """How this step's messages reach the ranks, made again only when a rank registers or is
        forgotten: a step only cuts the plan into its parts, with no pass in Python over every rank."""
        if self._routing is not None and self._routing[0] == self.registry.ranks_generation:
            return self._routing[1]
        trainers = self.registry.trainers
        ranks = sorted(self.receivers | (trainers.keys() - self.receivers))  # (optional metadata-only stages too)
        direct, members = [], {}  # members: relay -> [(rank, DP rank)], a relay_step each
        for rank in ranks:
            d = self.dp_rank(rank)
            trainer = trainers[rank]
            if trainer.via is None:
                direct.append((rank, d, trainer.identity))
            else:
                members.setdefault(trainer.via, []).append((rank, d))
        delivery = self._delivery_ranks(ranks)
        routes = Routes(direct, [RelayGroup.of(via, m) for via, m in members.items()],
                        np.array(delivery, dtype=np.uint64), np.array([self._dp_of[r] for r in delivery], np.int64))
        self._routing = (self.registry.ranks_generation, routes)
        return routes

    def _relay_step(self, identity: bytes, group: "RelayGroup", plan: StepPlan, refs: np.ndarray,
                    counts: np.ndarray, edges: np.ndarray, costs: tuple[np.ndarray, np.ndarray],
                    balance: tuple[float, float]) -> Send:
        """The step's recipes of a relay's ranks, each DP rank's once (the relay writes their step_headers)."""
        dps, at = group.dps, group.at
        sizes = edges[at + 1] - edges[at]
        rows = slice(edges[dps[0]], edges[dps[-1] + 1]) if group.contiguous else rows_of(edges, at)[0]
        return Send(identity, P.RelayStep(
            step=plan.step, row_len=plan.row_capacity, dps=dps, ranks=group.ranks,
            piece_counts=sizes.tolist(), rank_costs=costs[0][at].tolist(), naive_costs=costs[1][at].tolist(),
            max_over_mean=balance[0], naive_max_over_mean=balance[1], pieces=refs[rows],
            counts=counts[dps[0]:dps[-1] + 1] if group.contiguous else counts[at]))

    def _delivery_ranks(self, ranks: list[int]) -> list[int]:
        """The ranks pieces are addressed to: a direct rank itself; behind a relay, the lowest of
        its ranks of each DP rank (the relay passes them on to the others)."""
        trainers = self.registry.trainers
        out, seen = [], set()
        for r in ranks:
            t = trainers.get(r)
            if t is None or t.via is None:
                out.append(r)
                continue
            key = (t.via, self._dp_of[r])
            if key not in seen:
                seen.add(key)
                out.append(r)
        return out

    def _address_table(self, ranks: np.ndarray) -> tuple[list[str], np.ndarray]:
        """A `deliver`'s addresses (each once, in the order of its first rank there) and its targets
        table (protocol.DELIVER_TARGET rows: each registered one of `ranks`, sorted, and the index of
        its data address); one numpy pass over a table kept until a rank comes or goes."""
        generation = self.registry.ranks_generation
        if self._addressing is None or self._addressing[0] != generation:
            trainers = self.registry.trainers
            known = sorted(trainers)
            index: dict[str, int] = {}
            codes = [index.setdefault(trainers[r].address, len(index)) for r in known]
            self._addressing = (generation, np.array(known, np.uint64), np.array(codes, np.int64), list(index))
        _, known, codes, addresses = self._addressing
        at = np.minimum(np.searchsorted(known, ranks), max(0, len(known) - 1))
        ok = known[at] == ranks if len(known) else np.zeros(len(ranks), bool)
        ranks, codes = ranks[ok], codes[at[ok]]
        used, first, inverse = np.unique(codes, return_index=True, return_inverse=True)
        order = np.argsort(first, kind="stable")  # the addresses used, in the order their first rank comes
        renumber = np.empty(len(used), np.int64)
        renumber[order] = np.arange(len(used))
        targets = np.column_stack([ranks, renumber[inverse].astype(np.uint64)]).reshape(-1, 2)
        return [addresses[c] for c in used[order].tolist()], targets

    def _holders(self, positions: np.ndarray) -> np.ndarray:
        """The worker holding each [source, position] row's prepared copy."""
        owners = self.tables.holders(positions)
        if (owners == NOBODY).any():
            missing = positions[owners == NOBODY][0].tolist()
            raise RuntimeError(f"no worker holds source {missing[0]} position {missing[1]}")
        return owners

    def deliver(self, step: int, items: np.ndarray, positions: np.ndarray, release: np.ndarray) -> list[Send]:
        """One DELIVER per worker holding any of the pieces (opened in the delivery book): payloads go
        worker -> rank directly. items: DELIVER_ITEM rows; positions and release: [source, position]
        rows (of each item's record; of prepared copies used up after this step)."""
        owners, release_owners = self._holders(positions), self._holders(release)
        workers = self.registry.workers
        out = []
        for wid in np.union1d(owners, release_owners).tolist():
            mask = owners == wid
            mine = items[mask]
            rel = release[release_owners == wid]
            ranks = np.unique(mine[:, DELIVER_ITEM.rank])
            addresses, targets = self._address_table(ranks)
            registered = self.registry.ranks_generation if len(targets) == len(ranks) else None
            d = self.deliveries.open(wid, step, mine, positions[mask], rel, ranks.tolist(), registered)
            release_keys = doc_key(rel[:, 0], self.tables.records(rel))
            out.append(Send(workers[wid].identity, P.Deliver(
                worker_id=wid, delivery_id=d.delivery_id, step=step, addresses=addresses, items=mine,
                release=release_keys, epochs=self.epochs_of(positions[mask]), release_epochs=self.epochs_of(rel),
                targets=targets)))
        return out

    def epochs(self, s: int, positions: np.ndarray) -> np.ndarray:
        """The pass over source s that each stream position falls in (a transform's ctx.epoch)."""
        return (np.asarray(positions, dtype=np.int64) // max(1, self.num_records[s])).astype(np.uint32)

    def epochs_of(self, rows: np.ndarray) -> np.ndarray:
        """Epochs of [source, position] rows."""
        counts = np.maximum(np.asarray(self.num_records, dtype=np.int64), 1)
        return (rows[:, 1].astype(np.int64) // counts[rows[:, 0].astype(np.int64)]).astype(np.uint32) if len(rows) \
            else np.zeros(0, np.uint32)
