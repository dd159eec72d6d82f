"""Data-plane throughput: megascale-data end to end against a bare numpy + pyzmq loop.

    python tools/bench_dataplane.py --json OUT [--steps N] [--repeats R] [--global-batch SEQUENCES]

Ours: one Megatron source, one coordinator, 1 worker process, 2 trainer ranks (DataClient,
numpy output), steps of 64 x 8192 tokens (--global-batch), tokens/s delivered to the ranks as
assembled micro-batches (tokens, labels, position_ids, loss_mask, cu_seqlens), measured from
each rank's first batch to its last.
Bare: one process reads the same number of tokens from the same `.bin` with numpy, in
seq_len-sized slices, and sends them over one PUSH/PULL pair to a receiver process.
A third variant, bare_assembled, adds to the bare receiver the same batch assembly our client
does (int64 tokens, labels, position_ids, float32 loss_mask), for one piece per sequence: the
cheapest possible output, to separate the cost of the output format from our overheads.
Two document-length mixes are measured (web-like, the headline; and long documents).
Runs alternate (ours, bare, bare_assembled, ours, ...) and medians are compared; prints JSON.
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
import yaml
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402  (tools/ is on the path when run as a script)

from msd.testing.local import LocalJob  # noqa: E402
from trainer_client.assemble import assemble_micro_batch  # noqa: E402,F401  (imported by the receiver)
from msd_common.formats.megatron import MegatronIndex, write_megatron  # noqa: E402

SPAWN = mp.get_context("spawn")
SEQ_LEN = 8192
# Sequences per step: 64 is 32 micro-batches of 1 x 8192 per rank, 0.5M tokens a step, still small
# for LLM training (Megatron configs run 1-4M). The coordinator's and the client's per-step work
# is a fixed cost per step; --global-batch 16 shows it (docs/BENCHMARKS.md has both).
GLOBAL_BATCH = 64


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


def _bare_receiver(address: str, messages: int, assemble: bool, out) -> None:
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(address)
    tokens, first = 0, None
    for i in range(messages):
        frames = pull.recv_multipart(copy=False)
        chunk = np.frombuffer(frames[1].buffer, dtype=np.uint16)
        if assemble:  # the same output a trainer gets from us, for one piece per sequence (the cheapest case)
            assemble_micro_batch([[[0, 0, len(chunk)]]], {(0, 0, len(chunk)): chunk}, len(chunk), 257)
        if first is None:
            first = time.perf_counter()
        else:
            tokens += len(chunk)
    out.put(tokens / (time.perf_counter() - first))
    pull.close()
    ctx.term()


def run_bare(prefix: str, total_tokens: int, assemble: bool = False) -> float:
    """Read documents of the .bin with numpy (through the .idx, as ours does), pack them into
    seq_len-token messages and push them over tcp loopback to a receiver process."""
    idx = MegatronIndex(prefix)
    messages = total_tokens // SEQ_LEN
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    port = push.bind_to_random_port("tcp://127.0.0.1")
    out = SPAWN.Queue()
    receiver = SPAWN.Process(target=_bare_receiver, args=(f"tcp://127.0.0.1:{port}", messages, assemble, out))
    receiver.start()
    doc, pending, have = 0, [], 0
    for _ in range(messages):
        while have < SEQ_LEN:
            d = idx.document(doc % len(idx))
            pending.append(d)
            have += len(d)
            doc += 1
        joined = np.concatenate(pending)
        push.send_multipart([b"h", joined[:SEQ_LEN]], copy=False)
        pending, have = [joined[SEQ_LEN:]], have - SEQ_LEN
    rate = out.get(timeout=600)
    receiver.join()
    push.close()
    ctx.term()
    return rate


def measure(root: str, mix: str, steps: int, repeats: int) -> dict:
    prefix = make_dataset(root, mix)
    total = (steps - 3) * GLOBAL_BATCH * SEQ_LEN
    runs: dict[str, list[float]] = {"ours": [], "bare": [], "bare_assembled": []}
    for _ in range(repeats):  # interleaved, so drifting machine load hits every variant alike
        runs["ours"].append(run_ours(root, prefix, steps))
        runs["bare"].append(run_bare(prefix, total))
        runs["bare_assembled"].append(run_bare(prefix, total, assemble=True))
    med = {k: statistics.median(v) for k, v in runs.items()}
    lengths = MegatronIndex(prefix).document_lengths()
    return {
        "mean_document_tokens": float(lengths.mean()),
        "ours_tokens_per_s": med["ours"],
        "bare_tokens_per_s": med["bare"],
        "bare_assembled_tokens_per_s": med["bare_assembled"],
        "ratio": med["ours"] / med["bare"],
        "ratio_vs_bare_assembled": med["ours"] / med["bare_assembled"],
        "runs": runs,
    }


def main() -> None:
    global GLOBAL_BATCH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--global-batch", type=int, default=GLOBAL_BATCH, help="sequences of 8192 tokens per step")
    args = ap.parse_args()
    GLOBAL_BATCH = args.global_batch
    with tempfile.TemporaryDirectory() as root:
        os.environ["MSD_CACHE_DIR"] = os.path.join(root, "cache")
        mixes = {mix: measure(root, mix, args.steps, args.repeats) for mix in MIXES}
    headline = mixes["web"]
    result = {
        "benchmark": "dataplane",
        "seq_len": SEQ_LEN,
        "global_batch_sequences": GLOBAL_BATCH,
        "steps": args.steps,
        "ranks": 2,
        "worker_processes": 1,
        "cpu_cores": os.cpu_count(),
        # headline: the web-like mix (short documents, the harder case for per-piece overheads)
        "ratio": headline["ratio"],
        "ours_tokens_per_s": headline["ours_tokens_per_s"],
        "bare_tokens_per_s": headline["bare_tokens_per_s"],
        "target_ratio": 0.5,
        "mixes": mixes,
    }
    emit(result, args.json_path)


if __name__ == "__main__":
    main()
