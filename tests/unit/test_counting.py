"""The counting phase of `runtime.index_on: workers` (coordinator/counting.py) without sockets:
which messages it answers, when the counting is done, and what it refuses. Worker answers come
from a real WorkerCore over real files."""

from __future__ import annotations

import pytest

from msd_common.spec import parse_job
from coordinator.counting import _Counting
from coordinator.sources import open_sources
from tests.conftest import job_dict
from msd_common import protocol as P
from worker.core import ToCoordinator, WorkerCore


def _hello(host: str = "a", version: int = P.PROTOCOL_VERSION) -> P.Message:
    return P.WorkerHello(version=version, host=host, pid=1, incarnation=1, agent=1)


def _counting(dataset_dir) -> tuple[_Counting, object]:
    job = parse_job(job_dict(runtime={"index_on": "workers"}), "job.yaml", base_dir=dataset_dir)
    return _Counting(job, {0: ["web-0.jsonl"], 2: ["long-0.jsonl.zst"]}), job


def _counts(sources: list[int], records: list[int], problems: list[str] | None = None) -> P.Message:
    return P.SourceCounts(worker_id=0, sources=sources, records=records,
                  problems=problems or [""] * len(sources))


def test_a_welcomed_worker_counts_what_it_is_asked_and_the_counting_ends(dataset_dir):
    counting, job = _counting(dataset_dir)
    welcome = counting.handle(b"w0", _hello())
    assert welcome.TYPE == "welcome" and welcome.count == [0, 2] and welcome.worker_id == 0
    assert counting.handle(b"w0", P.WorkerHeartbeat(worker_id=0, cached_records=0, busy_s=0.0, backlog=0,
                                         send_waits=0)).TYPE == "alive"
    assert counting.handle(b"t0", P.TrainerHeartbeat(rank=0)) is None  # trainers wait
    # the worker's real answer, from its core over the real files
    core = WorkerCore()
    actions = core.handle(welcome)
    [answer] = [a.message for a in actions if isinstance(a, ToCoordinator)]
    assert answer.TYPE == "source_counts" and answer.sources == [0, 2]
    assert not counting.done
    counting.handle(b"w0", answer)
    assert counting.done and not counting.problems
    opened = open_sources(parse_job(job_dict(), "job.yaml", base_dir=dataset_dir))
    assert {s: n for s, (n, _) in counting.counts.items()} == {0: opened.num_records[0], 2: opened.num_records[2]}
    status = counting.handle(b"tool", P.StatusRequest()).status
    assert status["counting"] == {"sources": 2, "counted": 2, "shards_to_index": 2, "workers": 1}
    from rich.console import Console

    from coordinator.status_view import render

    console = Console(record=True, width=160)
    console.print(render(status))  # what `msd status` shows meanwhile
    assert "waiting for the workers to index 2 shard(s): 2 of 2 source(s) counted, 1 worker(s)" in console.export_text()


def test_a_host_agent_is_told_to_run_all_the_processes_it_may(dataset_dir):
    """Indexing is work for every process: an auto host (1..max_procs) runs its maximum meanwhile."""
    counting, _ = _counting(dataset_dir)
    hello = P.HostHello(version=P.PROTOCOL_VERSION, agent_id=7, host="a", procs=1, min_procs=1, max_procs=6,
                   auto=1)
    scale = counting.handle(b"h0", hello)
    assert scale.TYPE == "scale" and scale.procs == 6 and scale.retire == []
    assert counting.handle(b"h0", P.HostHeartbeat(agent_id=7, procs=6, pids=[])).TYPE == "alive"
    assert counting.handle(b"h1", P.HostHeartbeat(agent_id=8, procs=1, pids=[])) is None  # never said hello


def test_counts_from_a_peer_never_welcomed_are_ignored(dataset_dir):
    counting, _ = _counting(dataset_dir)
    counting.handle(b"stranger", _counts([0, 2], [5, 6]))
    assert not counting.done and not counting.counts


def test_an_older_worker_is_refused_with_the_reason(dataset_dir):
    counting, _ = _counting(dataset_dir)
    reply = counting.handle(b"w0", _hello(version=P.PROTOCOL_VERSION - 1))
    assert reply.TYPE == "reject" and f"!= {P.PROTOCOL_VERSION}" in reply.reason
    assert not counting.welcomed


def test_two_hosts_that_count_a_source_differently_are_named(dataset_dir):
    counting, _ = _counting(dataset_dir)
    counting.handle(b"w0", _hello("host-a"))
    counting.handle(b"w1", _hello("host-b"))
    counting.handle(b"w0", _counts([0], [120]))
    counting.handle(b"w1", _counts([0, 2], [118, 25]))
    assert counting.done
    assert counting.problems == {0: "sources.web: host host-a counts 120 records, host host-b 118: the hosts see "
                                    "different files"}


def test_a_source_a_worker_cannot_open_is_a_problem_naming_its_host(dataset_dir):
    counting, _ = _counting(dataset_dir)
    counting.handle(b"w0", _hello("host-a"))
    counting.handle(b"w0", _counts([0, 2], [120, 0], ["", "long-0.jsonl.zst: cannot decompress"]))
    assert counting.done
    assert counting.problems == {2: "sources.long: long-0.jsonl.zst: cannot decompress (on host host-a)"}


@pytest.mark.parametrize("value", ["everywhere", 1])
def test_index_on_takes_two_values(dataset_dir, value):
    from msd_common.spec import ConfigError

    with pytest.raises(ConfigError, match="runtime.index_on: expected one of coordinator, workers"):
        parse_job(job_dict(runtime={"index_on": value}), "job.yaml", base_dir=dataset_dir)


def test_msd_validate_does_not_index_what_the_workers_will(tmp_path):
    """With index_on: workers, `msd validate` opens the sources as the coordinator does: a corpus
    this host has no index of (terabytes, maybe) is not indexed; its counts are '?', with a note."""
    import glob

    from click.testing import CliRunner

    from msd.commands import validate
    from tests.conftest import build_dataset, write_job

    build_dataset(str(tmp_path))
    path = write_job(str(tmp_path), job_dict(runtime={"index_on": "workers"}))
    result = CliRunner().invoke(validate, [path])
    assert result.exit_code == 0, result.output
    assert "web=jsonl:2 file(s)/? records" in result.stdout and "code=megatron:1 file(s)/80 records" in result.stdout
    assert ("note: sources.long: 1 shard(s) not indexed on this host; the workers index them and count its records "
            "at start-up (runtime.index_on: workers)") in result.stderr
    assert not glob.glob(str(tmp_path / "**" / "*.msd*"), recursive=True)  # nothing indexed here
