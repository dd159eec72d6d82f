"""Memory-mapped (Megatron) sources are prepared by the coordinator from their index: no prepare
round trip, records spread over the workers, and a worker that cannot open such a source stops
instead of being handed records it cannot read."""

import logging

import numpy as np

from msd_common.spec import parse_job
from coordinator.events import WorkerHello
from coordinator.history import StepHistory
from coordinator.instructions import Send
from coordinator.sources import open_sources
from coordinator.state import CoordinatorState
from msd_common import protocol as P
from worker.core import Quit, WorkerCore
from msd_common.formats.megatron import MegatronIndex, write_megatron


def _job(tmp_path):
    rng = np.random.default_rng(0)
    write_megatron(str(tmp_path / "code_text_document"),
                   [rng.integers(0, 1000, int(n), dtype=np.uint16) for n in rng.integers(1, 900, 3000)])
    raw = {"seed": 3, "sources": {"code": {"format": "megatron", "paths": ["code_text_document"]}},
           "batch": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 8}, "topology": {"dp": 2},
           "mixture": {"weights": {"code": 1.0}}, "runtime": {"prepare_batch": 64}}
    return parse_job(raw, str(tmp_path / "job.yaml"), str(tmp_path))


def test_coordinator_prepares_mapped_records_itself_and_spreads_them(tmp_path):
    job = _job(tmp_path)
    state = CoordinatorState(job, open_sources(job), StepHistory(durable=False))
    out = state.handle(*[WorkerHello(at=0.0, peer=b"w%d" % w, version=P.PROTOCOL_VERSION, host="h", pid=w,
                                     incarnation=w, agent=1) for w in range(3)])  # one burst: then one pump
    assert [i.message.TYPE for i in out if isinstance(i, Send)] == ["welcome"] * 3  # no prepare task sent
    table = state.tables[0]
    positions = np.arange(table.base, table.end)
    assert len(positions) >= 192 and not len(state.tasks)  # prepared, and no task in flight
    index = MegatronIndex(str(tmp_path / "code_text_document"))
    records = table.records(positions)
    assert table.window(table.base, len(positions))[1].tolist() == index.document_lengths()[records].tolist()
    held = np.bincount(table.holders(positions), minlength=3)
    assert held.max() - held.min() <= job.runtime.prepare_batch  # batches dealt to whoever holds fewest
    plan = state.planner.plan_step(state.prep)  # planning needs nothing from a worker
    assert int(plan.pieces[:, 4].sum()) == job.step_tokens


def test_worker_that_cannot_open_a_mapped_source_stops(tmp_path, caplog):
    core = WorkerCore()
    spec = {"name": "code", "index": 0, "format": "megatron", "files": [str(tmp_path / "missing_document")]}
    with caplog.at_level(logging.ERROR, logger="msd.worker"):
        actions = core.handle(P.Welcome(worker_id=4, heartbeat_s=1.0, job={"seed": 0, "sources": [spec]}, count=[]))
    assert actions == [Quit("cannot open source code")]
    assert "cannot open source code" in caplog.text
