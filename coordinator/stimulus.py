"""The stimulus log: the coordinator's recent bursts of events and the instructions each produced
(after Dask's `stimulus_log`), bounded, and written to a file when the coordinator fails.

The state machine is deterministic given its construction (job, record counts, the journal it
restored, the mixture changes) and its events, so a log that starts at construction replays
exactly: `replay(path)` builds the same state, feeds it the same bursts and compares every
instruction, which turns a failed chaos run into a unit test. A log whose oldest entries were
dropped (`complete: false`) is still worth reading, but does not replay from the start.

The file is msgpack (arrays as dtype, shape and bytes); nothing in it is ever unpickled.
"""

from __future__ import annotations

import collections
import os
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from . import events as E
from . import instructions as I

MAX_ENTRIES = 100_000
# runtime.stimulus_log_mb: a chaos run of a few hundred steps fits; a long run keeps its recent past
MAX_BYTES = 4 << 20
FORMAT = 1


def _default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        a = np.ascontiguousarray(value)
        return {"__ndarray__": [a.dtype.str, list(a.shape), a.tobytes()]}
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot log a {type(value).__name__}")


def _object_hook(d: dict) -> Any:
    if "__ndarray__" in d:
        dtype, shape, data = d["__ndarray__"]
        return np.frombuffer(data, dtype=np.dtype(dtype)).reshape(shape).copy()
    return d


def _nbytes(events: tuple, instructions: tuple) -> int:
    """About what a burst holds in memory: its arrays, and a little per event and instruction."""
    n = 200 * (len(events) + len(instructions))
    for e in events:
        for name in ("lengths", "patches"):
            a = getattr(e, name, None)
            if a is not None:
                n += a.nbytes
    for i in instructions:
        if isinstance(i, I.Send):
            n += sum(a.nbytes for a in i.message.frames())
    return n


class StimulusLog:
    def __init__(self, origin: dict[str, Any], max_entries: int = MAX_ENTRIES, max_bytes: int = MAX_BYTES) -> None:
        """origin: what the state was built from (job path, record counts, restored history,
        mixture changes): enough, with the job's data, to build it again. The oldest bursts are
        dropped beyond max_entries, or beyond about max_bytes of memory."""
        self.origin = origin
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: collections.deque = collections.deque()
        self.nbytes = 0
        self.recorded = 0

    def record(self, events: list[E.Event], instructions: list[I.Instruction]) -> None:
        self.recorded += 1
        if self.max_bytes <= 0:
            return
        entry = (tuple(events), tuple(instructions))
        size = _nbytes(*entry)
        self.entries.append((*entry, size))
        self.nbytes += size
        while len(self.entries) > self.max_entries or (self.nbytes > self.max_bytes and len(self.entries) > 1):
            self.nbytes -= self.entries.popleft()[2]

    @property
    def complete(self) -> bool:
        return self.recorded == len(self.entries)

    def dump(self, path: str) -> str:
        doc = {"format": FORMAT, "written": time.time(), "origin": self.origin, "complete": self.complete,
               "entries": [[[E.to_dict(e) for e in evs], [I.to_dict(i) for i in ins]] for evs, ins, _ in self.entries]}
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(msgpack.packb(doc, default=_default, use_bin_type=True))
        os.replace(tmp, path)
        return path


@dataclass
class Dump:
    origin: dict[str, Any]
    complete: bool
    entries: list[tuple[list[E.Event], list[I.Instruction]]]


def load(path: str) -> Dump:
    with open(path, "rb") as f:
        doc = msgpack.unpackb(f.read(), object_hook=_object_hook, raw=False, strict_map_key=False)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: stimulus log format {doc.get('format')!r}, expected {FORMAT}")
    entries = [([E.from_dict(e) for e in evs], [I.from_dict(i) for i in ins]) for evs, ins in doc["entries"]]
    return Dump(doc["origin"], doc["complete"], entries)


def same(a: Any, b: Any) -> bool:
    """Equality through dicts, lists, tuples and numpy arrays (values, not types of sequence)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@dataclass
class ReplayResult:
    bursts: int  # bursts replayed
    mismatch: int | None  # index of the first burst whose instructions differ (None: all equal)
    expected: list[I.Instruction] | None = None
    got: list[I.Instruction] | None = None


def replay(dump: Dump, state: Any) -> ReplayResult:
    """Feed a dump's bursts to `state` (built as the dump's origin says) and compare what it
    returns with what the logged coordinator returned, burst by burst."""
    for i, (events, expected) in enumerate(dump.entries):
        got = state.handle(*events)
        if not same([I.to_dict(x) for x in got], [I.to_dict(x) for x in expected]):
            return ReplayResult(i + 1, i, expected, got)
    return ReplayResult(len(dump.entries), None)


def build_state(dump: Dump, job: Any = None, sources: Any = None) -> Any:
    """A CoordinatorState built as the dump's origin says: its job file (or `job`), the job's
    sources (or `sources`), the restored history and mixture changes."""
    from msd_common.spec import load_job
    from .history import StepHistory
    from .sources import open_sources
    from .state import CoordinatorState

    origin = dump.origin
    job = job if job is not None else load_job(origin["job_path"])
    sources = sources if sources is not None else open_sources(job)
    if list(sources.num_records) != list(origin["num_records"]):
        raise ValueError(f"the sources hold {sources.num_records} records, the logged run had {origin['num_records']}")
    history = StepHistory(origin["durable"], origin["loaded_states"])
    return CoordinatorState(job, sources, history, [(s, list(w)) for s, w in origin["mixture_changes"]],
                            [(name, int(r)) for name, r in origin.get("quarantined", [])],
                            [(int(s), list(c)) for s, c in origin.get("cost_changes", [])])
