"""The planner's state before every step, kept so that any step since the last compaction can
be planned again, identically: a trainer resuming from an older checkpoint, or a coordinator
restarted from its --state-dir.

The state is O(number of sources) (cursors, the document each source carries over, quota
targets and deliveries, exhausted sources), so a step costs one short JSON line. Lines are
appended to `steps.journal` and fsynced once per planning pass (a step boundary); when the
journal holds `COMPACT_AFTER` steps it is rewritten, atomically, to its last state, and older
steps can no longer be resumed (a clear error names the oldest step that can).
"""

from __future__ import annotations

import logging
import os

import orjson

from .plan import PlannerState

log = logging.getLogger("msd.journal")
JOURNAL = "steps.journal"
COMPACT_AFTER = 100_000


class StepJournal:
    def __init__(self, state_dir: str | None, digest: str, accept_changed_job: bool = False) -> None:
        """accept_changed_job: entries written for another job digest are taken (the caller
        allowed the change); the journal is then rewritten to its last state under this digest."""
        self.state_dir = state_dir
        self.accept_changed_job = accept_changed_job
        self.digest = digest
        self.history: dict[int, dict] = {}  # step -> planner state before it (JSON form)
        self._pending: list[bytes] = []
        self._file = None
        if state_dir:
            os.makedirs(state_dir, exist_ok=True)
            self.path = os.path.join(state_dir, JOURNAL)
            self._load()
            self._file = open(self.path, "ab")
            if accept_changed_job and self.history:
                self.compact()

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return
        for i, line in enumerate(lines, start=1):
            try:
                entry = orjson.loads(line)
                state = entry["state"]
                PlannerState.from_json(state)  # validates
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                if i == len(lines):  # cut short by a crash before its fsync: the step was never dispatched
                    log.warning("%s:%d: incomplete last entry ignored", self.path, i)
                    continue
                raise ValueError(f"{self.path}:{i}: corrupt journal entry") from None
            if entry.get("digest") != self.digest and not self.accept_changed_job:
                raise ValueError(f"{self.path}:{i}: written for plan digest {entry.get('digest')}, this job's is "
                                 f"{self.digest}: the job file changed (use a new --state-dir)")
            self.history[int(state["next_step"])] = state

    @property
    def latest(self) -> PlannerState | None:
        return PlannerState.from_json(self.history[max(self.history)]) if self.history else None

    @property
    def oldest(self) -> int | None:
        return min(self.history) if self.history else None

    def record(self, state: PlannerState) -> None:
        """The planner's state before step state.next_step (call after planning each step)."""
        j = state.to_json()
        self.history[state.next_step] = j
        if self._file is not None:
            self._pending.append(orjson.dumps({"digest": self.digest, "state": j}) + b"\n")
        if len(self.history) > COMPACT_AFTER:
            self.compact()

    def state_before(self, step: int) -> PlannerState | None:
        j = self.history.get(step)
        return PlannerState.from_json(j) if j is not None else None

    def flush(self) -> None:
        """Make the recorded steps durable (before their deliveries go out)."""
        if self._file is None or not self._pending:
            return
        self._file.write(b"".join(self._pending))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._pending.clear()

    def compact(self) -> None:
        """Keep only the latest state, on disk (temp file, fsync, rename) and in memory."""
        last = max(self.history)
        self.history = {last: self.history[last]}
        self._pending.clear()  # the rewritten file holds the latest state
        if self._file is None:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(orjson.dumps({"digest": self.digest, "state": self.history[last]}) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")

    def close(self) -> None:
        if self._file is not None:
            self.flush()
            self._file.close()
            self._file = None
