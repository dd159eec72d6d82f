"""Time inside `DataClient.__next__` when the micro-batch's data has already arrived.

    python tools/bench_next.py --json OUT [--rows 4096,32768] [--compute-ms 0,5] [--micro-batches 2000]

A real DataClient (its I/O thread, its builder thread, its buffer pool) whose finished steps are
put on its hand-over queue directly, as its I/O thread puts them once every piece is in (the
coordinator's address is a closed port: nothing arrives over the sockets, so nothing competes with
the trainer but the client itself). Steps of 8 micro-batches of one row each, pieces of the web mix
(Pareto lengths, mean ~600 tokens), uint16 tokens as a Megatron source sends them. The trainer
takes a micro-batch, "computes" (sleeps --compute-ms), drops it and takes the next.

Per row length, compute time and mode:
- `prebuilt`: the client as it is: the builder thread builds the next micro-batch while the trainer
  computes;
- `in_next`: the builder asked for nothing, so every micro-batch is built inside `next()` (the
  client before issue 35, and what happens with no compute between calls);
- with `pin_memory=True` too where a CUDA device exists (reported as unavailable otherwise).
Figures: median, p90 and p99 of the time inside `next()` in microseconds, how many micro-batches
were found built ahead, and how many buffers the pool allocated for all of them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_output import emit  # noqa: E402

from msd.testing.ports import free_port  # noqa: E402
from trainer_client import DataClient  # noqa: E402
from trainer_client.assemble import StepAssembler  # noqa: E402
from trainer_client.receiving import ReadyStep  # noqa: E402

MICRO_BATCHES = 8  # per step
INFO = {"topology": {"dp": 1, "pp": 1, "cp": 1, "tp": 1}, "pad_id": 0, "micro_batch_size": 1,
        "micro_batches": MICRO_BATCHES}


def web_step(step: int, row_len: int, rng: np.random.Generator) -> ReadyStep:
    """A finished step of one rank: rows filled with documents of the web mix, tokens in."""
    refs, counts, key = [], [], step << 20
    for _ in range(MICRO_BATCHES):
        left, n = row_len, 0
        while left > 0:
            length = min(left, int(rng.pareto(1.3) * 300) + 20)
            refs.append((key, 0, length))
            key, left, n = key + 1, left - length, n + 1
        counts.append(n)
    refs_a = np.array(refs, dtype=np.uint64)
    assembler = StepAssembler(refs_a, np.array(counts), row_len, 0, 1)
    items = np.column_stack([np.arange(len(refs_a), dtype=np.uint64), refs_a])
    assembler.add(items, rng.integers(0, 65_000, int(refs_a[:, 2].sum())).astype(np.uint16))
    return ReadyStep(step, 0, assembler, {}, 0, INFO, False)


def run(row_len: int, compute_s: float, micro_batches: int, prebuilt: bool, pin: bool) -> dict:
    client = DataClient(f"tcp://127.0.0.1:{free_port()}", rank=0, timeout_s=30, pin_memory=pin)
    client.start()
    if not prebuilt:
        client._builder.ask = lambda ready, m: None  # nothing is built ahead
    rng = np.random.default_rng(row_len)
    steps = -(-(micro_batches + 20) // MICRO_BATCHES)
    for s in range(steps):  # every step is in before the first is taken: the data has arrived
        client._queue.put(web_step(s, row_len, rng))
    times = []
    try:
        batch = None
        for _ in range(micro_batches + 20):
            t0 = time.perf_counter()
            batch = next(client)
            times.append(time.perf_counter() - t0)
            if compute_s:
                time.sleep(compute_s)
            del batch
        built_ahead, allocated = client._builder.built_ahead, client._pool.allocated
    finally:
        client.close()
    us = np.array(times[20:]) * 1e6  # the first 20: warm-up
    return {"row_len": row_len, "compute_ms": compute_s * 1e3, "mode": "prebuilt" if prebuilt else "in_next",
            "pin_memory": pin, "micro_batches": len(us), "median_us": float(np.median(us)),
            "p90_us": float(np.percentile(us, 90)), "p99_us": float(np.percentile(us, 99)),
            "built_ahead": built_ahead, "buffers_allocated": allocated}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--rows", default="4096,32768")
    ap.add_argument("--compute-ms", default="0,5")
    ap.add_argument("--micro-batches", type=int, default=2000)
    a = ap.parse_args()
    # the client's coordinator is a closed port on purpose: its "waiting for the coordinator" lines say nothing here
    logging.getLogger("msd.session").setLevel(logging.ERROR)
    import torch

    pins = [False, True] if torch.cuda.is_available() else [False]
    results = []
    for row_len in (int(r) for r in a.rows.split(",")):
        for compute_ms in (float(c) for c in a.compute_ms.split(",")):
            for pin in pins:
                for prebuilt in (True, False):  # side by side
                    r = run(row_len, compute_ms / 1e3, a.micro_batches, prebuilt, pin)
                    results.append(r)
                    print(f"# {row_len} tokens, {compute_ms:g} ms, {r['mode']}, pin {pin}: median "
                          f"{r['median_us']:.1f} us, p90 {r['p90_us']:.1f}, built ahead {r['built_ahead']}, "
                          f"buffers {r['buffers_allocated']}", file=sys.stderr, flush=True)
    emit({"benchmark": "next", "command": "python tools/bench_next.py " + " ".join(sys.argv[1:]),
          "cpus": os.cpu_count(), "pin_memory": "measured" if len(pins) == 2 else "no CUDA device: not measured",
          "results": results}, a.json)


if __name__ == "__main__":
    main()
