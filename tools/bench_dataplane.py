"""Data-plane throughput: megascale-data end to end against a bare numpy + pyzmq loop.

    python tools/bench_dataplane.py --json OUT [--steps N] [--repeats R]

Ours: one Megatron source, one coordinator, 1 worker process, 2 trainer ranks (DataClient,
numpy output), tokens/s delivered to the ranks as assembled micro-batches (tokens, labels,
position_ids, loss_mask, cu_seqlens), measured from each rank's first batch to its last.
Bare: one process reads the same number of tokens from the same `.bin` with numpy, in
seq_len-sized slices, and sends them over one PUSH/PULL pair to a receiver process.
Runs alternate (ours, bare, ours, ...) and the medians are compared; prints JSON.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import orjson
import yaml
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.local import LocalJob  # noqa: E402
from worker.readers.megatron import MegatronIndex, write_megatron  # noqa: E402

SPAWN = mp.get_context("spawn")
SEQ_LEN = 8192
GLOBAL_BATCH = 16  # sequences per step: 8 micro-batches of 1 x 8192 per rank


# Document length mixes (tokens): web-like text, and long documents (books, code files, papers).
MIXES = {
    "web": dict(scale=300, low=50, docs=20_000),  # mean ~650 tokens
    "long": dict(scale=4000, low=1000, docs=3_000),  # mean ~9k tokens
}


def make_dataset(root: str, mix: str = "web") -> str:
    m = MIXES[mix]
    rng = np.random.default_rng(0)
    lengths = np.clip((rng.pareto(1.5, m["docs"]) * m["scale"] + m["low"]).astype(int), m["low"], 100_000)
    prefix = os.path.join(root, f"{mix}_text_document")
    write_megatron(prefix, (rng.integers(0, 50_000, n, dtype=np.uint16) for n in lengths), np.uint16)
    return prefix


def _rank(address: str, rank: int, steps: int, out) -> None:
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=False)
    tokens, first, warm = 0, None, 3
    for batch in client:
        if batch["step"] == warm and batch["micro_batch"] == 0 and first is None:
            first = time.perf_counter()
        if batch["step"] >= warm:
            tokens += batch["num_tokens"]
        if batch["step"] + 1 >= steps and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
            break
    out.put((tokens, time.perf_counter() - first))
    client.close()


def run_ours(root: str, prefix: str, steps: int) -> float:
    job = {
        "seed": 1,
        "sources": {"tokens": {"format": "megatron", "paths": [prefix]}},
        "batch": {"seq_len": SEQ_LEN, "micro_batch_size": 1, "global_batch_size": GLOBAL_BATCH},
        "topology": {"dp": 2},
        "mixture": {"weights": {"tokens": 1.0}},
        "runtime": {"lookahead_steps": 4, "prepare_batch": 256},
    }
    path = os.path.join(root, "bench.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    with LocalJob(path, workers=1) as cluster:
        out = SPAWN.Queue()
        ranks = [SPAWN.Process(target=_rank, args=(cluster.address, r, steps, out)) for r in range(2)]
        for p in ranks:
            p.start()
        results = [out.get(timeout=600) for _ in ranks]
        for p in ranks:
            p.join()
    # the ranks run concurrently: total tokens over the longer of the two spans
    return sum(t for t, _ in results) / max(s for _, s in results)


def _bare_receiver(address: str, messages: int, out) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(address)
    tokens, first = 0, None
    for i in range(messages):
        frames = pull.recv_multipart(copy=False)
        if first is None:
            first = time.perf_counter()
        else:
            tokens += len(np.frombuffer(frames[1].buffer, dtype=np.uint16))
    out.put(tokens / (time.perf_counter() - first))
    pull.close()
    ctx.term()


def run_bare(prefix: str, total_tokens: int) -> float:
    """Read seq_len-token slices of the .bin with numpy and push them to a receiver process."""
    idx = MegatronIndex(prefix)
    data = np.memmap(prefix + ".bin", dtype=np.uint16, mode="r")
    messages = total_tokens // SEQ_LEN
    address = f"ipc://{tempfile.mkdtemp()}/bare"
    out = SPAWN.Queue()
    receiver = SPAWN.Process(target=_bare_receiver, args=(address, messages, out))
    receiver.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(address.replace("ipc://", "ipc://"))
    n = len(data) - SEQ_LEN
    rng = np.random.default_rng(1)
    starts = rng.integers(0, n, messages)
    for s in starts:
        chunk = np.array(data[s: s + SEQ_LEN])  # the read: a copy out of the mmap
        push.send_multipart([b"h", chunk], copy=False)
    rate = out.get(timeout=600)
    receiver.join()
    push.close()
    ctx.term()
    del idx
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        os.environ["MSD_CACHE_DIR"] = os.path.join(root, "cache")
        prefix = make_dataset(root)
        total = (args.steps - 3) * GLOBAL_BATCH * SEQ_LEN
        ours, bare = [], []
        for _ in range(args.repeats):
            ours.append(run_ours(root, prefix, args.steps))
            bare.append(run_bare(prefix, total))
    result = {
        "benchmark": "dataplane",
        "seq_len": SEQ_LEN,
        "global_batch_sequences": GLOBAL_BATCH,
        "steps": args.steps,
        "ranks": 2,
        "worker_processes": 1,
        "ours_tokens_per_s": statistics.median(ours),
        "bare_tokens_per_s": statistics.median(bare),
        "ours_runs": ours,
        "bare_runs": bare,
        "ratio": statistics.median(ours) / statistics.median(bare),
        "target_ratio": 0.5,
    }
    text = orjson.dumps(result, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.json_path:
        with open(args.json_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
