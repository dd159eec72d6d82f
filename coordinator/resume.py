"""The resume checks: whether a rank's hello can be served from the step it asks for, and the
coordinator state a checkpoint carries. Functions of the state that change nothing in it.

A rank may resume at or behind the plan (the plan is rewound, from memory, the journal, or the
state its checkpoint carries), ahead of it only where the plan was rewound for a rank further
back, or at the very start of a run that adopts the state the rank brings."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from msd_common import protocol as P

from .events import StateRequest, TrainerHello
from .instructions import AppendCostChange, AppendMixture, AppendQuarantine, Instruction, Send
from .plan import PlannerState

if TYPE_CHECKING:
    from .state import CoordinatorState

log = logging.getLogger("msd.coordinator")


def refusal(state: "CoordinatorState", ev: TrainerHello) -> str | None:
    """Why this rank's hello cannot be served (None: it can)."""
    rank, next_step = ev.rank, state.planner.state.next_step
    topology = state.topology
    if ev.version != P.PROTOCOL_VERSION:
        return f"protocol version {ev.version} != {P.PROTOCOL_VERSION}"
    if rank >= topology.world_size:
        return f"rank {rank} out of range: the topology has {topology.world_size} ranks"
    if not topology.fields(rank, want_metadata=bool(ev.metadata_only)):
        return (f"rank {rank} {topology.coords(rank)} receives no data (delivery "
                f"{topology.delivery!r}, pp {topology.pp}): it needs no DataClient "
                "(a middle pipeline stage may ask for the metadata: metadata_only=True)")
    carried = carried_problem(state, ev)
    if state.adopted is not None and ev.resume_step == state.adopted[0] and ev.carried is not None \
            and ev.carried != state.adopted[1]:
        return (f"the coordinator state of rank {rank}'s checkpoint for step {ev.resume_step} differs from the one "
                "the first rank brought: the ranks' checkpoints are not of the same run or step")
    if next_step < ev.resume_step <= state.planned_until:
        return None  # the plan was rewound for a rank further back: it comes to this step again
    if ev.resume_step > next_step:
        if state.fresh and next_step == 0 and carried is None:
            return None  # the plan starts from the state this rank brings (_adopt)
        why = carried or "its checkpoint does not carry the coordinator's state"
        return (f"cannot resume at step {ev.resume_step}: the plan stands at step {next_step} ({why}; start the "
                "coordinator with the run's --state-dir)")
    if ev.resume_step < next_step and state_before(state, ev) is None:
        return (f"cannot resume at step {ev.resume_step}: the coordinator keeps steps from "
                f"{state.history.oldest} on (the journal was compacted)")
    return None


def carried_problem(state: "CoordinatorState", ev: TrainerHello) -> str | None:
    """Why the coordinator state a rank brought cannot be used (None: it can)."""
    c = ev.carried
    if c is None:
        return "its checkpoint does not carry the coordinator's state"
    try:
        if c["digest"] != state.digest and c["digest"] not in state.earlier_digests:
            return f"the carried state is of plan digest {c['digest']}, this job's is {state.digest}"
        if PlannerState.from_json(c["planner"]).next_step != ev.resume_step:
            return "the carried state is not of the resume step"
        for at, w in c["mixture_changes"]:
            if len(w) != len(state.job.sources) or int(at) < 0:
                return "the carried mixture changes do not fit this job's sources"
        for at, coefficients in c.get("cost_changes", []):
            if int(at) < 0 or len(coefficients) != 5:
                return "the carried cost models are malformed"
        [(str(name), int(record)) for name, record in c["quarantined"]]
    except (KeyError, TypeError, ValueError) as e:
        return f"the carried state is malformed ({e!r})"
    return None


def state_before(state: "CoordinatorState", ev: TrainerHello) -> PlannerState | None:
    """The planner's state before the rank's resume step: from memory, the journal, or its checkpoint."""
    found = state.history.state_before(ev.resume_step, ev.journaled_state)
    if found is None and carried_problem(state, ev) is None:  # older than what memory and journal hold
        found = PlannerState.from_json(ev.carried["planner"])
    return found


def carried_state(state: "CoordinatorState", step: int) -> dict | None:
    """What a checkpoint of `step` carries of the coordinator (a state_reply): enough for a
    coordinator without its state dir to resume there."""
    before = state.history.state_before(step)
    if before is None:
        return None
    return {"digest": state.digest, "planner": before.to_json(),
            "mixture_changes": [[at, list(w)] for at, w in state.mixture_changes],
            "cost_changes": [[at, list(c)] for at, c in state.calibration.changes],
            "quarantined": [[state.job.sources[s].name, r] for s, rs in sorted(state.quarantined.items())
                            for r in sorted(rs)]}


def state_reply(state: "CoordinatorState", ev: StateRequest) -> Send:
    """The answer to a rank's state_request: the coordinator's state before that step, for its checkpoint."""
    carried = carried_state(state, ev.step)
    reason = "" if carried is not None else (f"step {ev.step} is not among the steps kept in memory "
                                             f"({state.history.oldest}..{state.planner.state.next_step})")
    return Send(ev.peer, P.StateReply(step=ev.step, ok=int(carried is not None), reason=reason,
                                state=carried))


def adopt(state: "CoordinatorState", ev: TrainerHello) -> list[Instruction]:
    """A coordinator with no state of its own (no state dir, or an empty one) resumes from the
    state a resuming rank's checkpoint carries; every other rank must bring the same one. Returns
    what to journal of it."""
    c = ev.carried
    planner = PlannerState.from_json(c["planner"])
    log.warning("no state of an earlier run here: resuming from the state rank %d brought for step %d",
                ev.rank, planner.next_step)
    durable = state.history.durable
    out: list[Instruction] = []
    state.fresh = False
    state.adopted = (ev.resume_step, c)
    for at, weights in c["mixture_changes"]:
        state.mixtures.replay(int(at), weights)
        if durable:
            out.append(AppendMixture(int(at), tuple(weights)))
    for at, coefficients in c.get("cost_changes", []):
        if state.calibration.replay(int(at), coefficients) and durable:
            out.append(AppendCostChange(int(at), tuple(float(x) for x in coefficients)))
    for name, record in c["quarantined"]:
        if state.skips.replay(name, int(record)) and durable:
            out.append(AppendQuarantine(name, int(record), "carried by a trainer's checkpoint"))
    j = state.history.restart_from(planner)
    if durable:  # the journal holds this state alone from now on
        state._journal_lines.clear()
        state._compact_to = j
    state._restart_plan(planner)
    return out
