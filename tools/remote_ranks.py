"""One trainer rank of tools/bench_remote.py, as its own process: it imports torch (a trainer
has it before its data loader exists), takes `--steps` steps of micro-batches as fast as its
loader gives them, and prints one JSON line: when its first batch came, when its last came,
how many tokens it received.

    python tools/remote_ranks.py ours --address tcp://... --rank 0 --steps 100
    python tools/remote_ranks.py mosaic --remote s3://b/mds --local DIR --rank 0 --ranks 2 \
        --workers 1 --micro-batch 2 --steps 100      # run with the Mosaic Streaming venv's python

Mosaic Streaming runs per rank, as a team would run it: a StreamingDataset over the bucket
(`remote`) with a local shard cache shared by the ranks of the host, in a torch DataLoader with
this rank's share of the worker processes; its samples are sequences of seq_len tokens already
packed when the MDS shards were written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import json


def ours(a: argparse.Namespace) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from trainer_client import DataClient

    client = DataClient(a.address, rank=a.rank, as_torch=True, timeout_s=600)
    first = last = None
    tokens = 0
    try:
        for batch in client:
            now = time.time()
            first = first or now
            last = now
            tokens += int((batch["piece_lengths"]).sum())
            if batch["step"] + 1 >= a.steps and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                break
    finally:
        client.close()
    return {"first_batch_at": first, "last_batch_at": last, "tokens": tokens}


def mosaic(a: argparse.Namespace) -> dict:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    os.environ.update({"RANK": str(a.rank), "WORLD_SIZE": str(a.ranks), "LOCAL_RANK": str(a.rank),
                       "LOCAL_WORLD_SIZE": str(a.ranks), "NODE_RANK": "0"})
    dataset = StreamingDataset(remote=a.remote, local=a.local, shuffle=True, shuffle_seed=a.seed,
                               batch_size=a.micro_batch)
    loader = DataLoader(dataset, batch_size=a.micro_batch, num_workers=a.workers,
                        persistent_workers=a.workers > 0)
    first = last = None
    tokens, batches = 0, 0
    for batch in loader:
        now = time.time()
        first = first or now
        last = now
        tokens += int(batch["tokens"].numel())
        batches += 1
        if batches >= a.steps * a.micro_batches:
            break
    return {"first_batch_at": first, "last_batch_at": last, "tokens": tokens}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("design", choices=("ours", "mosaic"))
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--address")
    p.add_argument("--remote")
    p.add_argument("--local")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step per rank")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch  # noqa: F401

    result = ours(a) if a.design == "ours" else mosaic(a)
    print(json.dumps({"rank": a.rank, **result}), flush=True)


if __name__ == "__main__":
    main()
