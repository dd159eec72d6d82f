"""The planner's state before every recent step, so that any of them can be planned again,
identically (a trainer resuming from an older checkpoint). Part of the coordinator's state: it
decides what the journal file holds (`coordinator/journal.py` writes it), but touches no file.

The state is O(number of sources), one short JSON object a step. Memory keeps the last
MEMORY_STEPS of them. With a journal file, every state goes to it too; when the file holds
COMPACT_AFTER steps it is rewritten to its last state, and older steps can no longer be resumed
(a clear refusal names the oldest that can). A step older than memory but still in the file is
read back by the shell (`TrainerHello.journaled_state`).
"""

from __future__ import annotations

from .plan import PlannerState

COMPACT_AFTER = 100_000
MEMORY_STEPS = 1024


class StepHistory:
    def __init__(self, durable: bool, loaded: list[dict] | None = None) -> None:
        """durable: a journal file holds every state recorded; loaded: the states it held at
        start-up, oldest first."""
        self.durable = durable
        self.states: dict[int, dict] = {}  # step -> planner state before it (JSON form), recent steps
        self.first_on_disk: int | None = None  # the oldest step the journal file holds
        self.entries = 0  # states in the journal file
        for state in loaded or ():
            step = int(state["next_step"])
            self.states[step] = state
            self.first_on_disk = step if self.first_on_disk is None else min(self.first_on_disk, step)
            self.entries += 1
        self._trim()

    @property
    def latest(self) -> PlannerState | None:
        return PlannerState.from_json(self.states[max(self.states)]) if self.states else None

    @property
    def oldest(self) -> int | None:
        """The oldest step that can be planned again."""
        if self.durable and self.first_on_disk is not None:
            return self.first_on_disk
        return min(self.states) if self.states else None

    def _trim(self) -> None:
        while len(self.states) > MEMORY_STEPS:
            del self.states[min(self.states)]

    def record(self, state: PlannerState) -> tuple[dict, bool]:
        """Keep the state before step state.next_step; returns (its JSON form, whether the
        journal should now be compacted to it)."""
        j = state.to_json()
        self.states[state.next_step] = j
        if len(self.states) > 2 * MEMORY_STEPS:
            self._trim()
        if not self.durable:
            return j, False
        if self.first_on_disk is None:
            self.first_on_disk = state.next_step
        self.entries += 1
        if self.entries <= COMPACT_AFTER:
            return j, False
        self.states = {state.next_step: j}
        self.first_on_disk, self.entries = state.next_step, 1
        return j, True

    def restart_from(self, state: PlannerState) -> dict:
        """Start over from this state alone (brought by the trainers: the coordinator had none);
        returns its JSON form, which the journal, if any, should be compacted to."""
        j = state.to_json()
        self.states = {state.next_step: j}
        self.first_on_disk, self.entries = (state.next_step, 1) if self.durable else (None, 0)
        return j

    def in_memory(self, step: int) -> bool:
        return step in self.states

    def on_disk(self, step: int) -> bool:
        """Whether the journal file should hold the state before `step` (older than memory)."""
        return self.durable and self.first_on_disk is not None and self.first_on_disk <= step

    def state_before(self, step: int, journaled: dict | None = None) -> PlannerState | None:
        """The state before `step`: from memory, else `journaled` (read back from the file)."""
        j = self.states.get(step, journaled)
        return PlannerState.from_json(j) if j is not None else None

    def forget_after(self, step: int) -> None:
        """Drop states of steps after `step` (the plan was rewound there; they come again)."""
        self.states = {k: v for k, v in self.states.items() if k <= step}
