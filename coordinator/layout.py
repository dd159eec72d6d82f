"""A planned step as messages: its step headers (one per rank served directly, one `relay_step` per
relay for its ranks), and its deliveries (one `deliver` per worker holding any of its pieces).
It returns the messages (`Send` instructions); the state sends them, in order.

Every piece goes once to each global rank that receives its DP rank's part of the plan, and once
per relay for all its ranks of one DP rank (the relay passes it on to each). A header's plan
summary is O(1): this rank's costs and the step's balance, never every rank's (that would make
each step O(DP^2) to encode).
"""

from __future__ import annotations

import numpy as np

from msd_common import protocol as P
from msd_common.doc_keys import doc_key
from msd_common.protocol import DELIVER_ITEM
from msd_common.topology import Topology

from .deliveries import DeliveryBook, address_table
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
        trainers = self.registry.trainers
        ranks = sorted(self.receivers | (trainers.keys() - self.receivers))  # (optional metadata-only stages too)
        # as Python floats: indexing a numpy array gives a numpy scalar per rank, slower to pack too
        rank_costs = np.asarray(plan.rank_costs, dtype=np.float64).tolist()
        naive_costs = np.asarray(plan.naive_rank_costs, dtype=np.float64).tolist()
        relayed: dict[int, list] = {}  # relay -> [(rank, DP rank)]: one relay_step each
        edges = np.asarray(bounds, dtype=np.int64)
        out: list[Send] = []
        for rank in ranks:
            d = self.dp_rank(rank)
            trainer = trainers[rank]
            if trainer.via is not None:
                relayed.setdefault(trainer.via, []).append((rank, d))
                continue
            out.append(Send(trainer.identity, P.step_header(plan.step, rank, plan.row_capacity, *balance,
                                                            rank_costs[d], naive_costs[d],
                                                            refs[bounds[d]:bounds[d + 1]], counts[d])))
        costs = (np.asarray(rank_costs, dtype=np.float64), np.asarray(naive_costs, dtype=np.float64))
        for via, members in relayed.items():
            out.append(self._relay_step(via, members, plan, refs, counts, edges, costs, balance))
        ranks = self._delivery_ranks(ranks)
        dps = np.array([self._dp_of[r] for r in ranks], dtype=np.int64)
        piece, within = rows_of(edges, dps)
        sizes = edges[dps + 1] - edges[dps]
        items = np.column_stack([np.repeat(np.array(ranks, dtype=np.uint64), sizes), within.astype(np.uint64),
                                 refs[piece]])  # DELIVER_ITEM rows
        return out + self.deliver(plan.step, items, t[piece][:, [SOURCE, POSITION]], plan.finished)

    def _relay_step(self, via: int, members: list[tuple[int, int]], plan: StepPlan, refs: np.ndarray,
                    counts: np.ndarray, edges: np.ndarray, costs: tuple[np.ndarray, np.ndarray],
                    balance: tuple[float, float]) -> Send:
        """The step's recipes of a relay's ranks, each DP rank's once (the relay writes their step_headers)."""
        dps = sorted({d for _, d in members})
        index = {d: i for i, d in enumerate(dps)}
        at = np.asarray(dps, dtype=np.int64)
        sizes = edges[at + 1] - edges[at]
        contiguous = dps[-1] - dps[0] + 1 == len(dps)  # a host of consecutive DP ranks: slices, no gather
        rows = slice(edges[dps[0]], edges[dps[-1] + 1]) if contiguous else rows_of(edges, at)[0]
        return Send(self.registry.relays[via].identity, P.RelayStep(
            step=plan.step, row_len=plan.row_capacity, dps=dps, ranks=[[r, index[d]] for r, d in members],
            piece_counts=sizes.tolist(), rank_costs=costs[0][at].tolist(), naive_costs=costs[1][at].tolist(),
            max_over_mean=balance[0], naive_max_over_mean=balance[1], pieces=refs[rows],
            counts=counts[dps[0]:dps[-1] + 1] if contiguous else counts[at]))

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
        trainers, workers = self.registry.trainers, self.registry.workers
        out = []
        for wid in np.union1d(owners, release_owners).tolist():
            mask = owners == wid
            mine = items[mask]
            rel = release[release_owners == wid]
            ranks = np.unique(mine[:, DELIVER_ITEM.rank]).tolist()
            d = self.deliveries.open(wid, step, mine, positions[mask], rel, ranks)
            addresses, targets = address_table(ranks, trainers)
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
