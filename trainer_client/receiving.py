"""What a trainer rank knows while it receives: the steps' recipes, the pieces in, what is finished.

`ReceivingState` takes the frames of every message (from the coordinator, and the workers'
pieces) and decides everything about them: decoding and checks, deduplication by (step, index in
the recipe), each piece's tokens copied into its step, and finished steps handed over
(`ReadyStep`, whose micro-batches are built one at a time as the trainer takes them). It never
touches a socket; the client's I/O thread (`client.py`) moves bytes in and carries out what it
returns. It lives in the I/O thread only; a ReadyStep, once handed over, belongs to the trainer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from msd_common import protocol as P
from msd_common.session import Forgotten
from msd_common import wire
from .assemble import StepAssembler
from .buffers import BufferPool
from msd_common.errors import JobFailedError, ProtocolError, RejectedError
from msd_common.topology import Topology, cp_share

log = logging.getLogger("msd.client")

MAX_BUFFERED_STEPS = 256  # pieces for steps this far ahead are dropped (a broken or hostile sender)
MAX_BUFFERED_PIECES = 1_000_000  # and so are pieces beyond this many held for unfinished steps


class Stopping:
    """The coordinator said it is stopping: a standby (or the same address, restarted) may take
    over; if none does within the grace period, the rank raises CoordinatorStoppedError."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class End:
    """Marker for the trainer: the coordinator ended the stream."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


# What a control message asks of the I/O thread.
@dataclass(frozen=True, slots=True)
class Welcomed:
    heartbeat_s: float


@dataclass(frozen=True, slots=True)
class EvalReady:
    """A pass over an eval set whose pieces are all in (or, with `reason`, one that cannot be served)."""

    set: str
    pass_no: int
    assembler: StepAssembler | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class StateReply:
    """The coordinator's state before `step` (None, with the reason, when it could not give it)."""

    step: int
    state: dict | None
    reason: str


class ReceivingState:
    def __init__(self, rank: int, next_step: int, next_micro_batch: int, plan_digest: str | None,
                 metadata_only: bool = False) -> None:
        self.rank = rank
        self.metadata_only = metadata_only
        self.plan_digest = plan_digest  # from the checkpoint, then the coordinator's
        self.batch_info: dict[str, Any] | None = None
        self.steps: dict[int, tuple[StepAssembler, Any]] = {}  # step -> (its assembler, plan summary)
        self.early: dict[int, list[tuple[np.ndarray, ...]]] = {}  # pieces that came before their recipe
        self.step = next_step  # next micro-batch to assemble
        self.micro_batch = next_micro_batch
        self.duplicates = 0
        self.buffered = 0  # pieces held in self.early
        self.end: tuple[int, str] | None = None  # (first step that will not come, why)
        self.not_welcomed: str | None = None  # why the coordinator answered a hello without a welcome
        # eval passes: step id (protocol.eval_step) -> (set, pass, assembler); pieces before their header
        self.eval_steps: dict[int, tuple[str, int, StepAssembler]] = {}
        self.eval_early: dict[int, list[tuple[np.ndarray, ...]]] = {}
        # passes handed over (step -> (set, pass)): pieces sent again for them are dropped, until the
        # trainer asks for that pass again (asked())
        self.eval_done: dict[int, tuple[str, int]] = {}

    # ------------------------------------------------------------------ the coordinator's messages

    def on_control(self, frames: list) -> list[Any]:
        """One message from the coordinator: returns what follows from it, for the I/O thread
        (Welcomed, Forgotten) and for the trainer (an error to raise, End)."""
        try:
            msg = wire.receive(frames, P.TRAINER_CONTROL_INBOX)
        except ProtocolError as e:
            log.warning("rank %d: dropped message from coordinator: %s", self.rank, e)
            return []
        if isinstance(msg, P.TrainerWelcome):
            out: list[Any] = [Welcomed(float(msg.heartbeat_s))]
            earlier = msg.batch.get("earlier_plan_digests", []) if isinstance(msg.batch, dict) else []
            if self.plan_digest is not None and self.plan_digest != msg.plan_digest and self.plan_digest not in earlier:
                out.append(RejectedError(f"plan digest {msg.plan_digest} differs from the checkpoint's "
                                         f"{self.plan_digest}: the job file changed"))
            self.plan_digest = msg.plan_digest
            self.batch_info = msg.batch
            return out
        if isinstance(msg, P.StepHeader):
            self._on_step_header(msg)
        elif isinstance(msg, P.EvalHeader):
            return self._on_eval_header(msg)
        elif isinstance(msg, P.RankTaken):
            log.warning("rank %d: %s; asking again", self.rank, msg.reason)
            self.not_welcomed = msg.reason
        elif isinstance(msg, P.EndOfStream):
            log.info("rank %d: the stream ends before step %d: %s", self.rank, msg.step, msg.reason)
            self.end = (msg.step, msg.reason)
        elif isinstance(msg, P.UnknownPeer):
            return [Forgotten(msg.reason)]  # (said by RankCore: once per registration lost)
        elif isinstance(msg, P.Reject):
            return [RejectedError(f"rank {self.rank}: coordinator refused: {msg.reason}")]
        elif isinstance(msg, P.Shutdown):  # the coordinator stops: never the end of the data (end_of_stream is)
            log.warning("rank %d: the coordinator is stopping (%s); waiting for a coordinator to take over",
                        self.rank, msg.reason)
            return [Stopping(msg.reason)]
        elif isinstance(msg, P.JobFailed):
            log.error("rank %d: the coordinator stopped the job: %s", self.rank, msg.reason)
            return [JobFailedError(f"rank {self.rank}: the coordinator stopped the job: {msg.reason}")]
        elif isinstance(msg, P.StateReply):
            return [StateReply(msg.step, msg.state if msg.ok else None, msg.reason)]
        return []

    def _on_eval_header(self, msg: P.EvalHeader) -> list[Any]:
        if msg.reason:
            return [EvalReady(msg.set, msg.pass_no, None, msg.reason)]
        info = self.batch_info
        step = msg.step
        if info is None or msg.rank != self.rank or step < P.EVAL_STEP_BASE:
            log.warning("rank %d: eval header for rank %d dropped", self.rank, msg.rank)
            return []
        if step in self.eval_steps:
            return []
        self.eval_done.pop(step, None)  # the same pass asked for again (a rank that restarted its evaluation)
        try:
            assembler = StepAssembler(msg.pieces, msg.counts, msg.row_len, info["pad_id"],
                                      info["micro_batch_size"], info.get("patch_bytes", 0), info.get("rope", "plain"))
        except ValueError as e:
            return [EvalReady(msg.set, msg.pass_no, None, f"eval header unusable: {e}")]
        self.eval_steps[step] = (msg.set, msg.pass_no, assembler)
        for items, *payload in self.eval_early.pop(step, []):
            self.buffered -= len(items)
            assembler.add(items, *payload)
        return []

    def _on_step_header(self, msg: P.StepHeader) -> None:
        info = self.batch_info
        step = msg.step
        if info is None or msg.rank != self.rank or not self.step <= step < self.step + MAX_BUFFERED_STEPS:
            why = ("before the coordinator's welcome" if info is None else f"for rank {msg.rank}"
                   if msg.rank != self.rank else f"outside steps {self.step}..{self.step + MAX_BUFFERED_STEPS - 1}")
            log.warning("rank %d: step header of step %d dropped (%s)", self.rank, step, why)
            return
        mbs, n_mb = info["micro_batch_size"], info["micro_batches"]
        if len(msg.counts) != mbs * n_mb:
            log.warning("rank %d: step %d header has %d sequences, expected %d; dropped", self.rank, step,
                        len(msg.counts), mbs * n_mb)
            return
        if step in self.steps:
            return  # a repeated header: the plan of a step never changes
        try:
            assembler = StepAssembler(msg.pieces, msg.counts, msg.row_len, info["pad_id"], mbs,
                                      info.get("patch_bytes", 0), info.get("rope", "plain"))
        except ValueError as e:
            log.warning("rank %d: step %d header dropped: %s", self.rank, step, e)
            return
        self.steps[step] = (assembler, msg.plan)
        for items, *payload in self.early.pop(step, []):  # pieces that came before their recipe
            self.buffered -= len(items)
            self.duplicates += assembler.add(items, *payload)

    # ------------------------------------------------------------------ the workers' pieces

    def on_pieces(self, frames: list) -> None:
        try:
            msg = wire.receive(frames, P.TRAINER_DATA_INBOX)
            # (before the welcome the topology is not known: such pieces are held, and checked against
            # the recipe's references like any piece when it comes)
            if msg.rank != self.rank and self.batch_info is not None and not self._same_dp(msg.rank):
                raise ProtocolError(f"pieces for rank {msg.rank} sent to rank {self.rank}")
        except ProtocolError as e:
            log.warning("rank %d: dropped data message: %s", self.rank, e)
            return
        step = msg.step
        items = msg.items  # PIECE_ITEM rows
        payload = (msg.tokens, msg.patch_counts, msg.patches, msg.loss_mask, msg.extras,
                   msg.extra_rows, msg.tail)
        if step >= P.EVAL_STEP_BASE:  # a piece of an eval pass
            if step in self.eval_done:
                self.duplicates += len(items)
            elif step in self.eval_steps:
                self.duplicates += self.eval_steps[step][2].add(items, *payload)
            elif self.buffered + len(items) <= MAX_BUFFERED_PIECES:
                self.eval_early.setdefault(step, []).append((items, *payload))
                self.buffered += len(items)
            return
        if not self.step <= step < self.step + MAX_BUFFERED_STEPS:
            self.duplicates += 1  # an old step (a re-sent delivery) or absurdly far ahead
            return
        if len(payload[1]) and msg.patch_bytes != (self.batch_info or {}).get("patch_bytes"):
            log.warning("rank %d: dropped data message: patches of %d bytes, the job's are %s", self.rank,
                        msg.patch_bytes, (self.batch_info or {}).get("patch_bytes"))
            return
        if step in self.steps:
            self.duplicates += self.steps[step][0].add(items, *payload)
            return
        if self.buffered + len(items) > MAX_BUFFERED_PIECES:
            log.warning("rank %d: %d pieces already buffered; data message for step %d dropped", self.rank,
                        self.buffered, step)
            return
        self.early.setdefault(step, []).append((items, *payload))
        self.buffered += len(items)

    def _same_dp(self, rank: int) -> bool:
        """Whether `rank` is of this rank's data-parallel rank: a relay passes a DP rank's pieces,
        asked for once per host, to each of its local ranks of that DP rank."""
        info = self.batch_info
        if info is None:
            return False
        topo = Topology(**info["topology"])
        return rank < topo.world_size and topo.coords(rank).dp == topo.coords(self.rank).dp

    # ------------------------------------------------------------------ finished steps

    def finished_evals(self) -> list[EvalReady]:
        """Eval passes whose pieces are all in, for the trainer's thread."""
        done = [step for step, (_, _, a) in self.eval_steps.items() if a.done]
        for step in done:
            self.eval_done[step] = self.eval_steps[step][:2]
        return [EvalReady(*self.eval_steps.pop(step)) for step in done]

    def asked(self, name: str, pass_no: int) -> None:
        """The trainer asks for this pass: it is not done here any more, even if it was handed over
        before (served unasked, to a rank that then restarted its evaluation): its pieces that come
        before its header are kept, not dropped as copies of a pass taken (found by msd.sim, seed
        201540: the pass never completed)."""
        for step in [s for s, what in self.eval_done.items() if what == (name, pass_no)]:
            del self.eval_done[step]

    def finished(self) -> list[Any]:
        """Steps whose recipe and pieces are all in, in order from where the client resumes, for
        the trainer's thread (ReadyStep), and End once the stream's end is reached."""
        out: list[Any] = []
        while self.step in self.steps and self.steps[self.step][0].done:
            assembler, plan = self.steps.pop(self.step)
            out.append(ReadyStep(self.step, self.micro_batch, assembler, plan, self.rank, self.batch_info,
                                 self.metadata_only))
            self.step, self.micro_batch = self.step + 1, 0
        if self.end is not None and self.step >= self.end[0]:
            out.append(End(self.end[1]))
            self.end = None
        return out


@dataclass(frozen=True, slots=True)
class ReadyStep:
    """A step of one rank whose pieces are all in, as received (tokens in the wire's dtype). Its
    micro-batches are built one at a time, as the trainer takes them (by the trainer's thread,
    or just ahead by the client's builder thread, prebuild.py): built
    micro-batches (int64 tokens, labels and position ids, float32 loss mask: 28 bytes a token)
    take 7-14x the memory of the received tokens, and the coordinator's look-ahead delivers
    several steps early, so a client holds the micro-batch its trainer holds and at most one
    more built (until 2026-12-02 the client's I/O thread built whole steps, one ahead of the trainer:
    two steps of int64 arrays per rank). The step is complete and no longer touched by the I/O
    thread, so building it in another thread is safe."""

    step: int
    first: int  # the first micro-batch the trainer takes (a resume mid-step)
    assembler: StepAssembler
    plan: Any
    rank: int
    batch_info: dict[str, Any]
    metadata_only: bool

    @property
    def micro_batches(self) -> int:
        return self.assembler.micro_batches

    def micro_batch(self, m: int, pool: BufferPool | None = None, ahead: bool = False,
                    pixels_to: Any = None) -> dict[str, Any]:
        """pixels_to: a device where the pixel values are made at next(); they stay PendingPixels here."""
        batch = for_rank(self.assembler.micro_batch(m, pool, ahead, pixels_later=pixels_to is not None),
                         self.batch_info, self.rank, self.metadata_only)
        batch["step"], batch["micro_batch"] = self.step, m
        if m == 0:
            batch["plan"] = self.plan
        return batch


def for_rank(batch: dict[str, Any], info: dict[str, Any], rank: int, metadata_only: bool) -> dict[str, Any]:
    """What a global rank gets of its DP rank's micro-batch: its CP share, and the fields of its
    pipeline stage (msd_common.topology)."""
    topo = Topology(**info["topology"])
    if topo.world_size == topo.dp:
        return batch
    coords = topo.coords(rank)
    if topo.cp > 1:
        batch = cp_share(batch, topo.cp, coords.cp, info["pad_id"])
    keep = set(topo.fields(rank, want_metadata=metadata_only))
    return {k: v for k, v in batch.items() if k in keep}
