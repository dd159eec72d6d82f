"""A processor's arrays whose shape differs from sample to sample beyond the first axis (a batch of
one, or patches padded per sample: LLaVA-NeXT and LLaVA-OneVision's `pixel_values` [images,
patches, 3, S, S], a transform's own outputs): a worker sends each shape in messages of its own
(one message declares one row shape an array), and the client pads every piece's to the widest of
the micro-batch with zeros, as transformers pads a batch of them, then concatenates. Before, a
micro-batch holding two such samples stalled in silence: the worker declared the first sample's
shape for both, and the rank refused the message."""

from __future__ import annotations

import sys

import numpy as np

from msd.testing.vlm_data import write_gemma3_processor
from msd_common.doc_keys import split_doc_key
from tests.conftest import write_job
from tests.integration.harness import run_job

TRANSFORM = '''
import numpy as np
from worker.transforms import Sample


def padded(record, ctx):
    """Tokens of the record's text, and pixel values [1, n, 3, 2, 2] of n = 1 + record % 4 patches,
    each value the record's index: a batch of one, as LLaVA-NeXT pads its patches."""
    tokens = np.array(ctx.processor.tokenizer.encode(record["text"]), np.int64)
    n = 1 + ctx.record % 4
    return Sample(tokens, processed={"pixel_values": np.full((1, n, 3, 2, 2), ctx.record, np.float32)})
'''


def test_arrays_of_per_sample_shapes_are_padded_to_the_micro_batchs_widest(tmp_path):
    write_gemma3_processor(str(tmp_path / "gemma"))
    (tmp_path / "padded_mod.py").write_text(TRANSFORM)
    with open(tmp_path / "notes.jsonl", "w") as f:
        for i in range(40):
            f.write('{"text": "note %d %s"}\n' % (i, "word " * (3 + i % 7)))
    job = {
        "seed": 2,
        "sources": {"notes": {"format": "jsonl", "paths": ["notes.jsonl"], "processor": "gemma",
                              "transform": "padded_mod:padded", "packing": "whole"}},
        "batch": {"seq_len": 256, "micro_batch_size": 2, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"notes": 1.0}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 8, "lookahead_steps": 1},
    }
    sys.path.insert(0, str(tmp_path))
    try:
        received = run_job(write_job(str(tmp_path), job), workers=2, ranks=2, steps=4, timeout_s=120,
                           devices={1: "cpu"})  # rank 1 makes its pixel values at next(), on a torch device
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("padded_mod", None)
    checked = mixed = 0
    for batches in received.values():
        for b in batches:
            pixels = np.asarray(b["pixel_values"])
            records = [split_doc_key(k)[1] for k in b["doc_keys"].tolist()]
            widths = [1 + r % 4 for r in records]
            assert pixels.shape == (len(records), max(widths), 3, 2, 2), (pixels.shape, records)
            for j, (record, n) in enumerate(zip(records, widths)):
                assert (pixels[j, :n] == record).all() and (pixels[j, n:] == 0).all()
                checked += 1
            mixed += len(set(widths)) > 1
    assert checked >= 16 and mixed > 0
