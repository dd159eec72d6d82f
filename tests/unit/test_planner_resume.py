"""The planner's state through the common save/load check: resume anywhere, twice."""

import numpy as np

from msd_common.spec import parse_job
from coordinator.plan import Planner, PlannerState
from coordinator.sources import open_sources
from tests.conftest import job_dict
from tests.resume_harness import check_save_load
from worker.samples import open_source


class TrueLengths:
    """plan.Known over the records' real lengths (0 for the ones a worker would skip)."""

    def __init__(self, job, planner):
        self.planner = planner
        self.readers = [open_source(spec) for spec in job.worker_job().sources]

    def window(self, source, start, count):
        records = self.planner.streams[source].records_array(start, count)
        lengths = []
        for r in records.tolist():
            try:
                lengths.append(len(self.readers[source].read_sample(r)[0]))
            except Exception:
                lengths.append(0)
        return records, np.asarray(lengths, dtype=np.int64)

    def patches(self, source, positions):
        return np.zeros(len(positions), dtype=np.int64)

    def patch_squares(self, source, positions):
        return np.zeros(len(positions), dtype=np.int64)


def test_planner_resumes_from_any_step_and_twice(dataset_dir):
    job = parse_job(job_dict(mixture=[{"weights": {"web": 0.6, "code": 0.4}, "until_step": 8},
                                      {"weights": {"web": 0.2, "code": 0.3, "long": 0.5}, "ramp_steps": 4}]),
                    "job.yaml", base_dir=dataset_dir)
    counts = open_sources(job).num_records

    def run(state, n):
        planner = Planner(job, counts)
        if state is not None:
            planner.state = PlannerState.from_json(state)
        known = TrueLengths(job, planner)
        items, states = [], []
        for _ in range(n):
            plan = planner.plan_step(known)
            items.append((plan.step, plan.pieces.tolist(), plan.rank.tolist(), plan.row.tolist()))
            states.append(planner.state.to_json())
        return items, states

    reference = check_save_load(run, total=20, resume_at=[0, 7, 11, 18], twice=(3, 14))
    assert {len(pieces) for _, pieces, _, _ in reference} != {0}
