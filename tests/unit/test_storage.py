"""The object-store layer's own rules: which ranges share a request, what is retried, which
storage options are refused. The store itself is the external boundary here (a recording
stand-in for its file system); the integration tests run a real S3 server."""

from __future__ import annotations

import time

import pytest

from msd_common.spec import ConfigError, load_job
from tests.conftest import job_dict, write_job
from msd_common.formats import storage
from msd_common.formats.storage import COALESCE_GAP, COALESCE_MAX, Store


class Recording:
    """A file system that serves a fixed object and records the ranges asked for; the first
    `fail` requests fail with `error`."""

    def __init__(self, data: bytes, fail: int = 0, error: Exception | None = None) -> None:
        self.data, self.fail, self.error, self.asked = data, fail, error, []

    def cat_ranges(self, paths, starts, ends, on_error="return"):
        out = []
        for a, b in zip(starts, ends):
            self.asked.append((a, b))
            if self.fail:
                self.fail -= 1
                out.append(self.error)
            else:
                out.append(self.data[a:b])
        return out


def _store(fs: Recording, monkeypatch, retries: int = 3) -> Store:
    monkeypatch.setattr(storage, "_sleep", lambda s: None)
    s = Store.__new__(Store)
    s.protocol, s.max_retries, s.share_indexes, s.fs, s._fast = "s3", retries, False, fs, None
    s.bytes_fetched = s.requests = s.retries = 0
    return s


def test_nearby_ranges_share_a_request_far_ones_do_not(monkeypatch):
    data = bytes(range(256)) * 200_000
    fs = Recording(data)
    store = _store(fs, monkeypatch)
    starts = [5000, 100, 100 + 50 + COALESCE_GAP, 30_000_000, 400_000]  # given out of order
    ends = [5100, 150, 200 + COALESCE_GAP, 30_000_010, 400_001]
    got = store.fetch("s3://b/k", starts, ends)
    assert got == [data[a:b] for a, b in zip(starts, ends)]
    # 100-150, 5000-5100 and the one just a gap after are one request; the far two are alone
    assert sorted(fs.asked) == [(100, 200 + COALESCE_GAP), (400_000, 400_001), (30_000_000, 30_000_010)]
    assert store.bytes_fetched == sum(b - a for a, b in fs.asked)


def test_a_request_stays_under_the_size_bound(monkeypatch):
    fs = Recording(b"x" * (3 * COALESCE_MAX))
    store = _store(fs, monkeypatch)
    starts = list(range(0, 2 * COALESCE_MAX, 1 << 20))
    store.fetch("s3://b/k", starts, [a + (1 << 20) for a in starts])
    assert len(fs.asked) == 2 and all(b - a <= COALESCE_MAX for a, b in fs.asked)


def test_transient_errors_are_retried_and_final_ones_are_not(monkeypatch):
    fs = Recording(b"abcdef", fail=2, error=OSError("503 SlowDown"))
    store = _store(fs, monkeypatch)
    assert store.read("s3://b/k", 1, 4) == b"bcd"
    assert store.retries == 2
    missing = _store(Recording(b"abc", fail=1, error=FileNotFoundError("no such key")), monkeypatch)
    with pytest.raises(OSError, match="s3://b/k bytes 0-2: FileNotFoundError"):
        missing.read("s3://b/k", 0, 2)
    assert len(missing.fs.asked) == 1  # asked once: a missing object does not come back
    flaky = _store(Recording(b"abc", fail=10, error=TimeoutError("stalled")), monkeypatch, retries=3)
    with pytest.raises(OSError, match=r"s3://b/k: TimeoutError: stalled \(after 3 retries\)"):
        flaky.read("s3://b/k", 0, 2)
    assert len(flaky.fs.asked) == 4


def test_retry_wraps_other_calls_the_same_way(monkeypatch):
    store = _store(Recording(b""), monkeypatch, retries=2)
    calls = []

    def listing():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("reset by peer")
        return ["a"]
    assert store.retry("s3://b/*", listing) == ["a"]
    with pytest.raises(FileNotFoundError, match="s3://b/x"):
        store.retry("s3://b/x", lambda: (_ for _ in ()).throw(FileNotFoundError("gone")))


class Stalled(Recording):
    """A store that answers every request after `stall_s` seconds (fsspec's calls block meanwhile)."""

    def __init__(self, data: bytes, stall_s: float) -> None:
        super().__init__(data)
        self.stall_s = stall_s

    def cat_ranges(self, paths, starts, ends, on_error="return"):
        time.sleep(self.stall_s)
        return super().cat_ranges(paths, starts, ends, on_error)

    def info(self, url):
        time.sleep(self.stall_s)
        return {"size": len(self.data), "ETag": "x"}


def test_a_worker_waiting_on_a_stalled_store_keeps_its_heartbeat(monkeypatch):
    """A request that takes 1.2 s (the coordinator declares a worker dead after 3 silent
    heartbeats) calls keep_alive all along; the test failed when fsspec's calls blocked the
    worker's thread (a flaky-store test saw workers declared dead over and over)."""
    beats = []
    monkeypatch.setattr(storage, "keep_alive", lambda: beats.append(time.monotonic()))
    store = _store(Stalled(b"abcdef", stall_s=1.2), monkeypatch)
    started = time.monotonic()
    assert store.read("s3://b/k", 1, 4) == b"bcd"
    assert store.stamp("s3://b/k")[0] == 6
    gaps = [b - a for a, b in zip([started, *beats], beats + [time.monotonic()])]
    assert len(beats) >= 6 and max(gaps) < 0.5, gaps


def test_a_call_that_raises_timeout_ends_the_wait(monkeypatch):
    """A store call that itself raises TimeoutError is retried and then named, not waited on forever."""
    store = _store(Recording(b"abc", fail=10, error=TimeoutError("stalled")), monkeypatch, retries=1)
    store.fs.info = lambda url: (_ for _ in ()).throw(TimeoutError("read timed out"))
    with pytest.raises(OSError, match=r"s3://b/k: TimeoutError: read timed out \(after 1 retries\)"):
        store.info("s3://b/k")


def test_storage_blocks_are_checked_in_the_job_file(tmp_path, dataset_dir):
    job = job_dict()
    job["sources"]["web"]["storage"] = {"max_retries": -1, "share_indexes": "yes", "secret": "s",
                                        "config_kwargs": {"session_token": "t"}}
    job["runtime"]["cache_bytes"] = 0
    with pytest.raises(ConfigError) as e:
        load_job(write_job(dataset_dir, job, "storage-bad.yaml"))
    text = str(e.value)
    for key in ("sources.web.storage.max_retries", "sources.web.storage.share_indexes", "sources.web.storage.secret",
                "sources.web.storage.config_kwargs.session_token", "runtime.cache_bytes"):
        assert key in text
    ok = job_dict()
    ok["sources"]["web"]["storage"] = {"max_retries": 2, "share_indexes": True}
    loaded = load_job(write_job(dataset_dir, ok, "storage-ok.yaml"))
    spec = loaded.worker_job().sources[0]
    assert spec.storage == {"max_retries": 2, "share_indexes": True} and spec.cache_bytes > 0
    assert loaded.digest() == load_job(write_job(dataset_dir, job_dict(), "plain.yaml")).digest()  # access, not stream
