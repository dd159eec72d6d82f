"""How long the trainer waits for data: msd in both launch modes against per-rank DataLoaders,
side by side in one run, at fixed compute times per micro-batch.

    python tools/bench_wait.py --json OUT [--compute-ms 0,10,50,200] [--repeats 3] [--ranks 8]

The point (issue 35): R trainer ranks (default 8), rows of 4,096 tokens, micro-batch size 1, 2
micro-batches a step, a Megatron source of real text (this Python's standard library, documents of
lognormal length, byte-tokenized: tools/bench_remote.py's corpus, --mb 100 gives 35,510
documents). Each rank sleeps --compute-ms per micro-batch (0: no compute, the loaders' throughput)
and meets the others at a barrier after every step (tools/e2e_ranks.train). Designs, alternated
within every repeat:
- `msd-two`: `msd coordinator` and `msd worker --procs 2`, two commands;
- `msd-one`: `msd coordinator --worker-procs auto`, one command;
- `msd-relay`: as msd-two, the ranks behind one `msd relay` (MSD_RELAY=auto), as on a trainer host;
- `msd-loss`: as msd-two, each rank reporting a per-token loss after each micro-batch's compute
  (`DataClient.report_loss`, a `[rows, seq_len]` tensor), timed on its own;
- `megatron`: per-rank DataLoaders (2 workers each) over megatron-core's GPTDataset on the same
  files (tools/e2e_ranks.megatron_rank).
Per design and compute time: the data wait (time inside `next()` over the run's wall time, mean
over ranks), steps/s, tokens/s and the loader's memory (PSS, tools/bench_e2e.py's accounting);
medians and spreads over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_e2e  # noqa: E402
from bench_output import emit  # noqa: E402
from bench_remote import make_corpus  # noqa: E402

DESIGNS = {"msd-two": ("ours", "separate", 2), "msd-one": ("ours", "coordinator", "auto"),
           "msd-relay": ("ours", "separate", 2), "msd-loss": ("ours", "separate", 2),
           "megatron": ("megatron", None, None)}
DEFAULT_DESIGNS = "msd-two,msd-one,megatron"


def write_job(root: str, corpus: str, ranks: int, seq_len: int) -> str:
    """The job a user would write for this source: defaults everywhere else."""
    job = {
        "seed": 5,
        "sources": {"text": {"format": "megatron", "paths": [os.path.join(corpus, "megatron", "part-*")]}},
        "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": 2 * ranks},
        "topology": {"dp": ranks},
        "mixture": {"weights": {"text": 1.0}},
    }
    path = os.path.join(root, f"wait-r{ranks}-{seq_len}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def run_once(design: str, compute_ms: float, a: argparse.Namespace, corpus: str, work: str) -> dict:
    kind, host, procs = DESIGNS[design]
    point = {"ranks": a.ranks, "workers": 2, "sources": 1, "seq_len": a.seq_len}
    steps = a.steps or max(30, min(200, int(10.0 / max(2 * compute_ms / 1000, 0.02))))  # ~10 s of compute
    params = {"seq_len": a.seq_len, "micro_batches": 2, "warmup": a.warmup, "seed": 5, "steps": steps,
              "a": bench_e2e.A_7B, "b": bench_e2e.B_7B, "time_scale": 1.0, "compute_s": compute_ms / 1000,
              "report_loss": design == "msd-loss"}
    prefixes = sorted(os.path.join(corpus, "megatron", f[:-4]) for f in os.listdir(os.path.join(corpus, "megatron"))
                      if f.endswith(".bin"))
    data = ([], prefixes, [1.0] * len(prefixes))
    job = write_job(work, corpus, a.ranks, a.seq_len) if kind == "ours" else None
    r = bench_e2e.run_design(kind, point, data, params, k=1, root=work, procs=procs, worker_host=host or "separate",
                             job=job, relay=design == "msd-relay")
    tokens_per_step = a.ranks * 2 * a.seq_len
    return {"design": design, "compute_ms": compute_ms, "steps": steps, "data_wait_share": r["data_wait_share"],
            "steps_per_s": r["steps_per_s"], "tokens_per_s": r["steps_per_s"] * tokens_per_step,
            "loader_pss_mb": r["loader_pss_mb"], "wall_s": r["wall_s"],
            **({"report_loss_ms_per_micro_batch": r["report_loss_ms_per_micro_batch"]}
               if "report_loss_ms_per_micro_batch" in r else {})}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "all": values}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--compute-ms", default="0,10,50,200", help="simulated compute per micro-batch, ms")
    ap.add_argument("--designs", default=DEFAULT_DESIGNS, help=f"some of {', '.join(DESIGNS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=None, help="measured steps (default: ~10 s of compute, 30-200)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100, help="corpus size, MB of text")
    ap.add_argument("--data-dir", default=os.path.join(os.environ.get("MSD_CACHE_DIR") or os.path.expanduser(
        "~/.cache/megascale-data"), "bench-wait"))
    a = ap.parse_args()
    corpus = os.path.join(a.data_dir, f"corpus-{a.mb}")
    info = make_corpus(corpus, a.mb, a.seq_len, None)
    work = tempfile.mkdtemp(prefix="msd-wait-")
    designs = a.designs.split(",")
    started = time.perf_counter()
    runs: list[dict] = []
    for compute_ms in (float(c) for c in a.compute_ms.split(",")):
        for rep in range(a.repeats):
            order = designs if rep % 2 == 0 else designs[::-1]  # alternated: drift in the machine cancels
            for d in order:
                r = run_once(d, compute_ms, a, corpus, work)
                runs.append(r)
                print(f"# {d} {compute_ms:g} ms: wait {100 * r['data_wait_share']:.2f}%, {r['steps_per_s']:.2f} "
                      f"steps/s, "
                      f"{r['tokens_per_s'] / 1e6:.2f} M tokens/s, PSS {r['loader_pss_mb']:.0f} MB", file=sys.stderr,
                      flush=True)
    table = {}
    for d in designs:
        for c in sorted({r["compute_ms"] for r in runs}):
            mine = [r for r in runs if r["design"] == d and r["compute_ms"] == c]
            table.setdefault(d, {})[f"{c:g}ms"] = {k: spread([r[k] for r in mine]) for k in
                                                  ("data_wait_share", "steps_per_s", "tokens_per_s", "loader_pss_mb")}
    emit({"benchmark": "wait", "command": "python tools/bench_wait.py " + " ".join(sys.argv[1:]),
          "cpus": os.cpu_count(), "corpus": info, "ranks": a.ranks, "seq_len": a.seq_len, "results": table,
          "runs": runs, "wall_s": time.perf_counter() - started}, a.json)


if __name__ == "__main__":
    main()
