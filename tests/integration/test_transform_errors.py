"""A transform that fails on most records is a bug, not poison: max_transform_errors consecutive
errors on one source stop the job, naming the source, the record and the last traceback; a
worker host whose copy of the transform differs from the coordinator's does not serve."""

import sys
import time

import pytest

from coordinator.testing.local import LocalJob
from tests.conftest import job_dict, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_consecutive_transform_errors_stop_the_job_with_the_traceback(dataset_dir, tmp_path):
    (tmp_path / "failing_mod.py").write_text("def f(record, ctx):\n    return record['no_such_field']\n")
    sys.path.insert(0, str(tmp_path))
    try:
        job = job_dict()
        job["sources"]["web"].update(transform="failing_mod:f", max_transform_errors=5)
        path = write_job(str(tmp_path), {**job, "sources": {k: {**v, "paths": [f"{dataset_dir}/{v['paths'][0]}"]}
                                                            for k, v in job["sources"].items()}})
        log = str(tmp_path / "job.log")
        with LocalJob(path, workers=1, log_path=log, log_level="INFO") as cluster:
            deadline = time.monotonic() + 60
            while cluster.coordinator.is_alive() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not cluster.coordinator.is_alive()
            assert cluster.coordinator.exitcode != 0
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("failing_mod", None)
    text = open(log).read()
    assert "source 'web': 5 consecutive records failed in transform failing_mod:f" in text
    assert "KeyError" in text and "no_such_field" in text and "Traceback" in text
