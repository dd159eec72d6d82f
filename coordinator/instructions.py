"""The coordinator's output: what `CoordinatorState.handle` asks the shell to do, in order.

The shell (app.py) carries them out in the order given. File instructions run off the event
loop, and every instruction after one of them waits for it: a step's journal line is durable
before its step headers and deliveries go out, and a mixture change before its answer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from msd_common import protocol as P


@dataclass(frozen=True, slots=True)
class Instruction:
    pass


@dataclass(frozen=True, slots=True)
class Send(Instruction):
    """Send one message (wire.encode) to the peer with this identity."""

    peer: bytes
    message: P.Message


@dataclass(frozen=True, slots=True)
class FileInstruction(Instruction):
    """Work on the state dir: done in a thread; later instructions wait for it."""


@dataclass(frozen=True, slots=True)
class AppendJournal(FileInstruction):
    """Append the planner states before these steps to the step journal, then fsync."""

    states: tuple[dict, ...]


@dataclass(frozen=True, slots=True)
class CompactJournal(FileInstruction):
    """Rewrite the step journal to hold this state only (atomically)."""

    state: dict


@dataclass(frozen=True, slots=True)
class AppendMixture(FileInstruction):
    """Append an accepted run-time mixture change to the mixture journal, then fsync."""

    at_step: int
    weights: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class AppendCostChange(FileInstruction):
    """Append a calibrated cost model (calibrate.TERMS) and the step it plans from to the cost journal."""

    at_step: int
    coefficients: tuple[float, ...]
    errors: tuple[float, float] = (0.0, 0.0)  # relative error of the model before and of the fit
    evidence: tuple = ()  # [measured, predicted before, predicted after] of some of the samples


@dataclass(frozen=True, slots=True)
class AppendEvalLoss(FileInstruction):
    """Append a rank's evaluation (mean loss per source of one set, at a training step) to the eval journal."""

    set: str
    step: int
    rank: int
    losses: tuple[tuple[str, float], ...]


@dataclass(frozen=True, slots=True)
class AppendQuarantine(FileInstruction):
    """Append a quarantined record (source name, record index) to the quarantine journal, then fsync."""

    source: str
    record: int
    reason: str


@dataclass(frozen=True, slots=True)
class WriteStatus(FileInstruction):
    """Log the status and replace status.json in the state dir with it."""

    status: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Stop(Instruction):
    """Stop serving: `failed` means an internal error (the process exits non-zero)."""

    reason: str
    failed: bool = False


ALL_INSTRUCTIONS: dict[str, type[Instruction]] = {
    cls.__name__: cls for cls in (Send, AppendJournal, CompactJournal, AppendMixture, AppendQuarantine, AppendEvalLoss,
                                  AppendCostChange,
                                  WriteStatus,
                                               Stop)}


def to_dict(instruction: Instruction) -> dict[str, Any]:
    """A plain form (for the stimulus log); a Send as its peer, header and array frames."""
    if isinstance(instruction, Send):
        m = instruction.message
        return {"instruction": "Send", "peer": instruction.peer, "header": m.header(), "arrays": m.frames()}
    return {"instruction": type(instruction).__name__,
            **{f.name: getattr(instruction, f.name) for f in fields(instruction)}}


def from_dict(d: dict[str, Any]) -> Instruction:
    d = dict(d)
    cls = ALL_INSTRUCTIONS[d.pop("instruction")]
    if cls is Send:
        kind = P.ALL_TYPES[d["header"]["type"]]
        arrays = {spec.name: a for spec, a in zip(kind.arrays, d.get("arrays", ()))}
        return Send(d["peer"], kind.cls.from_wire(d["header"], arrays))
    for key in ("arrays", "states", "weights"):
        if key in d:
            d[key] = tuple(d[key])
    return cls(**d)
