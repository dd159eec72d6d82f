"""Sources in a bucket: a real S3-compatible server (moto's server mode, a child process on
loopback) serves shards of every format; the stream of a job over the bucket must equal the
stream of the same job over the local files, record for record and token for token, also when
a proxy in front of the server fails and stalls a share of the requests."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from msd.commands import validate
from msd.testing.multimodal_data import captions, write_parquet, write_webdataset
from msd.testing.s3 import LoopbackS3
from tests.conftest import build_dataset, job_dict, write_job

from .harness import check_content, run_job, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 8
BUCKET = "corpus"


def _job(paths: dict[str, str], **runtime) -> dict:
    job = job_dict()
    job["sources"]["web"]["paths"] = [paths["web"]]
    job["sources"]["code"]["paths"] = [paths["code"]]
    job["sources"]["long"]["paths"] = [paths["long"]]
    job["sources"]["table"] = {"format": "parquet", "paths": [paths["table"]], "text_key": "text"}
    job["sources"]["images"] = {"format": "webdataset", "paths": [paths["images"]], "image_token_id": 300,
                                "max_pixels": 48 * 48, "patch_size": 16}
    job["mixture"]["weights"] = {"web": 0.25, "code": 0.2, "long": 0.15, "table": 0.2, "images": 0.2}
    job["balance"]["cost"]["patch_quadratic"] = 10.0
    job["runtime"].update(runtime)
    return job


LOCAL = {"web": "web/*.jsonl", "code": "code/code_text_document", "long": "long/*.jsonl.zst",
         "table": "table/*.parquet", "images": "images/*.tar"}
REMOTE = {k: f"s3://{BUCKET}/data/{v}" for k, v in LOCAL.items()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket-data")
    build_dataset(str(root))
    (root / "table").mkdir()
    (root / "images").mkdir()
    write_parquet(str(root / "table" / "t-0.parquet"), captions()[:300], row_group_size=40)
    write_webdataset(str(root / "images" / "img-000.tar"), 30, seed=1, sizes=(32, 96), broken={4: "bad_image"})
    write_webdataset(str(root / "images" / "img-001.tar"), 30, seed=2, sizes=(32, 96))
    return root


@pytest.fixture(scope="module")
def local_stream(corpus, tmp_path_factory):
    work = tmp_path_factory.mktemp("local-job")
    data = work / "data"
    shutil.copytree(corpus, data)
    path = write_job(str(data), _job(LOCAL))
    return path, run_job(path, workers=2, ranks=2, steps=STEPS)


def _same_stream(a: dict, b: dict) -> None:
    assert signature(a) == signature(b)
    for rank in a:
        for x, y in zip(sorted(a[rank], key=lambda m: (m["step"], m["micro_batch"])),
                        sorted(b[rank], key=lambda m: (m["step"], m["micro_batch"]))):
            np.testing.assert_array_equal(x["tokens"], y["tokens"])
            if "pixel_patches" in x or "pixel_patches" in y:
                np.testing.assert_array_equal(x["pixel_patches"], y["pixel_patches"])


def _remote_job(tmp_path, s3: LoopbackS3, monkeypatch, **runtime) -> str:
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    return write_job(str(tmp_path), _job(REMOTE, cache_dir=str(tmp_path / "cache"), **runtime))


@pytest.mark.parametrize("copies", ["plain", "seekable"])
def test_every_format_from_a_bucket_streams_as_the_local_files_do(corpus, local_stream, tmp_path, monkeypatch, copies):
    local_path, local = local_stream
    with LoopbackS3(proxy=True) as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        # cache_bytes smaller than the .zst shard's copy of either kind (274 KB plain, 50 KB seekable)
        path = _remote_job(tmp_path, s3, monkeypatch, cache_bytes=32 << 10, copies=copies)
        remote = run_job(path, workers=2, ranks=2, steps=STEPS)
        _same_stream(local, remote)
        assert check_content(local_path, remote) > 50  # and against the local files' tokens
        fetched = s3.stats()["bytes_out"]
    assert fetched > 0
    assert all(len(b) == STEPS * 2 for b in remote.values())


@pytest.mark.parametrize("ranges", ["obstore", "fsspec"])
def test_a_flaky_store_changes_nothing(corpus, local_stream, tmp_path, monkeypatch, ranges):
    """10% of requests answered 503 SlowDown, 3% dropped, 2% stalled for 2 s: every request is
    retried until it succeeds; nothing that is not corrupt is skipped; no worker is taken for dead
    while it waits (heartbeats every 0.5 s). Both ranged-read clients."""
    _, local = local_stream
    monkeypatch.setenv("MSD_STORAGE_RANGES", ranges)
    with LoopbackS3(error_rate=0.10, drop_rate=0.03, stall_rate=0.02, stall_s=2.0, seed=5) as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        path = _remote_job(tmp_path, s3, monkeypatch)
        log = str(tmp_path / "job.log")
        remote = run_job(path, workers=2, ranks=2, steps=STEPS, log_path=log, timeout_s=240)
        stats = s3.stats()
    _same_stream(local, remote)
    assert stats["errors"] > 5 and stats["drops"] > 0 and stats["stalls"] > 0, stats
    skipped = [line for line in open(log) if "skipped record" in line]
    # the corrupt records of the corpus, and nothing else: two bad JSON lines, one bad image
    assert all("web-1.jsonl" in line or "img-000.tar" in line for line in skipped), skipped
    # a worker waiting on a stalled request keeps its heartbeat: none is taken for dead
    dead = [line for line in open(log) if "declared dead" in line]
    assert not dead, dead


def test_validate_names_the_object_that_is_missing_or_unreadable(corpus, tmp_path, monkeypatch):
    with LoopbackS3() as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        path = _remote_job(tmp_path, s3, monkeypatch)
        ok = CliRunner().invoke(validate, [path])
        assert ok.exit_code == 0, ok.output
        assert "web=jsonl:2 file(s)/120 records" in ok.output
        assert "note: sources.web is read from object storage with a record-level shuffle" in ok.stderr
        assert ok.stdout.count("\n") == 1  # the summary stays one line
        # a Megatron pair whose .bin is gone
        s3.client().delete_object(Bucket=BUCKET, Key="data/code/code_text_document.bin")
        result = CliRunner().invoke(validate, [path])
        assert result.exit_code != 0
        assert f"sources.code: s3://{BUCKET}/data/code/code_text_document.bin: cannot be read" in result.output
        # a pattern that matches nothing
        job = yaml.safe_load(open(path))
        job["sources"]["web"]["paths"] = [f"s3://{BUCKET}/data/nothing-here/*.jsonl"]
        bad = write_job(str(tmp_path), job, "bad.yaml")
        result = CliRunner().invoke(validate, [bad])
        assert result.exit_code != 0
        assert f"sources.web.paths: 's3://{BUCKET}/data/nothing-here/*.jsonl' matches no file" in result.output


def test_secrets_in_the_job_file_are_refused(corpus, tmp_path, monkeypatch):
    with LoopbackS3() as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        path = _remote_job(tmp_path, s3, monkeypatch)
        job = yaml.safe_load(open(path))
        job["sources"]["web"]["storage"] = {"key": "AKIA...", "client_kwargs": {"aws_secret_access_key": "x"},
                                            "max_retries": 3}
        bad = write_job(str(tmp_path), job, "secret.yaml")
        result = CliRunner().invoke(validate, [bad])
        assert result.exit_code != 0
        assert "sources.web.storage.key" in result.output
        assert "sources.web.storage.client_kwargs.aws_secret_access_key" in result.output
        assert "AKIA" not in result.output


def test_indexes_are_shared_beside_the_shards_when_the_job_allows_it(corpus, tmp_path, monkeypatch):
    with LoopbackS3(proxy=True) as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        path = _remote_job(tmp_path, s3, monkeypatch)
        job = yaml.safe_load(open(path))
        for name in ("web", "long", "images"):
            job["sources"][name]["storage"] = {"share_indexes": True}
        shared = write_job(str(tmp_path), job, "shared.yaml")
        from msd_common.spec import load_job
        from coordinator.sources import open_sources

        open_sources(load_job(shared))
        keys = {o["Key"] for o in s3.client().list_objects_v2(Bucket=BUCKET, Prefix="data/")["Contents"]}
        assert {"data/web/web-0.jsonl.msdidx.npy", "data/long/long-0.jsonl.zst.msdidx.npy",
                "data/images/img-001.tar.msdidx.json"} <= keys
        # another host (an empty cache) takes the shared indexes instead of reading the shards again
        job["runtime"]["cache_dir"] = str(tmp_path / "other-host-cache")
        other = write_job(str(tmp_path), job, "other.yaml")
        s3.reset_stats()
        opened = open_sources(load_job(other))
        stats = s3.stats()
        shard_bytes = sum(os.path.getsize(os.path.join(corpus, d, f)) for d in ("web", "images")
                          for f in os.listdir(corpus / d) if not f.endswith((".npy", ".json")))
        assert stats["bytes_out"] < shard_bytes / 2, stats
        assert opened.num_records[0] == 120


def _zst_shard(path: str, seed: int, docs: int = 40) -> None:
    import orjson
    import zstandard

    rng = np.random.default_rng(seed)
    lines = b"".join(orjson.dumps({"text": " ".join(map(str, rng.integers(0, 10**6, 400)))}) + b"\n"
                     for _ in range(docs))
    with open(path, "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(lines))


@pytest.mark.parametrize("copies", ["plain", "seekable"])
def test_compressed_shards_stay_within_cache_bytes_and_evicted_copies_are_fetched_again(tmp_path, monkeypatch,
                                                                                         copies):
    """With runtime.copies: seekable the cached copies are in the Zstandard seekable format, and
    the same bound holds as many of them as of plain copies three times their size."""
    from worker.samples import open_source
    from msd_common.formats.jsonl import JsonlShard

    local = tmp_path / "local"
    local.mkdir()
    for i in range(3):
        _zst_shard(str(local / f"part-{i}.jsonl.zst"), seed=i)
    cache = tmp_path / "cache"
    with LoopbackS3() as s3:
        s3.upload_dir(str(local), BUCKET, "zst")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        files = [f"s3://{BUCKET}/zst/part-{i}.jsonl.zst" for i in range(3)]
        expected = open_source({"name": "z", "format": "jsonl", "files": sorted(str(p) for p in local.iterdir())})
        # about one copy of a shard: the bound holds one copy, not three
        copy_size = 40 * 2800 if copies == "plain" else int(1.2 * os.path.getsize(
            JsonlShard(str(local / "part-0.jsonl.zst"), str(tmp_path / "measure"), copies="seekable").path))
        spec = {"name": "z", "format": "jsonl", "files": files, "cache_dir": str(cache), "cache_bytes": copy_size,
                "copies": copies}
        first, second = open_source(spec), open_source(spec)  # two processes sharing one host's cache
        assert first.num_records == expected.num_records == 120
        order = [r for i in range(40) for r in (i, 40 + i, 80 + i)]  # every read in another shard
        for r in order:
            np.testing.assert_array_equal(first.read(r), expected.read(r))
            np.testing.assert_array_equal(second.read(119 - r), expected.read(119 - r))
        held = list((cache / "copies").glob("*.msd.copy"))
        assert len(held) == 1  # the bound held: the others were evicted as each was needed
        assert sum(p.stat().st_size for p in held) <= 2 * copy_size
        assert (held[0].name.endswith(".seekable.zst.msd.copy")) == (copies == "seekable")
        assert first.shards[0].seekable == (copies == "seekable")
    if copies == "seekable":
        assert copy_size < 0.6 * 40 * 2800  # these random digits compress less than text: 0.44 of plain


def test_arrow_and_pre_tokenized_parquet_from_a_bucket_read_as_local(tmp_path, monkeypatch):
    import datasets

    from worker.samples import open_source

    local = tmp_path / "local"
    texts = captions()[:200]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(local / "arrow"), max_shard_size="20KB")
    (local / "pq").mkdir()
    write_parquet(str(local / "pq" / "ids.parquet"), texts, row_group_size=30, tokens=True)
    with LoopbackS3() as s3:
        s3.upload_dir(str(local), BUCKET, "t")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        from msd_common.spec import _expand

        for fmt, sub, pattern, key in (("arrow", "arrow", "*.arrow", {"text_key": "text"}),
                                       ("parquet", "pq", "*.parquet", {"tokens_key": "tokens"})):
            urls = _expand(f"s3://{BUCKET}/t/{sub}/{pattern}", "", fmt)
            paths = _expand(str(local / sub / pattern), "", fmt)
            assert [u.rsplit("/", 1)[1] for u in urls] == [os.path.basename(p) for p in paths] and urls
            remote = open_source({"name": "r", "format": fmt, "files": urls, "cache_dir": str(tmp_path / "c"), **key})
            here = open_source({"name": "r", "format": fmt, "files": paths, **key})
            assert remote.num_records == here.num_records == 200
            for r in range(200):
                np.testing.assert_array_equal(remote.read(r), here.read(r))


def test_whole_objects_are_copied_once_per_host_and_stream_as_local(tmp_path, monkeypatch):
    """storage.whole_objects: a plain JSONL shard and a Megatron .bin are copied whole into the
    cache, once for the host although two worker processes and the coordinator read them, and the
    stream is that of the local files."""
    data = tmp_path / "data"
    build_dataset(str(data))
    local = run_job(write_job(str(data), job_dict()), workers=2, ranks=2, steps=STEPS)
    whole = {"whole_objects": True}
    with LoopbackS3(proxy=True) as s3:
        s3.upload_dir(str(data), BUCKET, "data")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        job = job_dict()
        for name, rel in (("web", LOCAL["web"]), ("code", LOCAL["code"]), ("long", LOCAL["long"])):
            job["sources"][name]["paths"] = [f"s3://{BUCKET}/data/{rel}"]
        job["sources"]["web"]["storage"] = whole
        job["sources"]["code"]["storage"] = whole
        job["runtime"]["cache_dir"] = str(tmp_path / "cache")
        (tmp_path / "remote").mkdir()
        remote = run_job(write_job(str(tmp_path / "remote"), job), workers=2, ranks=2, steps=STEPS)
        fetched = s3.stats()["bytes_out"]
    _same_stream(local, remote)
    stored = sum(os.path.getsize(p) for p in [*data.glob("web/*.jsonl"), *data.glob("long/*.zst"),
                                              *data.glob("code/*")])
    assert stored <= fetched < stored * 1.1 + (64 << 10), (fetched, stored)  # not once per process
    copies = os.listdir(tmp_path / "cache" / "copies")
    assert any(n.endswith("code_text_document.bin.msd.copy") for n in copies), copies
    assert sum(n.endswith(".jsonl.msd.copy") for n in copies) == 3, copies  # two plain, one decompressed


def test_whole_objects_is_refused_where_it_does_not_apply(tmp_path):
    job = job_dict()
    job["sources"]["table"] = {"format": "parquet", "paths": ["s3://b/t/*.parquet"], "text_key": "text",
                               "storage": {"whole_objects": True}}
    job["sources"]["web"]["storage"] = {"whole_objects": "yes"}
    path = write_job(str(tmp_path), job)
    result = CliRunner().invoke(validate, [path])
    assert result.exit_code != 0
    assert "sources.table.storage.whole_objects" in result.output and "parquet" in result.output
    assert "sources.web.storage.whole_objects: expected true or false" in result.output


def test_a_block_shuffle_reads_a_run_of_records_in_one_request_and_streams_as_local(tmp_path, monkeypatch):
    """shuffle_block: the stream over the bucket equals the same job's over the local files, and
    the records of a task come in a request or two where a record-level shuffle asks for each
    document alone (documents of 10 KB lie too far apart to be coalesced)."""
    from msd_common.formats.megatron import write_megatron

    data = tmp_path / "data"
    (data / "big").mkdir(parents=True)
    rng = np.random.default_rng(3)
    write_megatron(str(data / "big" / "docs"), [rng.integers(0, 250, int(n), dtype=np.uint16)
                                               for n in rng.integers(4000, 6000, 400)], np.uint16)

    def job(paths: str, block: int, name: str, where: str) -> str:
        j = job_dict()
        j["sources"] = {"big": {"format": "megatron", "paths": [paths], "shuffle_block": block}}
        j["mixture"]["weights"] = {"big": 1.0}
        j["batch"] = {"seq_len": 2048, "micro_batch_size": 2, "global_batch_size": 8}
        j["runtime"]["cache_dir"] = str(tmp_path / f"cache-{name}")
        (tmp_path / where).mkdir(exist_ok=True)
        return write_job(str(tmp_path / where), j, f"{name}.yaml")

    local = run_job(job(str(data / "big" / "docs"), 16, "local", "data"), workers=2, ranks=2, steps=STEPS)
    requests = {}
    with LoopbackS3(proxy=True) as s3:
        s3.upload_dir(str(data), BUCKET, "data")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        for block in (16, 1):
            s3.reset_stats()
            remote = run_job(job(f"s3://{BUCKET}/data/big/docs", block, f"b{block}", "remote"), workers=2, ranks=2,
                             steps=STEPS)
            requests[block] = s3.stats()["requests"]
            if block == 16:
                _same_stream(local, remote)
    # 8 steps of 8 x 2048 tokens: about 26 documents a step, most their own request at block 1
    # (how many steps' documents are read by the end depends on how far ahead they are prepared)
    assert requests[1] > 2 * 26, requests
    assert requests[16] * 4 < requests[1], requests


def test_listing_and_metadata_through_obstore_agree_with_fsspec(corpus, monkeypatch):
    """For s3:// the objects a pattern matches and each object's size and version tag come from
    obstore (no s3fs import in a worker process); they must be fsspec's answers."""
    from msd_common.formats.storage import Store

    with LoopbackS3() as s3:
        s3.upload_dir(str(corpus), BUCKET, "data")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        fast = Store("s3")
        monkeypatch.setenv("MSD_STORAGE_RANGES", "fsspec")
        plain = Store("s3")
        assert fast._fast is not None and plain._fast is None
        assert "fs" not in vars(fast)  # no fsspec file system made for it
        patterns = [f"s3://{BUCKET}/data/web/*.jsonl", f"s3://{BUCKET}/data/**/*.idx", f"s3://{BUCKET}/data/*/web-?.*",
                    f"s3://{BUCKET}/data/[wc]*/*", f"s3://{BUCKET}/data/code/code_text_document.idx",
                    f"s3://{BUCKET}/data/none/*.jsonl", f"s3://{BUCKET}/data/web/missing.jsonl", f"s3://{BUCKET}/d*/*/*"]
        for pattern in patterns:
            assert fast.glob(pattern) == plain.glob(pattern), pattern
        assert len(fast.glob(patterns[0])) == 2 and len(fast.glob(patterns[3])) == 4
        for url in fast.glob(f"s3://{BUCKET}/data/**"):
            assert fast.stamp(url) == plain.stamp(url), url
        assert not fast.exists(f"s3://{BUCKET}/data/web/missing.jsonl")
        with pytest.raises(FileNotFoundError, match="missing.jsonl"):
            fast.info(f"s3://{BUCKET}/data/web/missing.jsonl")
        assert "fs" not in vars(fast)


def test_a_transform_gets_every_entry_of_a_webdataset_sample_from_a_bucket(tmp_path, monkeypatch):
    """A prepare task's samples are fetched together: with a transform, every entry of each sample
    (not only the image and the caption), and the records equal the local shard's."""
    import io
    import sys
    import tarfile

    from msd_common.spec import _expand
    from worker.samples import open_source

    local = tmp_path / "local"
    local.mkdir()
    with tarfile.open(local / "s.tar", "w") as tar:
        for i in range(20):
            for ext, data in (("jpg", b"j" * (10 + i)), ("seg.png", b"m" * i), ("cls", str(i).encode()),
                              ("txt", b"caption %d" % i)):
                if ext == "txt" and i % 4 == 0:
                    continue  # no caption: the transform's to judge
                info = tarfile.TarInfo(f"{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (tmp_path / "wds_remote.py").write_text(
        "from worker.transforms import Sample\n"
        "def names(record, ctx):\n"
        "    return Sample(ctx.tokenizer.encode(','.join(f'{k}={v[:3]!r}' for k, v in sorted(record.items()))))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = {"name": "w", "index": 0, "format": "webdataset", "tokenizer": "byte", "image_token_id": 300,
            "patch_size": 14, "max_pixels": 50176, "transform": "wds_remote:names"}
    with LoopbackS3() as s3:
        s3.upload_dir(str(local), BUCKET, "w")
        for k, v in s3.env().items():
            monkeypatch.setenv(k, v)
        remote = open_source({**spec, "files": _expand(f"s3://{BUCKET}/w/*.tar", "", "webdataset"),
                              "cache_dir": str(tmp_path / "c")})
        here = open_source({**spec, "files": [str(local / "s.tar")], "cache_dir": str(tmp_path / "c2")})
        remote.prefetch(np.arange(20))
        for r in range(20):
            a, b = remote.read_full(r)[0], here.read_full(r)[0]
            np.testing.assert_array_equal(a, b)
            text = bytes(a[:-1].astype(np.uint8)).decode()
            assert "cls=" in text and "seg.png=" in text and ("txt=" in text) == (r % 4 != 0), text
    sys.modules.pop("wds_remote", None)
