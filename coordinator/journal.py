"""The planner's state before every step, kept so that any step since the last compaction can
be planned again, identically: a trainer resuming from an older checkpoint, or a coordinator
restarted from its --state-dir.

The state is O(number of sources) (cursors, the document each source carries over, quota
targets and deliveries, exhausted sources), so a step costs one short JSON line. Lines are
appended to `steps.journal` and fsynced once per planning pass (a step boundary); when the
journal holds `COMPACT_AFTER` steps it is rewritten, atomically, to its last state, and older
steps can no longer be resumed (a clear error names the oldest step that can). Memory holds
the last MEMORY_STEPS states only; an older one is read back from the file when a trainer
resumes there (without a state dir, only those in memory can be resumed).
"""

from __future__ import annotations

import logging
import os

import orjson

from .plan import PlannerState

log = logging.getLogger("msd.journal")
JOURNAL = "steps.journal"
COMPACT_AFTER = 100_000
MEMORY_STEPS = 1024


class StepJournal:
    def __init__(self, state_dir: str | None, digest: str, accept_changed_job: bool = False) -> None:
        """accept_changed_job: entries written for another job digest are taken (the caller
        allowed the change); the journal is then rewritten to its last state under this digest."""
        self.state_dir = state_dir
        self.accept_changed_job = accept_changed_job
        self.digest = digest
        self.history: dict[int, dict] = {}  # step -> planner state before it (JSON form), recent steps
        self.first_on_disk: int | None = None  # the oldest step the journal file holds
        self.entries = 0  # lines in the journal file
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
            step = int(state["next_step"])
            self.history[step] = state
            if self.first_on_disk is None or step < self.first_on_disk:
                self.first_on_disk = step
            self.entries += 1
        self._trim()

    @property
    def latest(self) -> PlannerState | None:
        return PlannerState.from_json(self.history[max(self.history)]) if self.history else None

    @property
    def oldest(self) -> int | None:
        if self.first_on_disk is not None:
            return self.first_on_disk
        return min(self.history) if self.history else None

    def _trim(self) -> None:
        while len(self.history) > MEMORY_STEPS:
            del self.history[min(self.history)]

    def record(self, state: PlannerState) -> None:
        """The planner's state before step state.next_step (call after planning each step)."""
        j = state.to_json()
        self.history[state.next_step] = j
        if len(self.history) > 2 * MEMORY_STEPS:
            self._trim()
        if self._file is not None:
            self._pending.append(orjson.dumps({"digest": self.digest, "state": j}) + b"\n")
            if self.first_on_disk is None:
                self.first_on_disk = state.next_step
            self.entries += 1
            if self.entries > COMPACT_AFTER:
                self.compact()

    def state_before(self, step: int) -> PlannerState | None:
        j = self.history.get(step)
        if j is None and self._file is not None and self.first_on_disk is not None and step >= self.first_on_disk:
            j = self._read_from_disk(step)
        return PlannerState.from_json(j) if j is not None else None

    def _read_from_disk(self, step: int) -> dict | None:
        self.flush()
        with open(self.path, "rb") as f:
            for line in f:
                try:
                    entry = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if int(entry["state"]["next_step"]) == step:
                    return entry["state"]
        return None

    def forget_after(self, step: int) -> None:
        """Drop states of steps after `step` (the plan was rewound there; they come again)."""
        self.history = {k: v for k, v in self.history.items() if k <= step}

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
        self.first_on_disk, self.entries = last, 1
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
