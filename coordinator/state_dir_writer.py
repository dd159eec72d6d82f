"""The coordinator's file work on its state dir: reading what an earlier run left (journals), and
carrying out the file instructions (journal lines, mixture and cost changes, quarantined records,
eval losses, status.json) in a thread, one at a time, fenced by the lease.

A disk that is full or failing (OSError) is waited out, not a reason to stop: the write is tried
again (each write is all or nothing) and the shell holds everything after it, so no step goes
out that is not journaled, and the plan stops at the look-ahead since nothing is consumed meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from msd_common.spec import JobConfig

from .instructions import (AppendCostChange, AppendEvalLoss, AppendJournal, AppendMixture, AppendQuarantine,
                           CompactJournal, FileInstruction, WriteStatus)
from .journal import (JournalFile, append_cost_journal, append_eval_journal, append_mixture_journal,
                      append_quarantine_journal, read_cost_journal, read_mixture_journal, read_quarantine_journal)
from .lease import Lease
from .statedir import check_job_change, write_status
from .status_view import status_line

if TYPE_CHECKING:
    from .metrics import CoordinatorMetrics

log = logging.getLogger("msd.coordinator")
STATE_DIR_RETRY_S = 1.0  # a failed state dir write is tried again after this, doubling up to the max
STATE_DIR_RETRY_MAX_S = 2.0
SLOW_WRITE_S = 1.0  # a state dir write slower than this is logged


@dataclass
class Restored:
    """What an earlier run left in the state dir: the state machine is built from it."""

    journal: JournalFile | None
    loaded: list[dict]  # planner states, oldest first
    mixture: list
    quarantined: list
    costs: list


def restore(state_dir: str | None, job: JobConfig, allow_config_change: bool) -> Restored:
    changed = check_job_change(state_dir, job, allow_config_change)
    journal = JournalFile(state_dir, job.digest(), tuple(job.earlier_digests())) if state_dir else None
    loaded = journal.load(accept_changed_job=changed) if journal else []
    if changed and loaded:  # the entries of the old job: keep its last state, under this digest
        loaded = loaded[-1:]
        journal.compact(loaded[0])
    return Restored(journal, loaded, read_mixture_journal(state_dir), read_quarantine_journal(state_dir),
                    read_cost_journal(state_dir))


class StateDirWriter:
    def __init__(self, state_dir: str | None, journal: JournalFile | None, lease: Lease | None,
                 metrics: "CoordinatorMetrics | None", status: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
        """status: the shell's additions to the state's status (what status.json holds)."""
        self.state_dir, self.journal, self.lease, self.metrics = state_dir, journal, lease, metrics
        self.status = status
        self.stalled_since: float | None = None  # a state dir write keeps failing since then
        self.slowest_write_s = 0.0
        self.journaled_step = -1  # the last step whose planner state is durable in the journal

    async def until_done(self, ins: FileInstruction) -> None:
        """Do one file instruction in a thread, trying again until it succeeds (a status write is
        skipped instead)."""
        delay = STATE_DIR_RETRY_S
        while True:
            started = time.monotonic()
            try:
                await asyncio.to_thread(self.write, ins)
            except OSError as e:
                if isinstance(ins, WriteStatus):
                    log.warning("status.json not written (%s)", e)
                    return
                if self.stalled_since is None:
                    self.stalled_since = time.monotonic()
                log.error("state dir %s: %s failed (%s); nothing more goes out until it succeeds (trying again "
                          "in %.0fs; free space there?)", self.state_dir, type(ins).__name__, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, STATE_DIR_RETRY_MAX_S)
                continue
            took = time.monotonic() - started
            if self.metrics is not None:
                self.metrics.journal.labels(type(ins).__name__).observe(took)
            if self.stalled_since is not None:
                log.warning("state dir %s writable again after %.1fs; carrying on", self.state_dir,
                            time.monotonic() - self.stalled_since)
                self.stalled_since = None
            elif took > SLOW_WRITE_S:
                log.warning("state dir %s: %s took %.1fs (a slow disk holds back every step)", self.state_dir,
                            type(ins).__name__, took)
            self.slowest_write_s = max(self.slowest_write_s, took)
            return

    def write(self, ins: FileInstruction) -> None:
        """Runs in a thread. Journal writes are fenced: only the lease's holder writes."""
        if self.lease is not None and not isinstance(ins, WriteStatus):
            self.lease.check()
        if isinstance(ins, AppendJournal):
            self.journal.append(ins.states)
            self.journaled_step = max(self.journaled_step, max(int(st["next_step"]) for st in ins.states) - 1)
        elif isinstance(ins, CompactJournal):
            self.journal.compact(ins.state)
            self.journaled_step = max(self.journaled_step, int(ins.state["next_step"]) - 1)
        elif isinstance(ins, AppendMixture):
            append_mixture_journal(self.state_dir, ins.at_step, ins.weights)
        elif isinstance(ins, AppendQuarantine):
            append_quarantine_journal(self.state_dir, ins.source, ins.record, ins.reason)
        elif isinstance(ins, AppendCostChange):
            append_cost_journal(self.state_dir, ins.at_step, ins.coefficients, ins.errors, ins.evidence)
        elif isinstance(ins, AppendEvalLoss):
            append_eval_journal(self.state_dir, ins.set, ins.step, ins.rank, ins.losses)
        elif isinstance(ins, WriteStatus):
            status = self.status(ins.status)
            log.info("%s", status_line(status))
            write_status(self.state_dir, status)
