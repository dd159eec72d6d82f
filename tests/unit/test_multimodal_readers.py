"""Parquet and WebDataset sources: real files written by pyarrow, tarfile and Pillow."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

from msd.testing.multimodal_data import write_parquet, write_webdataset
from msd_common.formats.errors import RecordError, SourceFormatError
from worker.samples import open_source
from worker.vision import fit, to_patches


def _spec(fmt, files, **kw):
    return {"name": "s", "format": fmt, "files": files, **kw}


# ---------------------------------------------------------------- parquet

def test_parquet_text_rows_are_records_across_shards(tmp_path):
    a, b = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")
    write_parquet(a, [f"row {i}" for i in range(100)], row_group_size=16)
    write_parquet(b, [f"second {i}" for i in range(5)], row_group_size=16)
    r = open_source(_spec("parquet", [a, b], text_key="text"))
    assert r.num_records == 105
    assert bytes(r.read(17)[:-1].astype(np.uint8)).decode() == "row 17"
    assert r.read(17)[-1] == 256
    assert bytes(r.read(102)[:-1].astype(np.uint8)).decode() == "second 2"
    # one record decodes one row group of one column, not the file
    assert list(r.shards[0]._groups) == [1]


def test_parquet_token_column_is_used_as_stored(tmp_path):
    path = str(tmp_path / "t.parquet")
    texts = ["hello", "parquet tokens"]
    write_parquet(path, texts, tokens=True)
    r = open_source(_spec("parquet", [path], tokens_key="tokens"))
    assert r.read(1).tolist() == list(b"parquet tokens") + [256]
    assert r.dtype == np.dtype("<i4")


def test_parquet_bad_column_and_bad_cell_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"text": pa.array(["ok", None], pa.string())}), path)
    with pytest.raises(SourceFormatError, match=r"n.parquet: no column 'body'"):
        open_source(_spec("parquet", [path], text_key="body"))
    r = open_source(_spec("parquet", [path], text_key="text"))
    with pytest.raises(RecordError, match=r"n.parquet: row 1: column 'text' is not a string"):
        r.read(1)
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 but not really")
    with pytest.raises(SourceFormatError, match="junk.parquet: not a readable Parquet file"):
        open_source(_spec("parquet", [str(junk)], text_key="text"))


# ---------------------------------------------------------------- images

@pytest.mark.parametrize("w,h", [(640, 480), (100, 900), (17, 17), (4000, 30)])
def test_fit_keeps_budget_and_aspect(w, h):
    tw, th = fit(w, h, 224 * 224, 14)
    assert tw % 14 == 0 and th % 14 == 0 and tw >= 14 and th >= 14
    assert tw * th <= max(224 * 224, 14 * max(tw, th))  # one patch row/column may exceed a thin budget
    if w * h > 224 * 224 and min(tw, th) > 14:
        assert abs(tw / th - w / h) / (w / h) < 0.15


def test_patches_tile_the_resized_image():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    patches = to_patches(buf.getvalue(), max_pixels=10_000, patch_size=8)
    tw, th = fit(70, 50, 10_000, 8)
    assert (tw, th) == (64, 48)  # 70x50 fits the budget: only rounded down to whole patches
    expected = np.asarray(img.resize((tw, th), Image.Resampling.BICUBIC))
    assert patches.shape == ((th // 8) * (tw // 8), 8 * 8 * 3) and patches.dtype == np.uint8
    # patch (row 1, col 2) in raster order is the 8x8 block at y=8, x=16
    np.testing.assert_array_equal(patches[1 * (tw // 8) + 2].reshape(8, 8, 3), expected[8:16, 16:24])


# ---------------------------------------------------------------- webdataset

def test_webdataset_samples_become_placeholders_then_caption(tmp_path):
    shard = str(tmp_path / "img-000.tar")
    write_webdataset(shard, 12, seed=1, sizes=(64, 200))
    r = open_source(_spec("webdataset", [shard], image_token_id=300, max_pixels=64 * 64, patch_size=16,
                          tokenizer="byte"))
    assert r.num_records == 12 and r.has_images and r.patch_bytes == 16 * 16 * 3
    for i in range(12):
        tokens, patches = r.read_sample(i)
        n = len(patches)
        assert 1 <= n <= 16 and patches.shape == (n, 768)
        assert (tokens[:n] == 300).all() and (tokens[n:] != 300).all() and tokens[-1] == 256
        caption = bytes(tokens[n:-1].astype(np.uint8)).decode()
        assert len(caption) > 10
    assert r.dtype == np.dtype("<u2")  # 300 fits the byte tokenizer's uint16


def test_webdataset_broken_samples_are_skipped_by_name(tmp_path):
    shard = str(tmp_path / "broken.tar")
    write_webdataset(shard, 8, broken={1: "no_caption", 3: "bad_image", 5: "split"})
    r = open_source(_spec("webdataset", [shard], image_token_id=300, max_pixels=32 * 32, patch_size=16))
    # the split sample's late caption forms a second run of key 000005: both are refused
    assert r.num_records == 9
    expected = {1: "'000001': no caption entry", 3: "'000003': image does not decode",
                5: "'000005': entries split across the tar", 8: "'000005': entries split across the tar"}
    for i in range(r.num_records):
        if i in expected:
            with pytest.raises(RecordError, match=f"broken.tar: sample {expected[i]}"):
                r.read_sample(i)
        else:
            assert len(r.read_sample(i)[1]) >= 1


def test_webdataset_index_is_cached_and_rebuilt_when_the_shard_changes(tmp_path):
    shard = str(tmp_path / "c.tar")
    write_webdataset(shard, 3)
    assert open_source(_spec("webdataset", [shard], image_token_id=300)).num_records == 3
    assert os.path.exists(shard + ".msdidx.json")
    write_webdataset(shard, 5, seed=2)
    os.utime(shard, ns=(1, os.stat(shard).st_mtime_ns + 10**9))
    assert open_source(_spec("webdataset", [shard], image_token_id=300)).num_records == 5
    (tmp_path / "junk.tar").write_bytes(b"\x00garbage" * 100)
    with pytest.raises(SourceFormatError, match="junk.tar"):
        open_source(_spec("webdataset", [str(tmp_path / "junk.tar")], image_token_id=300))


def test_a_split_sample_with_several_late_entries_is_refused_by_name_and_the_rest_read(tmp_path):
    """A key whose entries come back later as a run of several (a tar appended to): both runs are
    refused by name, on the built-in path and for a transform, and the shard's other samples read."""
    import tarfile

    good = io.BytesIO()
    Image.new("RGB", (20, 20), (9, 9, 9)).save(good, format="PNG")
    shard = tmp_path / "late.tar"
    with tarfile.open(shard, "w") as tar:
        for name, data in (("a.png", good.getvalue()), ("a.txt", b"first"), ("b.png", good.getvalue()),
                           ("b.txt", b"second"), ("a.cls", b"1"), ("a.json", b"{}"), ("c.png", good.getvalue()),
                           ("c.txt", b"third")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    r = open_source(_spec("webdataset", [str(shard)], image_token_id=300, max_pixels=32 * 32, patch_size=16))
    assert r.num_records == 4  # a, b, a again, c
    for i in (0, 2):
        with pytest.raises(RecordError, match="'a': entries split across the tar"):
            r.read_sample(i)
        with pytest.raises(RecordError, match="'a': entries split across the tar"):
            r.record(i)
    assert bytes(r.record(1)["txt"]) == b"second" and len(r.read_sample(3)[1]) >= 1
