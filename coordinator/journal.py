"""The journal files of a state dir, written by the coordinator's shell (app.py), off its event
loop; what goes in them is decided by the state (`history.StepHistory`, `state.py`).

- `steps.journal`: one JSON line per step, the planner's state before it, tied to the job's
  digest; appended and fsynced before any delivery of those steps goes out; rewritten to its
  last state when compacted.
- `mixture.journal`: one JSON line per accepted run-time mixture change (`msd mix`), fsynced
  before the change is answered; replayed at start-up.
- `quarantine.journal`: one JSON line per record quarantined (it killed worker processes),
  fsynced before any step planned without it; replayed at start-up.

An incomplete last line (a write cut short by a crash, never acknowledged) is ignored; any other
bad line stops start-up with the file and line.
"""

from __future__ import annotations

import logging
import os
from typing import Iterable

import orjson

from msd_common.files import atomic_write, durable_append

from .plan import PlannerState

log = logging.getLogger("msd.journal")
JOURNAL = "steps.journal"
MIXTURE_JOURNAL = "mixture.journal"
QUARANTINE_JOURNAL = "quarantine.journal"
EVAL_JOURNAL = "eval.journal"  # one line per evaluation a rank reported: set, step, rank, losses
COST_JOURNAL = "cost.journal"  # cost models calibrated as the job ran: at_step, coefficients (calibrate.TERMS)


def _json_lines(path: str) -> list[bytes]:
    try:
        with open(path, "rb") as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


class JournalFile:
    """The step journal of a state dir."""

    def __init__(self, state_dir: str, digest: str, earlier: tuple[str, ...] = ()) -> None:
        """earlier: digests this job had under earlier definitions (JobConfig.digest_before_0_4),
        whose entries are this job's too."""
        os.makedirs(state_dir, exist_ok=True)
        self.path = os.path.join(state_dir, JOURNAL)
        self.digest = digest
        self.earlier = earlier

    def load(self, accept_changed_job: bool = False) -> list[dict]:
        """The states the file holds, in file order, validated. accept_changed_job: entries
        written for another job digest are taken (the caller allowed the change)."""
        lines = _json_lines(self.path)
        states = []
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
            if entry.get("digest") not in (self.digest, *self.earlier) and not accept_changed_job:
                raise ValueError(f"{self.path}:{i}: written for plan digest {entry.get('digest')}, this job's is "
                                 f"{self.digest}: the job file changed (use a new --state-dir)")
            states.append(state)
        return states

    def _line(self, state: dict) -> bytes:
        return orjson.dumps({"digest": self.digest, "state": state}) + b"\n"

    def append(self, states: Iterable[dict]) -> None:
        """Append states and make them durable (fsync); all or nothing (a full disk leaves the
        file as it was, and the append can be tried again)."""
        durable_append(self.path, b"".join(self._line(s) for s in states))

    def compact(self, state: dict) -> None:
        """Rewrite the journal to hold this state only (temp file, fsync, rename)."""
        atomic_write(self.path, self._line(state))

    def read_state(self, step: int) -> dict | None:
        """The state before `step` as the file holds it (the latest entry for that step)."""
        found = None
        for line in _json_lines(self.path):
            try:
                entry = orjson.loads(line)
            except orjson.JSONDecodeError:
                continue
            if int(entry["state"]["next_step"]) == step:
                found = entry["state"]
        return found

    def close(self) -> None:
        pass  # nothing is kept open: each append opens, writes, fsyncs and closes


def _read_entries(state_dir: str | None, name: str, parse):
    """The parsed lines of one small journal of the state dir, in order (parse raises on a bad line)."""
    if not state_dir:
        return []
    path = os.path.join(state_dir, name)
    lines = _json_lines(path)
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            out.append(parse(orjson.loads(line)))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            if i == len(lines):  # a write cut short by a crash: it was never acknowledged
                log.warning("%s:%d: incomplete last entry ignored", path, i)
            else:
                raise ValueError(f"{path}:{i}: corrupt journal entry") from None
    return out


def _append_entry(state_dir: str, name: str, entry: dict) -> None:
    """Append one line durably (fsync) before what it records takes effect."""
    os.makedirs(state_dir, exist_ok=True)
    durable_append(os.path.join(state_dir, name), orjson.dumps(entry) + b"\n")


def read_mixture_journal(state_dir: str | None) -> list[tuple[int, list[float]]]:
    """The run-time mixture changes recorded in the state dir, in the order they were made."""
    return _read_entries(state_dir, MIXTURE_JOURNAL,
                         lambda e: (int(e["at_step"]), [float(w) for w in e["weights"]]))


def append_mixture_journal(state_dir: str, at_step: int, weights: Iterable[float]) -> None:
    """Append one change durably (fsync) before it is acknowledged."""
    _append_entry(state_dir, MIXTURE_JOURNAL, {"at_step": at_step, "weights": list(weights)})


def read_quarantine_journal(state_dir: str | None) -> list[tuple[str, int]]:
    """(source name, record) of every record quarantined so far, in the order decided."""
    return _read_entries(state_dir, QUARANTINE_JOURNAL, lambda e: (str(e["source"]), int(e["record"])))


def append_quarantine_journal(state_dir: str, source: str, record: int, reason: str) -> None:
    """Append one quarantine decision durably, before any step planned with it is journaled."""
    _append_entry(state_dir, QUARANTINE_JOURNAL, {"source": source, "record": record, "reason": reason})


def append_eval_journal(state_dir: str, set_name: str, step: int, rank: int, losses: Iterable) -> None:
    _append_entry(state_dir, EVAL_JOURNAL, {"set": set_name, "step": step, "rank": rank, "losses": dict(losses)})


def read_eval_journal(state_dir: str) -> list[dict]:
    """Every evaluation reported, in the order it came: {set, step, rank, losses: {source: loss}}."""
    return _read_entries(state_dir, EVAL_JOURNAL, lambda e: {"set": str(e["set"]), "step": int(e["step"]),
                                                            "rank": int(e["rank"]),
                                                            "losses": {str(k): float(v) for k,
                                                                       v in e["losses"].items()}})


def append_cost_journal(state_dir: str, at_step: int, coefficients: Iterable[float], errors: Iterable[float] = (),
                        evidence: Iterable = ()) -> None:
    _append_entry(state_dir, COST_JOURNAL, {"at_step": at_step, "coefficients": [float(c) for c in coefficients],
                                            "errors": [float(e) for e in errors],
                                            "evidence": [[float(v) for v in row] for row in evidence]})


def read_cost_changes(state_dir: str | None) -> list[dict]:
    """The cost journal's entries whole: at_step, coefficients, errors (before, after), evidence."""
    return _read_entries(state_dir, COST_JOURNAL, lambda e: {"at_step": int(e["at_step"]),
                                                            "coefficients": [float(c) for c in e["coefficients"]],
                                                            "errors": [float(v) for v in e.get("errors", [])],
                                                            "evidence": e.get("evidence", [])})


def read_cost_journal(state_dir: str | None) -> list[tuple[int, list[float]]]:
    """The calibrated cost models adopted in the state dir's run, in order: (from step, coefficients)."""
    return _read_entries(state_dir, COST_JOURNAL, lambda e: (int(e["at_step"]), [float(c) for c in e["coefficients"]]))
