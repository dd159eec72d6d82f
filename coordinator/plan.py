"""The step planner: a pure function of (config, seed, record lengths) -> the stream of steps.

Planning step k (DESIGN.md section 4):
1. Quota: every source's cumulative token target grows by weight x step tokens; the next unit is
   always drawn from the source furthest behind its target (error diffusion), so each source's
   cumulative tokens stay within one piece of its target at every step.
2. Draw: units come from the source's keyed-permutation stream; a document longer than seq_len
   is cut into pieces of at most seq_len; a document cut by the end of a step continues at the
   start of that source's next draw. A step holds exactly global_batch_size x seq_len tokens.
3. Balance: pieces are laid out on ranks x micro-batches x sequences by the cost model
   a*len^2 + b*len (coordinator.balance).

The draw is computed for a whole step at once. Each source's deficit (target minus delivered)
only decreases as it is drawn from, so "always the source furthest behind" is a k-way merge of
per-source sequences: candidate pieces of every source, each keyed by its source's deficit just
before it, sorted by key (ties: lowest source), cut where the step is full. This equals drawing
one piece at a time, which the tests check against a plain sequential reference.

The planner never waits: if a length it needs is not known yet, `plan_step` raises NeedLength
and changes nothing; the caller asks workers to prepare more records and calls again. No I/O, no
clocks, no randomness beyond the keyed streams: timing cannot change the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from . import balance
from .balance import Cost, Grid
from msd_common.spec import CostConfig, JobConfig
from .cursor import SourceStream
from .holdout import Holdout

# columns of a pieces table
SOURCE, POSITION, RECORD, OFFSET, LENGTH = range(5)
# A step of whole samples only draws this share more tokens than its rows are to hold
# (tools/bench_packing.py: padding 2.2 % -> see docs/BENCHMARKS.md with 0.1)
OVERDRAW = 0.1


class Known(Protocol):
    def window(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(record index, token length) of stream positions [start, start+count) of a source;
        length -1 where it is not known yet, 0 for a record that was skipped (corrupt)."""

    def patches(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Image patches of the records at these (prepared) positions of an image-text source."""

    def patch_squares(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Per record at these positions, its images' patches squared, summed."""


class NeedLength(Exception):
    def __init__(self, source: int, position: int) -> None:
        super().__init__(f"length of source {source} position {position} not known yet")
        self.source = source
        self.position = position


@dataclass
class StepPlan:
    step: int
    # One row per fragment, in delivery order (rank, micro-batch, sequence, packing order):
    # columns SOURCE, POSITION, RECORD, OFFSET (within the document), LENGTH.
    pieces: np.ndarray
    rank: np.ndarray
    micro_batch: np.ndarray
    row: np.ndarray  # sequence index within the rank: micro_batch * micro_batch_size + sequence
    rows_per_rank: int
    row_capacity: int  # tokens per packed sequence, padding included
    rank_costs: list[float]
    naive_rank_costs: list[float]  # the same pieces dealt to ranks in arrival order
    source_tokens: list[int]
    finished: np.ndarray  # [source, position] of records whose last token is in this step

    def rows_of_rank(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(pieces table, pieces per sequence) of one rank."""
        lo, hi = np.searchsorted(self.rank, [rank, rank + 1])
        counts = np.bincount(self.row[lo:hi], minlength=self.rows_per_rank)
        return self.pieces[lo:hi], counts


@dataclass
class PlannerState:
    """Everything the planner carries from one step to the next: O(number of sources)."""

    next_step: int
    cursors: list[int]  # next stream position per source
    carry: list[tuple[int, int, int, int] | None]  # (position, record, offset, end) of a cut document
    target: list[float]  # cumulative token target per source
    delivered: list[int]  # cumulative tokens per source
    exhausted: list[bool]  # sources whose finite epochs are used up
    # per source: whole samples drawn but left out of their step's rows, (position, record, end),
    # drawn first by the next step (packing: whole)
    deferred: list[list[tuple[int, int, int]]] | None = None

    def __post_init__(self) -> None:
        if self.deferred is None:
            self.deferred = [[] for _ in self.cursors]

    def to_json(self) -> dict:
        out = {"next_step": self.next_step, "cursors": list(self.cursors),
               "carry": [list(c) if c is not None else None for c in self.carry],
               "target": list(self.target), "delivered": list(self.delivered), "exhausted": list(self.exhausted)}
        if any(self.deferred):  # absent otherwise: states of jobs without whole samples read as before
            out["deferred"] = [[list(u) for u in d] for d in self.deferred]
        return out

    @classmethod
    def from_json(cls, d: dict) -> "PlannerState":
        return cls(int(d["next_step"]), [int(x) for x in d["cursors"]],
                   [tuple(int(v) for v in c) if c is not None else None for c in d["carry"]],
                   [float(x) for x in d["target"]], [int(x) for x in d["delivered"]],
                   [bool(x) for x in d["exhausted"]],
                   [[tuple(int(v) for v in u) for u in units] for units in d["deferred"]] if "deferred" in d else None)


class SourceExhausted(Exception):
    """A source with `on_exhausted: stop` has no records left: the job's stream ends before this step."""

    def __init__(self, source: str, step: int) -> None:
        super().__init__(f"source {source!r} is exhausted at step {step} (on_exhausted: stop)")
        self.source = source
        self.step = step


class Planner:
    def __init__(self, job: JobConfig, num_records: list[int]) -> None:
        self.job = job
        self.num_records = list(num_records)
        self.streams = [SourceStream(job.seed, i, n, src.shuffle_block) if n else None
                        for i, (src, n) in enumerate(zip(job.sources, num_records))]
        for src, n in zip(job.sources, num_records):
            if n == 0 and any(stage.weights[src.index] > 0 for stage in job.stages):
                raise ValueError(f"source {src.name!r} has no records but a weight in the mixture")
        # stream positions a source may use: epochs x records, or unbounded
        self.limit = [n * src.epochs if src.epochs else None for src, n in zip(job.sources, num_records)]
        self.truncate = [src.long_docs in ("truncate", "drop") for src in job.sources]
        self.drop = np.asarray([src.long_docs == "drop" for src in job.sources], dtype=bool)
        self.whole = np.asarray([src.whole for src in job.sources], dtype=bool)
        # records held out of training for the job's eval sets (coordinator/holdout.py)
        self.holdout = Holdout(job.seed, self.num_records,
                               [{s: amount for s, amount in e.holdout} for e in job.eval_sets])
        for src in job.sources:
            if self.holdout.end[src.index] >= 1 << 64 and any(st.weights[src.index] > 0 for st in job.stages):
                raise ValueError(f"source {src.name!r}: every record is held out for evaluation, but it has a weight")
        s = len(num_records)
        self.state = PlannerState(0, [0] * s, [None] * s, [0.0] * s, [0] * s, [False] * s)
        self.overrides: list[tuple[int, list[float]]] = []  # (from step, weights) set at run time, only added to
        self.cost_changes: list[tuple[int, CostConfig]] = []  # (from step, model) calibrated at run time
        self._weights_kept: dict[tuple, list[float]] = {}
        self.mean_length = [max(1.0, job.batch.seq_len / 4)] * s  # a guess, refined from what is drawn
        self.events: list[str] = []  # things worth logging (exhausted sources), drained by the caller

    def record_at(self, source: int, position: int) -> int:
        return self.streams[source].record_at(position)

    def grid_at(self, step: int) -> Grid:
        job = self.job
        return Grid(job.dp, job.micro_batches_per_rank, job.batch.micro_batch_size, job.row_capacity_at(step))

    def set_cost(self, from_step: int, model: CostConfig, replaying: bool = False) -> None:
        """The cost model from `from_step` on (a calibrated one, balance.calibrate): like a
        run-time mixture change, only for steps not planned yet, unless replaying the journal."""
        if from_step < self.state.next_step and not replaying:
            raise ValueError(f"step {from_step} is already planned (the plan stands at step {self.state.next_step})")
        self.cost_changes.append((from_step, model))
        self.cost_changes.sort(key=lambda c: c[0])

    def cost_at(self, step: int) -> CostConfig:
        """The cost model that plans `step`: the job file's, or the last calibrated one adopted by then."""
        model = self.job.cost
        for from_step, changed in self.cost_changes:
            if from_step <= step:
                model = changed
        return model

    def set_weights(self, from_step: int, weights: list[float], replaying: bool = False) -> None:
        """Weights from `from_step` on, replacing the job file's (a run-time mixture change).
        replaying: a change made earlier in the run (a journal, a carried state), which may lie
        before the steps already planned."""
        if from_step < self.state.next_step and not replaying:
            raise ValueError(f"step {from_step} is already planned (the plan stands at step {self.state.next_step})")
        total = sum(weights)
        if total <= 0 or any(w < 0 or math.isnan(w) for w in weights):
            raise ValueError("weights must be non-negative and not all zero")
        self.overrides.append((from_step, [w / total for w in weights]))
        self.overrides.sort(key=lambda o: o[0])

    def weights_at(self, step: int) -> list[float]:
        """The mixture for `step`: the job's curriculum (or a run-time override), renormalised over
        the sources that still have records. Asked several times per planning pass: the last
        answers are kept (a fresh list each time, so no caller can change a kept one)."""
        key = (step, len(self.overrides), tuple(self.state.exhausted))
        kept = self._weights_kept.get(key)
        if kept is None:
            if len(self._weights_kept) >= 8:
                self._weights_kept.clear()
            kept = self._weights_kept[key] = self._weights_at(step)
        return list(kept)

    def _weights_at(self, step: int) -> list[float]:
        weights = self.job.weights_at(step)
        for from_step, override in self.overrides:
            if from_step <= step:
                weights = override
        live = [0.0 if gone else w for w, gone in zip(weights, self.state.exhausted)]
        total = sum(live)
        return [w / total for w in live] if total > 0 else live

    def plan_step(self, known: Known) -> StepPlan:
        """Plan the next step, or raise NeedLength (and change nothing) if a length is unknown.
        A step with whole samples (`packing: whole`) that its rows cannot all hold ends before
        leaves out the ones that did not fit: they are drawn first by the next step."""
        drawn, commit = self._draw(known)
        step = self.state.next_step
        plan, left_out = self._layout(step, drawn, known)
        commit(drawn.pieces[left_out])
        return plan

    # ------------------------------------------------------------------ the draw

    def _draw(self, known: Known):
        st, job = self.state, self.job
        step = st.next_step
        for s, gone in enumerate(st.exhausted):
            if gone and job.sources[s].on_exhausted == "stop":
                raise SourceExhausted(job.sources[s].name, step)
        capacity, seq_len = job.step_tokens_at(step), job.seq_len_at(step)
        weights = self.weights_at(step)
        active = [s for s, w in enumerate(weights) if w > 0]
        if not active:
            raise SourceExhausted(", ".join(src.name for src in job.sources), step)
        for s in active:  # a carried-over document must be prepared too (after a rewind it may not be)
            carry = st.carry[s]
            if carry is not None and known.window(s, carry[0], 1)[1][0] < 0:
                raise NeedLength(s, carry[0])
            for pos, _, _ in st.deferred[s]:  # as must deferred samples
                if known.window(s, pos, 1)[1][0] < 0:
                    raise NeedLength(s, pos)
        target = {s: st.target[s] + weights[s] * capacity for s in active}
        # a step of whole samples only draws a little more than it holds: the layout packs the
        # rows from more candidates, and what it leaves out opens the next step
        draw = capacity + int(OVERDRAW * capacity) if self.whole[active].all() else capacity
        budget = {s: max(target[s] - st.delivered[s], 0.0) + seq_len for s in active}
        cands = self._candidates_all(active, budget, seq_len, known)
        # the merge below works on every active source's candidates at once: per-source numpy
        # steps made this loop and the commit a large part of a step at hundreds of sources
        src = np.asarray(active, dtype=np.int64)
        targets = np.asarray([target[s] for s in active], dtype=np.float64)
        delivered = np.asarray([st.delivered[s] for s in active], dtype=np.int64)
        while True:
            tables = [cands[s].table for s in active]
            table = np.concatenate(tables)
            sizes = np.fromiter((len(t) for t in tables), dtype=np.int64, count=len(tables))
            starts = np.zeros(len(active) + 1, dtype=np.int64)
            np.cumsum(sizes, out=starts[1:])
            group = np.repeat(np.arange(len(active)), sizes)
            running = np.zeros(len(table) + 1, dtype=np.int64)  # tokens of all candidates before each row
            np.cumsum(table[:, LENGTH], out=running[1:])
            before = running[:-1] - running[starts[:-1]][group]  # tokens of the row's source before it
            keys = targets[group] - (delivered[group] + before)
            order = np.lexsort((table[:, SOURCE], -keys))
            filled = np.cumsum(table[order, LENGTH])
            cut = int(np.searchsorted(filled, draw))  # the piece that fills the step
            # the merge is exact only if no piece not generated yet would sort before the cut
            next_keys = targets - (delivered + (running[starts[1:]] - running[starts[:-1]]))
            live = np.fromiter((not cands[s].exhausted for s in active), dtype=bool, count=len(active))
            if cut >= len(order):
                short_rows = live
            else:
                cut_key, cut_source = keys[order[cut]], table[order[cut], SOURCE]
                short_rows = live & ((next_keys > cut_key) | ((next_keys == cut_key) & (src < cut_source)))
            short = src[short_rows].tolist()
            if cut >= len(order) and not short:
                self._exhaust_all(cands, active, step)
            if not short:
                break
            for s in short:
                if cands[s].missing is not None:
                    raise NeedLength(s, cands[s].missing)
                budget[s] = 2 * budget[s] + seq_len
                cands[s] = self._candidates(s, budget[s], seq_len, known)
        n_take = cut + 1
        last_take = draw - (int(filled[cut - 1]) if cut else 0)
        if self.whole[table[order[cut], SOURCE]] and last_take < table[order[cut], LENGTH]:
            n_take = cut  # a whole sample is never cut by the step's end: it opens the next step
        taken = table[order[:n_take]].copy()
        cut_piece = taken[-1].copy()
        if n_take == cut + 1:
            taken[-1, LENGTH] = last_take
        else:
            last_take = int(cut_piece[LENGTH])
        all_ends = np.concatenate([cands[s].ends for s in active])
        ends = all_ends[order[:n_take]]
        finished = taken[taken[:, OFFSET] + taken[:, LENGTH] == ends][:, [SOURCE, POSITION]]
        n_sources = len(weights)
        counts = np.bincount(taken[:, SOURCE], minlength=n_sources)
        source_tokens = [int(x) for x in np.bincount(taken[:, SOURCE], weights=taken[:, LENGTH],
                                                     minlength=n_sources)]
        # a source's taken pieces are the first n of its candidates (keys fall along its stream):
        # its last taken row, and the sum of its taken document ends (exact, in int64)
        n_taken = counts[src]
        has = n_taken > 0
        last_rows = (starts[:-1] + n_taken - 1)[has]
        ends_before = np.zeros(len(all_ends) + 1, dtype=np.int64)
        np.cumsum(all_ends, out=ends_before[1:])
        end_sums = (ends_before[starts[:-1] + n_taken] - ends_before[starts[:-1]])[has]
        last = table[last_rows]
        rows = list(zip(src[has].tolist(), n_taken[has].tolist(), last[:, POSITION].tolist(),
                        last[:, RECORD].tolist(), last[:, OFFSET].tolist(), last[:, LENGTH].tolist(),
                        all_ends[last_rows].tolist(), end_sums.tolist()))
        cut_source, cut_length = int(cut_piece[SOURCE]), int(cut_piece[LENGTH])

        deferred_taken = {s: min(int(counts[s]), len(st.deferred[s])) for s in active}

        def commit(left_out: np.ndarray) -> None:
            """left_out: pieces-table rows of whole samples the step's rows did not hold."""
            held = list(source_tokens)
            for row in left_out.tolist():
                held[row[SOURCE]] -= row[LENGTH]
            step_tokens = sum(held)
            # whole samples left room: targets grow by what the step holds, so deficits stay bounded
            grown = {s: st.target[s] + weights[s] * step_tokens for s in active} if step_tokens < capacity else target
            for s in active:
                st.target[s] = grown[s]
                st.delivered[s] += held[s]
                st.deferred[s] = st.deferred[s][deferred_taken[s]:]
            for row in left_out.tolist():  # first in the next step, in draw order
                st.deferred[row[SOURCE]].insert(0, (row[POSITION], row[RECORD], row[OFFSET] + row[LENGTH]))
            for s in active:
                st.deferred[s].sort()
            for s, n, pos, rec, off, length, end, end_sum in rows:
                # positions never fall along a source's candidates: a new document taken means
                # the last one taken is new
                if pos >= st.cursors[s]:
                    st.cursors[s] = pos + 1
                    # a running mean of document lengths sizes the next windows (not the result)
                    self.mean_length[s] = 0.9 * self.mean_length[s] + 0.1 * (end_sum / n)
                if s == cut_source and last_take < cut_length:
                    st.carry[s] = (pos, rec, off + last_take, end)
                elif off + length < end:
                    st.carry[s] = (pos, rec, off + length, end)
                else:
                    st.carry[s] = None
            for s in active:
                c = cands[s]
                if c.exhausted and int(counts[s]) == len(c.table) and st.carry[s] is None and not st.deferred[s]:
                    self._exhaust(s, step)
            st.next_step += 1

        return _Drawn(taken, finished, source_tokens, ends), commit

    def _exhaust(self, s: int, step: int) -> None:
        src = self.job.sources[s]
        self.state.exhausted[s] = True
        if src.on_exhausted == "stop":
            self.events.append(f"source {src.name!r} exhausted after {src.epochs} epoch(s) at step {step}; "
                               f"the stream ends after step {step} (on_exhausted: stop)")
        else:
            self.events.append(f"source {src.name!r} exhausted after {src.epochs} epoch(s) at step {step}; "
                               "its weight is spread over the other sources")

    def _exhaust_all(self, cands: dict, active: list[int], step: int) -> None:
        """Every source that may still be drawn ran out before the step was full."""
        for s in active:
            if self.job.sources[s].on_exhausted == "stop":
                raise SourceExhausted(self.job.sources[s].name, step)
        raise SourceExhausted(", ".join(self.job.sources[s].name for s in active), step)

    def _candidates_all(self, active: list[int], budget: dict[int, float], seq_len: int,
                        known: Known) -> dict[int, "_Candidates"]:
        """_candidates of every active source, the same result, in one set of array operations
        over all of them where a source's first window holds its budget (the usual case); the
        others go through _candidates. With hundreds of sources, a numpy pass per source per step
        was the largest part of a step's planning."""
        st = self.state
        out: dict[int, _Candidates] = {}
        fast, counts, have = [], [], []
        for s in active:
            carry = st.carry[s]
            h = carry[3] - carry[2] if carry is not None else 0
            count = max(64, math.ceil((budget[s] - h) / max(self.mean_length[s], 1.0) * 1.25))
            limit = self.limit[s]
            if h >= budget[s] or (limit is not None and count > limit - st.cursors[s]) or st.deferred[s]:
                out[s] = self._candidates(s, budget[s], seq_len, known)
                continue
            fast.append(s)
            counts.append(count)
            have.append(h)
        if not fast:
            return out
        n = len(fast)
        windows = [known.window(s, st.cursors[s], c) for s, c in zip(fast, counts)]
        records = np.concatenate([w[0] for w in windows]).astype(np.int64)
        lengths = np.concatenate([w[1] for w in windows]).astype(np.int64)
        size = np.asarray(counts, dtype=np.int64)
        seg = np.repeat(np.arange(n), size)
        starts = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(size, out=starts[1:])
        within = np.arange(len(lengths)) - starts[seg]
        src = np.asarray(fast, dtype=np.int64)
        # positions from the first unknown length on are not used (as _candidates stops there)
        first_unknown = _first_per_segment(lengths < 0, seg, within, n)
        usable = (lengths > 0) & (within < first_unknown[seg]) & ~(self.drop[src][seg] & (lengths > seq_len))
        for i, s in enumerate(fast):  # records held out for evaluation are never trained on
            if self.holdout.any(s):
                rows = slice(starts[i], starts[i + 1])
                usable[rows] &= ~self.holdout.held_out(s, records[rows])
        ends = np.where(np.asarray(self.truncate)[src][seg], np.minimum(lengths, seq_len), lengths)
        ends = np.where(usable, ends, 0)
        cum = np.cumsum(ends)
        before = np.concatenate([[0], cum])[starts[:-1]]
        reach = cum - before[seg] + np.asarray(have, dtype=np.int64)[seg]
        budgets = np.asarray([budget[s] for s in fast], dtype=np.float64)
        stop = _first_per_segment(usable & (reach >= budgets[seg]), seg, within, n)  # the document reaching it
        ok = stop < size  # reached within the first window, before any unknown length
        for i in np.flatnonzero(~ok).tolist():
            out[fast[i]] = self._candidates(fast[i], budget[fast[i]], seq_len, known)
        take = usable & ok[seg] & (within <= stop[seg])
        carried = [i for i in np.flatnonzero(ok).tolist() if st.carry[fast[i]] is not None]
        carry_rows = np.array([st.carry[fast[i]] for i in carried], dtype=np.int64).reshape(-1, 4)
        # units in stream order per source: a carried document first, then the documents taken
        unit_seg = np.concatenate([np.asarray(carried, dtype=np.int64), seg[take]])
        order = np.argsort(2 * unit_seg + np.concatenate([np.zeros(len(carried), np.int64),
                                                          np.ones(int(take.sum()), np.int64)]), kind="stable")
        unit_seg = unit_seg[order]
        pos = np.concatenate([carry_rows[:, 0], (np.asarray([st.cursors[s] for s in fast])[seg] + within)[take]])[order]
        rec = np.concatenate([carry_rows[:, 1], records[take]])[order]
        off = np.concatenate([carry_rows[:, 2], np.zeros(int(take.sum()), np.int64)])[order]
        end = np.concatenate([carry_rows[:, 3], ends[take]])[order]
        table, piece_ends = _pieces(src[unit_seg], pos, rec, off, end, seq_len)
        # active sources come in ascending order, so the table's rows are grouped by source
        lows = np.searchsorted(table[:, SOURCE], src, side="left")
        highs = np.searchsorted(table[:, SOURCE], src, side="right")
        for i in np.flatnonzero(ok).tolist():
            lo, hi = lows[i], highs[i]
            missing = st.cursors[fast[i]] + int(first_unknown[i]) if first_unknown[i] < size[i] else None
            out[fast[i]] = _Candidates(table[lo:hi], piece_ends[lo:hi], missing, False)
        return out

    def _candidates(self, s: int, budget: float, seq_len: int, known: Known) -> "_Candidates":
        """Source s's next pieces in stream order, at least `budget` tokens of them where their
        lengths are known and the source has records left."""
        st = self.state
        units_pos, units_rec, units_off, units_end = [], [], [], []
        have = 0
        for pos, rec, end in st.deferred[s]:  # whole samples the last steps left out: first
            units_pos.append(np.array([pos]))
            units_rec.append(np.array([rec]))
            units_off.append(np.array([0]))
            units_end.append(np.array([end]))
            have += end
        if st.carry[s] is not None:
            pos, rec, off, end = st.carry[s]
            units_pos.append(np.array([pos]))
            units_rec.append(np.array([rec]))
            units_off.append(np.array([off]))
            units_end.append(np.array([end]))
            have += end - off
        cursor, missing, exhausted = st.cursors[s], None, False
        limit = self.limit[s]
        seen_tokens, seen_docs = 0, 0
        while have < budget:
            # size the window by the mean length seen (in this draw, else a running estimate)
            mean = seen_tokens / seen_docs if seen_docs else self.mean_length[s]
            count = max(64, math.ceil((budget - have) / max(mean, 1.0) * 1.25))
            if limit is not None:
                count = min(count, limit - cursor)
                if count <= 0:
                    exhausted = True
                    break
            records, lengths = known.window(s, cursor, count)
            unknown = np.flatnonzero(lengths < 0)
            if len(unknown):
                records, lengths = records[:unknown[0]], lengths[:unknown[0]]
                missing = cursor + int(unknown[0])
            usable = np.flatnonzero((lengths > 0) & ~(self.drop[s] & (lengths > seq_len))
                                    & ~self.holdout.held_out(s, records))
            ends = lengths[usable]
            seen_tokens += int(ends.sum())
            seen_docs += len(usable)
            if self.truncate[s]:
                ends = np.minimum(ends, seq_len)
            reach = np.cumsum(ends) + have
            stop = int(np.searchsorted(reach, budget)) + 1  # up to the document that reaches the budget
            if stop <= len(usable):
                usable, ends = usable[:stop], ends[:stop]
                scanned = int(usable[-1]) + 1
            else:
                scanned = len(lengths)
            units_pos.append(cursor + usable)
            units_rec.append(records[usable])
            units_off.append(np.zeros(len(usable), dtype=np.int64))
            units_end.append(ends)
            have += int(ends.sum())
            cursor += scanned
            if missing is not None:
                break
        if not units_pos:
            empty = np.zeros((0, 5), dtype=np.int64)
            return _Candidates(empty, np.zeros(0, dtype=np.int64), missing, exhausted)
        pos = np.concatenate(units_pos).astype(np.int64)
        rec = np.concatenate(units_rec).astype(np.int64)
        off = np.concatenate(units_off).astype(np.int64)
        end = np.concatenate(units_end).astype(np.int64)
        table, piece_ends = _pieces(np.full(len(pos), s, dtype=np.int64), pos, rec, off, end, seq_len)
        return _Candidates(table, piece_ends, missing, exhausted)

    # ------------------------------------------------------------------ the layout

    def _layout(self, step: int, drawn: "_Drawn", known: Known) -> tuple[StepPlan, np.ndarray]:
        job, grid = self.job, self.grid_at(step)
        pieces = drawn.pieces
        model = self.cost_at(step)
        cost = Cost(model.quadratic, model.linear)
        image_sources = [s.index for s in job.sources if s.has_encoder_cost]
        if image_sources and (model.patch_quadratic or model.patch_linear):
            ratio, square_ratio = np.zeros(len(pieces)), np.zeros(len(pieces))
            for s in image_sources:
                mine = pieces[:, SOURCE] == s
                if mine.any():
                    positions, doc_lengths = pieces[mine, POSITION], drawn.doc_lengths[mine]
                    ratio[mine] = balance.patch_ratio(known.patches(s, positions), doc_lengths)
                    square_ratio[mine] = balance.patch_square_ratio(known.patch_squares(s, positions), doc_lengths)
            cost = Cost(model.quadratic, model.linear, ratio, model.patch_quadratic, model.patch_linear, square_ratio)
        whole = self.whole[pieces[:, SOURCE]]
        left_out = np.zeros(0, dtype=np.int64)
        source_tokens, finished = drawn.source_tokens, drawn.finished
        if whole.any():
            # samples left out by an earlier step go first, so that none waits for ever
            earlier = whole & (pieces[:, POSITION] < np.asarray(self.state.cursors)[pieces[:, SOURCE]])
            lay, left_out = balance.whole_layout(pieces[:, LENGTH], whole, grid, cost, earlier,
                                                 budget=job.step_tokens_at(step))
            if len(left_out):
                out_rows = pieces[left_out]
                source_tokens = list(source_tokens)
                for row in out_rows.tolist():
                    source_tokens[row[SOURCE]] -= row[LENGTH]
                gone = np.isin(finished[:, 0] * (1 << 48) + finished[:, 1],
                               out_rows[:, SOURCE] * (1 << 48) + out_rows[:, POSITION])
                finished = finished[~gone]
        else:
            lay = balance.layout(job.balance_method, pieces[:, LENGTH], grid, cost)
        out = pieces[lay.piece]
        out[:, OFFSET] += lay.offset
        out[:, LENGTH] = lay.length
        rank = lay.row // grid.rows_per_rank
        row = lay.row % grid.rows_per_rank
        naive = balance.costs_dealt_in_order(pieces[:, LENGTH], job.dp, grid.rows_per_rank * job.seq_len_at(step),
                                             *cost.coefficients(np.arange(len(pieces))))
        return StepPlan(step, out, rank, row // grid.micro_batch_size, row, grid.rows_per_rank, grid.row_capacity,
                        lay.rank_costs(grid, cost).tolist(), naive, source_tokens, finished), left_out


@dataclass
class _Candidates:
    table: np.ndarray  # pieces table, stream order
    ends: np.ndarray  # end (exclusive) of each piece's document, or of its truncated head
    missing: int | None  # first stream position whose length is not known yet
    exhausted: bool  # the source has no records left after these


@dataclass
class _Drawn:
    pieces: np.ndarray  # arrival order
    finished: np.ndarray
    source_tokens: list[int]
    doc_lengths: np.ndarray  # tokens of each piece's document (or of its truncated head)


def _pieces(src: np.ndarray, pos: np.ndarray, rec: np.ndarray, off: np.ndarray, end: np.ndarray,
            seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Units (a document from `off` to `end`) -> pieces table rows of at most seq_len tokens, and
    the end of each piece's document."""
    n_pieces = -(-(end - off) // seq_len)
    total = int(n_pieces.sum())
    unit = np.repeat(np.arange(len(pos)), n_pieces)
    within = np.arange(total) - np.repeat(np.cumsum(n_pieces) - n_pieces, n_pieces)
    piece_off = off[unit] + within * seq_len
    table = np.empty((total, 5), dtype=np.int64)
    table[:, SOURCE] = src[unit]
    table[:, POSITION] = pos[unit]
    table[:, RECORD] = rec[unit]
    table[:, OFFSET] = piece_off
    table[:, LENGTH] = np.minimum(seq_len, end[unit] - piece_off)
    return table, end[unit]


def _first_per_segment(flags: np.ndarray, seg: np.ndarray, within: np.ndarray, n: int) -> np.ndarray:
    """Per segment, the `within` index of its first flagged row (a large number where none)."""
    out = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    rows = np.flatnonzero(flags)
    if len(rows):
        segs, first = np.unique(seg[rows], return_index=True)
        out[segs] = within[rows[first]]
    return out
