"""Real compute costs of packed micro-batches on a GPU: the cost model they give, and msd's gain.

    python tools/gpu_costs.py --json gpu-costs.json          # a CUDA GPU, within --minutes (8)
    python tools/gpu_costs.py --device cpu --tiny             # the same path, small: checks the script

A small causal transformer (default 8 layers, width 1,024, 16 heads, bf16) runs forward and
backward over packed rows whose documents attend only within themselves (document-masked
attention with PyTorch's own FlexAttention; `--attention sdpa` runs each document through
`scaled_dot_product_attention` instead, which CPUs can also do). Three parts, each timed with CUDA
events:

1. Times per micro-batch for rows of many document-length mixes (one long document to hundreds of
   short ones, some rows part padding), and the cost model `coordinator/calibrate.py` fits to
   them (quadratic, linear, a constant per micro-batch), with its error against a tokens-only
   model's: what `balance: {calibrate: true}` would find on this GPU.
2. Steps of 8 ranks x 2 micro-batches of long-tailed documents laid out by msd's planner
   (`coordinator/balance.py`, with the fitted model) and in arrival order (what per-rank loaders
   do): every rank's micro-batches timed for real, one after another on the one GPU; a step lasts
   as long as its slowest rank. The gain is the step time saved.
3. The JSON printed (and written with --json) holds the settings, every measured sample, the fit
   and the step times.

Needs only torch and numpy beside this checkout (coordinator/balance.py and calibrate.py are
numpy; the compiled layout loop is used where it was built, its Python twin elsewhere), so it runs
on a GPU machine without network access: copy the tree, run it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator import balance  # noqa: E402
from coordinator.calibrate import TERMS, fit, scaled_error  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model and short rows (checking the script on a CPU)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--row", type=int, default=16384, help="tokens per packed row")
    ap.add_argument("--micro-batch-size", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--attention", choices=("flex", "sdpa"), default=None,
                    help="flex (default on CUDA) or sdpa per document (default elsewhere)")
    ap.add_argument("--samples", type=int, default=96, help="micro-batches timed for the fit")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2, help="per rank per step")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--minutes", type=float, default=8.0, help="stop each part early to finish within this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.tiny:
        args.layers, args.dim, args.heads, args.vocab, args.row = 2, 64, 2, 512, 512
        args.samples, args.steps = min(args.samples, 24), min(args.steps, 2)
    if args.attention is None:
        args.attention = "flex" if args.device.startswith("cuda") else "sdpa"
    return args


# ---------------------------------------------------------------------------------- the model

def build_model(args: argparse.Namespace, torch):
    nn, F = torch.nn, torch.nn.functional
    flex = block_mask_for = None
    if args.attention == "flex":
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention, dynamic=False)

        def block_mask_for(doc: "torch.Tensor"):
            def same_document_causal(b, h, q, kv):
                return (doc[b, q] == doc[b, kv]) & (doc[b, q] >= 0) & (q >= kv)
            return create_block_mask(same_document_causal, doc.shape[0], None, doc.shape[1], doc.shape[1],
                                     device=doc.device)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(args.dim), nn.RMSNorm(args.dim)
            self.qkv = nn.Linear(args.dim, 3 * args.dim, bias=False)
            self.out = nn.Linear(args.dim, args.dim, bias=False)
            self.up = nn.Linear(args.dim, 4 * args.dim, bias=False)
            self.down = nn.Linear(4 * args.dim, args.dim, bias=False)

        def forward(self, x, mask):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, args.heads, -1).permute(2, 0, 3, 1, 4)
            if flex is not None:
                a = flex(q, k, v, block_mask=mask)
            else:  # each document alone: the same attention, one kernel call per document
                a = torch.zeros_like(q)
                for row, segments in enumerate(mask):
                    for s, e in segments:
                        a[row, :, s:e] = F.scaled_dot_product_attention(q[row:row + 1, :, s:e], k[row:row + 1, :, s:e],
                                                                        v[row:row + 1, :, s:e], is_causal=True)[0]
            x = x + self.out(a.transpose(1, 2).reshape(b, n, -1))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(args.vocab, args.dim)
            self.blocks = nn.ModuleList(Block() for _ in range(args.layers))
            self.norm = nn.RMSNorm(args.dim)
            self.head = nn.Linear(args.dim, args.vocab, bias=False)

        def forward(self, tokens, mask):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x, mask)
            return self.head(self.norm(x))

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    return Model().to(args.device, dtype), block_mask_for


class Timer:
    """Forward and backward of one micro-batch, timed on the device (CUDA events) or the host."""

    def __init__(self, args: argparse.Namespace, torch) -> None:
        self.args, self.torch = args, torch
        self.model, self.block_mask_for = build_model(args, torch)
        self.rng = np.random.default_rng(args.seed + 1)
        self.cuda = args.device.startswith("cuda")

    def __call__(self, rows: list[list[int]]) -> float:
        """Seconds of forward + backward of a micro-batch whose rows hold documents of these lengths
        (each row's remainder is padding, attending nothing)."""
        torch, args = self.torch, self.args
        doc = np.full((len(rows), args.row), -1, dtype=np.int32)
        segments = []
        for r, lengths in enumerate(rows):
            ends = np.cumsum(lengths)
            for i, (s, e) in enumerate(zip(ends - lengths, ends)):
                doc[r, s:e] = i
            segments.append(list(zip((ends - lengths).tolist(), ends.tolist())))
        tokens = torch.from_numpy(self.rng.integers(0, args.vocab, doc.shape)).to(args.device)
        if self.block_mask_for is not None:
            mask = self.block_mask_for(torch.from_numpy(doc).to(args.device))
        else:
            mask = segments
        labels = tokens.roll(-1, dims=1)
        labels[torch.from_numpy(doc < 0).to(args.device)] = -100
        self.model.zero_grad(set_to_none=True)
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            t0 = time.perf_counter()
        logits = self.model(tokens, mask)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        loss.backward()
        if self.cuda:
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        return time.perf_counter() - t0


# ---------------------------------------------------------------------------------- the data

def long_tailed(rng: np.random.Generator, n: int, row: int) -> np.ndarray:
    """Document lengths like a web corpus with some long documents (Pareto, at most one row)."""
    return np.minimum(row, (64 + rng.pareto(1.1, n) * 300).astype(np.int64))


def sample_rows(rng: np.random.Generator, args: argparse.Namespace) -> list[list[int]]:
    """Rows of one document-length mix: a typical length drawn log-uniformly (one long document
    to hundreds of short ones), a row filled to a share drawn in [0.7, 1] (some padding)."""
    rows = []
    for _ in range(args.micro_batch_size):
        typical = math.exp(rng.uniform(math.log(32), math.log(args.row)))
        fill = int(args.row * (1.0 if rng.random() < 0.5 else rng.uniform(0.7, 1.0)))
        lengths, total = [], 0
        while total < fill:
            n = int(min(fill - total, max(8, rng.exponential(typical))))
            lengths.append(n)
            total += n
        rows.append(lengths)
    return rows


def features(rows: list[list[int]]) -> list[float]:
    n = np.asarray([x for r in rows for x in r], dtype=np.float64)
    return [float((n * n).sum()), float(n.sum()), 1.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------- the parts

def calibrate(timer: Timer, args: argparse.Namespace, deadline: float) -> dict:
    rng = np.random.default_rng(args.seed)
    x, y = [], []
    for _ in range(args.samples):
        if time.monotonic() > deadline and len(y) >= 16:
            break
        rows = sample_rows(rng, args)
        y.append(timer(rows))
        x.append(features(rows))
    xa, ya = np.asarray(x), np.asarray(y)
    found = fit(xa, ya)
    tokens_only = scaled_error(xa, ya, (0.0, 1.0, 0.0, 0.0, 0.0))
    q, lin, const = found.coefficients[:3]
    return {"samples": len(y), "coefficients": dict(zip(TERMS, found.coefficients)), "fit_error": round(found.error, 4),
            "tokens_only_error": round(tokens_only, 4),
            "attention_share_of_a_full_row": round(q * args.row ** 2 / (q * args.row ** 2 + lin * args.row + const), 4)
            if q or lin or const else None,
            "measured": [[*f[:3], s] for f, s in zip(x, y)]}


def rows_of(lay: balance.Layout, lengths: np.ndarray, grid: balance.Grid) -> list[list[list[list[int]]]]:
    """[rank][micro-batch] -> rows of fragment lengths, from a layout."""
    out = [[[[] for _ in range(grid.micro_batch_size)] for _ in range(grid.micro_batches)] for _ in range(grid.ranks)]
    for row, n in zip(lay.row.tolist(), lay.length.tolist()):
        rank, within = divmod(row, grid.rows_per_rank)
        mb, seq = divmod(within, grid.micro_batch_size)
        out[rank][mb][seq].append(n)
    return out


def step_gain(timer: Timer, args: argparse.Namespace, coefficients: dict, deadline: float) -> dict:
    rng = np.random.default_rng(args.seed + 2)
    grid = balance.Grid(args.ranks, args.micro_batches, args.micro_batch_size, args.row)
    cost = balance.Cost(coefficients["quadratic"], coefficients["linear"])
    if not (cost.quadratic or cost.linear):  # all of it a constant per micro-batch: nothing to balance by
        cost = balance.Cost(0.0, 1.0)
    budget = args.ranks * args.micro_batches * args.micro_batch_size * args.row
    steps = []
    for step in range(args.steps):
        if time.monotonic() > deadline and steps:
            break
        lengths = long_tailed(rng, 4 * budget // 300, args.row)
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), budget, side="right"))]
        result = {"step": step, "documents": len(lengths), "tokens": int(lengths.sum())}
        for name, method in (("msd", "greedy"), ("arrival_order", "none")):
            lay = balance.layout(method, lengths, grid, cost)
            rank_s = [sum(timer(mb) for mb in rank) for rank in rows_of(lay, lengths, grid)]
            predicted = lay.rank_costs(grid, cost)
            result[name] = {"step_s": max(rank_s), "mean_rank_s": float(np.mean(rank_s)),
                            "max_over_mean": max(rank_s) / float(np.mean(rank_s)),
                            "predicted_max_over_mean": float(predicted.max() / predicted.mean())}
        result["gain"] = 1 - result["msd"]["step_s"] / result["arrival_order"]["step_s"]
        steps.append(result)
        print(f"# step {step}: msd {result['msd']['step_s'] * 1000:.1f} ms, arrival order "
              f"{result['arrival_order']['step_s'] * 1000:.1f} ms (gain {100 * result['gain']:.1f} %)", file=sys.stderr)
    msd = sum(s["msd"]["step_s"] for s in steps)
    arrival = sum(s["arrival_order"]["step_s"] for s in steps)
    return {"steps": steps, "msd_step_s_mean": msd / len(steps), "arrival_order_step_s_mean": arrival / len(steps),
            "gain": 1 - msd / arrival,
            "msd_max_over_mean_median": float(np.median([s["msd"]["max_over_mean"] for s in steps])),
            "arrival_order_max_over_mean_median": float(np.median([s["arrival_order"]["max_over_mean"]
                                                                   for s in steps]))}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import torch

    began = time.monotonic()
    end = began + 60 * args.minutes
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --device cpu --tiny to check the script")
    timer = Timer(args, torch)
    warm_rng = np.random.default_rng(args.seed + 3)
    for _ in range(3):  # compile, allocate, autotune
        timer(sample_rows(warm_rng, args))
    warmed = time.monotonic() - began
    print(f"# warmed up in {warmed:.1f} s", file=sys.stderr)
    # the fit gets up to half of what is left, the steps the rest
    fitted = calibrate(timer, args, time.monotonic() + 0.45 * (end - time.monotonic()))
    print(f"# fit from {fitted['samples']} micro-batches: {fitted['coefficients']} error {fitted['fit_error']} "
          f"(tokens only: {fitted['tokens_only_error']})", file=sys.stderr)
    gain = step_gain(timer, args, fitted["coefficients"], end - 10)
    result = {"benchmark": "gpu_costs",
              "command": "python tools/gpu_costs.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
              "settings": {k: v for k, v in vars(args).items() if k != "json"},
              "warm_up_s": round(warmed, 1), "fit": fitted, "layouts": gain,
              "seconds": round(time.monotonic() - began, 1)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return result


if __name__ == "__main__":
    main()
