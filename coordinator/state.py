"""The coordinator's state machine: `CoordinatorState.handle(*events) -> list[Instruction]`.

It owns everything the coordinator knows: the planner, the registry of peers
(`registry.py`), which worker holds which prepared record (`positions.PositionTables`), the
prepare tasks (`tasks.TaskBook`), the deliveries (`deliveries.DeliveryBook`), the per-source
costs and host sizes (`workforce.py`) and the recent planner states (`history.StepHistory`).
It never touches a socket, a clock or a file: events bring the time and the messages, and the
instructions it returns say what to send and what to write, in order. The shell (`app.py`)
carries them out. That makes every decision here replayable from its events (`stimulus.py`)
and testable without processes (tests/unit/test_coordinator_state.py).

One call handles a burst of events, then plans once ("pump"): whatever may be planned is
planned, the states of the new steps are journaled (an instruction the shell finishes before
any later send), then the steps are dispatched and more records are asked for.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

import numpy as np

from msd_common import protocol as P
from msd_common.spec import JobConfig

from .adapt import AdaptBook
from .ahead import AheadBytes
from .balance import imbalance
from .deliveries import DeliveryBook
from .events import (Consumed, Delivered, EvalReport, EvalRequest, Event, HostHeartbeat, HostHello, MixRequest,
                     PeerGone, Prepared, RelayReport, RelayHeartbeat, RelayHello, Shutdown, StateRequest, TaskFailed,
                     Tick, TrainerBye,
                     TrainerHeartbeat, TrainerHello, WorkerExited, WorkerHeartbeat, WorkerHello)
from .history import StepHistory
from .calibration_book import CalibrationBook
from .evaluation import EvalBook
from .instructions import (AppendCostChange, AppendEvalLoss, AppendJournal, CompactJournal,
                           Instruction, Send, Stop, WriteStatus)
from .layout import StepLayout
from .lead import PrepareLead
from .mix import MixtureChanges, check_weights
from .plan import NeedLength, Planner, PlannerState, SourceExhausted, StepPlan
from .positions import NOBODY
from .preparation import PreparationBook
from . import resume
from .relay_book import RelayBook
from .registry import HostInfo, RelayInfo, Registry, TrainerInfo, WorkerInfo
from .skips import SkipBook
from .state_status import relay_status, status_of
from .sources import OpenedSources
from .tasks import TaskBook
from .welcome import host_scale, trainer_batch_info, version_refusal, worker_welcome
from .workforce import Workforce, retire_idle

log = logging.getLogger("msd.coordinator")

# The messages each registered role may send, and the field that names the sender.
_EVENTS_OF: dict[str, tuple[type, ...]] = {
    "worker": (WorkerHeartbeat, Prepared, TaskFailed, Delivered),
    "trainer": (Consumed, TrainerHeartbeat, TrainerBye, StateRequest, EvalRequest, EvalReport),
    "host": (HostHeartbeat, WorkerExited),
    "relay": (RelayHeartbeat, RelayReport),
}
_ID_FIELD = {"worker": "worker_id", "trainer": "rank", "host": "agent_id", "relay": "relay_id"}
FORGET_EVERY_STEPS = 32  # position-table entries nothing refers to are dropped this often
HOST_BEAT_MIN_S = 1.0  # host agents are forgotten after 3 x max(heartbeat_s, this) of silence


# events that move nothing but a rank's consumed step
_RANK_REPORTS = (Consumed, TrainerHeartbeat, RelayHeartbeat, RelayReport)


class CoordinatorState:
    def __init__(self, job: JobConfig, sources: OpenedSources, history: StepHistory,
                 mixture_changes: list[tuple[int, list[float]]] = (),
                 quarantined: list[tuple[str, int]] = (),
                 cost_changes: list[tuple[int, list[float]]] = ()) -> None:
        """history: the recent planner states (restored from the journal, if any);
        mixture_changes: run-time weight changes of an earlier run (the mixture journal);
        quarantined: (source name, record) of records that killed workers (the quarantine journal);
        cost_changes: cost models calibrated earlier in the run, (from step, coefficients as
        calibrate.TERMS) (the cost journal)."""
        self.job = job
        self.planner = Planner(job, sources.num_records)
        self.mixtures = MixtureChanges(self.planner, [s.name for s in job.sources], history.durable)
        self.mixture_changes = self.mixtures.changes  # msd mix's and mixture.adapt's, in order
        for at_step, weights in mixture_changes:
            self.mixtures.replay(at_step, weights)
        # balance.calibrate: the micro-batches' features, the ranks' compute times, the models adopted
        self.calibration = CalibrationBook(job, self.planner, self._dp_rank, cost_changes)
        self.topology = job.topology
        self.receivers = set(job.topology.receivers())  # global ranks that get data
        self.planned: list[tuple[int, float, float, list[int]]] = []  # see handle()
        self.digest = job.digest()
        self.earlier_digests = job.earlier_digests()  # checkpoints of 0.3.0 and 0.4.0 carry these
        self.rope = job.rope  # read once: the processor directory's JSON
        self.batch_info = trainer_batch_info(job, self.rope, self.earlier_digests)  # every rank's welcome says it
        self.heartbeat_s = job.runtime.heartbeat_s
        self.registry = Registry()
        self.workforce = Workforce(len(job.sources), job.runtime.allocation, job.runtime.shrink_after_s)
        n = len(job.sources)
        self.tasks = TaskBook()
        self.lead = PrepareLead(n, self.job.runtime.lookahead_steps)
        self.ahead = AheadBytes(self.job.runtime.ahead_bytes, self.job.topology.dp)
        self.skips = SkipBook(job, history.durable)  # skipped records, transform errors, quarantine
        self.quarantined = self.skips.quarantined  # source -> records never handed to a worker again
        self.clock = 0.0  # the time of the last event (events bring the time; a task handed out is stamped with it)
        # what is known of every stream position, and preparing it ahead of the plan
        self.prep = PreparationBook(job, self.planner, sources, self.tasks, self.registry, self.workforce, self.lead,
                                    self.quarantined, self.skips,
                                    lambda s, positions: self.layout.epochs(s, positions), lambda: self.clock)
        self.tables = self.prep.tables  # (the same object: read here by planning, dispatch and rewinds)
        self.deliveries = DeliveryBook()
        self.relay_book = RelayBook(self.registry, job.topology, self.heartbeat_s)
        self.layout = StepLayout(job.topology, self.registry, self.tables, self.deliveries, self.planner.num_records)
        self.mapped = self.prep.mapped
        self.history = history
        self._journal_lines: list[dict] = []  # states recorded, not yet in an AppendJournal
        self._compact_to: dict | None = None
        restored = history.latest
        # the furthest the plan has stood in this run (restored, or planned here): a rewind plans the
        # same steps again, so a rank that resumes at or before it is behind the plan, not ahead
        self.planned_until = restored.next_step if restored is not None else 0
        self.adopted: tuple[int, Any] | None = None  # (step, state) brought by the first resuming rank
        # no state of an earlier run (a plan that never got past step 0 is none either)
        self.fresh = (restored is None or restored.next_step == 0) and not mixture_changes and not quarantined \
            and not cost_changes
        if restored is not None:  # a restart: carry on where the last run's plan stood
            self.planner.state = restored
            log.info("state restored: the plan stands at step %d (steps %d.. can be resumed)", restored.next_step,
                     history.oldest)
        else:
            self._record(self.planner.state)
        self.prep.reset_tables()
        self.skipped_by_kind = self.skips.by_kind  # per source: kind -> count
        for name, record in quarantined:
            if not self.skips.replay(name, record):
                log.warning("quarantine journal names source %r, which this job does not have; ignored", name)
        self.adapt = AdaptBook(job.adapt, [src.name for src in job.sources], job.runtime.lookahead_steps,
                               self._dp_rank, [at for at, _ in self.mixture_changes],
                               self.planner.state.next_step) if job.adapt else None  # mixture.adapt
        self.eval = EvalBook(job, self.planner.holdout, self.planner.num_records, self.topology,
                             lambda: self.registry.workers, lambda: self.registry.trainers)
        self._dead_pids: dict[tuple[int, int], int] = {}  # (agent, pid) -> worker id of workers forgotten
        # seconds each rank that left had waited for data: status and metrics keep the run's waits
        self.departed_wait: dict[int, float] = {}
        self.last_consumed_step = -1  # the furthest step any rank (here now or gone) reported consumed
        self.end: tuple[int, str] | None = None  # (first step that will never be planned, why)
        self.waiting: tuple[int, int] | None = None  # (source, position) whose length planning waits for
        self.stopped = False
        self.failed = False  # an internal error: the state may be inconsistent
        self.failure: str | None = None  # why the job was stopped on a fatal error, if it was
        self.events_handled = self.messages_sent = 0
        self._last_status: float | None = None
        self._out: list[Instruction] = []
        self._handlers: dict[type, Callable[[Any, Any], None]] = {
            WorkerHeartbeat: self._on_worker_heartbeat, Prepared: self._on_prepared, TaskFailed: self._on_task_failed,
            Delivered: self._on_delivered, Consumed: self._on_consumed, TrainerHeartbeat: self._alive,
            TrainerBye: self._on_trainer_bye, HostHeartbeat: self._on_host_heartbeat,
            WorkerExited: self._on_worker_exited, StateRequest: self._on_state_request,
            EvalRequest: self._on_eval_request, EvalReport: self._on_eval_report,
            RelayHeartbeat: self._on_relay_heartbeat, RelayReport: self._on_relay_report,
        }
        self._unregistered: dict[type, Callable[[Any], None]] = {
            Tick: lambda ev: self._tick(ev.at), Shutdown: lambda ev: self._shutdown(ev.reason, ev.failed),
            WorkerHello: self._on_worker_hello, TrainerHello: self._on_trainer_hello, MixRequest: self._on_mix_request,
            HostHello: self._on_host_hello, RelayHello: self._on_relay_hello, PeerGone: self._on_peer_gone,
        }
        self._peers_of = {"worker": self.registry.workers, "trainer": self.registry.trainers,
                          "host": self.registry.hosts, "relay": self.registry.relays}

    # ------------------------------------------------------------------ the one entry point

    def handle(self, *events: Event) -> list[Instruction]:
        """Apply a burst of events, then plan and dispatch what may be; returns what to do, in order."""
        out = self._out = []
        self.planned = []  # (step, max/mean, arrival-order max/mean, tokens per source) of the steps planned now
        if self.failed:  # after an internal error nothing more is decided; only the peers are told
            events = tuple(e for e in events if isinstance(e, Shutdown))
        slowest = self.registry.slowest()
        for event in events:
            self.events_handled += 1
            self.clock = event.at
            try:
                self._apply(event)
            except Exception:  # one message we could not handle: log it, drop it, serve the rest
                log.exception("error handling %s", type(event).__name__)
        # Ranks' reports that leave the slowest rank where it was change nothing planning and
        # dispatch look at: the pass would find what the last one found. At hundreds of ranks
        # nearly every burst is such (5,534 passes -> 248 in a 60-step profile at DP 512).
        quiet = bool(events) and self.registry.slowest() == slowest and all(type(e) in _RANK_REPORTS for e in events)
        if not (self.stopped or self.failed or quiet):
            try:
                self._pump()
            except Exception as e:
                # Planning and dispatch keep invariants across steps; after an unexpected error
                # there, carrying on could deliver a wrong stream or stall it silently.
                log.critical("internal error while planning step %d; stopping the coordinator",
                             self.planner.state.next_step, exc_info=True)
                self.failed = True
                self.failure = f"internal error while planning step {self.planner.state.next_step}: {e!r}"
                out.append(Stop(self.failure, failed=True))
        self._out = []
        return out

    def _send(self, peer: bytes, message: P.Message) -> None:
        self.messages_sent += 1
        self._out.append(Send(peer, message))

    def _sent(self, sends: list[Send]) -> None:
        """What a book returned to send."""
        self.messages_sent += len(sends)
        self._out.extend(sends)

    def _apply(self, ev: Event) -> None:
        first = self._unregistered.get(type(ev))  # events that need no registration
        if first is not None:
            return first(ev)
        kind = type(ev).__name__
        who = self.registry.lookup(ev.peer)
        if who is None:
            log.warning("%s from unregistered peer %s dropped; asked it to say hello", kind, ev.peer.hex(),
                        extra={"peer": ev.peer.hex()})
            self._send(ev.peer, P.UnknownPeer(reason="not registered: send a hello first"))
            return
        role, pid = who
        if not isinstance(ev, _EVENTS_OF[role]):
            log.warning("%s %d sent %s, which a %s does not send; dropped", role, pid, kind, role)
            return
        if getattr(ev, _ID_FIELD[role]) != pid:
            log.warning("%s %d claims to be %s %d; dropped", role, pid, role, getattr(ev, _ID_FIELD[role]))
            return
        info = self._peers_of[role][pid]
        info.last_seen = ev.at
        self._handlers[type(ev)](ev, info)

    # ------------------------------------------------------------------ hellos and requests

    def _on_worker_hello(self, ev: WorkerHello) -> None:
        refusal = version_refusal(ev.version, f"worker from {ev.host}")
        if refusal is not None:
            self._send(ev.peer, refusal)
            return
        if ev.peer in self.registry:
            self._forget_peer(ev.peer, "re-registered")
        worker = self.registry.add_worker(ev.peer, ev.at, ev.agent, ev.pid)
        log.info("worker %d registered (host %s pid %d)", worker.worker_id, ev.host, ev.pid,
                 extra={"worker_id": worker.worker_id, "peer": ev.peer.hex()})
        self._send(ev.peer, worker_welcome(self.job, worker.worker_id))
        self._sent(self.eval.pump())  # a pass waiting for workers

    def _on_host_hello(self, ev: HostHello) -> None:
        refusal = version_refusal(ev.version, f"worker host {ev.host}")
        if refusal is not None:
            self._send(ev.peer, refusal)
            return
        if ev.peer in self.registry:
            self._forget_peer(ev.peer, "re-registered")
        host = HostInfo(ev.agent_id, ev.peer, ev.host, ev.procs, ev.min_procs, ev.max_procs, bool(ev.auto), ev.at)
        self.registry.add_host(host)
        log.info("worker host %s registered: %d process(es)%s", host.host, host.procs,
                 f", auto up to {host.max_procs}" if host.auto else "")
        self._scale(host, host.procs, [], "registered")

    def _on_relay_hello(self, ev: RelayHello) -> None:
        answer = self.relay_book.answer(ev)
        if answer is None:  # a relay to admit: what it replaces is forgotten first (with its ranks)
            for identity, why in self.relay_book.replaced(ev):
                self._forget_peer(identity, why)
            answer = self.relay_book.admit(ev)
        self._emit(answer)

    def _on_relay_heartbeat(self, ev: RelayHeartbeat, relay: RelayInfo) -> None:
        """One heartbeat for the relay and every rank behind it that it still hears (answered)."""
        self.relay_book.counters(ev, relay)
        self._alive(ev, relay)

    def _on_trainer_hello(self, ev: TrainerHello) -> None:
        rank = ev.rank
        relay = None
        if ev.via:  # through a relay, which must be registered (a restarted coordinator: it says hello first)
            relay = self.registry.relay_at(ev.via)
            if relay is None:
                self._send(ev.via, P.UnknownPeer(reason="relay not registered: send a relay_hello first"))
                return
            relay.last_seen = ev.at
        reason = resume.refusal(self, ev)
        if reason:
            log.warning("trainer rank %d rejected: %s", rank, reason, extra={"rank": rank, "peer": ev.peer.hex()})
            self._send(ev.peer, P.Reject(reason=reason))
            return
        old = self.registry.trainers.get(rank)
        if old is not None and old.identity != ev.peer and ev.at - old.last_seen < 3 * self.heartbeat_s:
            # Another client holds this rank and is alive: two trainers must never share a rank.
            # The newcomer keeps asking; the rank is its once the holder leaves or goes silent. The
            # holder is asked if it is there: a rank's process started again alone (its old one
            # killed) finds the old connection gone (PeerGone), and is welcomed at its next hello.
            log.warning("rank %d claimed by a second client while the first is alive; refused", rank)
            self._send(ev.peer, P.RankTaken(rank=rank, reason=f"rank {rank} is held by a live client"))
            self._send(old.identity, P.Alive())
            return
        address = relay.address if relay is not None else ev.data_address
        if (old is not None and old.identity == ev.peer and old.address == address
                and old.incarnation == ev.incarnation and ev.resume_step == old.consumed + 1):
            # The same client saying hello again before our welcome reached it (a busy coordinator
            # at a thousand ranks): nothing to rewind, nothing to register again.
            old.last_seen = ev.at
            self._welcome(ev.peer, rank)
            return
        if ev.resume_step > max(self.planner.state.next_step, self.planned_until):
            self._out.extend(resume.adopt(self, ev))
        elif ev.resume_step < self.planner.state.next_step:
            self._rewind(ev.resume_step, resume.state_before(self, ev).to_json())
        if self.registry.lookup(ev.peer) not in (None, ("trainer", rank)):
            self._forget_peer(ev.peer, "re-registered")
        self.registry.add_trainer(TrainerInfo(rank, ev.peer, address, ev.at, ev.resume_step - 1,
                                              via=relay.relay_id if relay is not None else None,
                                              incarnation=ev.incarnation))
        log.info("rank %d registered, data address %s%s", rank, address,
                 f" (relay {relay.relay_id})" if relay is not None else "", extra={"rank": rank, "peer": ev.peer.hex()})
        self._welcome(ev.peer, rank)

    def _welcome(self, peer: bytes, rank: int) -> None:
        self._send(peer, P.TrainerWelcome(rank=rank, batch=self.batch_info, plan_digest=self.digest,
                                          heartbeat_s=self.heartbeat_s))
        if self.end is not None:
            self._send(peer, P.EndOfStream(step=self.end[0], reason=self.end[1]))

    def _on_mix_request(self, ev: MixRequest) -> None:
        """New weights from a later step on (msd mix): checked, journaled, then answered."""
        names = [s.name for s in self.job.sources]
        weights, problems = check_weights(names, self.planner.state.next_step, ev.at_step, ev.weights)
        if weights is not None:  # journaled before the answer, and before any step planned with it goes out
            self._out.extend(self.mixtures.change(ev.at_step, weights, "msd mix"))
        self._send(ev.peer, P.MixReply(ok=int(weights is not None), reason=problems, at_step=ev.at_step))

    # ------------------------------------------------------------------ messages of registered peers

    def _alive(self, ev: Event, who: Any) -> None:
        """Every heartbeat is answered: a peer that hears nothing for 3 heartbeats moves on to the
        next coordinator address it has (a standby that took over)."""
        self._send(ev.peer, P.Alive())

    def _on_worker_heartbeat(self, ev: WorkerHeartbeat, worker: WorkerInfo) -> None:
        if worker.busy_at is not None and ev.at > worker.busy_at:
            worker.busy_share = min(1.0, max(0.0, ev.busy_s - worker.busy_s) / (ev.at - worker.busy_at))
        worker.busy_at = ev.at
        worker.busy_s = max(worker.busy_s, ev.busy_s)
        worker.backlog, worker.send_waits = ev.backlog, ev.send_waits
        self._alive(ev, worker)

    def _on_host_heartbeat(self, ev: HostHeartbeat, host: HostInfo) -> None:
        """The agent vouches for its live worker processes: a worker busy on one sample for minutes
        sends nothing itself, and is alive while its process is (it is declared dead when its
        agent reports its exit, when the agent falls silent, or past its source's max_sample_s)."""
        host.procs = ev.procs
        for pid in ev.pids:
            worker = self.registry.worker_by_pid(host.agent_id, pid)
            if worker is not None:
                worker.last_seen = max(worker.last_seen, ev.at)
        self._alive(ev, host)

    def _on_worker_exited(self, ev: WorkerExited, host: HostInfo) -> None:
        """The host agent saw a worker process end: forgotten now (not after heartbeats of
        silence), and the task it was working on, if any, is blamed (the poison record hunt)."""
        overran = ev.overran_s > 0 and 0 <= ev.source < len(self.job.sources) and ev.record >= 0
        blame = ev.task_id if ev.task_id >= 0 and ev.exitcode != 0 and not overran else None
        if overran:  # the record is poison at once: trying it again would hold a worker as long
            src = self.job.sources[ev.source]
            self._quarantine(ev.source, ev.record, f"its sample took longer than max_sample_s ({src.max_sample_s:g}s) "
                                                   f"on host {host.host}; the worker process was stopped")
        worker = self.registry.worker_by_pid(host.agent_id, ev.pid)
        if worker is not None:
            log.warning("worker %d (pid %d) exited with %d (its host agent says): declared dead", worker.worker_id,
                        ev.pid, ev.exitcode, extra={"worker_id": worker.worker_id})
            self._forget_peer(worker.identity, "dead", blame)
            return
        wid = self._dead_pids.get((host.agent_id, ev.pid))  # already forgotten: it was silent first
        if blame is not None and wid is not None:
            self._blame(blame, wid)
            self._sent(self.prep.assign_queued())

    def _on_consumed(self, ev: Consumed, trainer: TrainerInfo) -> None:
        self._consumed([(trainer, ev.step, ev.waited_s)])
        if self.adapt is not None:
            self.adapt.report(trainer.rank, ev.loss_step, ev.loss_sources, ev.loss_sums, ev.loss_tokens)
        self.lead.consumed(ev.at, self.registry.slowest())
        if self.job.calibrate and ev.compute_step >= 0 and ev.compute_s:
            adopted = self.calibration.timed(trainer.rank, ev.compute_step, ev.compute_s, self.planner.state.next_step)
            if adopted is not None and self.history.durable:
                at, fit = adopted
                calibrator = self.calibration.calibrator
                self._out.append(AppendCostChange(at, tuple(fit.coefficients),
                                                  (float(calibrator.current_error or 0.0), float(fit.error)),
                                                  tuple(tuple(r) for r in calibrator.evidence)))

    def _consumed(self, rows: Iterable[tuple[TrainerInfo, int, float]]) -> None:
        # (a rank may be further on than a rewound plan: it assembled steps the last coordinator delivered)
        last = max(self.planner.state.next_step, self.planned_until) - 1
        self.last_consumed_step = max(self.last_consumed_step, self.registry.consumed(rows, last))

    def _on_relay_report(self, ev: RelayReport, relay: RelayInfo) -> None:
        """A relay_up's report: the relay's counters, and the `consumed` of its ranks."""
        self._consumed(self.relay_book.consumed(ev, relay))
        if self.adapt is not None and (losses := self.relay_book.losses(ev, relay)) is not None:
            self.adapt.report_table(*losses)
        self.lead.consumed(ev.at, self.registry.slowest())

    def _dp_rank(self, rank: int) -> int:
        return self.layout.dp_rank(rank)

    def _on_peer_gone(self, ev: PeerGone) -> None:
        """A rank or relay whose connection is gone is forgotten now. Not a worker: its host agent
        reports its exit with the task it died on (what narrows a poison record down), and a worker
        forgotten first would have its task handed on whole."""
        who = self.registry.lookup(ev.peer)
        if who is not None and ev.dropped:  # it would wait for that message for good (session.LOST_MESSAGES)
            log.warning("%s %d: a message to it was dropped; forgotten, it registers again", *who)
            self._forget_peer(ev.peer, "a message to it was dropped")
            self._send(ev.peer, P.UnknownPeer(reason="a message to this peer was dropped: say hello again"))
            return
        if who is None or who[0] not in ("trainer", "relay"):
            return
        log.warning("%s %d: its connection is gone; forgotten", *who)
        self._forget_peer(ev.peer, "disconnected")

    def _on_trainer_bye(self, ev: TrainerBye, trainer: TrainerInfo) -> None:
        log.info("rank %d left", trainer.rank)
        self._forget_peer(ev.peer, "left")

    def _on_eval_request(self, ev: EvalRequest, trainer: TrainerInfo) -> None:
        self._sent(self.eval.request(ev.rank, ev.set, ev.pass_no, ev.peer))

    def _on_eval_report(self, ev: EvalReport, trainer: TrainerInfo) -> None:
        losses = self.eval.report(ev.set, ev.step, ev.losses, ev.rank)
        if losses is not None and self.history.durable:
            self._out.append(AppendEvalLoss(ev.set, ev.step, ev.rank, tuple(sorted(losses.items()))))

    def _on_prepared(self, ev: Prepared, worker: WorkerInfo) -> None:
        if self.eval.owns(ev.task_id):
            for _, reason, kind in ev.skipped:
                log.warning("eval: record skipped (%s): %s", kind, reason.split("\n", 1)[0])
            self._sent(self.eval.prepared(ev.task_id, worker.worker_id, ev.lengths))
            return
        task = self.tasks.complete(ev.task_id, worker.worker_id)
        if task is None:
            log.debug("result of unknown or reassigned task %d ignored", ev.task_id)
            return
        s = task.source
        if len(ev.lengths) != len(task.positions):
            log.warning("worker %d: task %d returned %d lengths for %d records; re-issuing", worker.worker_id,
                        task.task_id, len(ev.lengths), len(task.positions))
            self._sent(self.prep.issue(s, task.positions))
            return
        for _, reason, kind in ev.skipped:
            self.skips.count(s, kind)
            log.warning("source %s: record skipped (%s): %s (%d skipped so far)", self.job.sources[s].name, kind,
                        reason.split("\n", 1)[0], self.skips.skipped(s), extra={"source": self.job.sources[s].name})
        failure = self.skips.transform_failure(s, ev.skipped, len(task.positions)) \
            if self.job.sources[s].transform else None
        if failure is not None:  # the transform is broken, not the data: the job stops, naming it
            log.critical("%s", failure, extra={"source": self.job.sources[s].name})
            self.failed, self.failure = True, failure
            self._out.append(Stop(failure, failed=True))
            return
        lengths = np.asarray(ev.lengths, dtype=np.int64)
        self.workforce.record(s, ev.busy_s, len(lengths), int(lengths.sum()))
        self.lead.task_done(s, ev.at - task.assigned_at)
        self.prep.set_prepared(s, task.positions, lengths, worker.worker_id, ev.patches, ev.patch_squares,
                               array_bytes=ev.array_bytes)

    def _on_task_failed(self, ev: TaskFailed, worker: WorkerInfo) -> None:
        if self.eval.owns(ev.task_id):
            log.error("worker %d failed eval task %d: %s", worker.worker_id, ev.task_id, ev.reason)
            self._sent(self.eval.failed(ev.task_id))
            return
        log.error("worker %d failed task %d: %s", worker.worker_id, ev.task_id, ev.reason,
                  extra={"worker_id": worker.worker_id})
        if self.tasks.fail(ev.task_id, worker.worker_id) is not None:
            self._sent(self.prep.assign_queued())

    def _on_delivered(self, ev: Delivered, worker: WorkerInfo) -> None:
        for s, record, reason, kind in ev.failed:  # planned, then its image pass failed: no loss on it
            if s < len(self.job.sources):
                self.skips.count(s, kind)
                log.warning("source %s: record %d delivered with nothing to train on (%s): %s (%d skipped so far)",
                            self.job.sources[s].name, record, kind, reason.split("\n", 1)[0], self.skips.skipped(s),
                            extra={"source": self.job.sources[s].name, "record": record})
        d = self.deliveries.acknowledge(ev.delivery_id, worker.worker_id)
        if d is None:
            log.debug("ack of unknown delivery %d", ev.delivery_id)
        else:
            # Only now is a used-up record really gone: until the ack, a worker death means re-preparing it.
            holders = self.tables.release(d.release)
            if self.mapped:
                self.prep.mapped_held.change(holders[self.prep.mapped_mask[d.release[:, 0]]], -1)
        if ev.unserved:
            # Its cache and our books disagree: what it holds is prepared again elsewhere, and its
            # deliveries sent again (the ranks drop what they already have), rather than a rank
            # waiting for good on pieces that will never come.
            log.warning("worker %d could not send %d piece(s) of delivery %d (not in its cache); preparing what it "
                        "held again elsewhere", worker.worker_id, ev.unserved, ev.delivery_id,
                        extra={"worker_id": worker.worker_id})
            self._send(worker.identity, P.UnknownPeer(reason="its cache lost records it was to deliver"))
            self._forget_peer(worker.identity, "lost records")

    # ------------------------------------------------------------------ time, failures, stopping

    def _tick(self, now: float) -> None:
        # A host agent is not on the data path (it starts processes, which may hold its loop for a
        # moment under load): a second of heartbeats at least before it is forgotten.
        for role, info in self.registry.silent(now, 3 * self.heartbeat_s, 3 * max(self.heartbeat_s, HOST_BEAT_MIN_S)):
            if role == "worker":
                log.warning("worker %d silent for %.1fs: declared dead", info.worker_id, now - info.last_seen,
                            extra={"worker_id": info.worker_id})
            elif role == "trainer":
                log.warning("rank %d silent for %.1fs: released (it may register again)", info.rank,
                            now - info.last_seen, extra={"rank": info.rank})
            elif role == "relay":
                log.warning("relay %d on %s silent for %.1fs: its ranks are released (they register again through "
                            "a relay started again)", info.relay_id, info.host, now - info.last_seen)
            else:
                log.warning("worker host %s silent for %.1fs: forgotten", info.host, now - info.last_seen)
            self._forget_peer(info.identity, "dead")
        self._scale_hosts(now)
        if self._last_status is None:
            self._last_status = now
        elif now - self._last_status >= self.job.runtime.status_every_s:
            self._last_status = now
            self._out.append(WriteStatus(self.status()))

    def _shutdown(self, reason: str, failed: str = "") -> None:
        """Every peer is told: workers and hosts stop; ranks end their stream, or, when a fatal error
        stopped the job, raise it (JobFailedError with the reason). A last status.json says how the
        job ended, so `msd status` and `msd report` made afterwards show it."""
        self.stopped = True
        self.failure = failed or self.failure
        for w in self.registry.workers.values():
            self._send(w.identity, P.Shutdown(reason=reason))
        for t in self.registry.trainers.values():
            self._send(t.identity, P.JobFailed(reason=self.failure) if self.failure
                       else P.Shutdown(reason=reason))
        for r in self.registry.relays.values():  # after what they pass on to their ranks
            self._send(r.identity, P.Shutdown(reason=reason))
        try:
            self._out.append(WriteStatus({**self.status(), "stopped": reason, "failed": self.failure}))
        except Exception:  # noqa: BLE001 - after an internal error the books may not add up; the peers are told
            log.exception("no last status (the state is inconsistent)")

    def _scale_hosts(self, now: float) -> None:
        reg = self.registry
        for host, procs in self.workforce.decide(now, reg.hosts, reg.workers, reg.trainers):
            log.info("worker host %s: %d -> %d processes (trainers wait %.0f%% of the time, workers %.0f%% busy)",
                     host.host, host.procs, procs, 100 * self.workforce.last_wait, 100 * self.workforce.last_busy)
            host.procs = procs
            self._scale(host, procs, [], "trainers wait for data")
        def holds(wid: int) -> bool:
            return bool(self.tasks.in_flight(wid) or self.deliveries.holds(wid)
                        or any(t.count_held(wid) for t in self.tables))

        for host, worker in retire_idle(reg.hosts, reg.workers, holds):
            self._scale(host, host.procs, [worker.pid], "idle")
            reg.remove(worker.identity)

    def _scale(self, host: HostInfo, procs: int, retire: list[int], reason: str) -> None:
        """Tell a host agent its process count (and which emptied workers to stop)."""
        self._send(host.identity, host_scale(self.job, procs, retire, reason))

    def _forget_peer(self, identity: bytes, why: str, blame: int | None = None) -> None:
        """blame: the task the worker died working on (its host agent said so)."""
        removed = self.registry.remove(identity)
        if removed is not None and removed[0] == "relay":
            relay = removed[1]
            for t in [t for t in self.registry.trainers.values() if t.via == relay.relay_id]:
                self._forget_peer(t.identity, why)
            for w in self.registry.workers.values():  # what workers hold for it: dropped, with its connection
                self._send(w.identity, P.ReleaseRank(rank=0, address=relay.address))
            return
        if removed is not None and removed[0] == "trainer":
            rank = removed[1].rank
            self.departed_wait[rank] = max(self.departed_wait.get(rank, 0.0), removed[1].waited_s)
            if removed[1].via is not None:  # its relay serves other ranks on the same connection
                return
            # What workers still hold for it would wait in their backlogs for good: dropped.
            # (A rank that comes back registers again and resumes from its own step.)
            for w in self.registry.workers.values():
                self._send(w.identity, P.ReleaseRank(rank=removed[1].rank, address=removed[1].address))
            return
        if removed is None or removed[0] != "worker":
            return
        wid = removed[1].worker_id
        log.info("worker %d %s: re-preparing its tasks and cached records elsewhere", wid, why,
                 extra={"worker_id": wid})
        self._dead_pids[(removed[1].agent, removed[1].pid)] = wid  # the agent's report of it may come later
        while len(self._dead_pids) > 4096:
            del self._dead_pids[next(iter(self._dead_pids))]
        self.tasks.withdraw(wid)  # back to the queue: assigned below, or when a worker registers
        self._sent(self.eval.worker_gone(wid))
        if blame is not None:
            self._blame(blame, wid)
        lost = {s: t.held_by(wid) for s, t in enumerate(self.tables)}
        for s, positions in lost.items():
            self.prep.reprepare.update((s, p) for p in positions.tolist())
        _, acked = self.deliveries.orphan(wid)
        for d in acked:  # acknowledged, but maybe never sent: again, from new copies
            for rows in (d.positions, d.release):
                for s in np.unique(rows[:, 0]).tolist():
                    positions = np.unique(rows[rows[:, 0] == s, 1])
                    gone = positions[self.tables[s].holders(positions) == NOBODY]
                    lost[s] = np.union1d(lost[s], gone)
                    self.prep.reprepare.update((s, p) for p in gone.tolist())
        self._sent(self.prep.assign_queued())
        for s, positions in lost.items():
            if len(positions):
                self.prep.reprepared += len(positions)
                self._sent(self.prep.issue(s, positions))
        # its deliveries are sent again by the next planning pass, once their records have live holders

    def _blame(self, task_id: int, worker_id: int) -> None:
        """A worker died working on this task: narrow it down to one record, and quarantine a
        record that has killed skips.ALLOWED_DEATHS workers (each try on another worker)."""
        task = self.tasks.get(task_id)
        if task is None or worker_id not in task.workers:
            return
        single = int(self.tables[task.source].records(task.positions)[0]) \
            if task.worker_id is None and len(task.positions) == 1 else None
        verdict, writes = self.skips.death(task, worker_id, single)
        if verdict == "split":
            self.tasks.split(task)
        self._out.extend(writes)

    def _quarantine(self, s: int, record: int, reason: str) -> None:
        self._out.extend(self.skips.quarantine(s, record, reason))

    def _reissue_orphans(self) -> None:
        """Send deliveries of dead workers again, once every record they read has a live holder
        (called once per planning pass, not from the handlers). Trainer clients drop pieces they
        already have, so a repeated piece is harmless."""
        # In step order, and none after one that must wait: a later step's delivery may release a
        # record an earlier step still reads (the worker would drop it before the earlier one came).
        for d in self.deliveries.orphans():
            if d.needs() & self.prep.reprepare:
                return
            self.deliveries.replaced(d)
            self._emit(self.layout.deliver(d.step, d.items, d.positions, d.release))

    # ------------------------------------------------------------------ planning and dispatch

    def _pump(self) -> None:
        trainers = self.registry.trainers
        self.deliveries.finish_consumed(lambda r: trainers[r].consumed if r in trainers else -1,
                                        self.registry.slowest(), self.registry.ranks_generation)
        if not self.registry.workers:
            return
        self._sent(self.prep.assign_queued())  # tasks queued while no worker lived
        if self.deliveries.orphaned:  # a dead worker's deliveries whose records have live holders again
            self._reissue_orphans()
        if self.prep.reprepare or not self.registry.all_present(self.receivers):
            # Records lost with a dead worker are being prepared again (a carried-over document may
            # be among them), or not every rank is here yet: plan nothing, but prepare ahead.
            self._sent(self.prep.prepare_ahead())
            return
        slowest = self.registry.slowest()
        self.ahead.consumed_through(slowest)
        for decision in self.adapt.decide(slowest, self.planner.weights_at) if self.adapt is not None else ():
            self._out.extend(self.mixtures.change(decision.at_step, decision.weights, "mixture.adapt"))
        planned = []
        while self.end is None and self.planner.state.next_step < slowest + 1 + self.job.runtime.lookahead_steps:
            if self.planner.state.next_step > slowest + 1 and self.ahead.full():
                break  # runtime.ahead_bytes: the steps ahead hold enough images for some rank
            if self.adapt is not None and self.adapt.holds(self.planner.state.next_step):
                break  # mixture.adapt: a decision this step needs waits for its losses

            if self.waiting is not None and self.tables[self.waiting[0]].window(self.waiting[1], 1)[1][0] < 0:
                break  # the length the last attempt stopped at is still not in: planning would stop there again
            self.waiting = None
            try:
                plan = self.planner.plan_step(self.prep)
            except NeedLength as need:  # nothing changed: plan again once the length is in
                self.waiting = (need.source, need.position)
                self._sent(self.prep.ensure_prepared(need.source, need.position))
                break
            except SourceExhausted as e:
                log.warning("%s: the stream ends before step %d", e, e.step, extra={"step": e.step})
                self.end = (e.step, str(e))
                for t in trainers.values():
                    self._send(t.identity, P.EndOfStream(step=e.step, reason=str(e)))
                break
            finally:
                for event in self.planner.events:
                    log.warning("%s", event)
                self.planner.events.clear()
            self._record(self.planner.state)
            self.ahead.planned(plan, lambda s, positions: self.tables[s].nbytes(positions))
            planned.append(plan)
        self._journal()  # the steps are durable before any of their deliveries goes out
        for plan in planned:
            self._dispatch(plan)
            if plan.step % FORGET_EVERY_STEPS == 0:
                self._forget_old()
        self._sent(self.prep.prepare_ahead())

    def _record(self, state) -> None:
        self.planned_until = max(self.planned_until, state.next_step)
        j, compact = self.history.record(state)
        if not self.history.durable:
            return
        if compact:  # the rewritten journal holds this state only
            self._journal_lines.clear()
            self._compact_to = j
        else:
            self._journal_lines.append(j)

    def _journal(self) -> None:
        if self._compact_to is not None:
            self._out.append(CompactJournal(self._compact_to))
            self._compact_to = None
        if self._journal_lines:
            self._out.append(AppendJournal(tuple(self._journal_lines)))
            self._journal_lines = []

    def _forget_old(self) -> None:
        """Drop position-table entries nothing can refer to any more: below the planner's cursor
        (and the document it carries, and the whole samples it left out), every delivery not done
        and every prepare task."""
        floor = list(self.planner.state.cursors)
        for s, carry in enumerate(self.planner.state.carry):
            if carry is not None:
                floor[s] = min(floor[s], carry[0])
        for s, units in enumerate(self.planner.state.deferred):  # whole samples left out of a step
            if units:
                floor[s] = min(floor[s], units[0][0])
        n = len(floor)
        for floors in (self.deliveries.floors(n), self.tasks.floors(n)):
            for s, low in enumerate(floors):
                if low is not None:
                    floor[s] = min(floor[s], low)
        for s, table in enumerate(self.tables):
            table.forget_before(floor[s])

    def _dispatch(self, plan: StepPlan) -> None:
        if self.job.calibrate:
            self.calibration.planned(plan, lambda s, positions: (self.tables[s].patches(positions),
                                                                 self.tables[s].lengths(positions),
                                                                 self.tables[s].patch_squares(positions)))
        ours, naive = imbalance(plan.rank_costs), imbalance(plan.naive_rank_costs)
        self.planned.append((plan.step, ours, naive, plan.source_tokens))
        if plan.step % 100 == 0:
            log.info("step %d planned: max/mean rank cost %.3f (arrival order: %.3f)", plan.step, ours, naive,
                     extra={"step": plan.step})
        self._emit(self.layout.step(plan, (ours, naive)))

    def _emit(self, sends: list[Send]) -> None:
        self.messages_sent += len(sends)
        self._out.extend(sends)

    # ------------------------------------------------------------------ resume

    def _rewind(self, step: int, journaled: dict | None) -> None:
        """Plan again from `step` (a trainer resumes from an older checkpoint). The planner is
        deterministic, so the steps planned again are the ones planned before; what was prepared
        or in flight for them is dropped, and the workers start clean (they register again)."""
        log.warning("rewinding the plan from step %d to step %d", self.planner.state.next_step, step,
                    extra={"step": step})
        self.history.forget_after(step)
        self._restart_plan(self.history.state_before(step, journaled))

    def _restart_plan(self, state: PlannerState) -> None:
        """Plan from this state on: what was prepared or in flight is dropped, and the workers
        start clean (they register again)."""
        step = state.next_step
        self.planner.state = state
        self.ahead.forget_from(step)
        self.deliveries.clear()
        self.prep.reprepare.clear()
        self.tasks.clear()
        self.lead.forget_pace()
        self.waiting = None
        if self.end is not None and self.end[0] > step:
            self.end = None
        for w in self.registry.forget_workers():
            self._send(w.identity, P.UnknownPeer(reason=f"plan rewound to step {step}: start clean"))
        self._sent(self.eval.reset())
        self.prep.reset_tables()

    def _on_state_request(self, ev: StateRequest, trainer: TrainerInfo) -> None:
        self._emit([resume.state_reply(self, ev)])

    # ------------------------------------------------------------------ status

    def relay_status(self) -> list[dict[str, Any]]:
        return relay_status(self)

    def status(self) -> dict[str, Any]:
        return status_of(self)
