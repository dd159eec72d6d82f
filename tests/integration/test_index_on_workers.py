"""`runtime.index_on: workers`: the coordinator builds no index. It listens at once, the worker
processes of every host index the shards their host lacks and count the records, and the job's
stream is the one the coordinator's own indexing gives. Run as a user runs it: `msd coordinator`
and `msd worker` commands, each with its own cache (two hosts, for the case of data in a bucket)."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time
import types

import pytest
import zstandard

from msd.testing.ports import free_address
from msd.testing.processes import stop
from msd.testing.s3 import LoopbackS3
from tests.conftest import build_dataset, job_dict, write_job

from .harness import run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 6
MSD = os.path.join(os.path.dirname(sys.executable), "msd")


def _runtime(**extra) -> dict:
    return {**job_dict()["runtime"], **extra}


def _indexes(directory: str) -> list[str]:
    """Index files and decompressed copies under a directory."""
    return sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory, "**", "*.msd*"), recursive=True)
                  if not p.endswith((".lock", ".synced")))


class _Commands:
    """`msd coordinator` and `msd worker --procs 2`, each with the environment of its own host."""

    def __init__(self, job: str, log_dir, coordinator_env: dict, worker_env: dict) -> None:
        self.address = free_address()
        self.logs = [open(log_dir / name, "wb") for name in ("coordinator.log", "worker.log")]
        self.coordinator = subprocess.Popen([MSD, "coordinator", "--config", job, "--bind", self.address],
                                            env={**os.environ, **coordinator_env}, stdout=self.logs[0],
                                            stderr=subprocess.STDOUT)
        self.host = subprocess.Popen([MSD, "worker", "--coordinator", self.address, "--procs", "2"],
                                     env={**os.environ, **worker_env}, stdout=self.logs[1], stderr=subprocess.STDOUT)

    def close(self) -> None:
        stop([self.host, self.coordinator])
        for f in self.logs:
            f.close()


def test_workers_index_and_count_the_stream_is_the_coordinators(tmp_path):
    """Local files (one host): the same stream as with the coordinator indexing, and the
    coordinator says the workers counted the two JSONL sources (the Megatron one it opens itself)."""
    streams, logs = {}, {}
    for index_on in ("coordinator", "workers"):
        root = tmp_path / index_on
        build_dataset(str(root))
        path = write_job(str(root), job_dict(runtime=_runtime(index_on=index_on)))
        logs[index_on] = str(tmp_path / f"{index_on}.log")
        streams[index_on] = run_job(path, workers=2, ranks=2, steps=STEPS, log_path=logs[index_on])
        assert _indexes(str(root)), "the shards were indexed"
    assert signature(streams["workers"]) == signature(streams["coordinator"])
    text = open(logs["workers"]).read()
    assert "waiting for workers to index 3 shard(s) and count 2 source(s)" in text, text[-3000:]
    assert "workers counted 2 source(s) (web=120, long=25)" in text, text[-3000:]
    assert "counted the records of 2 sources for the coordinator" in text
    assert "workers counted" not in open(logs["coordinator"]).read()


def test_an_auto_host_indexes_with_all_the_processes_it_may_run(tmp_path):
    """`msd worker --procs auto --max-procs 2` starts one process; while the sources are counted
    the host is told to run both (its hello comes before its first process's)."""
    build_dataset(str(tmp_path))
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    log = str(tmp_path / "job.log")
    run_job(path, workers=None, max_procs=2, ranks=2, steps=2, log_path=log)
    assert "worker processes: 1 -> 2 (indexing the job's shards)" in open(log).read()


def test_two_hosts_over_a_bucket_only_the_workers_host_indexes(tmp_path):
    """Shards in a bucket, the coordinator and the workers on hosts with caches of their own: the
    coordinator's cache stays empty, the workers' holds every shard's index (and the decompressed
    copy of the zstd shard), and the stream is the one of the same job over local files."""
    data = tmp_path / "data"
    build_dataset(str(data))
    local = write_job(str(data), job_dict(), "local.yaml")
    expected = run_job(local, workers=2, ranks=2, steps=STEPS)
    coordinator_cache, worker_cache = tmp_path / "coordinator-host", tmp_path / "worker-host"
    with LoopbackS3() as s3:
        s3.upload_dir(str(data / "web"), "corpus", "web")
        s3.upload_dir(str(data / "long"), "corpus", "long")
        s3.upload_dir(str(data / "code"), "corpus", "code")
        job = job_dict(runtime=_runtime(index_on="workers", heartbeat_s=1.0))
        job["sources"]["web"]["paths"] = ["s3://corpus/web/*.jsonl"]
        job["sources"]["long"]["paths"] = ["s3://corpus/long/*.jsonl.zst"]
        job["sources"]["code"]["paths"] = ["s3://corpus/code/code_text_document"]
        path = write_job(str(tmp_path), job, "remote.yaml")
        commands = _Commands(path, tmp_path, {**s3.env(), "MSD_CACHE_DIR": str(coordinator_cache)},
                             {**s3.env(), "MSD_CACHE_DIR": str(worker_cache)})
        try:
            received, _ = run_ranks(types.SimpleNamespace(address=commands.address), ranks=2, steps=STEPS,
                                    timeout_s=180)
        finally:
            commands.close()
    log = (tmp_path / "coordinator.log").read_text()
    assert signature(received) == signature(expected), log[-3000:]
    assert _indexes(str(coordinator_cache)) == [], "the coordinator's host indexed nothing"
    built = _indexes(str(worker_cache))
    for shard in ("web-0.jsonl", "web-1.jsonl", "long-0.jsonl.zst"):
        assert any(n.endswith(f"-{shard}.msdidx.npy") for n in built), (shard, built)
    assert any(n.endswith("-long-0.jsonl.zst.jsonl.msd.copy") for n in built), built  # the zstd shard's copy
    assert "workers counted 2 source(s) (web=120, long=25)" in log


def test_a_shard_the_workers_cannot_read_stops_the_coordinator_naming_it(tmp_path):
    """A truncated zstd shard: the workers cannot count its source, and `msd coordinator` exits
    with the source, the shard and the host that found it."""
    build_dataset(str(tmp_path))
    shard = tmp_path / "long" / "long-0.jsonl.zst"
    shard.write_bytes(shard.read_bytes()[:-40])
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    commands = _Commands(path, tmp_path, {}, {})
    try:
        commands.coordinator.wait(timeout=120)
    finally:
        commands.close()
    log = (tmp_path / "coordinator.log").read_text()
    assert commands.coordinator.returncode == 1, log[-3000:]
    assert "sources.long:" in log and "long-0.jsonl.zst" in log and "on host" in log, log[-3000:]
    assert "the zstd stream ends inside a frame" in log, log[-3000:]


def test_the_counts_are_taken_from_this_hosts_indexes_when_it_has_them(tmp_path):
    """A corpus already indexed on the coordinator's host: no counting phase, the coordinator
    opens the sources itself even with index_on: workers."""
    build_dataset(str(tmp_path))
    first = write_job(str(tmp_path), job_dict(), "first.yaml")
    run_job(first, workers=1, ranks=2, steps=1)  # indexes everything beside the data
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    log = str(tmp_path / "second.log")
    run_job(path, workers=1, ranks=2, steps=2, log_path=log)
    assert "waiting for workers" not in open(log).read()


def test_a_corpus_changed_since_it_was_indexed_is_counted_anew(tmp_path):
    """A shard rewritten after its index was built: this host's index is stale, so the workers
    index it again and the new count is the one planned with."""
    build_dataset(str(tmp_path))
    first = write_job(str(tmp_path), job_dict(), "first.yaml")
    run_job(first, workers=1, ranks=2, steps=1)
    shard = tmp_path / "long" / "long-0.jsonl.zst"
    lines = zstandard.ZstdDecompressor().decompressobj().decompress(shard.read_bytes()).splitlines(keepends=True)
    shard.write_bytes(zstandard.ZstdCompressor().compress(b"".join(lines[:20])))  # 25 -> 20 documents
    later = time.time() + 10
    os.utime(shard, (later, later))  # newer than its index, whatever the clock's resolution
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    log = str(tmp_path / "second.log")
    run_job(path, workers=1, ranks=2, steps=2, log_path=log)
    assert "workers counted 1 source(s) (long=20)" in open(log).read()


def _wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        time.sleep(0.05)


def test_a_worker_whose_host_is_killed_while_it_indexes_stops(tmp_path):
    """A worker busy with its welcome's indexing (here: waiting for a shard another process holds
    the lock of; at terabyte scale, hours of building) stops once its host agent is gone, instead of
    going on alone."""
    import fcntl

    from msd.testing.processes import running
    from worker.forks import host_worker_pids
    from msd_common.formats import indexing

    build_dataset(str(tmp_path))
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    shard = str(tmp_path / "long" / "long-0.jsonl.zst")
    with open(indexing._lock_path(("jsonl", shard, None)), "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as another process building it would
        commands = _Commands(path, tmp_path, {}, {})
        try:
            _wait_until(lambda: len(host_worker_pids(commands.host.pid)) == 2, 60, "the host's 2 worker processes")
            workers = host_worker_pids(commands.host.pid)
            _wait_until(lambda: "registered as worker" not in (tmp_path / "worker.log").read_text()
                        and os.path.exists(str(tmp_path / "web" / "web-1.jsonl") + ".msdidx.npy"), 60,
                        "the other shards indexed, the workers waiting for the held one")
            time.sleep(1.0)
            assert all(running(pid) for pid in workers), "the workers wait for the shard"
            commands.host.kill()
            commands.host.wait()
            _wait_until(lambda: not any(running(pid) for pid in workers), 5, "the workers stop")
        finally:
            commands.close()


def test_a_stop_as_the_counting_ends_stops_the_coordinator_and_its_workers_cleanly(tmp_path):
    """SIGTERM to `msd coordinator --worker-procs` the moment the workers have counted (between
    the counting and the coordinator's loop): a clean stop, exit status 0 and no worker process
    left, not the default action's death that left the host's workers behind, indexing on."""
    from msd.testing.processes import running
    from worker.forks import host_worker_pids

    build_dataset(str(tmp_path))
    path = write_job(str(tmp_path), job_dict(runtime=_runtime(index_on="workers")))
    coordinator = subprocess.Popen([MSD, "coordinator", "--config", path, "--bind", free_address(),
                                    "--worker-procs", "2"], stderr=subprocess.PIPE, text=True)
    try:
        workers: list[int] = []
        for line in coordinator.stderr:
            workers = workers or host_worker_pids(coordinator.pid)
            if "workers counted" in line:
                coordinator.send_signal(15)
                break
        rest = coordinator.stderr.read()
        assert coordinator.wait(timeout=60) == 0, rest[-3000:]
        assert workers
        _wait_until(lambda: not any(running(pid) for pid in workers), 10, "the workers stop")
    finally:
        stop([coordinator])
