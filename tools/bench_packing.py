"""Whole-sample packing against TRL's best-fit decreasing, on the same conversations.

Conversations (msd.testing.chat_data) are rendered with a chat template and tokenized
(msd's worker/chat.py); their lengths go to:
- msd: the planner with one `packing: whole` source (dp ranks x rows of seq_len, the cost
  model quadratic), for as many steps as the conversations fill;
- TRL: `trl.data_utils.pack_dataset(dataset, seq_len, strategy="bfd")` over the whole set;
- torchtune: `PackedDataset(..., split_across_pack=False)` over the whole set, run in its own
  venv (`make bench-packing-env` makes `.venv-torchtune`; torchtune pins its own torch and torchao),
  through tools/torchtune_packing.py; left out when that venv is missing.
Figures: padding share (padding / row tokens), samples dropped or truncated, and for msd the
max/mean rank cost per step against two lower bounds of the busiest rank: the simple one (the
larger of the mean rank cost and the costliest sample) and one that knows rows are full
(`full_rows_bound`: the k ranks that hold the k longest samples must also hold the rest of their
rows' tokens, at best the step's shortest samples; no layout of the step's samples with its
padding can do better).

    python tools/bench_packing.py [--samples 4000] [--seq-len 4096] [--dp 8] [--rows-per-rank 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lengths_of_conversations(n: int, seed: int) -> np.ndarray:
    from tokenizers import Tokenizer

    from msd.testing.chat_data import conversation, write_tokenizer_dir
    from worker.chat import ChatTemplate

    path = write_tokenizer_dir(tempfile.mkdtemp())
    chat = ChatTemplate(path, Tokenizer.from_file(os.path.join(path, "tokenizer.json")))
    rng = random.Random(seed)
    # a long tail: most conversations short, some many turns of long messages
    return np.array([len(chat.render(conversation(rng, turns=rng.choice([1, 1, 2, 3, 6, 12]),
                                                  words=(5, rng.choice([40, 120, 400])))).tokens)
                     for _ in range(n)], dtype=np.int64)


def full_rows_bound(lengths: np.ndarray, rank_tokens: int, padding: int, ranks: int) -> float:
    """A lower bound of the busiest rank's cost (quadratic model) for any layout of these whole
    samples on `ranks` ranks of `rank_tokens` each with `padding` tokens of padding in all. For
    each k: either the k longest samples are on k different ranks, which between them then hold
    k x rank_tokens - padding tokens at least, the rest at best the shortest samples (taken
    fractionally: a relaxation), so the busiest holds at least their mean; or two of them share
    a rank, which then costs at least the two cheapest of them."""
    n = np.sort(np.asarray(lengths, dtype=np.float64))[::-1]
    cost = n * n
    shortest = np.sort(n)  # fill from the cheapest per token
    best = 0.0
    for k in range(1, min(ranks, len(n)) + 1):
        need = k * rank_tokens - n[:k].sum() - padding
        rest = shortest[:len(n) - k]
        take = np.clip(need - (np.cumsum(rest) - rest), 0, rest)  # tokens taken of each, in order
        spread = (cost[:k].sum() + float((take * rest).sum())) / k
        paired = cost[k - 2] + cost[k - 1] if k >= 2 else np.inf
        best = max(best, min(spread, paired))
    return best


def msd_packing(lengths: np.ndarray, seq_len: int, dp: int, rows_per_rank: int, token_slack: float = 0.0) -> dict:
    from msd_common.spec import parse_job
    from coordinator.plan import LENGTH, Planner

    rows = dp * rows_per_rank
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "c.jsonl"), "w").write("{}\n")
        job = parse_job({"seed": 1, "sources": {"chat": {"format": "jsonl", "paths": ["c.jsonl"], "packing": "whole",
                                                           "epochs": 1}},
                         "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": rows},
                         "topology": {"dp": dp}, "mixture": {"weights": {"chat": 1.0}},
                         "balance": {"token_slack": token_slack}}, "job.yaml", base_dir=d)
    planner = Planner(job, [len(lengths)])

    class Known:
        def window(self, s, start, count):
            count = max(0, min(count, len(lengths) - start))
            records = np.array([planner.record_at(s, p) for p in range(start, start + count)], dtype=np.int64)
            return records, lengths[records] if count else np.zeros(0, np.int64)

    known, plans = Known(), []
    while True:
        try:
            plans.append(planner.plan_step(known))
        except Exception:  # the source's one epoch is used up
            break
    real = sum(int(p.pieces[:, LENGTH].sum()) for p in plans)
    ratios, bound_ratios, full_ratios = [], [], []
    rank_tokens = rows_per_rank * job.row_capacity_at(0)
    for p in plans[:-1]:  # the last step holds the remainder
        costs = np.asarray(p.rank_costs)
        n = p.pieces[:, LENGTH]
        bound = max(costs.mean(), float((n.astype(float) ** 2).max()))
        ratios.append(costs.max() / costs.mean())
        bound_ratios.append(costs.max() / bound)
        padding = dp * rank_tokens - int(n.sum())
        full_ratios.append(costs.max() / max(costs.mean(), full_rows_bound(n, rank_tokens, padding, dp)))
    full = plans[:-1]
    padding = 1 - sum(int(p.pieces[:, LENGTH].sum()) for p in full) / (len(full) * rows * job.row_capacity_at(0))
    return {"steps": len(plans), "padding_share": round(padding, 4), "tokens": real,
            "samples": int(sum(len(p.pieces) for p in plans)), "truncated": int((lengths > seq_len).sum()),
            "dropped": 0,  # whole samples are never dropped (long_docs: truncate)
            "left_at_epoch_end": int(len(lengths) - sum(len(p.pieces) for p in plans)),  # too few for a last step
            "max_over_mean_median": round(float(np.median(ratios)), 4),
            "max_over_lower_bound_median": round(float(np.median(bound_ratios)), 4),
            "max_over_lower_bound_p90": round(float(np.quantile(bound_ratios, 0.9)), 4),
            "max_over_full_rows_bound_median": round(float(np.median(full_ratios)), 4),
            "max_over_full_rows_bound_p90": round(float(np.quantile(full_ratios, 0.9)), 4)}


def trl_packing(lengths: np.ndarray, seq_len: int) -> dict:
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    ds = Dataset.from_dict({"input_ids": [[1] * int(n) for n in lengths]})
    packed = pack_dataset(ds, seq_len, strategy="bfd")
    rows = [len(x) for x in packed["input_ids"]]
    kept = sum(rows)
    return {"rows": len(rows), "padding_share": round(1 - kept / (len(rows) * seq_len), 4),
            "tokens": kept, "tokens_dropped": int(lengths.sum() - kept),
            "samples_truncated": int((lengths > seq_len).sum())}


def torchtune_packing(lengths: np.ndarray, seq_len: int, python: str) -> dict | None:
    import subprocess

    if not os.path.exists(python):
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    done = subprocess.run([python, os.path.join(here, "torchtune_packing.py")], capture_output=True, text=True,
                          input=json.dumps({"lengths": [int(n) for n in lengths], "seq_len": seq_len}), timeout=600)
    if done.returncode != 0:
        return {"error": done.stderr[-500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--rows-per-rank", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token-slack", type=float, default=0.0, help="balance.token_slack of the msd job")
    ap.add_argument("--torchtune-python", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".venv-torchtune", "bin", "python"), help="python of a venv with torchtune")
    args = ap.parse_args()
    lengths = lengths_of_conversations(args.samples, args.seed)
    out = {"samples": args.samples, "seq_len": args.seq_len, "dp": args.dp, "rows_per_rank": args.rows_per_rank,
           "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max()),
           "token_slack": args.token_slack,
           "msd": msd_packing(lengths, args.seq_len, args.dp, args.rows_per_rank, args.token_slack),
           "trl_bfd": trl_packing(np.minimum(lengths, args.seq_len), args.seq_len),
           "torchtune": torchtune_packing(np.minimum(lengths, args.seq_len), args.seq_len, args.torchtune_python)}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
