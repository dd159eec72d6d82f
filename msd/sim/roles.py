"""The simulated processes: thin shells, like the real ones, around the roles' decision code.

- `SimCoordinator`: `coordinator.state.CoordinatorState`, its journals kept in memory (a crash
  keeps what was appended, as the state dir would), bursts of messages, a tick a heartbeat.
- `SimHost` and `SimWorker`: a host agent and its worker processes, each `worker.core.WorkerCore`
  reading the seed's real files. A worker is busy while it works (its heartbeats wait; the agent
  vouches for it), and the agent reports a worker's death and starts another process.
- `SimRank`: `trainer_client.rank_core.RankCore`; `SimTrainer` takes steps in lockstep over every
  rank, as a data-parallel trainer does, checkpoints, and restarts from its checkpoint.

Every message goes through the real wire encoding (msd_common.wire) and the receiver's decoder.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import numpy as np

from coordinator.events import PeerGone, Shutdown, Tick, from_message
from coordinator.history import StepHistory
from coordinator.relaying import RelayEnvelopes
from coordinator.instructions import (AppendCostChange, AppendJournal, AppendMixture, AppendQuarantine, CompactJournal,
                                      Send, Stop)
from coordinator.state import CoordinatorState
from coordinator.validate import validate_state
from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.session import Forgotten, Registration
from relay import core as RC
from trainer_client import rank_core as R
from trainer_client.receiving import End, ReadyStep
from worker import core as W

if TYPE_CHECKING:
    from .run import Simulation

COORDINATOR = "coord"
LINGER_S = 0.5  # a stopping coordinator's sends still go out this long (its socket's linger)


class Violation(AssertionError):
    """An invariant did not hold."""


class SimCoordinator:
    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self.journal: list[dict] = []
        self.mixture: list[tuple[int, list[float]]] = []
        self.quarantine: list[tuple[str, int]] = []
        self.costs: list[tuple[int, list[float]]] = []
        self.state: CoordinatorState | None = None
        self.inbox: list = []
        self.generation = 0
        self.paused_until = 0.0
        self.dirty = False  # a burst was handled since the books were last validated
        self.dropped: list[bytes] = []  # peers a send to found its queue full (the shell's PeerGone)
        self.crashes = 0  # (what a crashed process had sent and was not on the wire yet is lost: world.py)

    def start(self) -> None:
        sim = self.sim
        self.generation += 1
        self.state = CoordinatorState(sim.job, sim.sources, StepHistory(True, list(self.journal)), list(self.mixture),
                                      list(self.quarantine), list(self.costs))
        self.inbox = []
        self.envelopes = RelayEnvelopes()  # as the shell (app.py): relayed ranks' messages in and out
        sim.world.listen(COORDINATOR, self)
        sim.world.log(f"coordinator {self.generation} starts (journal of {len(self.journal)} states)")
        self._tick(self.generation)

    @property
    def up(self) -> bool:
        return self.state is not None

    def _tick(self, generation: int) -> None:
        if generation != self.generation or self.state is None:
            return
        if self.sim.world.now >= self.paused_until:
            self._execute(self.state.handle(Tick(at=self.sim.world.now)))
        self.sim.world.after(self.state.heartbeat_s if self.state else 1.0, self._tick, generation)

    def receive(self, src: str, dst: str, frames: list) -> None:
        if not self.inbox:
            self.sim.world.after(max(0.0002, self.paused_until - self.sim.world.now), self._drain, self.generation)
        self.inbox.append((src, frames))

    def _drain(self, generation: int) -> None:
        if generation != self.generation or self.state is None:
            return
        world = self.sim.world
        if world.now < self.paused_until:  # a long pause (a GC, a stalled disk): the messages wait
            world.at(self.paused_until, self._drain, generation)
            return
        burst, self.inbox = self.inbox, []
        events = []
        for src, frames in burst:
            try:
                header, arrays = wire.decode(frames, P.COORDINATOR_INBOX)
            except ProtocolError as e:
                raise Violation(f"the coordinator could not decode a message from {src}: {e}") from e
            if header["type"] == P.RelayUp.TYPE:
                events.extend(self.envelopes.unpack(src.encode(), world.now, header, arrays))
            else:
                events.append(from_message(src.encode(), world.now, header, arrays))
        self._execute(self.state.handle(*events))

    def _execute(self, instructions: list) -> None:
        world = self.sim.world
        self.dirty = True
        for ins in instructions:
            if isinstance(ins, Send):
                self.sim.count(ins.message.TYPE)
                if self.envelopes.relayed(ins.peer):  # to a rank behind a relay: one relay_down per burst
                    self.envelopes.add(ins.peer, ins.message)
                    continue
                if self.envelopes.waiting_for(ins.peer):  # what it is to pass on goes first
                    for relay, frames in self.envelopes.take(ins.peer):
                        self._send(relay, frames)
                self._send(ins.peer, wire.encode(ins.message))
            elif isinstance(ins, AppendJournal):  # durable before anything after it goes out
                self.journal.extend(ins.states)
            elif isinstance(ins, CompactJournal):
                self.journal = [ins.state]
            elif isinstance(ins, AppendQuarantine):
                self.quarantine.append((ins.source, ins.record))
            elif isinstance(ins, AppendMixture):
                self.mixture.append((ins.at_step, list(ins.weights)))
            elif isinstance(ins, AppendCostChange):
                self.costs.append((ins.at_step, list(ins.coefficients)))
            elif isinstance(ins, Stop):
                if ins.failed or (self.state is not None and self.state.failed):
                    raise Violation(f"the coordinator stopped the job: {ins.reason}")
                world.log(f"coordinator stops: {ins.reason}")
        for relay, frames in self.envelopes.take():
            self._send(relay, frames)

    def _send(self, peer: bytes, frames: list) -> None:
        if not self.sim.world.send(COORDINATOR, peer.decode(), frames):
            if not self.dropped:
                self.sim.world.after(0.0, self._gone, self.generation)
            self.dropped.append(peer)

    def _gone(self, generation: int) -> None:
        peers, self.dropped = self.dropped, []
        if generation == self.generation and self.state is not None:
            self._execute(self.state.handle(*[PeerGone(at=self.sim.world.now, peer=p, dropped=True)
                                              for p in dict.fromkeys(peers)]))

    def validate_if_due(self) -> None:
        if self.dirty and self.state is not None:
            self.dirty = False
            problems = validate_state(self.state)
            if problems:
                raise Violation("the coordinator's books disagree: " + "; ".join(problems[:5]))

    # ------------------------------------------------------------------ faults

    def crash(self) -> None:
        self.sim.world.log(f"FAULT coordinator {self.generation} crashes")
        self.crashes += 1
        self.sim.world.close(COORDINATOR, self)
        self.state, self.inbox = None, []
        self.generation += 1

    def stop(self) -> None:
        """A graceful stop (SIGTERM): peers are told, and what it sent goes out (its socket's linger)
        before the process ends."""
        self.sim.world.log(f"FAULT coordinator {self.generation} stops gracefully")
        self._execute(self.state.handle(Shutdown(at=self.sim.world.now, reason="SIGTERM")))
        self.state, self.inbox = None, []
        self.sim.world.after(LINGER_S, self._gone_after_linger, self.generation)

    def _gone_after_linger(self, generation: int) -> None:
        if generation == self.generation and self.state is None:
            self.sim.world.close(COORDINATOR, self)
            self.generation += 1


class SimHost:
    """A worker host's agent and its worker processes (`procs` of them, restarted when they die)."""

    def __init__(self, sim: "Simulation", index: int, procs: int) -> None:
        self.sim = sim
        self.index = index
        self.address = f"host{index}"
        self.agent_id = 100 + index
        self.procs = procs
        self.workers: list[SimWorker] = []
        self.next_pid = 1000 * (index + 1)
        self.up = False
        self.registration = Registration(
            lambda: P.HostHello(version=P.PROTOCOL_VERSION, agent_id=self.agent_id, host=self.address,
                                procs=self.procs, min_procs=self.procs, max_procs=self.procs, auto=0),
            lambda: P.HostHeartbeat(agent_id=self.agent_id, procs=self.procs,
                                    pids=[w.pid for w in self.workers if w.busy_until > self.sim.world.now]))

    def start(self) -> None:
        self.up = True
        self.sim.world.listen(self.address, self)
        for _ in range(self.procs):
            self.spawn()
        self._turn()

    def spawn(self) -> SimWorker:
        self.next_pid += 1
        w = SimWorker(self.sim, self, self.next_pid)
        self.workers.append(w)
        w.start()
        return w

    def _turn(self) -> None:
        if not self.up:
            return
        now = self.sim.world.now
        msg = self.registration.due(now)
        if msg is not None:
            self.send(msg)
        self.sim.world.after(self.registration.heartbeat_s / 2, self._turn)

    def send(self, msg: P.Message) -> None:
        if not self.sim.world.send(self.address, COORDINATOR, wire.encode(msg)):
            self.connection_lost()

    def connection_lost(self) -> None:
        self.registration.forgotten()

    def receive(self, src: str, dst: str, frames: list) -> None:
        msg = wire.receive(frames, P.HOST_INBOX)
        self.registration.heard(self.sim.world.now)
        if isinstance(msg, P.Scale):
            self.registration.welcomed(msg.heartbeat_s)
        elif isinstance(msg, P.UnknownPeer):
            self.registration.forgotten()
        elif isinstance(msg, (P.Shutdown, P.JobFailed)):
            self.registration.stopping(self.sim.world.now)

    def worker_died(self, worker: SimWorker, task_id: int) -> None:
        """The agent reaps a worker process: it reports the exit, then starts another."""
        self.workers.remove(worker)
        if not self.up:
            return
        self.send(P.WorkerExited(agent_id=self.agent_id, pid=worker.pid, exitcode=-9, task_id=task_id))
        self.sim.world.after(0.05, self.spawn)

    def lose(self) -> None:
        """The host is lost: its agent and every worker go silent at once (no exit is reported)."""
        self.sim.world.log(f"FAULT host {self.index} lost")
        self.up = False
        self.sim.world.close(self.address, self)
        for w in list(self.workers):
            w.die()
        self.workers.clear()


class SimWorker:
    def __init__(self, sim: "Simulation", host: SimHost, pid: int) -> None:
        self.sim = sim
        self.host = host
        self.pid = pid
        self.address = f"w{host.index}.{pid}"
        self.core = W.WorkerCore()
        self.alive = False
        self.busy_until = 0.0
        self.task = -1  # the prepare task being worked on (the agent reports it if the process dies)
        self.inbox: list[list] = []
        self.slow = 1.0  # the cost of its samples, times this (a slow-sample fault)
        self.registration = Registration(
            lambda: P.WorkerHello(version=P.PROTOCOL_VERSION, host=host.address, pid=pid, incarnation=pid,
                                  agent=host.agent_id),
            lambda: self.core.heartbeat(0.0))

    def start(self) -> None:
        self.alive = True
        self.sim.world.listen(self.address, self)
        self._turn()

    def _turn(self) -> None:
        if not self.alive:
            return
        now = self.sim.world.now
        if now >= self.busy_until:
            msg = self.registration.due(now)
            if msg is not None and not self.sim.world.send(self.address, COORDINATOR, wire.encode(msg)):
                self.connection_lost(f"{msg.TYPE} dropped")
        self.sim.world.after(self.registration.heartbeat_s / 2, self._turn)

    def connection_lost(self, why: str = "the connection broke") -> None:
        if self.alive:
            self._apply(self.core.connection_lost(why))

    def receive(self, src: str, dst: str, frames: list) -> None:
        self.inbox.append(frames)
        if len(self.inbox) == 1 and self.sim.world.now >= self.busy_until:
            self._work()

    def _work(self) -> None:
        """Take the next message; the work's results go out when it is done."""
        if not self.alive or not self.inbox or self.sim.world.now < self.busy_until:
            return
        world = self.sim.world
        frames = self.inbox.pop(0)
        self.registration.heard(world.now)
        msg = wire.receive(frames, P.WORKER_INBOX)
        self.task = msg.task_id if isinstance(msg, P.Prepare) else -1
        actions = self.core.handle(msg)
        cost = 0.0002
        if isinstance(msg, P.Prepare):
            cost += self.sim.sample_cost(msg.source, msg.records, self.slow)
        elif isinstance(msg, P.Deliver):
            cost += 0.00002 * len(msg.items)
        self.busy_until = world.now + cost
        world.after(cost, self._done, actions)

    def _done(self, actions: list) -> None:
        if not self.alive:
            return
        self.task = -1
        self._apply(actions)
        if self.registration.registered:  # the work counted as a sign of life, as the loop's keep_alive
            self.registration.spoke(self.sim.world.now)
        self._work()

    def _apply(self, actions: list) -> None:
        world = self.sim.world
        for a in actions:
            if isinstance(a, W.ToCoordinator):
                if not world.send(self.address, COORDINATOR, wire.encode(a.message)):
                    self._apply(self.core.connection_lost(f"{a.message.TYPE} dropped"))
            elif isinstance(a, W.ToRank):
                world.send(self.address, a.address, wire.encode(a.message), data=True)
            elif isinstance(a, W.Registered):
                self.registration.welcomed(a.heartbeat_s)
            elif isinstance(a, Forgotten):
                self.registration.forgotten()
            elif isinstance(a, W.CoordinatorStopping):
                self.registration.stopping(world.now)
            elif isinstance(a, W.Quit):
                raise Violation(f"worker {self.address} quit: {a.reason}")

    def die(self) -> None:
        self.alive = False
        self.sim.world.close(self.address, self)
        self.inbox.clear()

    def crash(self) -> None:
        self.sim.world.log(f"FAULT worker {self.address} crashes (task {self.task})")
        task = self.task
        self.die()
        self.host.worker_died(self, task)


def documents(batches: list[dict[str, Any]]) -> list:
    """What a step (or an eval pass) holds over all its ranks, whatever the DP: per document, where
    its tokens in the step start and a digest of every token it has there, by position within the
    document (counted: a small source can bring one document twice to a step, in two epochs, and
    how its pieces are cut across rows depends on the DP, so the pieces are not joined in order)."""
    pieces: dict[int, list[tuple[int, np.ndarray]]] = {}
    for batch in batches:
        tokens = np.asarray(batch["tokens"]).reshape(len(batch["pieces_per_row"]), -1)
        keys, offsets, lengths = (np.asarray(batch[k]).tolist() for k in ("doc_keys", "doc_offsets", "piece_lengths"))
        i = 0
        for row, n in enumerate(np.asarray(batch["pieces_per_row"]).tolist()):
            at = 0
            for _ in range(n):
                pieces.setdefault(keys[i], []).append((offsets[i], tokens[row, at:at + lengths[i]]))
                at += lengths[i]
                i += 1
    out = []
    for key, parts in sorted(pieces.items()):
        positions = np.concatenate([np.arange(o, o + len(t), dtype=np.int64) for o, t in parts])
        values = np.concatenate([t.astype(np.int64) for _, t in parts])
        order = np.lexsort((values, positions))
        digest = hashlib.blake2b(positions[order].tobytes() + values[order].tobytes(), digest_size=8).hexdigest()
        out.append([key, min(o for o, _ in parts), digest])
    return out


def _digest(batch: dict[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=12)
    for key in sorted(batch):
        value = batch[key]
        if isinstance(value, np.ndarray):
            h.update(key.encode())
            h.update(np.ascontiguousarray(value).tobytes())
        elif key not in ("plan",):
            h.update(f"{key}={value!r}".encode())
    return h.hexdigest()


class SimRank:
    def __init__(self, sim: "Simulation", rank: int, next_step: int, incarnation: int, via: str | None) -> None:
        """via: the address of the relay of its host (None: it talks to the coordinator itself)."""
        self.sim = sim
        self.rank = rank
        self.address = f"rank{rank}.{incarnation}"
        self.control = via or COORDINATOR
        self.core = R.RankCore(rank, next_step, 0, sim.plan_digest, data_address=self.address,
                               incarnation=incarnation, stop_grace_s=1e9, coordinator_timeout_s=1e9,
                               via_relay=via is not None, relay_timeout_s=1e9)
        self.ready: list[Any] = []  # handed to the trainer, in order
        self.evals: list[Any] = []  # eval passes whose pieces are all in (EvalReady)
        self.alive = True

    def start(self) -> None:
        self.sim.world.listen(self.address, self)
        self._turn()

    def _turn(self) -> None:
        if not self.alive:
            return
        now = self.sim.world.now
        msg = self.core.registration.due(now)
        if msg is not None and not self.sim.world.send(self.address, self.control, wire.encode(msg)):
            self.connection_lost(f"{msg.TYPE} dropped")
        self._do(self.core.turn(now))
        self.sim.world.after(self.core.registration.heartbeat_s / 2, self._turn)

    def receive(self, src: str, dst: str, frames: list) -> None:
        if not self.alive:
            return
        now = self.sim.world.now
        if src == self.control:
            self.core.registration.heard(now)
            self._do(self.core.on_control(frames, now))
        else:
            self.core.on_pieces(frames)
        self._do(self.core.turn(now))

    def _do(self, actions: list) -> None:
        world = self.sim.world
        for a in actions:
            if isinstance(a, R.Send):
                if not world.send(self.address, self.control, wire.encode(a.message)):
                    self.connection_lost(f"{a.message.TYPE} dropped")
            elif isinstance(a, R.ToTrainer):
                if isinstance(a.item, BaseException):
                    raise Violation(f"rank {self.rank} would raise: {a.item}")
                if isinstance(a.item, End):
                    raise Violation(f"rank {self.rank}: the stream ended: {a.item.reason}")
                self.ready.append(a.item)
                self.sim.trainer.maybe_step()
            elif isinstance(a, R.CoordinatorStopping):
                self.core.registration.stopping(world.now)
            elif isinstance(a, R.ToEvals):
                self.evals.append(a.item)
                self.sim.trainer.maybe_step()

    def connection_lost(self, why: str = "the connection broke") -> None:
        if self.alive:
            self.core.connection_lost(why)

    def consumed(self, step: int) -> None:
        self._do(self.core.command(["consumed", step, 0.0, -1, []], self.sim.world.now))

    def evaluate(self, name: str, pass_no: int) -> None:
        """client.eval_batches: ask for the pass; its pieces come as an EvalReady."""
        self._do(self.core.command(["eval", name, pass_no], self.sim.world.now))

    def die(self) -> None:
        self.alive = False
        self.sim.world.close(self.address, self)


class SimTrainer:
    """Every rank takes step s together (the gradients' all-reduce), computes, and reports it
    consumed; a checkpoint every few steps; a restart resumes every rank from the last one. With an
    eval set, every `eval_every` steps every rank takes a pass over it before the next step (as a
    trainer's evaluation loop does: all ranks together), and each pass must be the fault-free run's."""

    def __init__(self, sim: "Simulation", ranks: list[int], compute_s: float, checkpoint_every: int,
                 eval_every: int = 0, eval_set: str = "") -> None:
        self.sim = sim
        self.rank_ids = ranks
        self.compute_s = compute_s
        self.checkpoint_every = checkpoint_every
        self.step = 0  # the next step the trainer takes
        self.checkpoint = 0  # the step its last checkpoint resumes from
        self.incarnation = 0
        self.ranks: dict[int, SimRank] = {}
        self.busy_until = 0.0
        self.paused_until = 0.0
        self.woken_at: float | None = None  # a maybe_step is scheduled then
        self.stream: dict[tuple[int, int], list[str]] = {}  # (rank, step) -> micro-batch digests, as trained
        self.trained = 0  # steps taken in all, counting steps taken again after a restart
        self.eval_every, self.eval_set = eval_every, eval_set
        self.eval_pass: int | None = None  # the pass every rank waits for (None: not evaluating)
        self.eval_passes = 0  # passes asked for by this incarnation (a client counts its own)
        self.evaluated = 0  # passes completed in all

    def start(self) -> None:
        self.incarnation += 1
        self.step = self.checkpoint
        self.eval_pass, self.eval_passes = None, 0
        self.ranks = {r: SimRank(self.sim, r, self.step, self.incarnation * 1000 + r, self.sim.relay_of(r))
                      for r in self.rank_ids}
        for rank in self.ranks.values():
            rank.start()

    def maybe_step(self, woken: bool = False) -> None:
        world = self.sim.world
        if woken:
            self.woken_at = None
        free_at = max(self.busy_until, self.paused_until)
        if world.now < free_at:
            if self.woken_at is None or self.woken_at > free_at:  # one wake-up is enough
                self.woken_at = free_at
                world.at(free_at, self.maybe_step, True)
            return
        if self.eval_pass is not None:
            self._maybe_evaluated()
            return
        if not self.ranks or any(not r.ready for r in self.ranks.values()):
            return
        step, incarnation = self.step, self.incarnation
        batches = []
        for rank in self.ranks.values():
            ready = rank.ready.pop(0)
            if not isinstance(ready, ReadyStep) or ready.step != step:
                raise Violation(f"rank {rank.rank} was handed step {getattr(ready, 'step', ready)} where the trainer "
                                f"takes step {step}")
            mine = [ready.micro_batch(m) for m in range(ready.first, ready.micro_batches)]
            digests = [_digest(b) for b in mine]
            self.sim.check_step(rank.rank, step, digests)
            self.stream[(rank.rank, step)] = digests
            batches += mine
        if self.sim.global_check:
            self.stream[(-1, step)] = documents(batches)
            self.sim.check_global((-1, step), self.stream[(-1, step)])
        self.busy_until = world.now + self.compute_s
        world.after(self.compute_s, self._computed, step, incarnation)

    def _computed(self, step: int, incarnation: int) -> None:
        if incarnation != self.incarnation:
            return
        self.trained += 1
        self.step = step + 1
        for rank in self.ranks.values():
            rank.consumed(step)
        if self.step % self.checkpoint_every == 0:
            self.checkpoint = self.step
        self.sim.progress(self.step)
        if self.eval_every and self.step % self.eval_every == 0:
            self.eval_pass, self.eval_passes = self.eval_passes, self.eval_passes + 1
            for rank in self.ranks.values():
                rank.evaluate(self.eval_set, self.eval_pass)
        self.maybe_step()

    def _maybe_evaluated(self) -> None:
        """Once every rank has the pass: its micro-batches checked, and training goes on."""
        for rank in self.ranks.values():  # as client.eval_batches: another pass (asked again, twice served) is dropped
            while rank.evals and (rank.evals[0].set, rank.evals[0].pass_no) != (self.eval_set, self.eval_pass):
                stale = rank.evals.pop(0)
                self.sim.world.log(f"rank {rank.rank} drops eval pass {stale.pass_no}, waiting for {self.eval_pass}")
        if not self.ranks or any(not r.evals for r in self.ranks.values()):
            return
        batches = []
        for rank in self.ranks.values():
            ready = rank.evals.pop(0)
            if ready.assembler is None:
                raise Violation(f"rank {rank.rank}: eval pass {ready.pass_no} of {ready.set!r} refused: {ready.reason}")
            mine = [ready.assembler.micro_batch(m) for m in range(ready.assembler.micro_batches)]
            digests = [_digest(b) for b in mine]
            self.sim.check_step(rank.rank, -1, digests)
            self.stream[(rank.rank, -1)] = digests
            batches += mine
        if self.sim.global_check:
            self.stream[(-1, -1)] = documents(batches)
            self.sim.check_global((-1, -1), self.stream[(-1, -1)])
        self.sim.world.log(f"eval pass {self.eval_pass} taken after step {self.step - 1}")
        self.eval_pass = None
        self.evaluated += 1
        self.maybe_step()

    def restart(self, down_s: float, ranks: list[int] | None = None) -> None:
        """Every rank's process ends (a failed node, a preemption); the job restarts from its
        checkpoint (with these ranks: an elastic resume at another DP)."""
        if ranks is not None:
            self.rank_ids = ranks
        if not self.ranks:  # down already: its restart is on its way
            return
        self.sim.world.log(f"FAULT trainer restarts from step {self.checkpoint} (was at {self.step})")
        for rank in self.ranks.values():
            rank.die()
        self.ranks = {}
        self.incarnation += 1
        self.sim.world.after(down_s, self.start)


class SimRelay:
    """A trainer host's relay: `relay.core.RelayCore` at `relay<i>` (its ranks' endpoint and its
    identity at the coordinator) and `relay<i>.data` (where workers push the host's pieces)."""

    def __init__(self, sim: "Simulation", index: int) -> None:
        self.sim = sim
        self.index = index
        self.address = f"relay{index}"
        self.data = f"relay{index}.data"
        self.generation = 0
        self.crashes = 0
        self.core: RC.RelayCore | None = None

    def start(self) -> None:
        self.generation += 1
        self.core = RC.RelayCore(self.data, self.address, self.address, 7000 + self.index * 100 + self.generation)
        self.sim.world.listen(self.address, self)
        self.sim.world.listen(self.data, self)
        self._turn(self.generation)

    def _turn(self, generation: int) -> None:
        if generation != self.generation or self.core is None:
            return
        now = self.sim.world.now
        msg = self.core.due(now)
        if msg is not None and not self.sim.world.send(self.address, COORDINATOR, wire.encode(msg)):
            self.connection_lost(f"{msg.TYPE} dropped")
        self._do(self.core.turn(now))
        self.sim.world.after(self.core.registration.heartbeat_s / 4, self._turn, generation)

    def connection_lost(self, why: str = "the connection broke") -> None:
        if self.core is not None:
            self.core.connection_lost(why)

    def receive(self, src: str, dst: str, frames: list) -> None:
        if self.core is None:
            return
        now = self.sim.world.now
        if dst == self.data:
            self._do(self.core.on_data(frames))
        elif src == COORDINATOR:
            self.core.registration.heard(now)
            self._do(self.core.on_up(frames, now))
        else:
            self._do(self.core.on_local(src.encode(), frames, now))
        self._do(self.core.turn(now))

    def _do(self, actions: list) -> None:
        world = self.sim.world
        for a in actions:
            if isinstance(a, RC.ToCoordinator):
                if not world.send(self.address, COORDINATOR, wire.encode(a.message)):
                    self.connection_lost(f"{a.message.TYPE} dropped")
            elif isinstance(a, RC.ToRank):
                world.send(self.address, a.identity.decode(), a.frames)
            elif isinstance(a, RC.ToData):
                world.send(self.data, a.address, a.frames)
            elif isinstance(a, RC.MoveOn):  # one coordinator address: hello there until one serves
                self.core.registration.stopping(world.now)
        if not self.core.running:
            raise Violation(f"relay {self.index} stopped")

    def crash(self, down_s: float) -> None:
        self.sim.world.log(f"FAULT relay {self.index} crashes")
        self.crashes += 1
        self.sim.world.close(self.address, self)
        self.sim.world.close(self.data, self)
        self.core = None
        self.generation += 1
        self.sim.world.after(down_s, self.start)
