"""runtime.cache_dir and the parallel indexing of shards at start-up (issue 15's cold start)."""

import dataclasses
import os
import sys

import numpy as np
import pytest
import zstandard

from msd_common.spec import ConfigError, parse_job
from coordinator.sources import open_sources
from tests.conftest import build_dataset, job_dict
from msd_common.formats import indexing
from msd_common.formats.errors import RecordError
from worker.samples import open_source


def _copy_dataset(tmp_path):
    root = str(tmp_path / "data")
    os.makedirs(root)
    build_dataset(root)
    return root


def _sidecars(root):
    return sorted(n for _, _, files in os.walk(root) for n in files if ".msd" in n)


def test_cache_dir_is_a_path_relative_to_the_job_file_and_a_bad_one_is_named(dataset_dir):
    job = parse_job(job_dict(runtime={"cache_dir": "cache"}), "job.yaml", base_dir=dataset_dir)
    assert job.runtime.cache_dir == os.path.join(dataset_dir, "cache")
    assert all(s.cache_dir == job.runtime.cache_dir for s in job.worker_job().sources)
    assert parse_job(job_dict(), "job.yaml", base_dir=dataset_dir).runtime.cache_dir is None
    with pytest.raises(ConfigError, match="runtime.cache_dir"):
        parse_job(job_dict(runtime={"cache_dir": 7}), "job.yaml", base_dir=dataset_dir)


def test_with_a_cache_dir_every_index_and_decompressed_copy_goes_there_and_workers_reuse_them(tmp_path):
    root = _copy_dataset(tmp_path)
    cache = str(tmp_path / "elsewhere")
    plain = open_sources(parse_job(job_dict(), "job.yaml", base_dir=root))
    assert indexing.wait_for_syncs(10)
    beside = [os.path.join(d, n) for d, _, files in os.walk(root) for n in files if ".msd" in n]
    assert beside  # the same job without a cache dir put them beside the data
    assert any(n.endswith(".msd.jsonl.synced") for n in beside)  # its decompressed copy reached the disk
    for path in beside:
        os.remove(path)
    job = parse_job(job_dict(runtime={"cache_dir": cache}), "job.yaml", base_dir=root)
    opened = open_sources(job)
    assert indexing.wait_for_syncs(10)
    assert opened.num_records == plain.num_records
    assert _sidecars(root) == []  # nothing beside the data
    cached = _sidecars(cache)
    assert any(n.endswith("long-0.jsonl.zst.msd.jsonl") for n in cached)  # the decompressed copy
    assert sum(n.endswith(".msdidx.npy") for n in cached) == 3  # two web shards and the long one
    stamps = {n: os.path.getmtime(os.path.join(cache, n)) for n in cached}
    # a worker opens its sources from the spec it is sent: it finds the cache, builds nothing
    readers = [open_source(spec) for spec in job.worker_job().sources]
    assert [r.num_records for r in readers] == plain.num_records
    assert {n: os.path.getmtime(os.path.join(cache, n)) for n in _sidecars(cache)} == stamps
    assert readers[2].read(0) is not None


def _zst_shard(path, rng, lines=2000):
    data = b"".join(b'{"text": "%s"}\n' % (b"x" * int(n)) for n in rng.integers(10, 200, lines))
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(data))


def test_shards_are_indexed_by_a_pool_a_corrupt_one_is_named_and_a_shard_added_later_is_indexed_alone(tmp_path):
    rng = np.random.default_rng(3)
    files = [str(tmp_path / f"s{i}.jsonl.zst") for i in range(6)]
    for path in files:
        _zst_shard(path, rng)
    with open(files[4], "wb") as f:  # not zstd at all
        f.write(b"this is not a zstd frame" * 100)
    cache = str(tmp_path / "cache")
    spec = {"name": "s", "format": "jsonl", "files": files, "cache_dir": cache}
    problems = indexing.build_indexes([spec], processes=3)
    assert list(problems) == [files[4]] and "cannot decompress" in problems[files[4]]
    indexes = sorted(n for n in os.listdir(cache) if n.endswith(".msdidx.npy"))
    assert len(indexes) == 5
    stamps = {n: os.path.getmtime(os.path.join(cache, n)) for n in indexes}
    added = str(tmp_path / "s6.jsonl.zst")
    _zst_shard(added, rng, 300)
    spec["files"] = [f for f in files if f != files[4]] + [added]
    assert indexing.build_indexes([spec], processes=3) == {}
    assert {n: os.path.getmtime(os.path.join(cache, n)) for n in indexes} == stamps  # untouched
    assert open_source(spec).num_records == 5 * 2000 + 300


@pytest.mark.parametrize("line_bytes", [3, 60, 255, 256, 400, 5000])
def test_line_offsets_are_the_same_by_every_scan(tmp_path, line_bytes):
    """The compiled scan (worker/_lines.c), both branches of its Python reference, on bytes and
    on a part of an mmap (a DirectWriter's buffer), and a whole file's offsets."""
    import mmap

    from msd_common.formats import jsonl
    from msd_common.formats.jsonl import _newlines, _newlines_py, _scan_offsets

    assert jsonl._lines is not None, "worker._lines was not built (setup.py): the scan falls back to Python"
    rng = np.random.default_rng(line_bytes)
    data = b"".join(b"y" * int(n) + b"\n" for n in rng.integers(0, 2 * line_bytes, 3000)) + b"tail"
    expected_all = np.flatnonzero(np.frombuffer(data, np.uint8) == 10).tolist()
    assert _newlines(data).tolist() == _newlines_py(data, 0, len(data)).tolist() == expected_all
    buffer = mmap.mmap(-1, len(data) + 100)
    buffer[50:50 + len(data)] = data
    for start, end in [(50, 50 + len(data)), (57, 50 + len(data) // 2), (60, 60)]:
        part = np.flatnonzero(np.frombuffer(buffer, np.uint8, end - start, start) == 10).tolist()
        assert _newlines(buffer, start, end).tolist() == _newlines_py(buffer, start, end).tolist() == part
    with pytest.raises(ValueError):
        jsonl._lines.newlines(data, 10, len(data) + 1)
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    expected = [0] + [i + 1 for i, b in enumerate(data) if b == 10] + [len(data)]
    assert _scan_offsets(str(path)).tolist() == expected


def test_a_truncated_zstd_shard_is_refused_by_name_and_several_frames_are_read_whole(tmp_path):
    from msd_common.formats.errors import SourceFormatError

    lines = [b'{"text": "line %d"}\n' % i for i in range(3000)]
    frames = zstandard.ZstdCompressor().compress(b"".join(lines[:1000])) + \
        zstandard.ZstdCompressor().compress(b"".join(lines[1000:]))
    whole = tmp_path / "two-frames.jsonl.zst"
    whole.write_bytes(frames)
    spec = {"name": "t", "format": "jsonl", "files": [str(whole)], "cache_dir": str(tmp_path / "cache")}
    reader = open_source(spec)
    assert reader.num_records == 3000 and reader.read(2999) is not None
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(frames[: len(frames) - 40])
    with pytest.raises(SourceFormatError, match="cut.jsonl.zst: cannot decompress: .*truncated"):
        open_source({**spec, "files": [str(cut)]})


@pytest.mark.parametrize("tail, refused", [
    (b"", None),  # two frames with a skippable frame between them: read whole
    (b"garbage!", "cannot decompress: zstd decompress error"),  # not a frame after the last one
    (b"\x28\xb5\x2f", "ends inside a frame at byte"),  # a frame cut inside its magic number
])
def test_the_frames_of_a_zstd_shard_are_checked_to_their_ends(tmp_path, tail, refused):
    """The copy is decompressed by a stream reader that says nothing at a cut frame; the frames
    are walked afterwards, so whatever follows the last whole frame is named, not dropped."""
    from msd_common.formats.errors import SourceFormatError

    lines = [b'{"text": "line %d"}\n' % i for i in range(3000)]
    skippable = b"\x50\x2a\x4d\x18" + (5).to_bytes(4, "little") + b"12345"
    data = zstandard.ZstdCompressor().compress(b"".join(lines[:1000])) + skippable + \
        zstandard.ZstdCompressor().compress(b"".join(lines[1000:])) + tail
    shard = tmp_path / "s.jsonl.zst"
    shard.write_bytes(data)
    spec = {"name": "t", "format": "jsonl", "files": [str(shard)], "cache_dir": str(tmp_path / "cache")}
    if refused is None:
        from msd_common.formats.jsonl import JsonlShard

        assert open_source(spec).num_records == 3000
        shard_reader = JsonlShard(str(shard), str(tmp_path / "cache"))
        assert [shard_reader.line(i) for i in (0, 999, 1000, 2999)] == [lines[i].rstrip() for i in (0, 999, 1000, 2999)]
    else:
        with pytest.raises(SourceFormatError, match=f"s.jsonl.zst: .*{refused}"):
            open_source(spec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")
def test_a_decompressed_copy_has_its_disk_reserved_first_and_is_exactly_the_content(tmp_path):
    from msd_common.files import preallocate
    from msd_common.formats.jsonl import _declared_size

    reserved = tmp_path / "reserved"
    with open(reserved, "wb") as f:
        assert preallocate(f, 1 << 20)  # ext4, xfs, tmpfs, overlayfs on them all support it
    assert reserved.stat().st_size == 0 and reserved.stat().st_blocks * 512 >= 1 << 20  # length kept
    with open(reserved, "wb") as f:
        assert not preallocate(f, 0)  # nothing to reserve
    lines = b"".join(b'{"text": "doc %d"}\n' % i for i in range(5000))
    shard = tmp_path / "one-frame.jsonl.zst"
    shard.write_bytes(zstandard.ZstdCompressor().compress(lines))
    assert _declared_size(str(shard)) == len(lines)
    streamed = tmp_path / "streamed.jsonl.zst"
    c = zstandard.ZstdCompressor().compressobj()
    streamed.write_bytes(c.compress(lines) + c.flush())  # a streaming compressor does not know the size
    assert _declared_size(str(streamed)) == -1 and _declared_size(str(tmp_path / "x.jsonl.gz")) == -1
    for path in (shard, streamed):
        spec = {"name": "t", "format": "jsonl", "files": [str(path)], "cache_dir": str(tmp_path / "cache")}
        reader = open_source(spec)
        assert reader.num_records == 5000
    copies = [os.path.join(tmp_path / "cache", n) for n in os.listdir(tmp_path / "cache") if n.endswith(".msd.jsonl")]
    assert len(copies) == 2
    for copy in copies:
        with open(copy, "rb") as f:
            assert f.read() == lines  # nothing reserved shows: the copy is the content, byte for byte


def test_a_copy_written_without_waiting_for_the_disk_is_reused_until_a_reboot_unless_synced(tmp_path):
    """Decompressed copies built at start-up are not fsynced before the job starts (the disk was
    most of a cold start); they are synced in the background and marked. A copy written before
    the machine's last boot without its marker may have lost pages in a crash: decompressed again."""
    from msd_common.formats import jsonl

    boot = jsonl.boot_time_ns()
    assert boot is not None  # Linux
    rng = np.random.default_rng(8)
    shard = str(tmp_path / "s.jsonl.zst")
    _zst_shard(shard, rng, 3000)
    spec = {"name": "s", "format": "jsonl", "files": [shard], "cache_dir": str(tmp_path / "cache")}
    assert indexing.build_indexes([spec], processes=1) == {}
    assert indexing.wait_for_syncs(10)
    copy = jsonl._sidecar_path(shard, ".msd.jsonl", spec["cache_dir"])
    marker = copy + jsonl.SYNCED_SUFFIX
    assert os.path.exists(marker)
    reader = jsonl.JsonlShard(shard, spec["cache_dir"])
    assert reader.offsets.tolist() == jsonl._scan_offsets(copy).tolist()  # indexed in the same pass as written
    assert len(reader) == 3000 and reader.unsynced_copy is None

    def age(path, ns):  # as if written `ns` before the boot
        os.utime(path, ns=(boot - ns, boot - ns))

    age(shard, 3 * 10**12)
    age(copy, 2 * 10**12)
    age(marker, 10**12)
    inode = os.stat(copy).st_ino
    jsonl.JsonlShard(shard, spec["cache_dir"])
    assert os.stat(copy).st_ino == inode  # synced before the boot: reused
    os.remove(marker)
    rebuilt = jsonl.JsonlShard(shard, spec["cache_dir"], durable_copy=False)
    assert os.stat(copy).st_ino != inode and rebuilt.unsynced_copy == copy  # unsynced before the boot: again
    assert not os.path.exists(marker) and len(rebuilt) == 3000
    inode = os.stat(copy).st_ino
    jsonl.JsonlShard(shard, spec["cache_dir"])
    assert os.stat(copy).st_ino == inode  # written since the boot: in the page cache or on disk
    jsonl.mark_synced(copy)
    assert os.path.exists(marker)


def _shared_build(specs, first, out, start):
    start.wait()  # both begin together, imports done
    built, problems = indexing.build_indexes_shared(specs, first=first)
    out.put((first, built, problems))


@pytest.mark.parametrize("copies", ["plain", "seekable"])
def test_the_worker_processes_of_a_host_share_the_indexing_of_shards_it_lacks(tmp_path, copies):
    """Two processes of one host, each given every shard: each shard is built once, by one of
    them, both return once all are built, and a corrupt shard is named by the one that tried it
    (with seekable copies, a process checking a shard another built looked for a plain copy and
    built it again)."""
    import multiprocessing as mp

    rng = np.random.default_rng(21)
    files = [str(tmp_path / f"s{i}.jsonl.zst") for i in range(8)]
    for path in files:
        _zst_shard(path, rng, 30000)
    with open(files[5], "wb") as f:
        f.write(b"not zstd" * 64)
    specs = [{"name": "s", "format": "jsonl", "files": files, "cache_dir": str(tmp_path / "host-cache"),
              "copies": copies}]
    ctx = mp.get_context("spawn")
    out, start = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_shared_build, args=(specs, first, out, start)) for first in (0, 4)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    built = [set(b) for _, b, _ in results]
    assert built[0] and built[1] and not built[0] & built[1]  # both worked, never on the same shard
    assert built[0] | built[1] == set(files) - {files[5]}
    problems = {k: v for _, _, p in results for k, v in p.items()}
    assert list(problems) == [files[5]] and "cannot decompress" in problems[files[5]]
    assert indexing.build_indexes_shared(specs) == ([], {files[5]: problems[files[5]]})  # nothing left to build
    assert open_source({**specs[0], "files": [f for f in files if f != files[5]]}).num_records == 7 * 30000


def test_a_welcomed_worker_builds_what_its_host_lacks_keeping_itself_alive(tmp_path):
    from worker.core import Registered, WorkerCore
    from msd_common import protocol as P

    rng = np.random.default_rng(22)
    files = [str(tmp_path / f"w{i}.jsonl.zst") for i in range(3)]
    for path in files:
        _zst_shard(path, rng, 500)
    cache = tmp_path / "this-host"
    spec = {"name": "w", "format": "jsonl", "files": files, "cache_dir": str(cache), "index": 0, "text_key": "text",
            "tokenizer": "byte"}
    core = WorkerCore()
    beats = []
    core.keep_alive = lambda: beats.append(1)
    actions = core.handle(P.Welcome(worker_id=1, heartbeat_s=0.5, job={"seed": 0, "sources": [spec]}, count=[]))
    assert actions == [Registered(1, 0.5)]
    assert sum(n.endswith(".msdidx.npy") for n in os.listdir(cache)) == 3  # before its first task
    assert len(beats) >= 3


# ---------------------------------------------------------------- runtime.copies: seekable


def _text_shard(path, rng, lines):
    """A zstd JSONL shard of real-looking text (words), of lines of 10 to 3,000 bytes."""
    words = [b"token", b"batch", b"rank", b"shard", b"the", b"of", b"attention", b"coordinator", b"\xce\xbb"]
    body = [b'{"text": "%s"}' % b" ".join(words[int(i)] for i in rng.integers(0, len(words), int(n)))
            for n in rng.integers(2, 500, lines)]
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(b"\n".join(body) + b"\n"))
    return body


def test_seekable_copies_read_every_line_as_plain_copies_do_from_a_third_of_the_disk(tmp_path):
    import pyzstd

    from msd_common.formats import jsonl

    lines = _text_shard(str(tmp_path / "a.jsonl.zst"), np.random.default_rng(5), 3000)
    plain = jsonl.JsonlShard(str(tmp_path / "a.jsonl.zst"))
    seekable = jsonl.JsonlShard(str(tmp_path / "a.jsonl.zst"), copies="seekable")
    assert plain.path.endswith(".msd.jsonl") and seekable.path.endswith(".msd.seekable.zst")
    order = np.random.default_rng(0).permutation(len(lines)).tolist()  # random access, as a worker reads
    assert [seekable.line(i) for i in order] == [plain.line(i) for i in order] == [lines[i] for i in order]
    plain_bytes, seekable_bytes = os.path.getsize(plain.path), os.path.getsize(seekable.path)
    assert plain_bytes > 4 * jsonl.SEEKABLE_FRAME  # several frames
    assert seekable_bytes < plain_bytes / 2, (seekable_bytes, plain_bytes)
    with pyzstd.SeekableZstdFile(seekable.path, "r") as f:  # the standard format, readable by others
        assert f.read() == b"\n".join(lines) + b"\n"


def test_a_seekable_copy_cut_short_is_written_again_and_few_readers_stay_open(tmp_path):
    from msd_common.formats import jsonl

    rng = np.random.default_rng(6)
    shards = [str(tmp_path / f"s{i}.jsonl.zst") for i in range(jsonl.OPEN_SEEKABLE + 4)]
    bodies = [_text_shard(p, rng, 200) for p in shards]
    opened = [jsonl.JsonlShard(p, copies="seekable") for p in shards]
    for k in range(600):  # round robin over more shards than stay open
        i = k % len(shards)
        assert opened[i].line(k % 200) == bodies[i][k % 200]
        assert len(jsonl._seekable_readers._open) <= jsonl.OPEN_SEEKABLE
    copy = opened[0].path
    with open(copy, "r+b") as f:  # a crash while it was written: no frame table at its end
        f.truncate(os.path.getsize(copy) // 2)
    again = jsonl.JsonlShard(shards[0], copies="seekable")
    assert again.path == copy and os.path.getsize(copy) > 0
    assert [again.line(i) for i in range(200)] == bodies[0]
    # the first reader of that shard was closed (more shards than stay open); opened again by
    # path it would find the new copy: a shard opened before it says so instead of misreading
    assert not any(key[0] == copy and key[1] == opened[0]._identity for key in jsonl._seekable_readers._open)
    with pytest.raises(RecordError, match="written anew while in use"):
        opened[0].line(0)
    assert again.line(199) == bodies[0][199]


def test_runtime_copies_is_checked_and_sent_to_workers_and_the_pool_writes_seekable_copies(tmp_path):
    root = _copy_dataset(tmp_path)
    assert parse_job(job_dict(), "job.yaml", base_dir=root).runtime.copies == "plain"
    with pytest.raises(ConfigError, match="runtime.copies"):
        parse_job(job_dict(runtime={"copies": "zip"}), "job.yaml", base_dir=root)
    plain = open_sources(parse_job(job_dict(), "job.yaml", base_dir=root))
    assert indexing.wait_for_syncs(10)
    job = parse_job(job_dict(runtime={"copies": "seekable"}), "job.yaml", base_dir=root)
    assert all(s.copies == "seekable" for s in job.worker_job().sources)
    # the plain copy and the index exist: the shard still counts as lacking its seekable copy
    assert indexing.unindexed_shards(job.worker_job().sources) == {2: [os.path.join(root, "long", "long-0.jsonl.zst")]}
    opened = open_sources(job)  # the start-up pool writes it
    assert indexing.wait_for_syncs(10)
    assert opened.num_records == plain.num_records
    assert "long-0.jsonl.zst.msd.seekable.zst" in _sidecars(root)
    assert indexing.unindexed_shards(job.worker_job().sources) == {}
    long_spec = job.worker_job().sources[2]
    reader = open_source(long_spec)
    assert reader.shards[0].seekable
    np.testing.assert_array_equal(reader.read(3), open_source(dataclasses.replace(long_spec, copies="plain")).read(3))
