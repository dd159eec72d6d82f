"""`format: arrow` on files written by Hugging Face `datasets` itself (`save_to_disk`): a text
column tokenized by the worker and a token-id column used as stored, through the whole path."""

import glob

import numpy as np
import pytest

from msd.testing.multimodal_data import captions
from tests.conftest import write_job
from msd_common.doc_keys import split_doc_key

from .harness import check_content, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_arrow_files_written_by_datasets_are_read_record_for_record(tmp_path):
    import datasets

    texts = captions()[:300]
    ids = [[(7 * i + j) % 256 for j in range(5 + i % 40)] + [256] for i in range(200)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "text_ds"), max_shard_size="20KB")
    datasets.Dataset.from_dict({"input_ids": ids}).save_to_disk(str(tmp_path / "ids_ds"))
    shards = sorted(glob.glob(str(tmp_path / "text_ds" / "*.arrow")))
    assert len(shards) > 1  # several shards: record indices run across them in path order
    job = {
        "seed": 3,
        "sources": {"text": {"format": "arrow", "paths": ["text_ds/*.arrow"], "text_key": "text"},
                    "ids": {"format": "arrow", "paths": ["ids_ds/*.arrow"], "tokens_key": "input_ids"}},
        "batch": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"text": 0.6, "ids": 0.4}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 16},
    }
    path = write_job(str(tmp_path), job)
    received = run_job(path, workers=2, ranks=2, steps=10)
    assert check_content(path, received) > 20
    # and against the documents as they were given to `datasets`, not as our reader reads them
    seen = {0: 0, 1: 0}
    for batches in received.values():
        for b in batches:
            flat, at = b["tokens"].reshape(-1), 0
            for key, off, n in zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(), b["piece_lengths"].tolist()):
                source, record = split_doc_key(key)
                document = list(texts[record].encode()) + [256] if source == 0 else ids[record]
                row_left = b["tokens"].shape[1] - at % b["tokens"].shape[1]
                if n > row_left or not np.array_equal(flat[at: at + n], document[off: off + n]):
                    at += row_left  # the row's padding
                assert flat[at: at + n].tolist() == document[off: off + n]
                at += n
                seen[source] += 1
    assert seen[0] > 10 and seen[1] > 10
