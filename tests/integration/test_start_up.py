"""Start-up at the paper's source count: the first batch comes in seconds, and does not wait
longer for more records (nothing in start-up is O(records) beyond reading the index files)."""

from __future__ import annotations

import time

import yaml

from msd.testing.fleet import sources
from msd.testing.local import LocalJob
from trainer_client import DataClient

FIRST_BATCH_S = 10.0  # the target for a job whose indexes are built, at any size


def _first_batch_s(root, count: int, records: int) -> float:
    """Seconds from starting the coordinator to rank 0's first batch."""
    prefixes = sources(str(root), count, records)
    job = {
        "seed": 3,
        "sources": {f"src{i:03d}": {"format": "megatron", "paths": [p]} for i, p in enumerate(prefixes)},
        "batch": {"seq_len": 8192, "micro_batch_size": 1, "global_batch_size": 1},
        "topology": {"dp": 1},
        "mixture": {"weights": {f"src{i:03d}": 1.0 for i in range(count)}},
        "runtime": {"lookahead_steps": 2},
    }
    path = root / f"job-{count}-{records}.yaml"
    path.write_text(yaml.safe_dump(job))
    started = time.monotonic()
    with LocalJob(str(path), workers=2) as cluster:
        client = DataClient(cluster.address, rank=0, as_torch=False, timeout_s=60)
        try:
            batch = next(iter(client))
            elapsed = time.monotonic() - started
        finally:
            client.close()
    assert batch["tokens"].shape == (1, 8192)
    assert len(set((batch["doc_keys"] >> 48).tolist())) > 1  # pieces of several of the sources
    return elapsed


def test_first_batch_at_306_sources_does_not_wait_for_more_records(tmp_path):
    small = _first_batch_s(tmp_path, 306, 10_000)  # 3 x 10^6 records in all
    large = _first_batch_s(tmp_path, 306, 10_000_000)  # 3 x 10^9 records, as in the paper: 1,000 times more
    assert large < FIRST_BATCH_S, (small, large)
    assert large < 2 * small + 2.0, f"first batch {small:.1f} s at 3e6 records, {large:.1f} s at 3e9"
