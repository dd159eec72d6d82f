"""The trainer ranks of tools/bench_e2e.py, one function per loader design, and the two
baselines' datasets. Each rank is a process that, for every micro-batch, sleeps the time the
cost model gives for its pieces (a GPU step leaves the CPU free), then meets the other ranks at
a barrier once per step (synchronous data parallelism).

Per step a rank reports: its compute (cost) seconds, its largest piece's cost, the sum of its
pieces' costs, and the seconds it waited for data. At the middle step it reports its PSS before
its loader existed, its PSS now and the PSS of its own loader children (DataLoader workers): the
bench sums them signed (added_kb).
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Any, Iterator

import numpy as np


def pss_kb(pid: int) -> int:
    """Proportional set size of a process (kB), from /proc/PID/smaps_rollup; 0 if it is gone."""
    return _rollup_kb(pid, "Pss:")


def anon_shmem_kb(pid: int) -> int:
    """A process's resident anonymous and shared memory (kB, RssAnon + RssShmem): its heap, and shared
    memory counted whole (a batch that a DataLoader's worker made in shared memory counts half in
    the trainer's PSS, whole here), without the file pages of the libraries it maps (which PSS
    shares out and RSS counts whole); 0 if it is gone."""
    try:
        fields = _status_kb(pid)
    except OSError:
        return 0
    return fields.get("RssAnon", 0) + fields.get("RssShmem", 0)


def _status_kb(pid: int) -> dict[str, int]:
    """A process's memory fields of /proc/PID/status, in kB (VmRSS, VmHWM, RssAnon, ...)."""
    with open(f"/proc/{pid}/status") as f:
        return {name: int(value.split()[0]) for name, _, value in (line.partition(":") for line in f)
                if value.rstrip().endswith(" kB")}


PIXEL_KEYS = ("pixel_values", "pixel_values_videos")


def pixel_arrays(batch: dict) -> list[Any]:
    """A batch's pixel values, of images and of videos, those it has."""
    return [batch[k] for k in PIXEL_KEYS if k in batch]


def touch_pages(arrays: Any) -> int:
    """Read a byte of every page of these arrays (numpy, or torch tensors on the CPU), as a trainer
    copying its batch to the GPU does: shared memory a loader's worker wrote is counted in a process
    only once it has touched it. Returns a checksum, so that the reads are not skipped."""
    total = 0
    for a in arrays:
        flat = np.asarray(a).reshape(-1).view(np.uint8)
        total += int(flat[::4096].sum())
    return total


class AnonShmemSampler:
    """While active, a process's anon_shmem_kb sampled every `every_s` in a thread: the mean and the
    peak over a run, where one figure at its end depends on where in a step the run happened to end.
    And the exact peak: the kernel's high-water mark of the process's resident set (VmHWM), reset as
    the run begins (clear_refs 5), which sees what lives between two samples (a batch made in 50 ms
    beside the one the trainer holds)."""

    def __init__(self, pid: int, every_s: float = 0.02) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[int] = []
        self.start_kb = 0
        self.rss_start_kb: int | None = None  # None: the kernel's mark could not be reset
        self.rss_high_water_kb = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="anon-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(anon_shmem_kb(self.pid))

    def __enter__(self) -> "AnonShmemSampler":
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as f:
                f.write("5")  # the high-water mark set to the resident set now
            self.rss_start_kb = _status_kb(self.pid)["VmRSS"]
        except OSError:
            self.rss_start_kb = None
        self.start_kb = anon_shmem_kb(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        if self.rss_start_kb is not None:
            self.rss_high_water_kb = _status_kb(self.pid)["VmHWM"]

    def growth_kb(self, before_kb: int) -> dict[str, int | None]:
        """{"mean", "peak"} of the samples less `before_kb` (0 for both if none was taken); and the
        rise above where the run began: "peak_rise", sampled, and "rss_rise_exact", the kernel's
        high-water mark of the whole resident set (None where it could not be reset)."""
        exact = None if self.rss_start_kb is None else self.rss_high_water_kb - self.rss_start_kb
        if not self.samples:
            return {"mean": 0, "peak": 0, "peak_rise": 0, "rss_rise_exact": exact}
        return {"mean": int(np.mean(self.samples)) - before_kb, "peak": max(self.samples) - before_kb,
                "peak_rise": max(self.samples) - self.start_kb, "rss_rise_exact": exact}


def over_run_mb(runs: list[dict]) -> dict[str, list[float]]:
    """Each round's AnonShmemSampler.growth_kb (its "trainer_anon_shmem_over_run") in MB, by key,
    for the keys every round has a figure for (the exact mark is None where it could not be reset)."""
    figures = [run["memory_kb"]["trainer_anon_shmem_over_run"] for run in runs]
    return {k: [f[k] / 1024 for f in figures] for k in ("mean", "peak", "peak_rise", "rss_rise_exact")
            if all(f.get(k) is not None for f in figures)}


def _rollup_kb(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def process_name(pid: int) -> str:
    """What a process of ours is: coordinator, host agent, fork server or worker process (by the
    names worker/forks.py gives the forked ones, then the command line)."""
    from worker.forks import SERVER_NAME, WORKER_NAME, process_comm

    comm = process_comm(pid)
    if not comm:
        return "gone"
    if comm in (SERVER_NAME, WORKER_NAME):
        return "fork server" if comm == SERVER_NAME else "worker process"
    cmd = _cmdline(pid)
    for key, name in ((" coordinator ", "coordinator"), (" worker ", "host agent")):
        if key in cmd:
            return name
    return "other"


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def pss_now(pid: int, with_descendants: bool = True) -> tuple[int, int]:
    """(PSS of the process, summed PSS of its descendants), kB."""
    return pss_kb(pid), sum(pss_kb(c) for c in descendants(pid)) if with_descendants else 0


def added_kb(reports: list[tuple[int, int, int]], loader_kb: int = 0) -> int:
    """What a loader design added to the machine, kB: for every rank (its PSS before its loader
    existed, its PSS now, its descendants' PSS now), plus the PSS now of the loader's own
    processes (our coordinator, host agent and workers). Signed, never clipped: forking workers
    makes a rank's pages shared, so its PSS falls while its workers carry that share; counting
    the workers whole and the fall as zero counted those pages twice."""
    return sum(now + kids - before for before, now, kids in reports) + loader_kb


def piece_costs(lengths: np.ndarray, a: float, b: float) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.float64)
    return a * lengths * lengths + b * lengths


# ---------------------------------------------------------------- the simulated trainer

def train(batches: Iterator[tuple[np.ndarray, Any]], p: dict, barrier, out, rank: int, pss_before: int,
          loader_children: bool, report: Any = None) -> None:
    """Consume p["warmup"] + p["steps"] steps of p["micro_batches"] micro-batches each.
    `batches` yields (piece lengths, the batch) per micro-batch. `report(batch)`, if given, runs
    after each micro-batch's compute (the trainer's own time, as `DataClient.report_loss`)."""
    a, b, scale = p["a"], p["b"], p["time_scale"]
    total = p["warmup"] + p["steps"]
    mid = p["warmup"] + p["steps"] // 2
    it = iter(batches)
    reported = 0.0  # seconds in report(), over the run
    for step in range(total):
        wait = compute = 0.0
        largest = cost_sum = 0.0
        for _ in range(p["micro_batches"]):
            t0 = time.perf_counter()
            lengths, _batch = next(it)
            wait += time.perf_counter() - t0
            c = piece_costs(lengths, a, b)
            cost_sum += float(c.sum())
            largest = max(largest, float(c.max()) if len(c) else 0.0)
            # a fixed compute per micro-batch (tools/bench_wait.py), or the cost model's time
            dt = p["compute_s"] if p.get("compute_s") is not None else float(c.sum()) * scale
            time.sleep(dt)
            compute += dt
            if report is not None:
                t1 = time.perf_counter()
                report(_batch)
                reported += time.perf_counter() - t1
        if step == mid:
            now, kids = pss_now(os.getpid(), loader_children)
            out.put(("pss", rank, pss_before, now, kids))
        barrier.wait()
        out.put(("step", rank, step, time.perf_counter(), wait, compute, largest, cost_sum))
    if report is not None:
        out.put(("report", rank, reported / (total * p["micro_batches"])))
    out.put(("done", rank))


def _prepare_process() -> int:
    """Import what every trainer imports (torch) before measuring what the loader adds. The free
    pages of the trainer's heap go back to the OS first, so that a loader that trims the heap
    (ours does, once, when its client starts) cannot count the trainer's free pages as its own
    saving: only what the loader itself left free can be given back after this."""
    import torch  # noqa: F401  (a trainer has torch loaded before its data loader exists)

    from msd_common.memory import return_freed_memory

    gc.collect()
    return_freed_memory()
    return pss_kb(os.getpid())


# ---------------------------------------------------------------- ours

def ours_rank(address: str, rank: int, p: dict, barrier, out) -> None:
    before = _prepare_process()
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=True, timeout_s=300)

    def batches():
        for batch in client:
            yield batch["piece_lengths"].numpy() if hasattr(batch["piece_lengths"], "numpy") else batch[
                "piece_lengths"], batch

    def report(batch) -> None:  # a per-token loss as a trainer has it before reducing it
        import torch

        client.report_loss(torch.full(batch["tokens"].shape, 2.0))

    try:
        train(batches(), p, barrier, out, rank, before, loader_children=False,
              report=report if p.get("report_loss") else None)
    finally:
        client.close()


# ---------------------------------------------------------------- per-rank PyTorch loaders

def _jsonl_stream_dataset():
    import orjson
    import torch
    from torch.utils.data import IterableDataset, get_worker_info

    class MultiSourceJsonl(IterableDataset):
        """The conventional multi-source loader: every worker opens every source, draws a source
        per document (probability weight / mean document tokens, so token shares follow the
        weights), reads the source's next line, tokenizes it (UTF-8 bytes + end-of-document, the
        same byte tokenizer as ours) and packs documents back to back into seq_len rows."""

        def __init__(self, files: list[str], weights: list[float], mean_tokens: list[float], seq_len: int,
                     seed: int, rank: int) -> None:
            self.files, self.seq_len, self.seed, self.rank = files, seq_len, seed, rank
            w = np.asarray(weights) / np.asarray(mean_tokens)
            self.p = w / w.sum()

        def __iter__(self):
            info = get_worker_info()
            wid, nw = (info.id, info.num_workers) if info else (0, 1)
            rng = np.random.default_rng([self.seed, self.rank, wid])
            handles = [open(f, "rb") for f in self.files]
            for h in handles:  # each worker starts at its own place in each source
                h.seek(int(rng.integers(0, max(1, os.fstat(h.fileno()).st_size))))
                h.readline()
            buf, pieces = [], []
            have = 0
            while True:
                s = int(rng.choice(len(self.files), p=self.p))
                line = handles[s].readline()
                if not line:
                    handles[s].seek(0)
                    line = handles[s].readline()
                text = orjson.loads(line)["text"]
                tokens = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
                doc = np.append(tokens, 256)
                while len(doc):
                    take = min(len(doc), self.seq_len - have)
                    buf.append(doc[:take])
                    pieces.append(take)
                    have += take
                    doc = doc[take:]
                    if have == self.seq_len:
                        yield {"tokens": torch.from_numpy(np.concatenate(buf)),
                               "piece_lengths": torch.tensor(pieces, dtype=torch.int64)}
                        buf, pieces, have = [], [], 0

    return MultiSourceJsonl


def torch_rank(files: list[str], weights: list[float], mean_tokens: list[float], workers: int, rank: int, p: dict,
               barrier, out) -> None:
    before = _prepare_process()
    from torch.utils.data import DataLoader

    dataset = _jsonl_stream_dataset()(files, weights, mean_tokens, p["seq_len"], p["seed"], rank)
    gc.collect()
    gc.freeze()  # the best honest setup: fewer copy-on-write pages in the forked workers
    loader = DataLoader(dataset, batch_size=1, num_workers=workers, persistent_workers=True, prefetch_factor=4,
                        multiprocessing_context="fork")  # the Linux default; gc.freeze pays off with fork

    def batches():
        for batch in loader:
            yield batch["piece_lengths"][0].numpy(), batch

    train(batches(), p, barrier, out, rank, before, loader_children=True)


# ---------------------------------------------------------------- Megatron-Core

class _ByteTokenizer:
    """What GPTDataset asks of a tokenizer: the end-of-document and padding ids."""

    eod, pad, vocab_size = 256, 257, 258
    unique_identifiers = {"class": "byte"}


def megatron_rank(prefixes: list[str], weights: list[float], workers: int, rank: int, ranks: int, p: dict,
                  barrier, out) -> None:
    before = _prepare_process()
    import warnings

    import torch
    from torch.utils.data import DataLoader

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    mbs = 1
    gbs = p["micro_batches"] * mbs * ranks
    n_samples = (p["warmup"] + p["steps"] + 1) * gbs
    config = GPTDatasetConfig(
        random_seed=p["seed"], sequence_length=p["seq_len"], blend=(prefixes, weights), split="100,0,0",
        reset_position_ids=True, reset_attention_mask=False, eod_mask_loss=False, create_attention_mask=False,
        tokenizer=_ByteTokenizer(), path_to_cache=None, mid_level_dataset_surplus=0.005)
    import logging

    logging.getLogger("megatron").setLevel(logging.ERROR)
    # As Megatron does: rank 0 builds the index files, the others load them once it is done
    # (building them concurrently races on the cache files).
    build = lambda: BlendedMegatronDatasetBuilder(GPTDataset, [n_samples, 0, 0], lambda: True, config).build()[0]  # noqa: E731
    if rank == 0:
        dataset = build()
    barrier.wait()
    if rank != 0:
        dataset = build()
    # Megatron's pretraining sampler: each global batch is gbs consecutive samples, micro-batch m
    # of a step holds samples [m*mbs*dp, (m+1)*mbs*dp) of it, and DP rank r takes its slice.
    indices = [t * gbs + m * mbs * ranks + rank * mbs + i for t in range(p["warmup"] + p["steps"])
               for m in range(p["micro_batches"]) for i in range(mbs)]
    gc.collect()
    gc.freeze()
    loader = DataLoader(torch.utils.data.Subset(dataset, indices), batch_size=mbs, num_workers=workers,
                        persistent_workers=True, prefetch_factor=4,
                        multiprocessing_context="fork")  # the Linux default; gc.freeze pays off with fork

    def batches():
        for batch in loader:
            tokens = batch["tokens"][0].numpy()
            ends = np.flatnonzero(tokens == 256) + 1  # documents end with end-of-document
            bounds = np.concatenate([[0], ends[ends < len(tokens)], [len(tokens)]])
            yield np.diff(bounds), batch

    train(batches(), p, barrier, out, rank, before, loader_children=True)
