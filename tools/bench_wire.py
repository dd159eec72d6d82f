"""What the typed message classes cost on the wire, in-process, for one step at DP 4,096: the
coordinator's part (a step_header per rank built and encoded, a consumed per rank decoded into its
event) and the ranks' part (a pieces message per rank decoded, summed over the ranks), through the
typed path (protocol classes, wire.receive) and through raw header dicts and wire.decode (how
every role but the coordinator's state read them before), alternated, CPU time per step.

    python tools/bench_wire.py --json OUT [--dp 4096] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.events import from_message  # noqa: E402
from msd_common import protocol as P  # noqa: E402
from msd_common import wire  # noqa: E402
from bench_output import emit  # noqa: E402

PLAN = {"max_over_mean": 1.01, "naive_max_over_mean": 1.3, "rank_cost": 1.0, "naive_rank_cost": 1.2}


def coordinator_typed(dp: int, pieces: np.ndarray, counts: np.ndarray, consumed: list) -> None:
    """The coordinator's part of a step served directly: a step_header built and encoded per rank,
    a consumed per rank decoded into its event."""
    for rank in range(dp):
        wire.encode(P.StepHeader(step=7, rank=rank, row_len=2048, plan=PLAN, pieces=pieces, counts=counts))
    for frames in consumed:
        header, arrays = wire.decode(frames, P.COORDINATOR_INBOX)
        from_message(b"peer", 0.0, header, arrays)


def coordinator_dicts(dp: int, pieces: np.ndarray, counts: np.ndarray, consumed: list) -> None:
    for rank in range(dp):
        wire.encode({"type": "step_header", "step": 7, "rank": rank, "row_len": 2048, "plan": PLAN}, pieces, counts)
    for frames in consumed:
        header, arrays = wire.decode(frames, P.COORDINATOR_INBOX)
        from_message(b"peer", 0.0, header, arrays)  # (the coordinator's events were typed before too)


def clients_typed(pieces_msg: list) -> None:
    """The ranks' part, summed over all of them (each decodes its own): a pieces message each."""
    for frames in pieces_msg:
        wire.receive(frames, P.TRAINER_DATA_INBOX)


def clients_dicts(pieces_msg: list) -> None:
    for frames in pieces_msg:
        wire.decode(frames, P.TRAINER_DATA_INBOX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dp", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pieces = np.arange(4 * 3, dtype=np.uint64).reshape(4, 3)
    counts = np.array([2, 2], np.uint32)
    consumed = [[bytes(f) for f in wire.encode(P.Consumed(rank=r, step=7, waited_s=0.0))] for r in range(args.dp)]
    items = np.array([[0, 5, 0, 512], [1, 6, 0, 512]], np.uint64)
    tokens = np.zeros(1024, np.uint16)
    pieces_msg = [[bytes(f) for f in wire.encode(P.Pieces(
        step=7, rank=r, dtype="<u2", patch_bytes=0, extras=[], items=items, tokens=tokens,
        patch_counts=np.zeros(0, np.uint32), patches=np.zeros(0, np.uint8), loss_mask=np.zeros(0, np.uint8),
        extra_rows=np.zeros(0, np.uint32)))] for r in range(args.dp)]
    parts = {"coordinator": ({"typed": coordinator_typed, "dicts": coordinator_dicts},
                             (args.dp, pieces, counts, consumed)),
             "all ranks": ({"typed": clients_typed, "dicts": clients_dicts}, (pieces_msg,))}
    runs: dict[str, dict[str, list[float]]] = {part: {"typed": [], "dicts": []} for part in parts}
    for _ in range(args.repeats):
        for part, (fns, fn_args) in parts.items():
            for name, fn in fns.items():
                t = time.process_time()
                fn(*fn_args)
                runs[part][name].append(1000 * (time.process_time() - t))
    out: dict = {"dp": args.dp, "repeats": args.repeats}
    for part, by in runs.items():
        med = {k: statistics.median(v) for k, v in by.items()}
        out[part] = {"ms_per_step": {k: round(v, 2) for k, v in med.items()},
                     "spread_ms": {k: [round(min(v), 2), round(max(v), 2)] for k, v in by.items()},
                     "typed_over_dicts": round(med["typed"] / med["dicts"], 3)}
    emit(out, args.json)

if __name__ == "__main__":
    main()
