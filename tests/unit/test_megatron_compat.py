"""Byte-compatibility with megatron-core's IndexedDatasetBuilder / IndexedDataset (the real library)."""

import warnings

import numpy as np

from msd_common.formats.megatron import MegatronIndex, write_megatron

import torch

with warnings.catch_warnings():  # megatron-core warns that Apex / Transformer Engine are absent
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def _docs():
    rng = np.random.default_rng(5)
    return [rng.integers(0, 60000, int(n)).astype(np.uint16) for n in rng.integers(1, 300, 40)]


def test_files_written_by_megatron_core_are_read_exactly(tmp_path):
    prefix = str(tmp_path / "mc")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    docs = _docs()
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    # one document of two sequences, as megatron's sentence-split preprocessing writes
    builder.add_document(torch.arange(10), [4, 6])
    builder.finalize(prefix + ".idx")
    ours = MegatronIndex(prefix)
    assert len(ours) == len(docs) + 1
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(ours.document(i), d)
    np.testing.assert_array_equal(ours.document(len(docs)), np.arange(10))
    assert ours.document_lengths()[-1] == 10


def test_files_we_write_are_byte_identical_and_read_by_megatron_core(tmp_path):
    docs = _docs()
    write_megatron(str(tmp_path / "ours"), docs, np.uint16)
    builder = IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(str(tmp_path / "mc.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"mc{ext}").read_bytes()
    theirs = IndexedDataset(str(tmp_path / "ours"))
    assert len(theirs) == len(docs)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(theirs[i], d)
