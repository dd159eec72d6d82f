"""Where the paper's step-time gain comes from: `msd plan` at the paper's scale, and its
prediction checked against the measured imbalance of a real run.

    python tools/bench_plan.py --json OUT [--quick]

1. Data: three Megatron sources of real text, this Python's standard library (.py files) as
   byte tokens: `paragraphs` (blank-line separated blocks: short), `files` (whole files: a long
   tail) and `packages` (every directory's files joined: very long).
2. Dry runs (msd.dryrun, what `msd plan --json` prints) of two mixes - `files`, and
   `short_long` (60 % paragraphs, 40 % packages by tokens) - at DP 8 to 1,024 and 32k and 128k
   context, one packed sequence per rank per step, with a 7B-like cost model (attention
   6*d*layers*len^2 against 6*params*len flops), with 1 and 4 packed sequences per rank per step:
   per point the max/mean rank cost of msd's layout and of arrival-order dealing (what per-rank
   loaders do), the predicted step-time gain (arrival order's max/mean over ours), and the raw
   ratio of the busiest ranks' costs (which also counts the attention arrival order saves by
   cutting documents wherever a row ends).
3. The check: a real job (coordinator, worker processes, 4 DataClients on loopback) of the
   `short_long` mix at seq_len 4096, 2 sequences per rank, once with `balance.method: none`
   (pieces in arrival order) and once with `greedy`; every rank's pieces are then timed on this
   CPU running real causal attention per piece (torch scaled_dot_product_attention, one thread)
   plus a linear layer, one rank after another (fastest of 5). The cost model of both jobs is
   fitted to this CPU first (time of one piece against its length; the fit's per-piece constant
   is reported, the cost model has none). Reported: the dry run's predicted max/mean
   per run against the measured max/mean of the rank times, and the relative error.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import threading
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402  (tools/ is on the path when run as a script)

from msd import dryrun  # noqa: E402
from msd_common.spec import load_job  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

A_7B = 6 * 4096 * 32 / 4e14  # seconds per token^2 (causal attention, forward + backward), as bench_e2e
B_7B = 6 * 7e9 / 4e14  # seconds per token (everything else)
DATA_VERSION = 1
HEADS, HEAD_DIM = 4, 32  # the timed attention of the check


def make_data(root: str) -> dict[str, str]:
    """The three Megatron sources (written once, reused): name -> prefix."""
    prefixes = {n: os.path.join(root, f"{n}_text_document") for n in ("paragraphs", "files", "packages")}
    stamp = os.path.join(root, f".complete-v{DATA_VERSION}")
    if os.path.exists(stamp):
        return prefixes
    os.makedirs(root, exist_ok=True)
    stdlib = sysconfig.get_paths()["stdlib"]
    paragraphs, files, packages = [], [], []
    for dirpath, dirnames, filenames in os.walk(stdlib):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        joined = []
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read()
            except OSError:
                continue
            if not data.strip():
                continue
            tokens = np.frombuffer(data, np.uint8).astype(np.uint16)
            files.append(tokens)
            joined.append(tokens)
            paragraphs.extend(np.frombuffer(p, np.uint8).astype(np.uint16) for p in data.split(b"\n\n") if p.strip())
        if joined:
            packages.append(np.concatenate(joined))
    for name, docs in (("paragraphs", paragraphs), ("files", files), ("packages", packages)):
        write_megatron(prefixes[name], docs, np.uint16)
    open(stamp, "w").close()
    return prefixes


def write_job(root: str, name: str, prefixes: dict[str, str], weights: dict[str, float], dp: int, seq_len: int,
              quadratic: float, linear: float, method: str = "greedy", per_rank: int = 1) -> str:
    job = {
        "seed": 7,
        "sources": {n: {"format": "megatron", "paths": [prefixes[n]]} for n in weights},
        "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": dp * per_rank},
        "topology": {"dp": dp},
        "mixture": {"weights": weights},
        "balance": {"method": method, "cost": {"quadratic": quadratic, "linear": linear}},
        "runtime": {"heartbeat_s": 1.0, "lookahead_steps": 2},
    }
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


MIXES = {"files": {"files": 1.0}, "short_long": {"paragraphs": 0.6, "packages": 0.4}}


def paper_scale(root: str, prefixes: dict[str, str], quick: bool) -> list[dict]:
    grid = [(8, 32768), (64, 32768), (512, 32768), (512, 131072)] if quick else \
        [(8, 32768), (64, 32768), (512, 32768), (1024, 32768), (512, 131072), (1024, 131072)]
    steps = 3 if quick else 6
    rows = []
    for mix, weights in MIXES.items():
        for (dp, seq_len), per_rank in ((point, n) for point in grid for n in (1, 4)):
            path = write_job(root, f"paper-{mix}-{dp}-{seq_len}-{per_rank}", prefixes, weights, dp, seq_len, A_7B,
                             B_7B, per_rank=per_rank)
            started = time.perf_counter()
            report = dryrun.dry_run(load_job(path), steps, every_stage=False)
            report.pop("_known")
            st = report["stages"][0]
            row = {"mix": mix, "dp": dp, "seq_len": seq_len, "sequences_per_rank": per_rank, "steps": st["steps"],
                   "pieces_per_step": st["pieces_per_step"], "max_over_mean": round(st["max_over_mean"], 4),
                   "naive_max_over_mean": round(st["naive_max_over_mean"], 4),
                   "predicted_step_time_gain": round(st["predicted_step_time_gain"], 4),
                   "busiest_rank_cost_ratio": round(st["busiest_rank_cost_ratio"], 4),
                   "planning_ms_per_step": round(st["planning_ms_per_step"], 1),
                   "wall_s": round(time.perf_counter() - started, 1)}
            print(row, file=sys.stderr)
            rows.append(row)
    return rows


# ---------------------------------------------------------------- the check against a real run

def _piece_time_fn(max_len: int):
    """One piece's compute: causal attention over its tokens and a linear layer (one thread)."""
    import torch

    torch.set_num_threads(1)
    x = torch.randn(1, HEADS, max_len, HEAD_DIM)
    flat = torch.randn(max_len, HEADS * HEAD_DIM)
    weight = torch.randn(HEADS * HEAD_DIM, 4 * HEADS * HEAD_DIM)

    def run(length: int) -> None:
        q = x[:, :, :length]
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        torch.matmul(flat[:length], weight)

    return run


def _timed(fn, repeats: int) -> float:
    """The fastest of `repeats` runs: noise on a shared machine only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def fit_cost(run, max_len: int, repeats: int = 7) -> tuple[float, float, float]:
    """(quadratic, linear, per piece) seconds of one piece against its length, least squares."""
    lengths = [16, 64, 128, 256, 512, 1024, 1536, 2048, 3072, max_len]
    times = []
    for n in lengths:
        run(n)
        times.append(_timed(lambda: run(n), repeats))
    x = np.array(lengths, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(np.column_stack([x * x, x, np.ones_like(x)]), np.array(times), rcond=None)
    return float(coef[0]), float(coef[1]), float(coef[2])


def receive(path: str, ranks: int, steps: int) -> dict[tuple[int, int], list[int]]:
    """Run the job for real; (step, rank) -> the lengths of the pieces the rank received."""
    from msd.testing.local import LocalJob
    from trainer_client import DataClient

    got: dict[tuple[int, int], list[int]] = {}
    errors: list[str] = []

    def rank(r: int, address: str) -> None:
        try:
            with DataClient(address, rank=r, as_torch=False, timeout_s=120) as client:
                for batch in client:
                    got[(batch["step"], r)] = got.get((batch["step"], r), []) + batch["piece_lengths"].tolist()
                    if batch["step"] + 1 >= steps:
                        break
        except Exception as e:  # noqa: BLE001
            errors.append(f"rank {r}: {e}")

    with LocalJob(path, workers=2) as job:
        threads = [threading.Thread(target=rank, args=(r, job.address)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    if errors:
        raise RuntimeError("; ".join(errors))
    return got


def time_ranks(run, got: dict[tuple[int, int], list[int]], ranks: int, steps: int, repeats: int) -> list[float]:
    """Measured max/mean of the ranks' compute per step (each rank's pieces run one by one)."""
    out = []
    for step in range(steps):
        times = [_timed(lambda: [run(n) for n in got[(step, r)]], repeats) for r in range(ranks)]
        out.append(max(times) / statistics.mean(times))
    return out


def summarise(predicted: list[float], measured: list[float]) -> dict:
    """Predicted against measured max/mean over the steps: medians (a step disturbed by another
    process on this shared machine shows as an outlier, always upwards), means, the relative error
    of the medians, and each step's pair."""
    p, m = statistics.median(predicted), statistics.median(measured)
    return {"predicted_max_over_mean": round(p, 4), "measured_max_over_mean": round(m, 4),
            "relative_error": round(abs(p - m) / m, 4),
            "mean_predicted": round(statistics.mean(predicted), 4), "mean_measured": round(statistics.mean(measured),
                                                                                           4),
            "per_step_relative_error_median": round(statistics.median(abs(a - b) / b for a, b in
                                                                      zip(predicted, measured)), 4),
            "per_step": [[round(a, 3), round(b, 3)] for a, b in zip(predicted, measured)]}


def check_against_real_run(root: str, prefixes: dict[str, str], quick: bool) -> dict:
    ranks, seq_len, per_rank = 4, 4096, 2
    run = _piece_time_fn(seq_len)
    quadratic, linear, per_piece = fit_cost(run, seq_len)
    steps = 8 if quick else 20
    runs = {}
    for method in ("none", "greedy"):
        path = write_job(root, f"check-{method}", prefixes, MIXES["short_long"], ranks, seq_len, quadratic, linear,
                         method, per_rank)
        report = dryrun.dry_run(load_job(path), steps, every_stage=False)
        report.pop("_known")
        predicted = [r["max_over_mean"] for r in report["series"]]
        got = receive(path, ranks, steps)
        measured = time_ranks(run, got, ranks, steps, repeats=5)
        runs[method] = summarise(predicted, measured)
        print(method, runs[method]["predicted_max_over_mean"], runs[method]["measured_max_over_mean"], file=sys.stderr)
    pn, pg = runs["none"]["predicted_max_over_mean"], runs["greedy"]["predicted_max_over_mean"]
    mn, mg = runs["none"]["measured_max_over_mean"], runs["greedy"]["measured_max_over_mean"]
    return {"ranks": ranks, "seq_len": seq_len, "sequences_per_rank": per_rank, "steps": steps, "mix": "short_long",
            "cost_fit": {"quadratic": quadratic, "linear": linear, "per_piece_not_modelled": per_piece},
            "attention": {"heads": HEADS, "head_dim": HEAD_DIM}, "runs": runs,
            "predicted_gain_greedy_over_none": round(pn / pg, 4), "measured_gain_greedy_over_none": round(mn / mg, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/megascale-data/bench-plan"))
    ap.add_argument("--skip-check", action="store_true", help="Only the dry runs at the paper's scale.")
    args = ap.parse_args()
    prefixes = make_data(args.data_dir)
    result = {"paper_scale": paper_scale(args.data_dir, prefixes, args.quick),
              "cost_model": {"quadratic": A_7B, "linear": B_7B}}
    if not args.skip_check:
        result["check"] = check_against_real_run(args.data_dir, prefixes, args.quick)
    emit(result, args.json)


if __name__ == "__main__":
    main()
