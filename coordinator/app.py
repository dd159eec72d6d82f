"""The coordinator process's shell: one asyncio loop (uvloop) around one ZeroMQ ROUTER socket.

It owns the sockets, the loops and the files of the state dir, and nothing else: every decision
is `CoordinatorState.handle`'s (state.py). An event flows like this:

    receive loop: frames -> wire.decode (a bad message is logged and dropped)
                  -> events.from_message (stamped with the monotonic clock)
    tick loop:    Tick(now) every heartbeat interval
    both:         state.handle(*burst) -> instructions -> _execute, in order:
                  Send goes out at once (non-blocking); file instructions (journal, mixture,
                  status) run in a thread, and every instruction after one waits for it.

Every burst and its instructions go to the stimulus log (stimulus.py), written to a file when
the coordinator fails, so the failure can be replayed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import gc
import logging
import os
import tempfile
import time
from typing import TYPE_CHECKING, Any

import orjson
import zmq

from msd_common import memory, security
from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.sockets import NOWAIT, has_message, raise_fd_limit, send_frames_nowait

from .balance import COMPILED
from msd_common.spec import JobConfig
from .cursor import COMPILED as PERMUTATION_COMPILED
from .events import Event, PeerGone, Shutdown, Tick, TrainerHello, from_message
from .history import StepHistory
from .instructions import FileInstruction, Instruction, Send, Stop, WriteStatus
from .lease import SELF_FENCE_BEATS, Lease, LeaseLost
from .linger import linger
from .relaying import RelayEnvelopes
from .router import Router
from .sources import OpenedSources
from .state import CoordinatorState
from .state_dir_writer import StateDirWriter, restore
from .state_status import RecentWarnings
from .statedir import write_state_file
from .status_view import status_line
from .stimulus import StimulusLog

if TYPE_CHECKING:  # imported where a job serves metrics: prometheus-client is 3.3 MB of a coordinator's memory
    from .metrics import CoordinatorMetrics

log = logging.getLogger("msd.coordinator")
MAX_BURST = 256  # messages handled before the next planning pass
GC_NURSERY = 20_000  # allocations between collections of the youngest generation (Python's default: 700)


class Coordinator:
    def __init__(self, job: JobConfig, sources: OpenedSources, bind: str = "tcp://127.0.0.1:5555",
                 state_dir: str | None = None, allow_config_change: bool = False, lease: Lease | None = None,
                 metrics: CoordinatorMetrics | None = None, router: Router | None = None) -> None:
        """lease: this coordinator's lease on the state dir (taken before: the journal is read here);
        metrics: Prometheus metrics to keep (served by the caller); router: the control socket,
        already bound (the counting phase's, whose peers carry on), else bound by run()."""
        self.job = job
        self.router = router
        self.metrics = metrics
        self.lease = lease
        self.bind = bind
        self.state_dir = state_dir
        restored = restore(state_dir, job, allow_config_change)
        self.journal = restored.journal
        loaded, mixture, quarantined, costs = restored.loaded, restored.mixture, restored.quarantined, restored.costs
        self.files = StateDirWriter(state_dir, self.journal, lease, metrics, self._status)
        self.state = CoordinatorState(job, sources, StepHistory(state_dir is not None, loaded), mixture, quarantined,
                                      costs)
        self.stimuli = StimulusLog({"job_path": os.path.abspath(job.path), "num_records": list(sources.num_records),
                                    "durable": state_dir is not None, "loaded_states": loaded,
                                    "mixture_changes": mixture, "quarantined": quarantined, "cost_changes": costs},
                                   max_bytes=int(job.runtime.stimulus_log_mb * (1 << 20)))
        self.sock: zmq.Socket | None = None
        self.stopped = asyncio.Event()
        self.quit = asyncio.Event()  # a stop signal: no lingering after a failure either
        self.failed = False
        self.failure: str | None = None  # the fatal error that stopped the job: ranks raise it
        self.messages_received = 0
        self.address: str | None = None
        self._backlog: collections.deque[Instruction] = collections.deque()  # waiting behind file work
        self.lease_lost = False
        self._drain_task: asyncio.Task | None = None
        self._readable: asyncio.Event | None = None  # set when the ROUTER may have messages (_receive_loop)
        # ZAP user ids of the operator keys (a CURVE job): the only ones whose control requests count
        self.operators = security.operator_ids(job.curve_keys) if job.curve_keys else None
        self._names = [s.name for s in job.sources]
        self.relays = RelayEnvelopes()
        self._relay_flush_due = False
        # sends that found their connection gone (EHOSTUNREACH), or dropped a message (high-water mark)
        self._gone_peers: list[tuple[bytes, bool]] = []
        self.warnings = RecentWarnings()
        logging.getLogger("msd").addHandler(self.warnings)

    # ------------------------------------------------------------------ lifecycle

    async def run(self, ready: asyncio.Future | None = None) -> None:
        memory.keep_freed_memory()
        # What was built to start (the job, the sources' tables) lives for the whole run: out of the
        # collector's way. And a collection per 700 allocations, each walking the books of thousands
        # of ranks, cost ~20 ms a step at DP 4,096 (tools/bench_fanout.py): the nursery is larger.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_NURSERY, 20, 20)
        raise_fd_limit("coordinator")
        router = self.router
        try:
            if router is None:
                router = Router.open(self.job, self.bind)
            self.sock = router.sock
            self.address = router.address
            log.info("coordinator for %s (digest %s) listening on %s", self.job.path, self.state.digest, self.address)
            if not (COMPILED and PERMUTATION_COMPILED):
                log.warning("coordinator._greedy, _whole or _feistel is not built (no C compiler at install?): the "
                            "planner runs in Python, several times slower; reinstall with a compiler to fix")
            if self.state_dir:  # where tools (msd status, manifest, ...) find this coordinator and its job
                try:
                    write_state_file(self.state_dir, self.job, self.address)
                except OSError as e:
                    log.warning("%s: could not record this coordinator's address: %s", self.state_dir, e)
            if ready is not None:
                ready.set_result(self.address)
            loops = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._tick_loop())]
            if self.lease is not None:
                self.lease.address = self.address
                loops.append(asyncio.create_task(self._lease_loop()))
            stopped = asyncio.create_task(self.stopped.wait())
            await asyncio.wait([stopped, *loops], return_when=asyncio.FIRST_COMPLETED)
            for t in loops:
                if t.done() and not t.cancelled() and t.exception() is not None:  # a loop must never end
                    log.critical("the coordinator's %s ended with an error", t.get_coro().__name__,
                                 exc_info=t.exception())
                    self._fail(f"{t.get_coro().__name__} failed: {t.exception()!r}")
            for t in [stopped, *loops]:
                t.cancel()
            loops.append(stopped)
            await asyncio.gather(*loops, return_exceptions=True)
            if self.lease is not None and not self.failed and not self.lease_lost and \
                    self.files.stalled_since is None:
                # A clean stop (SIGTERM) gives the lease up before it tells the peers, so that a
                # standby takes over at once, not after heartbeats of silence (faster than a crash)
                await self._drained()
                await asyncio.to_thread(self.lease.release)
                self.lease = None
            if not self.lease_lost:  # the peers are another coordinator's now
                self._handle([Shutdown(at=time.monotonic(), reason="coordinator stopping", failed=self.failure or "")])
            if self.files.stalled_since is not None and self._drain_task is not None:
                # The disk is still full: what waits for it is dropped (the ranks resume from the
                # journal, which holds every step that went out), and the peers are told directly.
                log.error("stopping with %d instructions still waiting for the state dir", len(self._backlog))
                self._drain_task.cancel()
                for ins in [i for i in self._backlog if isinstance(i, Send) and isinstance(i.message, P.Shutdown)]:
                    self._do(ins)
                self._backlog.clear()
            await self._drained()
            self._flush_relays()  # what the last pass sent to relayed ranks (job_failed, shutdown)
            if self.lease is not None and not self.failed:
                await asyncio.to_thread(self.lease.release)
            if self.failed and not self.lease_lost and not self.quit.is_set():
                health = self.metrics.health if self.metrics is not None else None
                if health is not None:
                    health.set("failed", False)
                reason = self.failure or "the coordinator failed"
                await linger(self.sock, reason, self.job.runtime.failed_linger_s,
                             lambda: {**self.status(), "stopped": "the job failed", "failed": reason}, self.quit,
                             health.beat if health is not None else (lambda: None))
        finally:
            logging.getLogger("msd").removeHandler(self.warnings)
            if self.journal is not None:
                self.journal.close()
            if router is not None:
                router.close()

    def stop(self) -> None:
        self.stopped.set()

    def terminate(self) -> None:
        """SIGTERM or SIGINT: stop, and a failed job's lingering (runtime.failed_linger_s) ends too."""
        self.quit.set()
        self.stopped.set()

    # ------------------------------------------------------------------ events in

    async def _receive_loop(self) -> None:
        """Bursts of messages from the ROUTER: asyncio only says when its file descriptor is
        readable (edge-triggered), and every pass checks ZMQ_EVENTS before waiting, since a send
        may have taken the edge that a pending message would give."""
        loop = asyncio.get_running_loop()
        self._readable = readable = asyncio.Event()
        sock = self.sock
        # Frames as bytes: for the small messages that are nearly all of them, cheaper than zmq
        # Frame objects; Frames only where an operator's key (a frame property) must be checked.
        copy = self.operators is None
        loop.add_reader(sock.FD, readable.set)
        try:
            while True:
                if not has_message(sock):
                    readable.clear()
                    await readable.wait()
                    continue
                # Take what has arrived before planning: one plan-and-dispatch pass per burst of
                # messages instead of one per message (the per-pass cost does not depend on the count).
                burst: list[Event] = []
                for _ in range(MAX_BURST):
                    try:
                        frames = sock.recv_multipart(NOWAIT, copy=copy)
                    except zmq.Again:
                        break
                    self._decode(frames, burst)
                if burst:
                    await self._attach_journaled_states(burst)
                    self._handle(burst)
        finally:
            loop.remove_reader(sock.FD)

    def _decode(self, frames: list, burst: list[Event]) -> None:
        self.messages_received += 1
        identity = frames[0] if type(frames[0]) is bytes else frames[0].bytes
        try:
            header, arrays = wire.decode(frames[1:], P.COORDINATOR_INBOX)
        except ProtocolError as e:
            log.warning("dropped message from peer %s: %s", identity.hex(), e)
            if self.metrics is not None:
                self.metrics.dropped.inc()
            return
        if self.metrics is not None:
            self.metrics.message(self.metrics.received, header["type"])
        if header["type"] == P.SourceCounts.TYPE:  # late for the counting at start-up (counting.py): settled
            return
        if header["type"] == P.RelayUp.TYPE:  # the messages of a relay's ranks, each an event of its own
            burst.extend(self.relays.unpack(identity, time.monotonic(), header, arrays))
            return
        if header["type"] == P.StatusRequest.TYPE:  # a read-only question, answered here
            self._do(Send(identity, P.StatusReply(status=self.status())))
            return
        refusal = security.operator_refusal(self.operators, header, frames[1])
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.dropped.inc()
            self._do(Send(identity, refusal))
            return
        try:
            burst.append(from_message(identity, time.monotonic(), header, arrays))
        except Exception:  # a message decode accepted but that makes no event: a bug, not the peer's
            log.exception("could not make an event of %s from peer %s; dropped", header.get("type"), identity.hex())

    async def _attach_journaled_states(self, burst: list[Event]) -> None:
        """A rank resuming from a step older than the states kept in memory: its planner state is
        read back from the journal file (in a thread) and carried by its hello event."""
        history = self.state.history
        for i, ev in enumerate(burst):
            if (isinstance(ev, TrainerHello) and self.journal is not None and not history.in_memory(ev.resume_step)
                    and history.on_disk(ev.resume_step)):
                await self._drained()  # every state recorded so far is in the file
                state = await asyncio.to_thread(self.journal.read_state, ev.resume_step)
                burst[i] = dataclasses.replace(ev, journaled_state=state)

    async def _lease_loop(self) -> None:
        """Renew the lease every heartbeat, in a thread. Another holder's token: stop at once. Not
        renewed for 2 heartbeats (a failing disk): stop too, before a standby may take over."""
        while True:
            await asyncio.sleep(self.state.heartbeat_s)
            try:
                await asyncio.to_thread(self.lease.renew)
            except LeaseLost as e:
                self._lost_lease(e)
                return
            except OSError as e:
                if self.lease.overdue():
                    log.error("the lease of %s could not be renewed for %d heartbeats (%s); stopping so that a "
                              "standby can take over safely", self.state_dir, SELF_FENCE_BEATS, e)
                    self.failed = True
                    self.stop()
                    return
                log.warning("the lease of %s not renewed (%s)", self.state_dir, e)

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.state.heartbeat_s)
            self._handle([Tick(at=time.monotonic())])
            if self.metrics is not None:
                self.metrics.update(self.state, self.files.journaled_step if self.journal is not None else None)

    def _handle(self, burst: list[Event]) -> None:
        started = time.perf_counter()
        instructions = self.state.handle(*burst)
        if self.metrics is not None and self.state.planned:
            self.metrics.planned(self.state.planned, self._names, time.perf_counter() - started)
        self.stimuli.record(burst, instructions)
        try:
            self._execute(instructions)
        except Exception as e:  # a bug in carrying out an instruction: the state may be ahead of the peers
            log.critical("error executing the coordinator's instructions; stopping", exc_info=True)
            self._backlog.clear()
            self._fail(f"error executing instructions: {e!r}")

    # ------------------------------------------------------------------ instructions out

    def _execute(self, instructions: list[Instruction]) -> None:
        """Carry out instructions in order. Sends go out now, unless file work is in progress: then
        they wait behind it, so that nothing that depends on a journal line overtakes it."""
        if self._backlog:
            for ins in instructions:  # an `alive` depends on nothing written: it never waits
                if isinstance(ins, Send) and isinstance(ins.message, P.Alive):
                    self._do(ins)
                else:
                    self._backlog.append(ins)
            return
        for i, ins in enumerate(instructions):
            if isinstance(ins, FileInstruction) and self.state_dir is not None:
                self._backlog.extend(instructions[i:])
                self._drain_task = asyncio.ensure_future(self._drain())
                return
            self._do(ins)

    async def _drain(self) -> None:
        while self._backlog:
            ins = self._backlog[0]
            try:
                if isinstance(ins, FileInstruction) and self.state_dir is not None:
                    await self.files.until_done(ins)
                else:
                    self._do(ins)
            except LeaseLost as e:  # a journal write found another holder's token (fenced) before a renewal did
                self._backlog.clear()
                self._lost_lease(e)
                return
            except Exception as e:
                # What follows may depend on this one (deliveries of unjournaled steps, the answer
                # to an unjournaled mixture change): nothing more goes out.
                log.critical("%s failed (%s); stopping the coordinator", type(ins).__name__, e, exc_info=True)
                self._backlog.clear()
                self._fail(f"{type(ins).__name__} failed: {e!r}")
                return
            self._backlog.popleft()

    async def _drained(self) -> None:
        while self._backlog and self._drain_task is not None:
            await asyncio.shield(self._drain_task)

    def _do(self, ins: Instruction) -> None:
        if isinstance(ins, Send):
            self._send(ins)
        elif isinstance(ins, WriteStatus):  # no state dir: the log only
            log.info("%s", status_line(self._status(ins.status)))
        elif isinstance(ins, Stop):
            if ins.failed:
                self._fail(ins.reason)
            else:
                self.stop()

    def status(self) -> dict[str, Any]:
        """A snapshot for `msd status`: the state's status, the shell's, the recent warnings."""
        planned, journaled = self.state.planner.state.next_step - 1, self.files.journaled_step
        journal = ({"journaled_step": journaled, "journal_lag_steps": max(0, planned - journaled)}
                   if self.journal is not None else {})
        snapshot = {**self._status(self.state.status()), **journal, "warnings": list(self.warnings.recent)}
        return orjson.loads(orjson.dumps(snapshot, option=orjson.OPT_NON_STR_KEYS))  # msgpack maps keyed by str

    def _status(self, status: dict[str, Any]) -> dict[str, Any]:
        stalled = self.files.stalled_since
        return {"time": time.time(), "messages_received": self.messages_received,
                "state_dir_stalled_s": round(time.monotonic() - stalled, 1) if stalled is not None else 0.0,
                "slowest_state_dir_write_s": round(self.files.slowest_write_s, 3),
                "instructions_waiting": len(self._backlog), **status}

    def _send(self, ins: Send) -> None:
        if self.relays.relayed(ins.peer):  # to a rank behind a relay: one relay_down per relay and loop pass
            self.relays.add(ins.peer, ins.message)
            if not self._relay_flush_due:
                self._relay_flush_due = True
                asyncio.get_running_loop().call_soon(self._flush_relays)
            if self.metrics is not None:
                self.metrics.message(self.metrics.sent, ins.message.TYPE)
            return
        if self.relays.waiting_for(ins.peer):  # what it is to pass on goes first
            for relay, frames in self.relays.take(ins.peer):
                self._send_frames(relay, "relay_down", frames)
        self._send_frames(ins.peer, ins.message.TYPE, wire.encode(ins.message))
        if self.metrics is not None:
            self.metrics.message(self.metrics.sent, ins.message.TYPE)

    def _gone(self, peer: bytes, dropped: bool = False) -> None:
        """A peer's connection is gone: the state hears it as an event, once this pass is done."""
        if not self._gone_peers:
            try:
                asyncio.get_running_loop().call_soon(self._handle_gone)
            except RuntimeError:  # no loop: the coordinator is stopping
                return
        self._gone_peers.append((peer, dropped))

    def _handle_gone(self) -> None:
        peers, self._gone_peers = self._gone_peers, []
        if not self.stopped.is_set():
            self._handle([PeerGone(at=time.monotonic(), peer=p, dropped=d) for p, d in dict.fromkeys(peers)])

    def _flush_relays(self) -> None:
        self._relay_flush_due = False
        for relay, frames in self.relays.take():
            self._send_frames(relay, "relay_down", frames)

    def _send_frames(self, peer: bytes, kind: str, frames: list) -> None:
        # NOBLOCK: a slow or vanished peer must never stall the coordinator.
        try:
            send_frames_nowait(self.sock, [peer, *frames])
        except zmq.Again:
            log.error("send of %s dropped: peer %s is not reading (high-water mark); it registers again", kind,
                      peer.hex())
            self._gone(peer, dropped=True)
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                log.info("send of %s to %s: peer has disconnected", kind, peer.hex())
                self._gone(peer)
            else:
                log.warning("send of %s to %s failed: %s", kind, peer.hex(), e)
        if self._readable is not None:
            self._readable.set()  # the send may have taken the edge of a message that came meanwhile

    def _lost_lease(self, e: LeaseLost) -> None:
        """Another coordinator holds the state dir now: stop at once, and say nothing to the peers
        (they are that coordinator's)."""
        log.error("%s: another coordinator serves this job now; stopping without a word to the peers", e)
        self.failed = self.lease_lost = True
        self.stop()

    def _fail(self, reason: str) -> None:
        self.failed = True
        self.failure = self.failure or reason
        path = os.path.join(self.state_dir or tempfile.gettempdir(), f"stimulus-{os.getpid()}.msgpack")
        try:
            self.stimuli.dump(path)
            log.critical("coordinator failed (%s); its last %d event bursts are in %s (coordinator.stimulus.replay)",
                         reason, len(self.stimuli.entries), path)
        except Exception:
            log.exception("could not write the stimulus log to %s", path)
        self.stop()
