"""The trainer container of the rendered JobSet in test_pods.py: NPROC_PER_NODE ranks of node
NODE_RANK, as torchrun would start them, each a DataClient built from the environment alone
(MSD_COORDINATOR, MSD_RELAY and RANK), receiving MSD_TEST_STEPS steps. Each rank writes what it
received to $MSD_TEST_RESULTS/rank-R.npz and its progress to $MSD_TEST_RESULTS/progress-R."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time

import numpy as np

FIELDS = ("doc_keys", "doc_offsets", "piece_lengths", "tokens")


def rank_main(rank: int) -> None:
    os.environ["RANK"] = str(rank)
    from trainer_client import DataClient

    steps = int(os.environ["MSD_TEST_STEPS"])
    compute_s = float(os.environ.get("MSD_TEST_COMPUTE_S", "0"))
    out = os.environ["MSD_TEST_RESULTS"]
    client = DataClient(as_torch=False, timeout_s=120)
    arrays: dict[str, np.ndarray] = {}
    i = 0
    for batch in client:
        for name in FIELDS:
            arrays[f"{i}.{name}"] = np.asarray(batch[name])
        arrays[f"{i}.at"] = np.array([batch["step"], batch["micro_batch"]])
        i += 1
        with open(os.path.join(out, f"progress-{rank}"), "w") as f:
            f.write(str(batch["step"]))
        time.sleep(compute_s)
        if batch["step"] + 1 >= steps and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
            break
    client.close()
    np.savez(os.path.join(out, f"rank-{rank}.npz"), **arrays)


def main() -> int:
    node, per_node = int(os.environ["NODE_RANK"]), int(os.environ["NPROC_PER_NODE"])
    ranks = [node * per_node + local for local in range(per_node)]
    procs = [mp.get_context("spawn").Process(target=rank_main, args=(r,)) for r in ranks]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())
