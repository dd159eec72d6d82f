"""A trainer rank's decisions, without sockets, threads or clocks: `RankCore` takes the
coordinator's messages, the workers' pieces, the trainer's commands and the time, and returns
what to do (`Send` a message to the coordinator, hand an item `ToTrainer`, ...). The client's I/O
thread (`client._Receiver`) carries the actions out; the simulation (`msd.sim`) runs the same
core under simulated time and a simulated network.

What it decides: when to say hello and heartbeat (session.Registration), what a coordinator's
stop means (never the end of the data: wait `stop_grace_s` for one that serves), when the
coordinator's silence becomes an error, and which finished steps go to the trainer
(receiving.ReceivingState)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from msd_common import protocol as P
from msd_common.errors import CoordinatorStoppedError, PeerLostError
from msd_common.session import LOST_AFTER_BEATS, LOST_MESSAGES, Forgotten, Registration
from .receiving import EvalReady, ReceivingState, StateReply, Stopping, Welcomed

import logging

log = logging.getLogger("msd.client")


@dataclass(frozen=True, slots=True)
class Send:
    """A message to the coordinator (or the rank's relay)."""

    message: P.Message


@dataclass(frozen=True, slots=True)
class ToTrainer:
    """For the trainer's queue, in order: a ReadyStep, End, or an error to raise."""

    item: Any


@dataclass(frozen=True, slots=True)
class ToEvals:
    item: EvalReady


@dataclass(frozen=True, slots=True)
class ToStateReplies:
    item: StateReply


@dataclass(frozen=True, slots=True)
class CoordinatorStopping:
    """The coordinator stops: the shell moves to the next address (or says hello again at this one)."""

    reason: str


Action = Send | ToTrainer | ToEvals | ToStateReplies | CoordinatorStopping


class RankCore:
    def __init__(self, rank: int, next_step: int, next_micro_batch: int, plan_digest: str | None, *,
                 data_address: str, incarnation: int, metadata_only: bool = False,
                 carried_for: Callable[[int], dict | None] = lambda step: None, via_relay: bool = False,
                 relay_timeout_s: float = 30.0, coordinator_timeout_s: float = 30.0, stop_grace_s: float = 15.0,
                 where: Callable[[], str] = lambda: "", addresses: Callable[[], list[str]] = lambda: []) -> None:
        """where(), addresses(): the address talked to now (the relay's, via one), and every
        coordinator address tried: how errors name where the coordinator was looked for."""
        self.rank = rank
        self.state = ReceivingState(rank, next_step, next_micro_batch, plan_digest, metadata_only)
        self.data_address = data_address
        self.via_relay = via_relay
        self.relay_timeout_s = relay_timeout_s
        self.coordinator_timeout_s = coordinator_timeout_s
        self.stop_grace_s = stop_grace_s
        self.where = where
        self.addresses = addresses
        self.closing = False
        self.eval_asked: tuple[str, int] | None = None  # the eval pass asked for and not in yet
        self.stopping: tuple[float, str] | None = None  # (when, why) the coordinator said it stops
        self.silence_told = False  # the coordinator's silence was logged (once per silence)
        self.welcomed = False  # a coordinator has served this rank (its silence counts from then on)
        self.incarnation = incarnation
        self.registration = Registration(
            lambda: P.TrainerHello(version=P.PROTOCOL_VERSION, rank=rank, data_address=data_address,
                                   resume_step=self.state.step, incarnation=self.incarnation,
                                   metadata_only=int(metadata_only), carried=carried_for(self.state.step)),
            lambda: P.TrainerHeartbeat(rank=rank))

    # ------------------------------------------------------------------ in

    def on_control(self, frames: list, now: float) -> list[Action]:
        """One message from the coordinator (heard: the shell has told the registration)."""
        out: list[Action] = []
        for item in self.state.on_control(frames):
            if isinstance(item, Stopping):
                self.stopping = (now, item.reason)
                out.append(CoordinatorStopping(item.reason))
            elif isinstance(item, Welcomed):
                if self.stopping is not None:
                    log.warning("rank %d: a coordinator serves this rank again (%.1fs after the stop)", self.rank,
                                now - self.stopping[0])
                self.stopping = None
                self.welcomed = True
                self.registration.welcomed(item.heartbeat_s)
                if self.eval_asked is not None:  # asked of a coordinator that forgot us (a restart): again
                    name, pass_no = self.eval_asked
                    out.append(Send(P.EvalRequest(rank=self.rank, set=name, pass_no=pass_no)))
            elif isinstance(item, Forgotten):
                # once per registration lost: until its hello is answered every heartbeat draws
                # another unknown_peer (eight lines a rank after a relay restart, issue 61)
                level = logging.WARNING if self.registration.registered else logging.DEBUG
                log.log(level, "rank %d: coordinator does not know this rank (%s); registering again", self.rank,
                        item.reason)
                self.registration.forgotten()
            elif isinstance(item, StateReply):
                out.append(ToStateReplies(item))
            elif isinstance(item, EvalReady):
                self.eval_asked = None
                out.append(ToEvals(item))
            else:  # an error to raise, or the end of the stream
                out.append(ToTrainer(item))
        return out

    def on_pieces(self, frames: list) -> None:
        self.state.on_pieces(frames)

    def command(self, cmd: list, now: float) -> list[Action]:
        """A command from the trainer's side: consumed, eval, eval_report, state, close."""
        kind = cmd[0]
        if kind == "eval":
            self.eval_asked = (str(cmd[1]), int(cmd[2]))
            self.state.asked(*self.eval_asked)
            return [Send(P.EvalRequest(rank=self.rank, set=str(cmd[1]), pass_no=int(cmd[2])))]
        if kind == "eval_report":
            return [Send(P.EvalReport(rank=self.rank, set=str(cmd[1]), step=int(cmd[2]), losses=cmd[3]))]
        if kind == "consumed":
            self.registration.spoke(now)
            loss_step, sources, sums, tokens = cmd[5] if len(cmd) > 5 else (-1, [], [], [])
            return [Send(P.Consumed(rank=self.rank, step=int(cmd[1]), waited_s=float(cmd[2]),
                                    compute_step=int(cmd[3]), compute_s=list(cmd[4]), loss_step=int(loss_step),
                                    loss_sources=list(sources), loss_sums=list(sums), loss_tokens=list(tokens)))]
        if kind == "state":
            return [Send(P.StateRequest(rank=self.rank, step=int(cmd[1])))]
        if kind == "close":
            self.closing = True
            if self.registration.registered:
                return [Send(P.TrainerBye(rank=self.rank))]
        return []

    def connection_lost(self, why: str) -> None:
        """Messages to or from the coordinator were lost (session.LOST_MESSAGES): a step header, a
        `consumed`. The rank says hello again as a new incarnation, so that the coordinator plans
        again from the step it needs and re-sends what was in flight (what it has comes again as
        duplicates, dropped)."""
        log.warning("rank %d: %s (%s); registering again from step %d", self.rank, LOST_MESSAGES, why,
                    self.state.step)
        self.incarnation += 1
        self.registration.forgotten()

    # ------------------------------------------------------------------ each turn

    def turn(self, now: float) -> list[Action]:
        """Once per turn of the shell's loop: the errors time decides, and the finished steps."""
        heard = self.registration.last_heard
        # (a relay not heard from yet may start after its ranks: the welcome's timeout_s covers that)
        if self.via_relay and heard > float("-inf") and now - heard > self.relay_timeout_s:
            self.closing = True
            return [ToTrainer(PeerLostError(
                f"rank {self.rank}: the relay at {self.where()} has been silent for {self.relay_timeout_s:.0f}s "
                "(is `msd relay` running on this host, and restarted when it dies?)"))]
        gone = self._coordinator_gone(now)
        if gone is not None:
            self.closing = True
            return [ToTrainer(gone)]
        out: list[Action] = [ToTrainer(item) for item in self.state.finished()]
        if self.state.eval_steps:
            for ready in self.state.finished_evals():
                self.eval_asked = None
                out.append(ToEvals(ready))
        return out

    def _coordinator_gone(self, now: float) -> BaseException | None:
        """A stopped coordinator that nobody replaced within the grace period, or one silent past
        coordinator_timeout_s: the trainer gets an error that says which (never a plain end)."""
        reg = self.registration
        if self.stopping is not None:
            when, reason = self.stopping
            if now - when > self.stop_grace_s:
                return CoordinatorStoppedError(
                    f"rank {self.rank}: the coordinator stopped ({reason}) and no coordinator took over within "
                    f"{self.stop_grace_s:.0f}s (tried {', '.join(self.addresses())}); the stream did not end: resume "
                    "from the last checkpoint once a coordinator serves the job again")
            return None
        if self.via_relay or not self.welcomed:  # (before the first welcome, next()'s timeout_s counts)
            return None
        quiet = now - max(reg.last_heard, reg.since)
        if quiet <= LOST_AFTER_BEATS * reg.heartbeat_s:
            self.silence_told = False
            return None
        if not self.silence_told:
            self.silence_told = True
            log.warning("rank %d: the coordinator at %s has not answered for %.1fs (stopped, killed, or its host "
                        "lost); waiting for it", self.rank, self.where(), quiet)
        if quiet > self.coordinator_timeout_s:
            return PeerLostError(
                f"rank {self.rank}: the coordinator at {self.where()} has not answered for {quiet:.0f}s (killed, "
                "or its host lost; a standby given as a second address takes over by itself)")
        return None
