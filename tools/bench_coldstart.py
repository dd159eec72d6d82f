"""Cold start on compressed JSONL: how long before a job can plan, when nothing is indexed yet.

    python tools/bench_coldstart.py --json OUT [--shards 16] [--shard-mb 100] [--copies seekable]

Writes S shards of real text (this Python's standard library, documents of lognormal length)
as JSONL of about M MB each, zstd-compressed (`zstd -3`), then measures, alternately and
--repeats times:
- the reference: `zstd -d -c SHARD | wc -l` for every shard, one after another (what one core
  needs to decompress the bytes and count their lines), and that divided by the core count;
- ours cold: a fresh process opening the job's sources as `msd coordinator` does at start-up
  (coordinator.sources.open_sources), with every index and decompressed copy removed first;
- ours warm: the same with everything cached;
- ours cold on a worker host: its worker processes (as many as cores) building what the host
  lacks when they are welcomed (indexing.build_indexes_shared, a lock per shard), everything
  removed first: as fresh processes (their imports counted), and forked from this process once
  it has imported the readers, as a host's fork server forks its workers;
- ours cold as a user runs it with `runtime.index_on: workers`: `msd coordinator` and
  `msd worker --procs N` (N = the cores) started together, until the coordinator has the record
  counts from the workers (its "workers counted" log line): every process's start-up included;
  and the same as one command, `msd coordinator --worker-procs N` (a job on one machine);
- ours cold as one command with the job's default, `runtime.index_on: coordinator`: `msd
  coordinator --worker-procs N` until it listens, its own processes (a pool, one per core) having
  indexed before it did.
The cold variants run in a different order in each repeat: on a virtual machine that hands
freed memory back to its host, the first touch of that memory is slow, and a run's time depends
on what ran before it (`dd` of 1.7 GB into the page cache: 0.33 s right after 1.7 GB had been
freed, 3.7-4.2 s after a 20 s pause). Also the disk the cache takes (decompressed copies and
line indexes) against the compressed shards, and what reading one record costs from the copies
(`record_read_us`: random lines of one shard, through the reader the workers use). --copies
seekable: the job's `runtime.copies`, copies in the Zstandard seekable format instead of plain.
Medians, spreads and the fastest runs in the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np
import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402

from msd.testing.demo_data import _stdlib_sources  # noqa: E402
from msd.testing.ports import free_address  # noqa: E402
from msd.testing.processes import stop  # noqa: E402

OPEN = "import sys; from msd_common.spec import load_job; from coordinator.sources import open_sources; " \
       "print(sum(open_sources(load_job(sys.argv[1])).num_records), flush=True)"


def make_shards(root: str, shards: int, shard_mb: int) -> list[str]:
    stamp = os.path.join(root, f".complete-{shards}-{shard_mb}")
    paths = [os.path.join(root, f"shard-{i:03d}.jsonl.zst") for i in range(shards)]
    if os.path.exists(stamp):
        return paths
    os.makedirs(root, exist_ok=True)
    text = "\n\n".join(src for _, src in _stdlib_sources())
    rng = np.random.default_rng(15)
    for i, path in enumerate(paths):
        plain = path[:-4]
        written = 0
        with open(plain, "wb") as f:
            while written < shard_mb << 20:
                lines = []
                for n in np.clip(rng.lognormal(7.0, 1.0, 4096), 50, 200_000).astype(int).tolist():
                    start = int(rng.integers(0, len(text) - n - 1))
                    lines.append(orjson.dumps({"text": text[start:start + n]}))
                block = b"\n".join(lines) + b"\n"
                f.write(block)
                written += len(block)
        subprocess.run(["zstd", "-q", "-3", "-f", "--rm", plain, "-o", path], check=True)
    open(stamp, "w").close()
    return paths


def clear_cache(root: str, cache: str) -> None:
    """Remove every index and copy, and let the disk finish writing what the run before wrote:
    each measured run starts with no dirty pages."""
    shutil.rmtree(cache, ignore_errors=True)
    for name in os.listdir(root):
        if ".msd" in name:
            os.remove(os.path.join(root, name))
    os.sync()


def reference_s(paths: list[str]) -> float:
    started = time.perf_counter()
    for p in paths:
        subprocess.run(f"zstd -d -c '{p}' | wc -l", shell=True, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def ours_s(job: str) -> tuple[float, int]:
    """Seconds until a fresh process has opened the sources (printed their record count); not
    until it exits: the copies' background sync to disk (indexing.sync_later) would hold the exit,
    where `msd coordinator` goes on serving meanwhile."""
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", OPEN, job], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    seconds = time.perf_counter() - started
    proc.stdout.close()
    if proc.wait() != 0 or not line.strip():
        raise RuntimeError(f"opening the sources failed ({proc.returncode})")
    return seconds, int(line.strip())


WORKERS = "import sys, json; from msd_common.formats.indexing import build_indexes_shared; " \
    "specs = json.loads(sys.argv[1]); built, problems = build_indexes_shared(specs, first=int(sys.argv[2])); " \
    "assert not problems, problems; print(len(built))"


def _worker_specs(paths: list[str], cache: str, copies: str) -> list[dict]:
    """The source specs a worker of the job is given (the part build_indexes_shared reads)."""
    return [{"name": "text", "format": "jsonl", "files": paths, "cache_dir": cache, "copies": copies}]


def record_read_us(path: str, cache: str, copies: str, reads: int = 3000) -> float:
    """Microseconds per line read at random places of one shard, from its cached copy."""
    from msd_common.formats.jsonl import JsonlShard

    shard = JsonlShard(path, cache, copies=copies)
    lines = np.random.default_rng(0).integers(0, len(shard), reads).tolist()
    started = time.perf_counter()
    for i in lines:
        shard.line(i)
    return (time.perf_counter() - started) / reads * 1e6


def _first_shard(i: int, paths: list[str], processes: int) -> int:
    """Where worker process i starts in the shard list, so that the processes start apart."""
    return i * len(paths) // processes


def workers_s(paths: list[str], cache: str, copies: str, processes: int) -> float:
    """Seconds until `processes` fresh processes, started together, have indexed every shard."""
    spec = orjson.dumps(_worker_specs(paths, cache, copies)).decode()
    started = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", WORKERS, spec, str(_first_shard(i, paths, processes))],
                              stdout=subprocess.PIPE, text=True) for i in range(processes)]
    built = sum(int(p.communicate()[0].strip()) for p in procs)
    assert built == len(paths), built
    return time.perf_counter() - started


def forked_workers_s(paths: list[str], cache: str, copies: str, processes: int) -> float:
    """Seconds until `processes` processes forked from this one, which has imported the readers
    (as a host's fork server has before it forks its workers), have indexed every shard: what a
    welcomed worker spends, without the fresh interpreter's imports that workers_s includes."""
    from msd_common.formats.indexing import build_indexes_shared

    spec = _worker_specs(paths, cache, copies)
    started = time.perf_counter()
    pids = []
    for i in range(processes):
        pid = os.fork()
        if pid == 0:  # the child: build, and say by the exit status whether it went well
            status = 1
            try:
                _, problems = build_indexes_shared(spec, first=_first_shard(i, paths, processes))
                status = 1 if problems else 0
            finally:
                os._exit(status)
        pids.append(pid)
    statuses = [os.waitpid(pid, 0)[1] for pid in pids]
    assert all(os.waitstatus_to_exitcode(st) == 0 for st in statuses), statuses
    return time.perf_counter() - started


def commands_s(job: str, processes: int, one_command: bool = False, until: str = "workers counted") -> float:
    """Seconds from starting `msd coordinator` (the job says index_on: workers) and `msd worker
    --procs N` (or one command, `msd coordinator --worker-procs N`) until the coordinator logs
    that the workers counted the sources (or `until`: with the job's default, index_on:
    coordinator, that it listens, its own processes having indexed)."""
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    address = free_address()
    started = time.perf_counter()
    coordinator = subprocess.Popen([msd, "coordinator", "--config", job, "--bind", address,
                                    *(["--worker-procs", str(processes)] if one_command else [])],
                                   stderr=subprocess.PIPE, text=True)
    host = coordinator if one_command else subprocess.Popen(
        [msd, "worker", "--coordinator", address, "--procs", str(processes), "--log-level", "WARNING"])
    try:
        for line in coordinator.stderr:
            if until in line:
                return time.perf_counter() - started
        raise RuntimeError(f"the coordinator exited ({coordinator.wait()}) before it logged {until!r}")
    finally:
        stop([coordinator] if one_command else [host, coordinator], timeout_s=30)


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, files in os.walk(path) for n in files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/megascale-data/bench-coldstart"))
    ap.add_argument("--copies", choices=("plain", "seekable"), default="plain",
                    help="runtime.copies: how the compressed shards are kept for random access")
    args = ap.parse_args()
    root = os.path.join(args.data_dir, f"{args.shards}x{args.shard_mb}")
    paths = make_shards(root, args.shards, args.shard_mb)
    cache = os.path.join(args.data_dir, "cache")
    job = os.path.join(args.data_dir, "job.yaml")
    with open(job, "w") as f:
        yaml.safe_dump({"seed": 1, "sources": {"text": {"format": "jsonl", "paths": [os.path.join(root,
                                                                                                  "*.jsonl.zst")]}},
                        "batch": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 8},
                        "topology": {"dp": 8}, "mixture": {"weights": {"text": 1.0}},
                        "runtime": {"cache_dir": cache, "copies": args.copies}}, f)
    workers_job = os.path.join(args.data_dir, "job-index-on-workers.yaml")
    with open(job) as f, open(workers_job, "w") as out:
        spec = yaml.safe_load(f)
        spec["runtime"]["index_on"] = "workers"
        yaml.safe_dump(spec, out)
    cores = os.cpu_count() or 1
    ref, cold, warm, on_workers, on_forked, commands, one_command, records = [], [], [], [], [], [], [], None
    one_command_default = []

    def coordinator_cold() -> None:
        nonlocal records
        seconds, records = ours_s(job)
        cold.append(seconds)
        warm.append(ours_s(job)[0])

    variants = [coordinator_cold, lambda: on_workers.append(workers_s(paths, cache, args.copies, cores)),
                lambda: on_forked.append(forked_workers_s(paths, cache, args.copies, cores)),
                lambda: commands.append(commands_s(workers_job, cores)),
                lambda: one_command.append(commands_s(workers_job, cores, one_command=True)),
                lambda: one_command_default.append(commands_s(job, cores, one_command=True, until="listening on"))]
    for repeat in range(args.repeats):
        ref.append(reference_s(paths))
        for variant in variants[repeat % len(variants):] + variants[:repeat % len(variants)]:
            clear_cache(root, cache)
            variant()
    compressed = sum(os.path.getsize(p) for p in paths)
    cache_bytes = _du(cache)
    reads = [record_read_us(paths[0], cache, args.copies) for _ in range(3)]
    med = statistics.median
    result = {
        "shards": args.shards, "records": records, "compressed_bytes": compressed, "cores": cores,
        "copies": args.copies, "record_read_us": med(reads),
        "repeats": args.repeats,
        "reference_serial_s": med(ref), "reference_spread_s": [min(ref), max(ref)],
        "reference_per_core_s": med(ref) / cores,
        "ours_cold_s": med(cold), "ours_cold_spread_s": [min(cold), max(cold)],
        "ours_warm_s": med(warm), "ours_warm_spread_s": [min(warm), max(warm)],
        "ours_cold_on_worker_processes_s": med(on_workers), "ours_cold_on_worker_processes_spread_s":
            [min(on_workers), max(on_workers)], "worker_processes": cores,
        "cold_on_workers_over_reference_per_core": med(on_workers) / (med(ref) / cores),
        "ours_cold_on_forked_workers_s": med(on_forked), "ours_cold_on_forked_workers_spread_s":
            [min(on_forked), max(on_forked)],
        "cold_on_forked_workers_over_reference_per_core": med(on_forked) / (med(ref) / cores),
        "ours_cold_index_on_workers_commands_s": med(commands), "ours_cold_index_on_workers_commands_spread_s":
            [min(commands), max(commands)],
        "cold_index_on_workers_commands_over_reference_per_core": med(commands) / (med(ref) / cores),
        "ours_cold_index_on_workers_one_command_s": med(one_command),
        "ours_cold_index_on_workers_one_command_spread_s": [min(one_command), max(one_command)],
        "cold_index_on_workers_one_command_over_reference_per_core": med(one_command) / (med(ref) / cores),
        "ours_cold_one_command_index_on_coordinator_s": med(one_command_default),
        "ours_cold_one_command_index_on_coordinator_spread_s": [min(one_command_default), max(one_command_default)],
        "cold_one_command_index_on_coordinator_over_reference_per_core": med(one_command_default) / (med(ref) / cores),
        "cold_over_reference_per_core": med(cold) / (med(ref) / cores),
        "fastest_over_reference_per_core": {
            "coordinator": min(cold) / (med(ref) / cores), "worker_processes": min(on_workers) / (med(ref) / cores),
            "forked_workers": min(on_forked) / (med(ref) / cores),
            "index_on_workers_commands": min(commands) / (med(ref) / cores),
            "index_on_workers_one_command": min(one_command) / (med(ref) / cores),
            "index_on_coordinator_one_command": min(one_command_default) / (med(ref) / cores)},
        "cache_bytes": cache_bytes, "cache_over_compressed": cache_bytes / compressed,
        "plain_bytes_per_s_cold": (cache_bytes / med(cold)),
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
