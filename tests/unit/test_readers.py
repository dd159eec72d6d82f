import gzip
import os
import struct

import numpy as np
import pytest

from msd_common.formats.errors import RecordError, SourceFormatError
from worker.samples import open_source
from msd_common.formats.jsonl import JsonlShard
from msd_common.formats.megatron import MAGIC, MegatronIndex, write_megatron
from msd_common.tokenizer import ByteTokenizer


def test_megatron_round_trip_and_exact_layout(tmp_path):
    prefix = str(tmp_path / "x")
    docs = [np.array([1, 2, 3], np.uint16), np.array([9], np.uint16), np.array([4, 5], np.uint16)]
    write_megatron(prefix, docs, np.uint16)
    raw = open(prefix + ".idx", "rb").read()
    # megatron-core _IndexWriter layout: magic, version, dtype code (uint16 = 8), counts, arrays
    assert raw[:9] == MAGIC
    assert struct.unpack("<QBQQ", raw[9:34]) == (1, 8, 3, 4)
    assert np.frombuffer(raw, "<i4", 3, 34).tolist() == [3, 1, 2]
    assert np.frombuffer(raw, "<i8", 3, 46).tolist() == [0, 6, 8]
    assert np.frombuffer(raw, "<i8", 4, 70).tolist() == [0, 1, 2, 3]
    assert len(raw) == 70 + 32
    idx = MegatronIndex(prefix)
    assert len(idx) == 3
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(idx.document(i), d)
    assert idx.document_lengths().tolist() == [3, 1, 2]


def test_megatron_foreign_and_truncated_files_are_refused(tmp_path):
    prefix = str(tmp_path / "x")
    write_megatron(prefix, [np.arange(100, dtype=np.uint16)], np.uint16)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(50)
    with pytest.raises(SourceFormatError, match=r"x\.bin.*truncated"):
        MegatronIndex(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMEGA!!")
    with pytest.raises(SourceFormatError, match=r"x\.idx.*not a Megatron index"):
        MegatronIndex(prefix)
    with open(prefix + ".idx", "r+b") as f:
        f.truncate(20)
    with pytest.raises(SourceFormatError, match=r"x\.idx.*truncated"):
        MegatronIndex(prefix)


def test_jsonl_index_is_cached_and_rebuilt_when_the_shard_changes(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "bb"}\n{"text": "ccc"}')  # no final newline
    shard = JsonlShard(str(path))
    assert len(shard) == 3 and shard.line(2) == b'{"text": "ccc"}'
    assert os.path.exists(str(path) + ".msdidx.npy")
    path.write_bytes(b'{"text": "a"}\n')
    os.utime(path, ns=(1, 1))
    assert len(JsonlShard(str(path))) == 1


def test_compressed_shards_read_like_plain_ones(tmp_path):
    import zstandard

    body = b"".join(b'{"text": "line %d"}\n' % i for i in range(20))
    (tmp_path / "p.jsonl").write_bytes(body)
    (tmp_path / "z.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(body))
    with gzip.open(tmp_path / "g.jsonl.gz", "wb") as f:
        f.write(body)
    lines = [JsonlShard(str(tmp_path / n)).line(7) for n in ("p.jsonl", "z.jsonl.zst", "g.jsonl.gz")]
    assert lines == [b'{"text": "line 7"}'] * 3


def test_read_only_data_dir_puts_the_index_in_the_cache_dir(tmp_path, monkeypatch):
    data = tmp_path / "ro"
    data.mkdir()
    (data / "a.jsonl").write_bytes(b'{"text": "x"}\n')
    cache = tmp_path / "cache2"
    monkeypatch.setattr(os, "access", lambda p, mode: False)
    shard = JsonlShard(str(data / "a.jsonl"), cache_dir=str(cache))
    assert len(shard) == 1
    assert not os.path.exists(str(data / "a.jsonl.msdidx.npy"))
    assert any(n.endswith(".msdidx.npy") for n in os.listdir(cache))


def test_source_reader_tokens_and_bad_records(dataset_dir):
    spec = {"name": "web", "format": "jsonl", "files": [f"{dataset_dir}/web/web-0.jsonl",
                                                        f"{dataset_dir}/web/web-1.jsonl"],
            "text_key": "text", "tokenizer": "byte"}
    reader = open_source(spec)
    assert reader.num_records == 120
    tokens = reader.read(0)
    assert tokens[-1] == 256 and tokens.dtype == np.uint16
    text = bytes(tokens[:-1].astype(np.uint8)).decode("utf-8")
    assert ByteTokenizer().encode(text).tolist() == tokens.tolist()
    with pytest.raises(RecordError, match=r"web-1\.jsonl:3: corrupt JSON"):
        reader.read(60 + 2)
    with pytest.raises(RecordError, match=r"web-1\.jsonl:5: corrupt JSON"):
        reader.read(60 + 4)


def test_megatron_lengths_vectorised_match_documents(tmp_path):
    docs = [np.arange(n, dtype=np.uint16) for n in (3, 1, 7, 2)]
    write_megatron(str(tmp_path / "a"), docs[:2], np.uint16)
    write_megatron(str(tmp_path / "b"), docs[2:], np.uint16)
    reader = open_source({"name": "m", "format": "megatron", "files": [str(tmp_path / "a"), str(tmp_path / "b")]})
    records = np.array([3, 0, 2, 1, 2])
    assert reader.lengths(records).tolist() == [len(reader.read(r)) for r in records.tolist()] == [2, 3, 7, 1, 7]
    with pytest.raises(IndexError):
        reader.lengths(np.array([4]))


def test_megatron_gather_equals_slicing_documents(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(0, 60000, int(n)).astype(np.uint16) for n in rng.integers(1, 400, 50)]
    write_megatron(str(tmp_path / "a"), docs[:30], np.uint16)
    write_megatron(str(tmp_path / "b"), docs[30:], np.uint16)
    reader = open_source({"name": "m", "format": "megatron", "files": [str(tmp_path / "a"), str(tmp_path / "b")]})
    recs = rng.integers(0, 50, 40)
    offs = np.array([int(rng.integers(0, len(docs[r]))) for r in recs])
    lens = np.array([int(rng.integers(1, len(docs[r]) - o + 1)) for r, o in zip(recs, offs)])
    expected = np.concatenate([docs[r][o: o + n] for r, o, n in zip(recs, offs, lens)])
    np.testing.assert_array_equal(reader.gather(recs, offs, lens), expected)  # across both shards
    one = recs < 30
    np.testing.assert_array_equal(reader.gather(recs[one], offs[one], lens[one]),
                                  np.concatenate([docs[r][o: o + n] for r, o, n in zip(recs[one], offs[one],
                                                                                       lens[one])]))
