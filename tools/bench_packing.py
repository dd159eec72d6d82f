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
(`coordinator.balance.busiest_rank_bound`: the k ranks that hold the k costliest samples must
also hold the rest of their rows' tokens, at best the step's cheapest per token; no layout of the
step's samples with its padding can do better), and the time of the layout (placing and exchanging) per step.

--images gives the conversations images (0 to 4 each, sides of 224 to 896 pixels), as
Qwen2.5-VL's processor counts them: 14-pixel patches on sides rounded to 28, one image token per
4 patches. A sample then costs n^2 for the language model's attention plus 0.4 x each image's
patches squared for the vision encoder's (its attention per token pair, 1,280 x 32 layers, over
the language model's, 3,584 x 28; full attention in every layer, Qwen's windows left out).
--distinct renders that many conversations and draws --samples of them (with replacement, seeded)
for the many samples that 1,024 ranks need.

    python tools/bench_packing.py [--samples 4000] [--seq-len 4096] [--dp 8] [--rows-per-rank 2]
                                  [--images] [--distinct N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

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


ENCODER_ATTENTION = 0.4  # the vision encoder's attention per patch pair over the language model's per token pair


def images_of_conversations(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Per conversation: image tokens and patches squared (summed over its images), and patches."""
    rng = random.Random(seed + 1)
    tokens, squares, patches = np.zeros(n, np.int64), np.zeros(n, np.float64), np.zeros(n, np.int64)
    for i in range(n):
        for _ in range(rng.choice([0, 0, 1, 1, 1, 2, 3, 4])):
            h, w = (max(28, round(rng.randint(224, 896) / 28) * 28) for _ in range(2))
            p = (h // 14) * (w // 14)
            tokens[i] += p // 4
            squares[i] += float(p) * p
            patches[i] += p
    return tokens, squares, patches


def msd_packing(lengths: np.ndarray, seq_len: int, dp: int, rows_per_rank: int, token_slack: float = 0.0,
                squares: "np.ndarray | None" = None, patches: "np.ndarray | None" = None) -> dict:
    """squares, patches: per sample, its images' patches squared (summed) and patches (--images)."""
    from msd_common.spec import parse_job
    from coordinator.balance import busiest_rank_bound
    from coordinator.plan import LENGTH, RECORD, Planner

    rows = dp * rows_per_rank
    images = squares is not None
    source = {"format": "jsonl", "paths": ["c.jsonl"], "packing": "whole", "epochs": 1}
    if images:  # a source whose samples cost the vision encoder (its patches are planned)
        source = {"format": "webdataset", "paths": ["c.tar"], "packing": "whole", "epochs": 1, "image_token_id": 5}
    with tempfile.TemporaryDirectory() as d:
        open(os.path.join(d, "c.jsonl"), "w").write("{}\n")
        open(os.path.join(d, "c.tar"), "wb").close()
        job = parse_job({"seed": 1, "sources": {"chat": source},
                         "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": rows},
                         "topology": {"dp": dp}, "mixture": {"weights": {"chat": 1.0}},
                         "balance": {"token_slack": token_slack,
                                     "cost": {"quadratic": 1.0, "linear": 0.0,
                                              "patch_quadratic": ENCODER_ATTENTION if images else 0.0}}},
                        "job.yaml", base_dir=d)
    planner = Planner(job, [len(lengths)])

    class Known:
        def window(self, s, start, count):
            count = max(0, min(count, len(lengths) - start))
            records = np.array([planner.record_at(s, p) for p in range(start, start + count)], dtype=np.int64)
            return records, lengths[records] if count else np.zeros(0, np.int64)

        def patches(self, s, positions):
            return patches[[planner.record_at(s, int(p)) for p in positions]]

        def patch_squares(self, s, positions):
            return squares[[planner.record_at(s, int(p)) for p in positions]]

    import coordinator.plan as plan_module

    layout, seconds = plan_module.balance.whole_layout, []

    def timed_layout(*args, **kwargs):  # the layout's own time (this bench's Known is slow Python)
        started = time.perf_counter()
        try:
            return layout(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    known, plans = Known(), []
    plan_module.balance.whole_layout = timed_layout
    try:
        while True:
            try:
                plans.append(planner.plan_step(known))
            except Exception:  # the source's one epoch is used up
                break
    finally:
        plan_module.balance.whole_layout = layout
    real = sum(int(p.pieces[:, LENGTH].sum()) for p in plans)
    ratios, bound_ratios, full_ratios = [], [], []
    rank_tokens = rows_per_rank * job.row_capacity_at(0)
    for p in plans[:-1]:  # the last step holds the remainder
        costs = np.asarray(p.rank_costs)
        n = p.pieces[:, LENGTH]
        sample_costs = n.astype(float) ** 2
        if images:
            sample_costs += ENCODER_ATTENTION * squares[p.pieces[:, RECORD]]
        bound = max(costs.mean(), float(sample_costs.max()))
        ratios.append(costs.max() / costs.mean())
        bound_ratios.append(costs.max() / bound)
        padding = dp * rank_tokens - int(n.sum())
        full_ratios.append(costs.max() / busiest_rank_bound(n, sample_costs, rank_tokens, padding, dp))
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
            "max_over_full_rows_bound_p90": round(float(np.quantile(full_ratios, 0.9)), 4),
            "layout_ms_per_step_median": round(1000 * float(np.median(seconds)), 1),
            "layout_ms_per_step_max": round(1000 * float(np.max(seconds)), 1)}


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
    ap.add_argument("--images", action="store_true", help="conversations with images (msd's cost: LM plus encoder)")
    ap.add_argument("--distinct", type=int, default=0, help="render this many conversations, draw --samples of them")
    ap.add_argument("--skip-others", action="store_true", help="msd only (no TRL, no torchtune)")
    ap.add_argument("--torchtune-python", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), ".venv-torchtune", "bin", "python"), help="python of a venv with torchtune")
    args = ap.parse_args()
    distinct = args.distinct or args.samples
    lengths = lengths_of_conversations(distinct, args.seed)
    squares = patches = None
    if args.images:
        image_tokens, squares, patches = images_of_conversations(distinct, args.seed)
        lengths = lengths + image_tokens
    if distinct != args.samples:
        drawn = np.random.default_rng(args.seed).integers(0, distinct, args.samples)
        lengths = lengths[drawn]
        if args.images:
            squares, patches = squares[drawn], patches[drawn]
    out = {"samples": args.samples, "distinct": distinct, "images": args.images, "seq_len": args.seq_len,
           "dp": args.dp, "rows_per_rank": args.rows_per_rank,
           "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max()),
           "token_slack": args.token_slack,
           "msd": msd_packing(lengths, args.seq_len, args.dp, args.rows_per_rank, args.token_slack, squares, patches)}
    if not args.skip_others:
        out["trl_bfd"] = trl_packing(np.minimum(lengths, args.seq_len), args.seq_len)
        out["torchtune"] = torchtune_packing(np.minimum(lengths, args.seq_len), args.seq_len, args.torchtune_python)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
