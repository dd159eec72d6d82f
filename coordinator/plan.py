"""The step planner: a pure function of (config, seed, record lengths) -> the stream of steps.

Planning step k (DESIGN.md section 4):
1. Quota: every source's cumulative token target grows by weight x step tokens; the next unit is
   always drawn from the source furthest behind its target (error diffusion), so each source's
   cumulative tokens stay within one piece of its target at every step.
2. Draw: units come from the source's keyed-permutation stream; a document longer than seq_len
   is cut into pieces of at most seq_len; a document cut by the end of a step continues at the
   start of that source's next draw. A step holds exactly global_batch_size x seq_len tokens.
3. Balance: pieces go to DP ranks, then to each rank's micro-batches, then to sequences
   (coordinator.balance), by the cost model a*len^2 + b*len.

The planner never waits: if a length it needs is not known yet, `plan_step` raises NeedLength,
the caller asks workers to prepare more records, and the next call resumes the same step.
No I/O, no clocks, no randomness beyond the keyed streams: timing cannot change the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

from .balance import Piece, assign, costs_dealt_in_order
from .config import JobConfig
from .cursor import SourceStream

# (source, stream position) -> (record_index, tokens) once a worker has prepared it, else None.
# The caller computes record indices in bulk when it asks workers to prepare (SourceStream.records_at).
Lookup = Callable[[int, int], "tuple[int, int] | None"]


class NeedLength(Exception):
    def __init__(self, source: int, position: int) -> None:
        super().__init__(f"length of source {source} position {position} not known yet")
        self.source = source
        self.position = position


@dataclass
class StepPlan:
    step: int
    # layout[rank][micro_batch][sequence] -> pieces in packing order
    layout: list[list[list[list[Piece]]]]
    rank_costs: list[float]
    naive_rank_costs: list[float]  # the same pieces dealt to ranks in arrival order
    source_tokens: list[int]
    # (source, position) of records whose last token is in this step: workers may evict them after it
    finished: set[tuple[int, int]] = field(default_factory=set)

    def pieces(self) -> Iterator[tuple[int, int, Piece]]:
        """(rank, micro_batch, piece) for every piece of the step."""
        for rank, mbs in enumerate(self.layout):
            for m, seqs in enumerate(mbs):
                for seq in seqs:
                    for p in seq:
                        yield rank, m, p


@dataclass
class _Carry:
    position: int
    record: int
    offset: int
    length: int


@dataclass
class PlannerState:
    """Everything the planner carries from one step to the next: O(number of sources)."""

    next_step: int
    cursors: list[int]  # next stream position per source
    carry: list[_Carry | None]  # a document cut by a step boundary, per source
    target: list[float]  # cumulative token target per source
    delivered: list[int]  # cumulative tokens per source


@dataclass
class _Draw:
    """The draw of the step being planned, kept across NeedLength so that planning resumes where
    it stopped: the draw is sequential and deterministic, so resuming equals planning in one go."""

    drawn: list[Piece] = field(default_factory=list)
    finished: set[tuple[int, int]] = field(default_factory=set)
    source_tokens: list[int] = field(default_factory=list)
    filled: int = 0


class Planner:
    def __init__(self, job: JobConfig, num_records: list[int]) -> None:
        self.job = job
        self.weights = [job.weights.get(s.name, 0.0) for s in job.sources]
        self.streams = [SourceStream(job.seed, i, n) if n else None for i, n in enumerate(num_records)]
        for i, n in enumerate(num_records):
            if n == 0 and self.weights[i] > 0:
                raise ValueError(f"source {job.sources[i].name!r} has no records but weight {self.weights[i]}")
        s = len(num_records)
        self.state = PlannerState(0, [0] * s, [None] * s, [0.0] * s, [0] * s)
        self._draw: _Draw | None = None  # a step whose draw waits for a length

    def record_at(self, source: int, position: int) -> int:
        return self.streams[source].record_at(position)

    def plan_step(self, lookup: Lookup) -> StepPlan:
        """Plan the next step. Raises NeedLength if a length is still unknown; the next call
        continues the same step from where this one stopped."""
        st, job = self.state, self.job
        seq_len, capacity = job.batch.seq_len, job.step_tokens
        d = self._draw
        if d is None:
            for i, w in enumerate(self.weights):
                st.target[i] += w * capacity
            d = self._draw = _Draw(source_tokens=[0] * len(self.weights))
        while d.filled < capacity:
            s = self._most_behind()
            unit = st.carry[s] or self._next_record(s, lookup)
            take = min(unit.length - unit.offset, seq_len, capacity - d.filled)
            d.drawn.append(Piece(s, unit.position, unit.record, unit.offset, take))
            d.filled += take
            st.delivered[s] += take
            d.source_tokens[s] += take
            if unit.offset + take < unit.length:
                st.carry[s] = _Carry(unit.position, unit.record, unit.offset + take, unit.length)
            else:
                st.carry[s] = None
                d.finished.add((s, unit.position))
        self._draw = None
        step = st.next_step
        st.next_step += 1
        return self._layout(step, d.drawn, d.source_tokens, d.finished)

    def _most_behind(self) -> int:
        st = self.state
        best, best_deficit = -1, 0.0
        for i, w in enumerate(self.weights):
            if w <= 0:
                continue
            deficit = st.target[i] - st.delivered[i]
            if best < 0 or deficit > best_deficit:
                best, best_deficit = i, deficit
        return best

    def _next_record(self, s: int, lookup: Lookup) -> _Carry:
        st = self.state
        while True:
            pos = st.cursors[s]
            found = lookup(s, pos)
            if found is None:
                raise NeedLength(s, pos)
            st.cursors[s] = pos + 1
            record, length = found
            if length > 0:  # length 0: a record the worker skipped as corrupt
                return _Carry(pos, record, 0, length)

    def _layout(self, step: int, drawn: list[Piece], source_tokens: list[int], finished) -> StepPlan:
        job = self.job
        cost = job.cost.of
        seq_len, mbs = job.batch.seq_len, job.batch.micro_batch_size
        n_mb = job.micro_batches_per_rank
        rank_capacity = n_mb * mbs * seq_len
        layout = []
        by_rank, rank_costs = assign(drawn, job.dp, rank_capacity, cost)
        for rank_pieces in by_rank:
            micro_batches = []
            for mb_pieces in assign(rank_pieces, n_mb, mbs * seq_len, cost)[0]:
                micro_batches.append(assign(mb_pieces, mbs, seq_len, cost)[0])
            layout.append(micro_batches)
        naive = costs_dealt_in_order([p.length for p in drawn], job.dp, rank_capacity, job.cost.quadratic,
                                     job.cost.linear)
        return StepPlan(step, layout, rank_costs, naive, source_tokens, finished)
