"""End-to-end training throughput and loader memory: ours against per-rank PyTorch DataLoaders
and Megatron-Core's datasets, side by side in one run.

    python tools/bench_e2e.py --json OUT [--quick] [--plots DIR]

Designs (same sources, same weights, same simulated trainer):
- `torch`: each of R ranks runs a torch DataLoader with W workers over an IterableDataset that
  opens all S JSONL sources, draws documents by the mixing weights, tokenizes them (UTF-8 bytes,
  the same byte tokenizer as ours) and packs them back to back (tools/e2e_ranks.py);
  persistent workers, gc.freeze() before the workers fork.
- `megatron`: each rank builds megatron-core's BlendedMegatronDatasetBuilder / GPTDataset /
  BlendedDataset over S pre-tokenized Megatron sources (memory-mapped), read through a
  DataLoader with W workers and Megatron's sampler order; no attention mask is built (THD).
- `ours`: one coordinator, W x R / k worker processes in total (k = --k, default 4; or
  --procs N, or --procs auto: the coordinator sizes them by the work), R DataClients, greedy balance with token_slack
  0.5, over the JSONL sources. The coordinator and
  the worker host agent are the `msd coordinator` and `msd worker` commands, started as a user
  starts them (not children of this script, which would carry its imports); with
  --worker-host coordinator, one command: `msd coordinator --worker-procs N|auto` (the host's
  fork server forked from the coordinator, its agent a thread there).

The simulated trainer spends, per micro-batch, `time_scale x sum over pieces of a*len^2 +
b*len` (the cost model of a 7B model, below), then all ranks meet at a barrier (synchronous
data parallelism), so a step takes the slowest rank's compute plus any data wait.

Cost constants, Llama-2-7B-like (hidden 4096, 32 layers, 6.7e9 parameters) on an H100 at
400 TFLOP/s sustained (about 40 % of bf16 peak): training costs 6 x 7e9 FLOPs per token
(b = 4.2e10 / 4e14 s) and causal attention 6 x hidden x layers FLOPs per token pair
(a = 7.9e5 / 4e14 s). `time_scale` shrinks the simulated GPU time so that the linear part of a
rank's step takes --step-s seconds (the ratios between designs do not depend on it as long as
the loaders keep up; where they do not, the data wait shows it).

Memory: what each design adds to the machine, from the proportional set size (PSS,
/proc/PID/smaps_rollup): the PSS at the middle step of every process (the trainer ranks, their
DataLoader workers; our coordinator, host agent and workers) minus the ranks' PSS with torch
imported, before the loader existed. Signed: a rank's PSS falls when it forks workers (its pages
become shared and the workers carry part of them), and that fall is counted
(e2e_ranks.added_kb).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import queue
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_output import emit  # noqa: E402
import e2e_ranks  # noqa: E402

from msd.testing.demo_data import _stdlib_sources  # noqa: E402
from msd.testing.ports import free_port  # noqa: E402
from msd.testing.processes import stop  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

SPAWN = mp.get_context("spawn")
A_7B = 6 * 4096 * 32 / 4e14  # seconds per token^2 (causal attention, forward + backward)
B_7B = 6 * 7e9 / 4e14  # seconds per token (everything else)
DATA_VERSION = 2
HEADLINE = dict(ranks=8, workers=4, sources=64, seq_len=32768)


# ---------------------------------------------------------------- data

def _data_paths(root: str, sources: int, tag: str) -> tuple[str, list[str], list[str], str, list[float] | None]:
    """(completion stamp, JSONL files, Megatron prefixes, file of mean tokens per source, those
    means if the data set is complete) of the data set `tag` under root."""
    os.makedirs(root, exist_ok=True)
    stamp = os.path.join(root, f".complete-v{DATA_VERSION}-{tag}")
    jsonl = [os.path.join(root, f"s{s:03d}.jsonl") for s in range(sources)]
    prefixes = [os.path.join(root, f"s{s:03d}_text_document") for s in range(sources)]
    means_path = os.path.join(root, f"means-{tag}.json")
    saved = None
    if os.path.exists(stamp):
        with open(means_path, "rb") as f:
            saved = orjson.loads(f.read())
    return stamp, jsonl, prefixes, means_path, saved


def _text() -> str:
    """This Python's standard library sources as one text (valid UTF-8)."""
    return "\n\n".join(src for _, src in _stdlib_sources()).encode("utf-8", "replace").decode("utf-8", "ignore")


def make_data(root: str, sources: int) -> tuple[list[str], list[str], list[float]]:
    """S sources of real text (the standard library's files), every second one of long documents
    (8k-48k tokens), the others short (lognormal, median ~700 tokens). Each as JSONL and as a
    Megatron pair of the same documents. Returns (JSONL files, Megatron prefixes, mean tokens)."""
    stamp, jsonl, prefixes, means_path, saved = _data_paths(root, sources, f"{sources}")
    if saved is not None:
        return jsonl, prefixes, saved
    text = _text()
    rng = np.random.default_rng(2026)
    means = []
    for s in range(sources):
        long = s % 2 == 1
        n_docs = 60 if long else 400
        lengths = (rng.integers(8_000, 48_000, n_docs) if long
                   else np.clip(rng.lognormal(6.5, 0.9, n_docs), 40, 12_000).astype(int))
        docs = []
        for n in lengths.tolist():
            start = int(rng.integers(0, len(text) - n - 1))
            docs.append(text[start:start + n])
        with open(jsonl[s], "wb") as f:
            for d in docs:
                f.write(orjson.dumps({"text": d}) + b"\n")
        tokens = [np.append(np.frombuffer(d.encode("utf-8"), np.uint8).astype(np.uint16), 256) for d in docs]
        write_megatron(prefixes[s], tokens, np.uint16)
        means.append(float(np.mean([len(t) for t in tokens])))
    with open(means_path, "wb") as f:
        f.write(orjson.dumps(means))
    open(stamp, "w").close()
    return jsonl, prefixes, means


LARGE_SOURCES = 128  # from this many sources on, sources of realistic size (below)


def make_large_data(root: str, sources: int, docs: int) -> tuple[list[str], list[str], list[float]]:
    """S sources of `docs` documents each (realistic sizes: 10^5 documents of ~1,000 or ~5,000
    tokens), every second one of long documents (lognormal, median ~4k tokens, 1k-48k), the others
    short (as in make_data). Two base sources are written (JSONL with its line index, and a
    Megatron pair) and each source is a hard link to one of them, so 306 sources cost the disk of
    two; each loader still opens, indexes and maps every source under its own name."""
    stamp, jsonl, prefixes, means_path, saved = _data_paths(root, sources, f"{sources}x{docs}")
    if saved is not None:
        return jsonl, prefixes, saved
    from msd_common.formats.jsonl import INDEX_SUFFIX, JsonlShard

    text = _text()
    rng = np.random.default_rng(2027)
    base_means = []
    for family in ("short", "long"):
        lengths = (np.clip(rng.lognormal(8.3, 0.6, docs), 1_000, 48_000) if family == "long"
                   else np.clip(rng.lognormal(6.5, 0.9, docs), 40, 12_000)).astype(int)
        starts = rng.integers(0, len(text) - int(lengths.max()) - 1, docs)
        path, prefix = os.path.join(root, f"base-{family}.jsonl"), os.path.join(root, f"base-{family}_text_document")
        with open(path, "wb") as f:
            for start, n in zip(starts.tolist(), lengths.tolist()):
                f.write(orjson.dumps({"text": text[start:start + n]}) + b"\n")
        token_counts: list[int] = []

        def documents():  # the byte tokenizer's tokens and the end of document, one at a time
            for a, n in zip(starts.tolist(), lengths.tolist()):
                tokens = np.append(np.frombuffer(text[a:a + n].encode("utf-8"), np.uint8).astype(np.uint16), 256)
                token_counts.append(len(tokens))
                yield tokens

        write_megatron(prefix, documents(), np.uint16)
        JsonlShard(path)  # its line index, beside it, shared by every link below
        base_means.append(float(np.mean(token_counts)))
    for s in range(sources):
        family = "long" if s % 2 == 1 else "short"
        base, base_prefix = os.path.join(root, f"base-{family}.jsonl"), os.path.join(root,
                                                                                     f"base-{family}_text_document")
        for src, dst in ((base, jsonl[s]), (base + INDEX_SUFFIX, jsonl[s] + INDEX_SUFFIX),
                         (base_prefix + ".bin", prefixes[s] + ".bin"), (base_prefix + ".idx", prefixes[s] + ".idx")):
            if os.path.exists(dst):
                os.unlink(dst)
            os.link(src, dst)
    means = [base_means[s % 2] for s in range(sources)]
    with open(means_path, "wb") as f:
        f.write(orjson.dumps(means))
    open(stamp, "w").close()
    return jsonl, prefixes, means


def write_job(root: str, files: list[str], ranks: int, seq_len: int, a: float, b: float) -> str:
    job = {
        "seed": 17,
        "sources": {f"s{s:03d}": {"format": "jsonl", "paths": [f], "text_key": "text"} for s, f in enumerate(files)},
        "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": 2 * ranks},
        "topology": {"dp": ranks},
        "mixture": {"weights": {f"s{s:03d}": 1.0 for s in range(len(files))}},
        "balance": {"method": "greedy", "token_slack": 0.5, "cost": {"quadratic": a * 1e9, "linear": b * 1e9}},
        "runtime": {"lookahead_steps": 3, "prepare_batch": 32, "heartbeat_s": 1.0, "status_every_s": 3600},
    }
    path = os.path.join(root, f"job-r{ranks}-s{len(files)}-{seq_len}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


# ---------------------------------------------------------------- one run

def _command(msd: str | list[str]) -> list[str]:
    return [msd] if isinstance(msd, str) else msd


class MsdCommands:
    """`msd coordinator` and `msd worker --procs N` (or `--procs auto`) as a user starts them, on
    a free port."""

    def __init__(self, job: str, workers: int | str, in_coordinator: bool = False, relay: bool = False) -> None:
        """in_coordinator: one command, `msd coordinator --worker-procs`, instead of two; relay: and
        `msd relay` for the ranks (all on this host), at the job's default endpoint (MSD_RELAY=auto)."""
        msd = os.path.join(os.path.dirname(sys.executable), "msd")
        # an environment with the project's dependencies but not the project (.venv-vlm): its module
        msd = msd if os.path.exists(msd) else [sys.executable, "-m", "msd.cli"]
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"
        self.logs = tempfile.mkdtemp(prefix="msd-e2e-")
        self._log_files = [open(os.path.join(self.logs, name), "wb") for name in ("coordinator.log", "worker.log")]
        self.coordinator = subprocess.Popen(
            [*_command(msd), "coordinator", "--config", job, "--bind", self.address, "--log-level", "WARNING",
             *(["--worker-procs", str(workers)] if in_coordinator else [])],
            stderr=self._log_files[0])
        deadline = time.monotonic() + 60
        while True:  # the worker host agent starts once the coordinator listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if self.coordinator.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the coordinator did not start; log in {self.logs}")
                time.sleep(0.05)
        self.host = self.coordinator  # the process the worker host lives in
        self.relay = None
        if relay:
            self._log_files.append(open(os.path.join(self.logs, "relay.log"), "wb"))
            self.relay = subprocess.Popen([*_command(msd), "relay", "--coordinator", self.address, "--log-level",
                                           "WARNING"], stderr=self._log_files[-1])
        if in_coordinator:
            return
        self.host = subprocess.Popen(
            [*_command(msd), "worker", "--coordinator", self.address, "--procs", str(workers), "--log-level",
             "WARNING"],
            stderr=self._log_files[1])

    def pids(self) -> list[int]:
        """The coordinator, the host agent (if a process of its own) and everything under them
        (fork server, worker processes)."""
        relay = [self.relay.pid] if self.relay is not None else []
        return sorted({self.coordinator.pid, self.host.pid, *relay, *e2e_ranks.descendants(self.host.pid)})

    def worker_pids(self) -> list[int]:
        """The worker processes now running: the fork server's children."""
        from worker.forks import host_worker_pids

        return host_worker_pids(self.host.pid)

    def close(self) -> None:
        """Stop both; their logs are removed unless they hold something (warnings, errors)."""
        stop([*([self.relay] if self.relay is not None else []),
              *([self.host, self.coordinator] if self.host is not self.coordinator else [self.coordinator])])
        for f in self._log_files:
            f.close()
        if any(os.path.getsize(f.name) for f in self._log_files):
            print(f"# msd logs kept in {self.logs}", file=sys.stderr)
        else:
            shutil.rmtree(self.logs, ignore_errors=True)


def worker_count(point: dict, k: int, procs: int | str | None) -> int | str:
    """Ours: --procs worker processes where given (a count, or "auto": the coordinator sizes the
    host's processes by the work), else W x R / k."""
    return procs or max(1, point["workers"] * point["ranks"] // k)


def run_design(design: str, point: dict, data: tuple, params: dict, k: int, root: str,
               timeout_s: float = 900, procs: int | str | None = None, worker_host: str = "separate",
               job: str | None = None, relay: bool = False) -> dict:
    """One design at one point. job: ours's job file (default: write_job's, over the JSONL files);
    relay: ours's ranks through one `msd relay` (MSD_RELAY=auto in their environment)."""
    ranks, workers = point["ranks"], point["workers"]
    jsonl, prefixes, means = data
    weights = [1.0 / len(prefixes)] * len(prefixes)  # one per source (JSONL file and Megatron pair alike)
    barrier = SPAWN.Barrier(ranks)
    out = SPAWN.Queue()
    cluster = None
    if design == "ours":
        job = job or write_job(root, jsonl, ranks, point["seq_len"], params["a"], params["b"])
        cluster = MsdCommands(job, workers=worker_count(point, k, procs), in_coordinator=worker_host == "coordinator",
                              relay=relay)
        targets = [(e2e_ranks.ours_rank, (cluster.address, r, params, barrier, out)) for r in range(ranks)]
    elif design == "torch":
        targets = [(e2e_ranks.torch_rank, (jsonl, weights, means, workers, r, params, barrier, out))
                   for r in range(ranks)]
    else:
        targets = [(e2e_ranks.megatron_rank, (prefixes, weights, workers, r, ranks, params, barrier, out))
                   for r in range(ranks)]
    procs = [SPAWN.Process(target=f, args=a, daemon=False) for f, a in targets]
    started = time.perf_counter()
    if relay:
        os.environ["MSD_RELAY"] = "auto"  # what a launcher that cannot change the script does
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop("MSD_RELAY", None)
    steps: dict[int, dict[int, tuple]] = {}
    pss_ranks, pss_ours, done = {}, 0, 0  # kB: (before, now, children now) per rank; our loader's processes
    running = None  # our worker processes at that moment
    report_s: dict[int, float] = {}  # rank -> seconds per micro-batch in DataClient.report_loss
    ours_mb = None  # PSS of each of our processes at that moment
    try:
        deadline = time.monotonic() + timeout_s
        while done < ranks:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{design} {point}: no result in {timeout_s}s")
            if any(p.exitcode not in (None, 0) for p in procs):
                raise RuntimeError(f"{design} {point}: a rank died ({[p.exitcode for p in procs]})")
            try:
                msg = out.get(timeout=1)
            except queue.Empty:
                continue
            if msg[0] == "step":
                _, rank, step, t, wait, compute, largest, cost = msg
                steps.setdefault(step, {})[rank] = (t, wait, compute, largest, cost)
            elif msg[0] == "pss":
                pss_ranks[msg[1]] = tuple(msg[2:5])
                if cluster is not None and len(pss_ranks) == 1:  # our loader's own processes, same moment
                    by_process = {pid: e2e_ranks.pss_kb(pid) for pid in cluster.pids()}
                    pss_ours = sum(by_process.values())
                    running = len(cluster.worker_pids())
                    ours_mb = {f"{e2e_ranks.process_name(pid)} {pid}": kb / 1024 for pid, kb in by_process.items()}
            elif msg[0] == "report":
                report_s[msg[1]] = msg[2]
            elif msg[0] == "done":
                done += 1
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
        if cluster is not None:
            cluster.close()
    reports = list(pss_ranks.values())
    result = summarize(design, steps, params, e2e_ranks.added_kb(reports, pss_ours), time.perf_counter() - started)
    # the parts of loader_pss_mb: the change of the ranks' own PSS (negative where their pages
    # became shared with forked workers), and the loader's processes (DataLoader workers; our
    # coordinator, host agent and workers)
    result["pss_mb_change_of_trainers"] = sum(now - before for before, now, _ in reports) / 1024
    result["pss_mb_loader_processes"] = (sum(kids for _, _, kids in reports) + pss_ours) / 1024
    if report_s:
        result["report_loss_ms_per_micro_batch"] = 1000 * sum(report_s.values()) / len(report_s)
    if running is not None:
        result["worker_processes_running"] = running
        result["pss_mb_by_process"] = ours_mb
        result["pss_mb_per_trainer"] = sorted((now - before) / 1024 for before, now, _ in reports)
    return result


def summarize(design: str, steps: dict, params: dict, pss_kb: int, wall_s: float) -> dict:
    first, last = params["warmup"] - 1, params["warmup"] + params["steps"] - 1
    t0 = min(v[0] for v in steps[first].values())
    t1 = max(v[0] for v in steps[last].values())
    elapsed = t1 - t0
    measured = [steps[s] for s in range(first + 1, last + 1)]
    waits = [sum(st[r][1] for st in measured) for r in measured[0]]
    imbalance, lower_bound_s, slowest_s = [], 0.0, 0.0
    for st in measured:
        costs = [v[4] for v in st.values()]
        imbalance.append(max(costs) / (sum(costs) / len(costs)))
        lower_bound_s += max(sum(costs) / len(costs), max(v[3] for v in st.values())) * params["time_scale"]
        slowest_s += max(costs) * params["time_scale"]
    return {
        "design": design,
        "steps_per_s": params["steps"] / elapsed,
        "step_s": elapsed / params["steps"],
        "data_wait_share": statistics.mean(waits) / elapsed,
        "max_over_mean_rank_cost": statistics.mean(imbalance),
        "lower_bound_step_s": lower_bound_s / params["steps"],
        "slowest_rank_compute_step_s": slowest_s / params["steps"],
        "loader_pss_mb": pss_kb / 1024,
        "wall_s": wall_s,
    }


def run_point(point: dict, designs: list[str], k: int, args, root: str) -> dict:
    data = (make_large_data(data_root(args, point), point["sources"], args.docs_per_source)
            if point["sources"] >= LARGE_SOURCES else make_data(data_root(args, point), point["sources"]))
    tokens_per_rank = 2 * point["seq_len"]
    params = {
        "seq_len": point["seq_len"], "micro_batches": 2, "warmup": args.warmup, "seed": 17,
        # Fewer ranks draw fewer documents per step, so a run's cost varies more from draw to draw:
        # steps x 8 / R keeps the number of rank-steps (and that variance) the same at every R.
        "steps": args.steps * max(1, 8 // point["ranks"]),
        "a": A_7B, "b": B_7B, "time_scale": args.step_s / (B_7B * tokens_per_rank),
    }
    res = {"point": point, "k": k, "worker_processes": worker_count(point, k, args.procs),
           "fixed_procs": args.procs, "worker_host": args.worker_host, "time_scale": params["time_scale"]}
    for d in designs:
        r = run_design(d, point, data, params, k, data_root(args, point), procs=args.procs,
                       worker_host=args.worker_host)
        res[d] = r
        print(f"# {point} {d}: {r['steps_per_s']:.2f} steps/s, wait {100 * r['data_wait_share']:.0f}%, "
              f"max/mean {r['max_over_mean_rank_cost']:.2f}, PSS {r['loader_pss_mb']:.0f} MB ({r['wall_s']:.0f}s)",
              file=sys.stderr, flush=True)
    if "torch" in res and "ours" in res:
        base = res["torch"]
        res["throughput_ratio"] = res["ours"]["steps_per_s"] / base["steps_per_s"]
        res["ideal_throughput_ratio"] = base["step_s"] / base["lower_bound_step_s"]
        res["memory_ratio"] = base["loader_pss_mb"] / res["ours"]["loader_pss_mb"]
    if "megatron" in res and "ours" in res:
        res["throughput_ratio_vs_megatron"] = res["ours"]["steps_per_s"] / res["megatron"]["steps_per_s"]
        res["memory_ratio_vs_megatron"] = res["megatron"]["loader_pss_mb"] / res["ours"]["loader_pss_mb"]
    return res


def data_root(args, point: dict) -> str:
    name = f"s{point['sources']}" + (f"x{args.docs_per_source}" if point["sources"] >= LARGE_SOURCES else "")
    return os.path.join(args.data_dir, name)


def grid(quick: bool) -> list[dict]:
    if quick:
        pts = [(2, 4, 32768), (8, 4, 32768), (2, 64, 32768), (8, 64, 32768), (8, 64, 4096)]
    else:
        pts = [(r, s, c) for c in (4096, 32768) for s in (4, 16, 64) for r in (2, 4, 8)]
    return [dict(ranks=r, workers=4, sources=s, seq_len=c) for r, s, c in pts]


def plot(results: list[dict], out_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    written = []
    designs = ("torch", "megatron", "ours")
    labels = {"torch": "per-rank PyTorch DataLoader", "megatron": "Megatron-Core datasets", "ours": "megascale-data"}
    for axis, fixed, fixed_key in (("ranks", 64, "sources"), ("sources", 8, "ranks")):
        def series(fixed_procs, host="separate"):
            return sorted((r for r in results if r["point"][fixed_key] == fixed and r["point"]["seq_len"] == 32768
                           and r["k"] == 4 and r["point"]["workers"] == 4 and r.get("fixed_procs") == fixed_procs
                           and r.get("worker_host", "separate") == host),
                          key=lambda r: r["point"][axis])

        pts = series(None)
        if len(pts) < 2:
            continue
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
        for d in designs:
            xs = [r["point"][axis] for r in pts if d in r]
            label = f"{labels[d]}, R worker processes (W x R / 4)" if d == "ours" else labels[d]
            left.plot(xs, [r[d]["steps_per_s"] for r in pts if d in r], marker="o", label=label)
            right.plot(xs, [r[d]["loader_pss_mb"] for r in pts if d in r], marker="o", label=label)
        for procs, host in sorted({(r["fixed_procs"], r.get("worker_host", "separate")) for r in results
                                   if r.get("fixed_procs")}, key=str):
            extra = [r for r in series(procs, host) if "ours" in r]
            if len(extra) >= 2:
                label = (f"{labels['ours']}, worker processes sized by msd (--procs auto)" if procs == "auto"
                         else f"{labels['ours']}, {procs} worker processes")
                if host == "coordinator":
                    label = f"{labels['ours']}, one command (msd coordinator --worker-procs {procs})"
                xe = [r["point"][axis] for r in extra]
                left.plot(xe, [r["ours"]["steps_per_s"] for r in extra], marker="s", linestyle="--", label=label)
                right.plot(xe, [r["ours"]["loader_pss_mb"] for r in extra], marker="s", linestyle="--", label=label)
        for ax, title in ((left, "training steps/s"), (right, "loader memory (PSS, MB)")):
            ax.set_xlabel(f"{axis} ({fixed_key} = {fixed}, 32k context)")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["point"][axis] for r in pts})
            ax.set_xticks(ticks, [str(x) for x in ticks])
            ax.set_title(title)
            ax.grid(alpha=0.3)
        right.set_yscale("log")
        left.legend(fontsize=8)
        fig.tight_layout()
        path = os.path.join(out_dir, f"e2e_vs_{axis}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def _processes(g: dict) -> str:
    """Worker processes of a point: the count asked for, or with auto the count running when
    memory was measured."""
    if "ours" not in g:
        return "-"
    where = ", in the coordinator" if g.get("worker_host") == "coordinator" else ""
    if g.get("fixed_procs") == "auto":
        return f"auto: {g['ours'].get('worker_processes_running', '?')}{where}"
    return f"{g.get('worker_processes', '-')}{where}"


def markdown(result: dict) -> str:
    """The grid as a markdown table (docs/BENCHMARKS.md)."""
    rows = ["| R | S | context | k (worker processes) | steps/s torch / megatron / ours | data wait (ours) | max/mean "
            "cost torch / megatron / ours "
            "| PSS MB torch / megatron / ours | throughput ratio (ideal) | memory ratio |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for g in result["grid"]:
        p = g["point"]
        get = lambda d, k, f: f.format(g[d][k]) if d in g else "-"  # noqa: E731
        ranks = p["ranks"] if p["workers"] == 4 else f"{p['ranks']}, W = {p['workers']}"  # baselines' workers per rank
        rows.append(
            f"| {ranks} | {p['sources']} | {p['seq_len'] // 1024}k | "
            f"{'-' if g.get('fixed_procs') or 'ours' not in g else g['k']} "
            f"({_processes(g)}) "
            f"| {get('torch', 'steps_per_s', '{:.2f}')} / {get('megatron', 'steps_per_s', '{:.2f}')} / "
            f"{get('ours', 'steps_per_s', '{:.2f}')} | {get('ours', 'data_wait_share', '{:.1%}')} "
            f"| {get('torch', 'max_over_mean_rank_cost', '{:.3f}')} / "
            f"{get('megatron', 'max_over_mean_rank_cost', '{:.3f}')} / "
            f"{get('ours', 'max_over_mean_rank_cost', '{:.3f}')} "
            f"| {get('torch', 'loader_pss_mb', '{:.0f}')} / {get('megatron', 'loader_pss_mb', '{:.0f}')} / "
            f"{get('ours', 'loader_pss_mb', '{:.0f}')} "
            + (f"| {g['throughput_ratio']:.3f} ({g['ideal_throughput_ratio']:.3f}) | {g['memory_ratio']:.2f} |"
               if "throughput_ratio" in g else "| - | - |"))
    return "\n".join(rows)


def main() -> None:
    if len(sys.argv) >= 3 and sys.argv[1] in ("--table", "--plots-from"):  # from a saved RESULT.json
        with open(sys.argv[2], "rb") as f:
            saved = orjson.loads(f.read())
        print(markdown(saved) if sys.argv[1] == "--table" else plot(saved["grid"], sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="a reduced grid, fewer steps (under 10 minutes)")
    ap.add_argument("--steps", type=int, default=None, help="measured steps at R = 8 (x 8 / R at fewer ranks)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--step-s", type=float, default=0.3, help="simulated seconds of a rank's linear compute per step")
    ap.add_argument("--k", type=int, default=4, help="ours: W x R / k worker processes")
    ap.add_argument("--k-sweep", default="1,2,4,8", help="k values tried at the headline point (full grid only)")
    ap.add_argument("--procs", type=lambda v: v if v == "auto" else int(v), default=None,
                    help="ours: this many worker processes whatever R (instead of W x R / k), or auto: "
                         "`msd worker --procs auto`, the coordinator sizing them by the work")
    ap.add_argument("--worker-host", choices=("separate", "coordinator"), default="separate",
                    help="ours: the worker host as `msd worker` beside `msd coordinator` (separate), or inside the "
                         "coordinator's process (`msd coordinator --worker-procs`, a job on one machine)")
    ap.add_argument("--docs-per-source", type=int, default=100_000,
                    help=f"documents per source at points of {LARGE_SOURCES} sources or more")
    ap.add_argument("--designs", default="torch,megatron,ours")
    ap.add_argument("--points", default=None,
                    help="only these points, e.g. 2x4x32768,8x64x32768 (RxSxcontext[xW]: W DataLoader "
                         "workers per rank of the baselines, 4 unless given)")
    ap.add_argument("--plots", default=None, help="write PNG plots here")
    ap.add_argument("--data-dir", default=os.path.join(os.environ.get("MSD_CACHE_DIR") or
                                                       os.path.expanduser("~/.cache/megascale-data"), "bench-e2e"))
    args = ap.parse_args()
    args.steps = args.steps or (6 if args.quick else 12)
    designs = args.designs.split(",")
    started = time.perf_counter()
    points = grid(args.quick)
    if args.points:
        points = [dict(ranks=int(f[0]), workers=int(f[3]) if len(f) > 3 else 4, sources=int(f[1]), seq_len=int(f[2]))
                  for f in (p.split("x") for p in args.points.split(","))]
    results = [run_point(p, designs, args.k, args, args.data_dir) for p in points]
    if not args.quick and not args.points:
        head = dict(HEADLINE)
        for k in (int(x) for x in args.k_sweep.split(",")):
            if k != args.k:
                results.append(run_point(head, ["ours"], k, args, args.data_dir))
    headline = next((r for r in results if r["point"] == HEADLINE and r["k"] == args.k), results[-1])
    result = {
        "benchmark": "e2e",
        "command": "python tools/bench_e2e.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "cost_model": {"a_s_per_token2": A_7B, "b_s_per_token": B_7B,
                       "model": "7B (hidden 4096, 32 layers) at 400 TFLOP/s"},
        "headline_point": {**HEADLINE, "sequences_per_rank": 2, "k": args.k},
        "throughput_ratio": headline.get("throughput_ratio"),
        "ideal_throughput_ratio": headline.get("ideal_throughput_ratio"),
        "memory_ratio": headline.get("memory_ratio"),
        "throughput_ratio_vs_megatron": headline.get("throughput_ratio_vs_megatron"),
        "memory_ratio_vs_megatron": headline.get("memory_ratio_vs_megatron"),
        "min_throughput_ratio": min((r["throughput_ratio"] for r in results if "throughput_ratio" in r), default=None),
        "grid": results,
        "wall_s": time.perf_counter() - started,
    }
    if args.plots:
        result["plots"] = plot(results, args.plots)
    emit(result, args.json)


if __name__ == "__main__":
    main()
